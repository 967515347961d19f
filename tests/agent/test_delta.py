"""Progress on change with a full heartbeat (agent.delta)."""

from __future__ import annotations

from hangwatch.agent.delta import DeltaReporter

from hangwatch.wire import pb


def _rank(
    rank: int, completed: int, *, age: float = 0.0, op: str = "all_reduce"
) -> pb.RankProgress:
    g = pb.GroupProgress(group="0", last_enqueued=completed + 1, last_completed=completed)
    g.oldest_in_flight.CopyFrom(pb.InFlight(seq=completed + 1, op=op, age_s=age))
    g.completed_unchanged_s = age
    return pb.RankProgress(rank=rank, state=pb.PROCESS_STATE_RUNNING, groups=[g])


def test_only_changed_ranks_then_a_full_heartbeat() -> None:
    d = DeltaReporter(full_every_s=3.0)
    first = d.select([_rank(0, 5), _rank(1, 5)], now=0.0)
    assert first is not None and [r.rank for r in first[0]] == [0, 1] and first[1]
    d.commit(first[0], first[1], now=0.0)
    # Ages grow every poll; that alone is no change (the coordinator extrapolates).
    assert d.select([_rank(0, 5, age=1.0), _rank(1, 5, age=1.0)], now=1.0) is None
    moved = d.select([_rank(0, 6), _rank(1, 5, age=2.0)], now=2.0)
    assert moved is not None and [r.rank for r in moved[0]] == [0] and not moved[1]
    d.commit(moved[0], moved[1], now=2.0)
    # The op becoming known is a change too.
    op = d.select([_rank(0, 6, op="broadcast"), _rank(1, 5)], now=2.5)
    assert op is not None and [r.rank for r in op[0]] == [0]
    beat = d.select([_rank(0, 6), _rank(1, 5)], now=3.0)
    assert beat is not None and [r.rank for r in beat[0]] == [0, 1] and beat[1]


def test_undelivered_reports_are_sent_again_and_reset_sends_all() -> None:
    d = DeltaReporter(full_every_s=60.0)
    pick = d.select([_rank(0, 1)], now=0.0)
    assert pick is not None
    d.commit(pick[0], pick[1], now=0.0)
    change = d.select([_rank(0, 2)], now=1.0)
    assert change is not None  # not committed: the RPC failed
    again = d.select([_rank(0, 2)], now=2.0)
    assert again is not None and [r.rank for r in again[0]] == [0]
    d.commit(again[0], again[1], now=2.0)
    assert d.select([_rank(0, 2)], now=3.0) is None
    d.reset()  # re-registered: the coordinator knows nothing
    full = d.select([_rank(0, 2)], now=4.0)
    assert full is not None and full[1]


def test_no_ranks_still_heartbeats() -> None:
    d = DeltaReporter(full_every_s=3.0)
    pick = d.select([], now=0.0)
    assert pick == ([], True)
    d.commit([], True, now=0.0)
    assert d.select([], now=1.0) is None
    assert d.select([], now=3.5) == ([], True)


def test_the_coordinators_heartbeat_wins_after_register() -> None:
    d = DeltaReporter(full_every_s=3.0)
    d.reset(1.0)  # RegisterResponse.heartbeat_s: its lost-agent timeout is 3 s
    pick = d.select([_rank(0, 1)], now=0.0)
    assert pick is not None
    d.commit(pick[0], pick[1], now=0.0)
    assert d.select([_rank(0, 1)], now=0.5) is None
    assert d.select([_rank(0, 1)], now=1.0) == ([_rank(0, 1)], True)
    d.reset(0.0)  # an older coordinator sends none: keep what we have
    assert d.full_every_s == 1.0
