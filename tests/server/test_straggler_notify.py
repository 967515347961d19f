"""A newly named straggler reaches the webhooks as a `straggler` notification, once."""

from __future__ import annotations

from collections.abc import Callable

from hangwatch.server.coordinator import Coordinator
from hangwatch.server.integrations.notifications import SCHEMA

from tests.support.simagents.lateness import SimJob, replay
from tests.support.webhook import receiver


def test_a_straggler_is_published_once(start_coordinator: Callable[..., Coordinator]) -> None:
    with receiver() as rx:
        c = start_coordinator(notify_url=(rx.url,), public_url="https://hw.example.org/")
        assert c.stragglers.on_flag is not None
        # The coordinator's own callback, called by a real monitor's decision.
        r = replay(
            SimJob(ranks=16, slow={6: 0.5}),
            150,
            clock_error_s=0.0005,
            job_id="job/a b",
            on_flag=c.stragglers.on_flag,
        )
        assert [s.rank for _, s in r.flags] == [6]
        (got,) = rx.wait(lambda got: len(got) >= 1, 10)
    body = got.body
    assert body["schema"] == SCHEMA and body["event"] == "straggler"
    item = body["incident"]
    assert item["job"] == "job/a b" and item["rank"] == 6 and item["kind"] == "host"
    assert item["host"] == "host-sim-0" and item["score"] > 0.2 and item["since"] > 0
    assert item["url"] == "https://hw.example.org/jobs/job%2Fa%20b"
    assert body["text"].startswith("[hangwatch] job job/a b: rank 6 (host-sim-0) is a straggler")
    assert item["url"] in body["text"]
    assert c.metrics.value("hangwatch_stragglers_flagged_total") == 1
    assert (
        c.metrics.value(
            "hangwatch_notifications_total", {"event": "straggler", "outcome": "delivered"}
        )
        == 1
    )
