from __future__ import annotations

import pytest
from hangwatch.server.incidents.triggers import stall_trigger
from hangwatch.server.live.detector import MemberProgress, find_group_stall
from hangwatch.server.live.views import StalledGroup


def _p(rank: int, le: int, lc: int, **kw: object) -> MemberProgress:
    return MemberProgress(
        rank=rank, last_enqueued=le, last_completed=lc, in_flight_op="all_reduce", **kw
    )  # type: ignore[arg-type]


def test_one_rank_not_entered() -> None:
    st = find_group_stall(
        group="0",
        members=[0, 1, 2, 3],
        progress={0: _p(0, 5, 4), 1: _p(1, 5, 4), 2: _p(2, 4, 4), 3: _p(3, 5, 4)},
        no_progress_for_s=3.0,
    )
    assert st is not None
    assert (st.kind, st.seq, st.op) == ("stall", 5, "all_reduce")
    assert st.waiting_ranks == [0, 1, 3] and st.not_entered_ranks == [2]


def test_async_ops_in_flight_still_name_the_laggard() -> None:
    # Healthy ranks ran ahead with async collectives 5..9; rank 1 is stuck before 5.
    st = find_group_stall(
        group="7", members=[0, 1], progress={0: _p(0, 9, 4), 1: _p(1, 4, 4)}, no_progress_for_s=1
    )
    assert st is not None and st.seq == 5 and st.not_entered_ranks == [1]


def test_long_healthy_collective_is_not_a_stall() -> None:
    progress = {r: _p(r, 8, 7) for r in range(4)}
    assert (
        find_group_stall(group="0", members=range(4), progress=progress, no_progress_for_s=999)
        is None
    )  # type: ignore[arg-type]


def test_idle_group_is_not_a_stall() -> None:
    progress = {r: _p(r, 8, 8) for r in range(4)}
    assert (
        find_group_stall(group="0", members=[0, 1, 2, 3], progress=progress, no_progress_for_s=999)
        is None
    )


@pytest.mark.parametrize("state", ["stopped", "gone", "zombie"])
def test_all_entered_but_a_member_is_dead(state: str) -> None:
    progress = {r: _p(r, 8, 7) for r in range(3)}
    progress[1] = _p(1, 8, 7, process_state=state)
    st = find_group_stall(group="0", members=[0, 1, 2], progress=progress, no_progress_for_s=5)
    assert st is not None and st.kind == "rank-lost" and st.dead_ranks == [1]


def test_unobserved_member_is_not_counted_as_not_entered() -> None:
    progress = {0: _p(0, 8, 7), 1: _p(1, 8, 7), 2: _p(2, 7, 7, observed=False)}
    st = find_group_stall(group="0", members=[0, 1, 2, 3], progress=progress, no_progress_for_s=5)
    assert st is not None and st.kind == "agent-lost"
    assert st.not_entered_ranks == [] and st.unobserved_ranks == [2, 3]


def test_members_in_different_ops_at_the_same_seq_are_a_mismatch_stall() -> None:
    # Every member entered seq 5, but rank 3 entered a broadcast where the
    # others run all_reduce: no member can ever finish, so it is a stall.
    progress = {
        r: MemberProgress(rank=r, last_enqueued=5, last_completed=4, in_flight_op="all_reduce")
        for r in range(3)
    }
    progress[3] = MemberProgress(
        rank=3, last_enqueued=5, last_completed=4, in_flight_op="broadcast"
    )
    stall = find_group_stall(group="0", members=range(4), progress=progress, no_progress_for_s=3.0)
    assert stall is not None and stall.kind == "mismatch"
    assert stall.not_entered_ranks == [] and stall.waiting_ranks == [0, 1, 2, 3]
    assert stall.ops_entered == {"all_reduce": [0, 1, 2], "broadcast": [3]}
    # The trigger line names both ops and no single one (one story per incident).
    fields = {k: getattr(stall, k) for k in stall.__dataclass_fields__}
    t = stall_trigger([StalledGroup(**fields)], [StalledGroup(**fields)], now=100.0)
    assert t.reason.startswith("group 0 stalled at seq 5: ranks 0-3 waiting"), t.reason
    assert "different ops at that seq: all_reduce on 0-2, broadcast on 3;" in t.reason, t.reason


def test_same_op_everywhere_with_unknown_ops_is_still_healthy() -> None:
    progress = {
        r: MemberProgress(rank=r, last_enqueued=5, last_completed=4, in_flight_op="all_reduce")
        for r in range(3)
    }
    progress[3] = MemberProgress(rank=3, last_enqueued=5, last_completed=4, in_flight_op="")
    assert (
        find_group_stall(group="0", members=range(4), progress=progress, no_progress_for_s=60.0)
        is None
    )


def test_a_job_whose_ranks_all_exited_is_not_stalled() -> None:
    # Normal end of a job: every process is gone, the last reports still show
    # the final collective in flight on some of them.
    progress = {r: _p(r, 8, 7 if r else 8, process_state="gone") for r in range(3)}
    assert (
        find_group_stall(group="0", members=[0, 1, 2], progress=progress, no_progress_for_s=60)
        is None
    )
