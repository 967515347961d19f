"""Stall detection over one group's live progress: pure functions, no clocks of their own.

A group is stalled at collective `s` when some members are inside `s`
(last_enqueued >= s > last_completed) while others have not entered it
(last_enqueued < s), and no member's last_completed has changed for the
stall timeout. Ordering across ranks comes only from sequence numbers and the
coordinator's own monotonic clock: agents' wall clocks are never compared.

A long collective that every member has entered is healthy, however long it
runs, unless the members entered different ops at that seq (a mismatch: gloo
and NCCL both wait forever on it), a member's process is stopped or gone (it
can never finish) or a member cannot be observed at all (its agent is lost).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

from hangwatch.formats import StallKind
from hangwatch.wire import DEAD_PROCESS_STATES, EXITED_PROCESS_STATES

# One definition for the whole project (hangwatch.wire), under the names used here.
DEAD_STATES: Final = DEAD_PROCESS_STATES
EXITED_STATES: Final = EXITED_PROCESS_STATES


@dataclass(kw_only=True, frozen=True)
class MemberProgress:
    rank: int
    last_enqueued: int  # -1 = none
    last_completed: int  # -1 = none
    in_flight_op: str = ""
    observed: bool = True  # False: its agent is lost, the numbers are stale
    process_state: str = "running"


@dataclass(kw_only=True, frozen=True)
class GroupStall:
    group: str
    seq: int
    op: str
    # "stall": members not entered; "mismatch": members entered different ops
    # at the same seq; "rank-lost": a member's process is dead;
    # "agent-lost": the only missing members are ones nobody can observe.
    kind: StallKind
    waiting_ranks: list[int]
    not_entered_ranks: list[int]
    dead_ranks: list[int] = field(default_factory=list)
    unobserved_ranks: list[int] = field(default_factory=list)
    stalled_for_s: float = 0.0


def find_group_stall(
    *,
    group: str,
    members: Sequence[int],
    progress: dict[int, MemberProgress],
    no_progress_for_s: float,
) -> GroupStall | None:
    """The stall pattern in one group, or None. The caller compares `stalled_for_s`
    with its timeout; returning the pattern early lets the dashboard show it growing."""
    observed = {r: p for r, p in progress.items() if p.observed}
    # Members with no numbers at all (never registered) count as unobserved.
    unobserved = sorted(r for r in members if r not in observed)
    in_flight = [p for p in observed.values() if p.last_enqueued > p.last_completed]
    if not in_flight:
        return None
    seq = min(p.last_completed + 1 for p in in_flight)
    # A rank whose process is gone is not waiting, whatever its last numbers
    # said: at a normal job end every rank exits with its last report stale.
    waiting = sorted(
        p.rank
        for p in observed.values()
        if p.last_enqueued >= seq > p.last_completed and p.process_state not in EXITED_STATES
    )
    not_entered = sorted(p.rank for p in observed.values() if p.last_enqueued < seq)
    dead = sorted(p.rank for p in observed.values() if p.process_state in DEAD_STATES)
    op = next(
        (p.in_flight_op for p in in_flight if p.last_completed + 1 == seq and p.in_flight_op), ""
    )
    if not waiting:
        return None
    # Agents learn a rank's in-flight op only once it has been in flight a
    # while, so compare just the ops that are known.
    ops_at_seq = {
        p.in_flight_op
        for p in observed.values()
        if p.last_completed + 1 == seq and p.last_enqueued >= seq and p.in_flight_op
    }
    if not_entered:
        kind = StallKind.STALL
    elif len(ops_at_seq) > 1:
        kind = StallKind.MISMATCH
    elif dead:
        kind = StallKind.RANK_LOST
    elif unobserved:
        kind = StallKind.AGENT_LOST
    else:
        return None  # every member is inside: a long but healthy collective
    return GroupStall(
        group=group,
        seq=seq,
        op=op,
        kind=kind,
        waiting_ranks=waiting,
        not_entered_ranks=not_entered,
        dead_ranks=dead,
        unobserved_ranks=unobserved,
        stalled_for_s=max(0.0, no_progress_for_s),
    )
