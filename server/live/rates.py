"""How fast each rank's growing counters grew lately, in fixed-width columns per job.

Two counters a rank: CPU time plus run-queue wait (RankProgress.cpu_time_ns,
runqueue_wait_ns) and storage bytes (RankProgress.io_bytes). Each keeps its
value at two moments at least half a window apart, and now: the rate over
the last half window to window and a half, in O(1) a rank (32,768 ranks keep
7 numbers each per counter, not a history).

As one slotted object per counter, a rank's two cost 176 bytes and 28-32
more for each value past 256 (a CPU time in ns always is): about 270 bytes a
rank while the job runs. Here they are 98 bytes in columns, indexed by a
slot each rank record holds (`RankRecord.rate_slot`), reused when a record
is replaced and freed when its rank leaves the job. Only the registry
writes, under its lock.
"""

from __future__ import annotations

from array import array


class RateColumns:
    """One counter's readings for every slot."""

    __slots__ = ("latest_t", "latest_v", "newer_t", "newer_v", "older_t", "older_v", "seen")

    def __init__(self) -> None:
        self.older_t = array("d")
        self.older_v = array("q")
        self.newer_t = array("d")
        self.newer_v = array("q")
        self.latest_t = array("d")
        self.latest_v = array("q")
        self.seen = array("B")  # a reading since the last start-over

    def add(self) -> None:
        for col in (self.older_t, self.newer_t, self.latest_t):
            col.append(0.0)
        for ints in (self.older_v, self.newer_v, self.latest_v, self.seen):
            ints.append(0)

    def clear(self, i: int) -> None:
        self.older_t[i] = self.newer_t[i] = self.latest_t[i] = 0.0
        self.older_v[i] = self.newer_v[i] = self.latest_v[i] = 0
        self.seen[i] = 0

    def note(self, i: int, now: float, value: int, window_s: float, *, zero_known: bool) -> None:
        """Take a reading. A fall is a new process behind the same rank: start
        over rather than read a negative rate. 0 is "unknown" (an older agent)
        unless `zero_known`: storage I/O is 0 for a rank that never touched a
        disk, and unknown I/O and none mean the same to the rules (no work)."""
        known = value > 0 or (value == 0 and zero_known)
        if not known or value < self.latest_v[i]:
            # On the per-report path: nothing to do for a rank with no reading.
            if self.seen[i]:
                self.clear(i)
            if not known:
                return
        if not self.seen[i]:
            self.older_t[i] = self.newer_t[i] = now
            self.older_v[i] = self.newer_v[i] = value
            self.seen[i] = 1
        elif now - self.newer_t[i] >= window_s / 2:
            self.older_t[i], self.older_v[i] = self.newer_t[i], self.newer_v[i]
            self.newer_t[i], self.newer_v[i] = now, value
        self.latest_t[i], self.latest_v[i] = now, value

    def rate(self, i: int, min_span_s: float) -> float | None:
        """The counter's growth per second, averaged over the last half window
        to window and a half; None while the readings span less than `min_span_s`."""
        span = self.latest_t[i] - self.older_t[i]
        if not self.seen[i] or span < max(min_span_s, 1e-3):
            return None
        return (self.latest_v[i] - self.older_v[i]) / span


class RankRates:
    """A job's two counters a rank, and which slots are free."""

    __slots__ = ("cpu", "free", "io")

    def __init__(self) -> None:
        self.cpu = RateColumns()
        self.io = RateColumns()
        self.free: list[int] = []

    def allocate(self) -> int:
        if self.free:
            i = self.free.pop()
            self.cpu.clear(i)
            self.io.clear(i)
            return i
        self.cpu.add()
        self.io.add()
        return len(self.cpu.seen) - 1

    def release(self, i: int) -> None:
        self.free.append(i)
