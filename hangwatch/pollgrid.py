"""The instants at which every agent polls its ranks, on the coordinator's clock.

Tick k is at k * tick plus a dither: the fractional part of k times the golden
ratio, times half a tick. Every agent computes the same instants, so ranks on
different hosts are still read together; the dither keeps those instants
from locking onto a job's step period (a 250 ms step read every 1.000 s would
be seen at the same phase for minutes, and its lateness would be sampled as
a few long runs, not as many independent looks). Shared by the agent, which
waits for the next instant, and the coordinator, which files each reading
under its tick.
"""

from __future__ import annotations

from typing import Final

_PHI: Final = 0.6180339887498949
DITHER: Final = 0.5  # of a tick


def instant_ns(tick: int, tick_ns: int) -> int:
    """When tick `tick` is, ns on the coordinator's clock."""
    return tick * tick_ns + int((tick * _PHI) % 1.0 * DITHER * tick_ns)


def nearest(at_ns: int, tick_ns: int) -> tuple[int, int]:
    """(the tick whose instant is nearest `at_ns`, how far from it, ns)."""
    k0 = at_ns // tick_ns
    best = min((k0 - 1, k0, k0 + 1), key=lambda k: abs(at_ns - instant_ns(k, tick_ns)))
    return best, abs(at_ns - instant_ns(best, tick_ns))


def next_after(at_ns: int, tick_ns: int) -> int:
    """The first tick instant strictly after `at_ns`, ns."""
    k = at_ns // tick_ns - 1
    while instant_ns(k, tick_ns) <= at_ns:
        k += 1
    return instant_ns(k, tick_ns)


class NearestTick:
    """`nearest`, remembering the last tick found: one agent reads its ranks
    within milliseconds, and within an eighth of a tick of a grid instant that
    instant is the nearest (instants are at least half a tick apart), so most
    ranks of a report skip the search."""

    def __init__(self, tick_ns: int) -> None:
        self.tick_ns = tick_ns
        self.tick, self.at = -1, 0

    def find(self, at_ns: int) -> tuple[int, int]:
        if self.tick >= 0 and abs(at_ns - self.at) <= self.tick_ns // 8:
            return self.tick, abs(at_ns - self.at)
        tick, off = nearest(at_ns, self.tick_ns)
        self.tick, self.at = tick, instant_ns(tick, self.tick_ns)
        return tick, off
