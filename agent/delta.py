"""Progress on change, with a full report as heartbeat.

A hung job is the moment the coordinator is busiest (dump fan-out and
collection) and the moment its ranks' progress stops changing. Reporting
every rank every poll would keep the coordinator ingesting ~4,096 identical
rank reports a second through the incident. So a report carries only the
ranks whose numbers changed since the last one sent, and every heartbeat
all of them, which keeps the agent alive in the coordinator's eyes and
refreshes in-flight ages. The coordinator names the heartbeat in
RegisterResponse (a third of its lost-agent timeout); FULL_REPORT_S is the
default for one that does not.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

from hangwatch.wire import pb

FULL_REPORT_S: Final = 3.0


def signature(rp: pb.RankProgress) -> tuple[Any, ...]:
    """What the coordinator acts on; ages are left out (it extrapolates them)."""
    return (
        rp.state,
        rp.finished,
        rp.in_compile,
        rp.compiler_running,
        tuple(
            (
                g.group,
                g.last_enqueued,
                g.last_completed,
                g.last_started,
                g.oldest_in_flight.seq if g.HasField("oldest_in_flight") else -1,
                g.oldest_in_flight.op if g.HasField("oldest_in_flight") else "",
            )
            for g in rp.groups
        ),
    )


class DeltaReporter:
    """Which ranks the next progress report must carry. Not thread-safe."""

    def __init__(self, full_every_s: float = FULL_REPORT_S) -> None:
        self.full_every_s = full_every_s
        self._sent: dict[int, tuple[Any, ...]] = {}
        self._last_full = float("-inf")

    def reset(self, heartbeat_s: float = 0.0) -> None:
        """After a (re-)register: the coordinator knows nothing; send everything.
        `heartbeat_s` is the coordinator's ask (RegisterResponse), if any."""
        self._sent.clear()
        self._last_full = float("-inf")
        if heartbeat_s > 0:
            self.full_every_s = heartbeat_s

    def select(
        self, ranks: Sequence[pb.RankProgress], now: float
    ) -> tuple[list[pb.RankProgress], bool] | None:
        """(ranks to send, whether it is a full report), or None: nothing to send."""
        full = now - self._last_full >= self.full_every_s
        out = [rp for rp in ranks if full or self._sent.get(rp.rank) != signature(rp)]
        if not out and not full:
            return None
        return out, full

    def commit(self, sent: Sequence[pb.RankProgress], full: bool, now: float) -> None:
        """The report was delivered."""
        for rp in sent:
            self._sent[rp.rank] = signature(rp)
        if full:
            self._last_full = now
