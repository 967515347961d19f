"""A rank's lag (RankLive.lag, server/live/views.py) through the real registry:
collectives behind the furthest member of its groups, counted, not numbered.

Every counter numbers the first collective 1 and says -1 for none, so the
numbers jump by two where the counts move by one. Read as numbers, a healthy
pipeline's first stage, still in its first step's p2p while the last stage
sat in the first all_reduce, showed lag 2 (a live test's CI failure, stop 52).
"""

from __future__ import annotations

import pytest
from hangwatch.server.live.registry import JobRegistry

from hangwatch.wire import pb

pytestmark = pytest.mark.timeout(30)

WORLD = 3


def _registry() -> tuple[JobRegistry, str]:
    reg = JobRegistry(clock=lambda: 100.0)
    sid = reg.register(
        pb.RegisterRequest(
            job_id="j",
            agent_id="a",
            host="h",
            ranks=[
                pb.RankInfo(
                    rank=r,
                    local_rank=r,
                    world_size=WORLD,
                    pid=1000 + r,
                    backend="gloo",
                    groups=[pb.GroupInfo(name="0", ranks=list(range(WORLD)))],
                )
                for r in range(WORLD)
            ],
        )
    )
    return reg, sid


def _lags(groups: dict[int, pb.GroupProgress]) -> dict[int, int]:
    reg, sid = _registry()
    reg.report_progress(
        pb.ProgressReport(
            session_id=sid,
            job_id="j",
            agent_id="a",
            report_seq=1,
            ranks=[
                pb.RankProgress(rank=r, state=pb.PROCESS_STATE_RUNNING, groups=[gp])
                for r, gp in groups.items()
            ],
        )
    )
    snap = reg.snapshot("j")
    assert snap is not None
    return {r.rank: r.lag for r in snap.ranks}


def _p2p(raw: int, entered: int, completed: int) -> pb.GroupProgress:
    """A group whose pg_status counts p2p too: its collective counts beside it."""
    return pb.GroupProgress(
        group="0",
        last_enqueued=raw,
        last_completed=-1,
        collectives_enqueued=entered,
        collectives_completed=completed,
    )


def _plain(enqueued: int, completed: int) -> pb.GroupProgress:
    return pb.GroupProgress(group="0", last_enqueued=enqueued, last_completed=completed)


def test_a_stage_still_in_its_first_p2p_is_one_collective_behind_not_two() -> None:
    # The CI failure's numbers: stage 0 has sent and is receiving (raw 2, no
    # collective yet); the others are in the first all_reduce.
    lags = _lags({0: _p2p(2, -1, -1), 1: _p2p(4, 1, -1), 2: _p2p(3, 1, -1)})
    assert lags == {0: 1, 1: 0, 2: 0}


def test_none_entered_against_the_first_is_one_behind_on_either_counter() -> None:
    assert _lags({0: _plain(-1, -1), 1: _plain(1, -1), 2: _plain(1, -1)}) == {0: 1, 1: 0, 2: 0}
    assert _lags({0: _plain(-1, -1), 1: _plain(1, 1), 2: _plain(1, 1)}) == {0: 1, 1: 0, 2: 0}
    assert _lags({0: _plain(1, -1), 1: _plain(1, 1), 2: _plain(2, 1)}) == {0: 1, 1: 1, 2: 0}


def test_past_the_first_collective_the_numbers_are_the_counts() -> None:
    assert _lags({0: _plain(3, 3), 1: _plain(5, 4), 2: _plain(5, 5)}) == {0: 2, 1: 1, 2: 0}
    assert _lags({0: _p2p(9, 3, 2), 1: _p2p(20, 5, 4), 2: _p2p(12, 4, 4)}) == {0: 2, 1: 0, 2: 1}
