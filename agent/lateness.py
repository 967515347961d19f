"""The agent's half of the straggler signal: one clock for the job, and polls on a shared grid.

The coordinator tells how late each rank enters collectives by comparing the
ranks' enqueue counters read at the same instant (server/live/stragglers.py). Two
things make "the same instant" true across hosts without touching training:

- the agent estimates its wall clock's offset from the coordinator's over
  Health round trips, NTP-style, and keeps the estimate from the round trip
  with the smallest delay among recent ones (the delay bounds the error);
- it polls on a grid of the poll interval laid on the coordinator's clock
  (hangwatch.pollgrid), so every agent reads its ranks within milliseconds
  of every other.

The status poll itself is unchanged (microseconds in the rank): lateness
costs the training processes nothing more.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from hangwatch import pollgrid
from hangwatch.wire import pb

log = logging.getLogger("hangwatch.agent")

# How often to measure the offset again: clocks drift by well under a
# millisecond a minute under NTP, and a Health call is one small RPC.
SYNC_EVERY_S: Final = 30.0
# Round trips remembered; the one with the smallest delay is used.
KEEP_SAMPLES: Final = 8


@dataclass(frozen=True)
class OffsetSample:
    offset_ns: int  # add to the agent's wall clock to get the coordinator's
    delay_ns: int  # round trip less the coordinator's own time on it


def offset_from(t0: int, t1: int, t2: int, t3: int) -> OffsetSample:
    """NTP's estimate: t0 sent and t3 received on our clock, t1 received and t2 sent on theirs."""
    return OffsetSample(
        offset_ns=((t1 - t0) + (t2 - t3)) // 2, delay_ns=max(0, (t3 - t0) - (t2 - t1))
    )


class ClockSync:
    """The best recent offset estimate; read from any thread, refreshed by the sender."""

    def __init__(self, clock_ns: Callable[[], int] = time.time_ns) -> None:
        self._clock_ns = clock_ns
        self._samples: deque[OffsetSample] = deque(maxlen=KEEP_SAMPLES)
        self._best: OffsetSample | None = None
        self._synced_at = -math.inf
        self._lock = threading.Lock()

    @property
    def offset_ns(self) -> int:
        best = self._best
        return best.offset_ns if best else 0

    @property
    def error_ns(self) -> int:
        """Half the best round trip's delay; 0 while there is no estimate."""
        best = self._best
        return max(1, best.delay_ns // 2) if best else 0

    def due(self, now: float) -> bool:
        return now - self._synced_at >= SYNC_EVERY_S

    def add(self, sample: OffsetSample, now: float) -> None:
        with self._lock:
            self._samples.append(sample)
            self._best = min(self._samples, key=lambda s: s.delay_ns)
            self._synced_at = now

    def exchange(self, health: Callable[[pb.HealthRequest], pb.HealthResponse], now: float) -> bool:
        """One round trip; False when the coordinator does not stamp its answers
        (an older one): instants then stay on the agent's clock."""
        t0 = self._clock_ns()
        resp = health(pb.HealthRequest(client_send_ns=t0))
        t3 = self._clock_ns()
        if not resp.receive_ns or not resp.send_ns:
            self._synced_at = now  # do not ask again every flush
            return False
        sample = offset_from(t0, resp.receive_ns, resp.send_ns, t3)
        self.add(sample, now)
        log.debug(
            "clock offset %+.3f ms (round trip %.3f ms)",
            sample.offset_ns / 1e6,
            sample.delay_ns / 1e6,
        )
        return True


def next_tick_delay(interval_s: float, wall_ns: int, offset_ns: int) -> float:
    """Seconds from `wall_ns` (agent clock) to the next poll instant of the grid
    (hangwatch.pollgrid) on the coordinator's clock. Never 0: a poll that overran
    its tick waits for the next one rather than polling twice in a row."""
    if interval_s <= 0:
        return 0.0
    coord = wall_ns + offset_ns
    return (pollgrid.next_after(coord, int(interval_s * 1e9)) - coord) / 1e9
