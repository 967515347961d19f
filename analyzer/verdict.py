"""The typed decision: which verdict, whom it blames, and what it rests on.

* ``mismatch``: ranks disagree on op, sizes or dtypes at the same (group,
  seq) that is not finished everywhere (or there is no other explanation).
* ``hang``: the waits-for graph has roots.
* ``no-culprit-visible``: nothing in FR explains a stall that *did* happen,
  i.e. an incident was triggered (the input holds `incident.json` or bundle
  `meta.json` files) but no rank is waiting on a rank that is behind.
* ``healthy``: the same situation without any sign that a stall happened:
  offline dumps in which every collective in flight has been entered by all
  of its members and nothing is unmatched. A single snapshot cannot tell a
  slow collective from a stuck one, so the summary says what FR shows.
* ``unknown``: the same, where a group's recorder does not record completion
  (torch 2.15's FlightRecorderHook on an asynchronous backend such as its
  default NCCL): every member entered every collective, and whether the last
  ones finished is not in the dumps. Never reported as healthy. Also when
  a rank is in an unfinished collective of a group whose membership only the
  dumps show (no pg_config ranks, no bundle metadata, no --world-size): a
  member without a dump is invisible, so whether everyone entered is
  unknown; and when selected ranks have unfinished work with ranks that
  --selected-ranks left out (selection.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from hangwatch.analyzer.matching import Mismatch
from hangwatch.analyzer.report import FindingKind, Verdict
from hangwatch.analyzer.scope import Scope
from hangwatch.analyzer.timing import Arrival
from hangwatch.analyzer.waits import Wait

# Which mismatch a verdict names when there are several: the most basic disagreement.
MISMATCH_ORDER = (FindingKind.OP_MISMATCH, FindingKind.SIZE_MISMATCH, FindingKind.DTYPE_MISMATCH)


@dataclass(frozen=True, kw_only=True)
class Decision:
    verdict: Verdict
    lagging: list[int] = field(default_factory=list)
    mismatch: Mismatch | None = None  # the one a "mismatch" verdict names
    best: Wait | None = None  # the wait a "hang" verdict names as stalled
    # The collective every member entered and none finished that the verdict
    # rests on: its late ranks ("hang"), or nobody behind ("no-culprit-visible").
    arrival: Arrival | None = None
    incident: bool  # a stall was reported (incident.json or bundle metadata)
    blocked_any: bool  # some rank is blocked in a collective or p2p op


def wait_key(w: Wait, roots: list[int]) -> tuple[Any, ...]:
    """Which wait best names "the" stalled collective: a collective over a p2p
    op, blaming the most roots and only roots, the one waiting the longest
    (the first collective the roots failed to join), then the most waiters."""
    return (
        w.kind != "collective",
        -len(w.targets & set(roots)),
        len(w.targets - set(roots)),  # blame a root directly, not through a blocked rank
        w.oldest_ns or np.iinfo(np.int64).max,  # the first collective the roots failed to join
        -len(w.waiters),
        w.seq,
    )


def decide(
    scope: Scope,
    waits: list[Wait],
    blamed: list[int],
    mismatches: list[Mismatch],
    p2p_blocked: set[int],
    outside: list[Wait] | None = None,
    arrivals: list[Arrival] | None = None,
) -> Decision:
    """`blamed`: the graph's roots after blame within cycles (graph.blame_in_cycles)."""
    live_mm = [m for m in mismatches if not scope.complete_everywhere(m.group, m.seq)]
    incident = scope.loaded.incident is not None or bool(scope.loaded.rank_meta)
    blocked_any = scope.any_collective_blocked() or bool(p2p_blocked)
    if live_mm or (mismatches and not blamed):
        m = sorted(live_mm or mismatches, key=lambda x: (MISMATCH_ORDER.index(x.kind), x.seq))[0]
        return Decision(
            verdict="mismatch",
            lagging=m.odd_ranks,
            mismatch=m,
            incident=incident,
            blocked_any=blocked_any,
        )
    if blamed:
        blame = [w for w in waits if w.targets & set(blamed)]
        best = sorted(blame, key=lambda w: wait_key(w, blamed))[0]
        return Decision(
            verdict="hang", lagging=blamed, best=best, incident=incident, blocked_any=blocked_any
        )
    # Every member entered, none finished: the dumps' entry times name who
    # came late; when nobody did, FR holds no culprit, and a collective stuck
    # long before the dumps is never "healthy".
    for a in arrivals or []:
        if a.late and (a.stuck or incident):
            return Decision(
                verdict="hang", lagging=a.late, arrival=a, incident=incident, blocked_any=True
            )
    stuck = [a for a in arrivals or [] if a.stuck or incident]
    if stuck and not outside:
        return Decision(
            verdict="no-culprit-visible", arrival=stuck[0], incident=incident, blocked_any=True
        )
    verdict: Verdict
    if not scope.dumped:
        verdict = "unknown"  # no dump at all: nothing is known either way
    elif outside:
        verdict = "unknown"  # selected ranks may be waiting on ranks not selected
    elif (scope.unknown_groups() or scope.membership_unknown()) and not incident:
        verdict = "unknown"
    elif incident:
        verdict = "no-culprit-visible"
    else:
        verdict = "healthy"
    return Decision(verdict=verdict, incident=incident, blocked_any=blocked_any)
