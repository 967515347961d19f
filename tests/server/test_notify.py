"""Webhook notifications against real HTTP receivers on loopback.

The notifier unit is driven directly for retry, back-off, bounds and
redaction; the last test runs a whole incident (open, verdict, resolution)
through a real coordinator over real gRPC and checks what the receiver got.
"""

from __future__ import annotations

import base64
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hangwatch.server.coordinator import Coordinator
from hangwatch.server.integrations.metrics import Metrics
from hangwatch.server.integrations.notifications import SCHEMA, Notifier, Policy, Target
from hangwatch.server.web.schemas import IncidentSummary

from hangwatch.config import env_var
from hangwatch.wire import rpc
from tests.support.webhook import closed_port_url, receiver

from .conftest import hang_rank_2, two_nodes, wait_status

FAST = Policy(timeout_s=2.0, attempts=4, backoff_s=0.05, backoff_max_s=0.2, drain_s=1.0)


def _item(i: int = 1, **kw: Any) -> dict[str, Any]:
    return {"id": f"inc-{i}", "job": "job-1", "verdict": "hang", "lagging_ranks": [2], **kw}


def _notifier(urls: list[str], policy: Policy = FAST) -> tuple[Notifier, Metrics]:
    m = Metrics()
    n = Notifier(urls, metrics=m, link=lambda i: f"http://dash.example:7450/incidents/{i}",
                 policy=policy)  # fmt: skip
    n.start()
    return n, m


def _outcome(m: Metrics, outcome: str, event: str = "incident.analyzed") -> float:
    return m.value("hangwatch_notifications_total", {"event": event, "outcome": outcome})


def _until(pred: Callable[[], bool], timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, what
        time.sleep(0.02)


@pytest.mark.timeout(30)
def test_body_retries_basic_auth_and_no_secret_in_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="hangwatch")
    with receiver([503, 429, 200], path="/services/T0/SECRETPATH") as rx:
        port = rx.url.split(":")[2].split("/")[0]
        url = f"http://bot:s3cr%40t@127.0.0.1:{port}/services/T0/SECRETPATH?key=SECRETQ"
        n, m = _notifier([url])
        try:
            n.publish("incident.analyzed", _item(summary="Rank 2 never entered all_reduce #5"))
            (got,) = rx.wait(lambda r: len(r) == 1, 10)
        finally:
            n.stop()
    assert got.path == "/services/T0/SECRETPATH?key=SECRETQ"
    assert got.headers["Content-Type"] == "application/json"
    assert got.headers["Authorization"] == "Basic " + base64.b64encode(b"bot:s3cr@t").decode()
    assert got.body["schema"] == SCHEMA and got.body["event"] == "incident.analyzed"
    assert got.body["incident"]["lagging_ranks"] == [2]
    assert got.body["incident"]["url"] == "http://dash.example:7450/incidents/inc-1"
    assert got.body["text"].startswith("[hangwatch] incident.analyzed job job-1")
    assert "Rank 2 never entered all_reduce #5" in got.body["text"]
    assert "s3cr" not in got.raw.decode() and "bot" not in got.raw.decode()
    assert _outcome(m, "delivered") == 1
    assert m.value("hangwatch_notification_retries_total") == 2
    assert m.histogram("hangwatch_notification_delivery_seconds").n == 1  # type: ignore[union-attr]
    assert "retrying" in caplog.text
    for secret in ("s3cr", "SECRETPATH", "SECRETQ", "bot:"):
        assert secret not in caplog.text
    assert f"#1 http://127.0.0.1:{port}" in caplog.text
    assert n.targets[0].label == f"#1 http://127.0.0.1:{port}"


@pytest.mark.timeout(30)
def test_a_final_error_is_not_retried() -> None:
    with receiver([400, 200]) as rx:
        n, m = _notifier([rx.url])
        try:
            n.publish("incident.analyzed", _item())
            _until(lambda: _outcome(m, "failed") == 1, 10, "400 counted as failed")
        finally:
            n.stop()
        assert rx.answered == 1 and rx.received == []
    assert m.value("hangwatch_notification_retries_total") == 0


@pytest.mark.timeout(30)
def test_a_receiver_that_is_down_is_retried_then_given_up_without_blocking() -> None:
    n, m = _notifier([closed_port_url()])
    try:
        t0 = time.perf_counter()
        for i in range(200):
            n.publish("incident.opened", _item(i))
        took = time.perf_counter() - t0
        _until(lambda: _outcome(m, "failed", "incident.opened") >= 1, 10, "gave up on the first")
    finally:
        n.stop()
    # 200 publishes with the receiver down cost what 200 queue appends cost.
    assert took < 0.5, took
    assert m.value("hangwatch_notification_retries_total") >= FAST.attempts - 1
    failed = _outcome(m, "failed", "incident.opened")
    dropped = _outcome(m, "dropped", "incident.opened")
    assert failed >= 1 and failed + dropped == 200  # every one accounted for at stop
    assert m.value("hangwatch_notification_queue") == 0


@pytest.mark.timeout(30)
def test_a_slow_receiver_delays_neither_publish_nor_another_webhook() -> None:
    hold = threading.Event()
    with receiver(hold=hold) as slow, receiver() as fast:
        n, m = _notifier([slow.url, fast.url], Policy(timeout_s=20.0, drain_s=0.5))
        try:
            t0 = time.perf_counter()
            n.publish("incident.analyzed", _item(1))
            publish_s = time.perf_counter() - t0
            t1 = time.monotonic()
            (got,) = fast.wait(lambda r: len(r) == 1, 5)
            fast_s = time.monotonic() - t1
            # The fast one's worker is done; the slow one's POST is still unanswered.
            _until(lambda: n.queued() == 1, 5, "only the slow webhook's notification left")
            assert slow.received == []
            hold.set()
            slow.wait(lambda r: len(r) == 1, 5)
        finally:
            n.stop()
    assert publish_s < 0.05, publish_s
    assert fast_s < 2.0, fast_s
    assert got.body["incident"]["id"] == "inc-1"
    assert _outcome(m, "delivered") == 2


@pytest.mark.timeout(30)
def test_the_queue_is_bounded_and_drops_the_oldest() -> None:
    hold = threading.Event()
    with receiver(hold=hold) as rx:
        n, m = _notifier([rx.url], Policy(max_queue=3, timeout_s=20.0, drain_s=5.0))
        try:
            n.publish("incident.analyzed", _item(0))
            rx.wait_arrived(1, 5)  # the first is in flight
            for i in range(1, 10):
                n.publish("incident.analyzed", _item(i))
            assert n.queued() == 4  # three waiting, one in flight
            assert _outcome(m, "dropped") == 6
            hold.set()
            got = rx.wait(lambda r: len(r) == 4, 10)
        finally:
            n.stop()
    assert [r.body["incident"]["id"] for r in got] == ["inc-0", "inc-7", "inc-8", "inc-9"]
    assert _outcome(m, "delivered") == 4


@pytest.mark.timeout(30)
def test_stop_is_bounded_and_counts_what_it_drops() -> None:
    hold = threading.Event()
    with receiver(hold=hold) as rx:
        n, m = _notifier([rx.url], Policy(timeout_s=20.0, drain_s=0.3))
        for i in range(5):
            n.publish("incident.opened", _item(i))
        rx.wait_arrived(1, 5)  # the first is in flight
        t0 = time.monotonic()
        n.stop()
        assert time.monotonic() - t0 < 2.0
        assert _outcome(m, "dropped", "incident.opened") == 4
        n.publish("incident.opened", _item(9))  # after stop: counted, never sent
        assert _outcome(m, "dropped", "incident.opened") == 5


@pytest.mark.timeout(10)
def test_target_names_a_webhook_without_its_secrets() -> None:
    t = Target.parse("https://u:p%2Fw@hooks.example.com:8443/services/A/B/C?token=x#frag", 3)
    assert t.label == "#3 https://hooks.example.com:8443"
    assert t.url == "https://hooks.example.com:8443/services/A/B/C?token=x"
    assert t.authorization == "Basic " + base64.b64encode(b"u:p/w").decode()
    v6 = Target.parse("http://[::1]:9000", 1)
    assert (v6.url, v6.label, v6.authorization) == (
        "http://[::1]:9000/",
        "#1 http://[::1]:9000",
        None,
    )


# ---- through a real coordinator -------------------------------------------------


def hang_then_resume(c: Coordinator, stub: rpc.CoordinatorStub) -> str:
    """Rank 2 skips collective 5 of a 4-rank job; dumps are uploaded; then it catches up."""
    a, b = two_nodes(stub, "job-1")
    iid = hang_rank_2(a, b, seq=5)
    wait_status(c, iid, "analyzed")
    a.progress({0: (5, 5), 1: (5, 5)})
    b.progress({2: (5, 5), 3: (5, 5)})
    wait_status(c, iid, "resolved")
    a.close()
    b.close()
    return iid


@pytest.mark.timeout(60)
def test_an_incident_through_the_coordinator_reaches_the_webhook(
    start_coordinator: Callable[..., Coordinator], caplog: pytest.LogCaptureFixture
) -> None:
    import grpc

    caplog.set_level(logging.INFO, logger="hangwatch")
    down = closed_port_url("/down?secret=DOWNSECRET")
    with receiver() as rx:
        c = start_coordinator(notify_url=(rx.url, down), public_url="https://hw.example.org/")
        with grpc.insecure_channel(c.grpc_address) as ch:
            iid = hang_then_resume(c, rpc.CoordinatorStub(ch))
        got = rx.wait(lambda r: len(r) == 3, 10)
        analyzed_row = c.store.get_incident(iid)
    assert [r.body["event"] for r in got] == [
        "incident.opened",
        "incident.analyzed",
        "incident.resolved",
    ]
    opened, analyzed, resolved = (r.body for r in got)
    # Each carries the API's own item for the incident, as it was at that change.
    fields = set(IncidentSummary.model_fields) | {"url"}
    for body in (opened, analyzed, resolved):
        assert set(body["incident"]) == fields
        assert body["incident"]["id"] == iid
        assert body["incident"]["url"] == f"https://hw.example.org/incidents/{iid}"
        assert body["incident"]["url"] in body["text"]
    assert opened["incident"]["status"] == "collecting" and opened["incident"]["verdict"] is None
    assert "incident opened (stall)" in opened["text"]
    assert analyzed["incident"]["status"] == "analyzed"
    assert analyzed["incident"]["verdict"] == "hang"
    assert analyzed["incident"]["lagging_ranks"] == [2]
    assert analyzed["text"].startswith("[hangwatch] job job-1: hang: ")
    assert resolved["incident"]["status"] == "resolved"
    assert resolved["incident"]["late_ranks"] == [2]
    assert analyzed_row is not None and analyzed_row.status == "resolved"
    delivered = c.metrics.value(
        "hangwatch_notifications_total", {"event": "incident.analyzed", "outcome": "delivered"}
    )
    assert delivered == 1
    assert "DOWNSECRET" not in caplog.text and "/down" not in caplog.text
    text = c.metrics.render()
    assert (
        'hangwatch_notifications_total{event="incident.analyzed",outcome="delivered"} 1.0' in text
    )


# ---- settings --------------------------------------------------------------------


@pytest.mark.timeout(10)
def test_notify_urls_from_repeated_flags_or_one_comma_separated_variable() -> None:
    import argparse

    from hangwatch import config as cfg

    p = argparse.ArgumentParser()
    cfg.add_arguments(p, cfg.SERVER)
    ns = p.parse_args(["--notify-url", "http://a.example/x", "--notify-url", "https://b.example"])
    environ = {env_var("notify_url"): "http://c.example, http://d.example"}
    assert cfg.from_sources(ns, environ).respond.notify_url == (
        "http://a.example/x",
        "https://b.example",
    )
    assert cfg.from_sources(p.parse_args([]), environ).respond.notify_url == (
        "http://c.example",
        "http://d.example",
    )
    assert cfg.from_sources(p.parse_args([]), {}).respond.notify_url == ()


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (
            ["--notify-url", "ftp://x.example/SECRET"],
            "--notify-url: expected an http:// or https://",
        ),
        (["--notify-url", "http://h.example:port/SECRET"], "--notify-url: not a URL"),
        (["--public-url", "http://u:SECRET@h.example"], "--public-url: must not carry credentials"),
    ],
)
def test_a_bad_webhook_url_is_refused_without_echoing_it(
    tmp_path: Path, args: list[str], needle: str
) -> None:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("HANGWATCH_")}
    r = subprocess.run(
        [sys.executable, "-m", "hangwatch", "server", "--data-dir", str(tmp_path), *args],
        capture_output=True, text=True, timeout=25, env=environ,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr and "SECRET" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.timeout(10)
def test_the_store_tells_its_listener_each_status_change_once(tmp_path: Path) -> None:
    from hangwatch.analyzer.report import Report
    from hangwatch.server.incidents.store import IncidentRow, IncidentStore

    store = IncidentStore.in_dir(tmp_path)
    seen: list[tuple[str, str]] = []

    def broken(row: IncidentRow) -> None:
        raise RuntimeError("a listener's bug")

    store.on_status_change += [broken, lambda row: seen.append((row.id, row.status))]
    try:
        row = store.create_incident(job_id="j", reason="r", trigger="stall", ranks_expected=[0])
        store.set_dump_outcome(row.id, ranks_dumped=[0], ranks_unreachable={})  # no status change
        report = Report(verdict="hang", summary="rank 0 never entered", lagging_ranks=[0])
        done = store.finish_incident(row.id, report=report, detection_s=1.0)
        store.end_incident(row.id, reason="the job stopped")
    finally:
        store.close()
    assert done.status == "analyzed"  # the broken listener changed nothing
    assert seen == [(row.id, "collecting"), (row.id, "analyzed"), (row.id, "ended")]
