"""GroupInfo.rank_ranges: group members as (start, stop, step) runs.

The agent's encoder round-trips any member set (hypothesis); the coordinator
checks runs as it checks lists, and a registry fed runs holds the groups a
registry fed lists does.
"""

from __future__ import annotations

import re

import pytest
from hangwatch.server.ingest import validate
from hangwatch.server.ingest.validate import Invalid
from hangwatch.server.live.registry import JobRegistry
from hypothesis import given, settings
from hypothesis import strategies as st

from hangwatch.wire import group_info, group_members, member_runs, pb


@pytest.mark.timeout(60)
@settings(max_examples=300, deadline=None)
@given(st.sets(st.integers(min_value=0, max_value=300), min_size=1))
def test_runs_round_trip(members: set[int]) -> None:
    gi = group_info(name="g", desc="d", pg_id=0, members=sorted(members))
    assert group_members(gi) == tuple(sorted(members))
    assert bool(gi.rank_ranges) != bool(gi.ranks)
    assert len(gi.rank_ranges) < len(members) or gi.ranks


@pytest.mark.timeout(30)
def test_a_world_group_is_one_run() -> None:
    assert member_runs(range(16_384)) == [0, 16_384, 1]
    assert member_runs(range(3, 16_384, 8)) == [3, 16_387, 8]


def _register(rank: int, world: int, runs: list[int]) -> pb.RegisterRequest:
    return pb.RegisterRequest(
        job_id="j",
        agent_id="a",
        host="h",
        ranks=[
            pb.RankInfo(
                rank=rank, world_size=world, groups=[pb.GroupInfo(name="g", rank_ranges=runs)]
            )
        ],
    )


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("rank", "runs", "says"),
    [
        (0, [0, 8, 1, 2], "not (start, stop, step) triples"),
        (0, [0, 8, 0], "run (0, 8, 0) is not ascending"),
        (0, [0, 4, 1, 3, 8, 1], "run (3, 8, 1) is not ascending"),
        (0, [0, 9, 1], "run (0, 9, 1) is not ascending within [0, 8)"),
        (0, [-2, 4, 1], "run (-2, 4, 1) is not ascending"),
        (5, [0, 8, 2], "rank 5 registers group 'g' it is not a member of"),
    ],
)
def test_a_bad_run_is_refused_by_name(rank: int, runs: list[int], says: str) -> None:
    with pytest.raises(Invalid, match=re.escape(says)):
        validate.register_request(_register(rank, 8, runs))


@pytest.mark.timeout(30)
def test_runs_and_lists_register_the_same_groups() -> None:
    world = 64
    groups = {"0": list(range(world)), "dp": list(range(3, world, 8)), "odd": [3, 4, 9, 11]}

    def request(as_runs: bool) -> pb.RegisterRequest:
        def info(name: str, members: list[int]) -> pb.GroupInfo:
            if as_runs:
                return pb.GroupInfo(name=name, desc=name, rank_ranges=member_runs(members))
            return pb.GroupInfo(name=name, desc=name, ranks=members)

        return pb.RegisterRequest(
            job_id="j",
            agent_id="a",
            host="h",
            ranks=[
                pb.RankInfo(
                    rank=r,
                    world_size=world,
                    pid=100 + r,
                    groups=[info(n, m) for n, m in groups.items() if r in m],
                )
                for r in (3, 4, 11)
            ],
        )

    snaps = []
    for as_runs in (False, True):
        req = request(as_runs)
        validate.register_request(req)
        reg = JobRegistry(clock=lambda: 5.0)
        reg.register(req)
        snap = reg.snapshot("j")
        assert snap is not None
        snaps.append([(g.name, g.ranks) for g in snap.groups])
    assert snaps[0] == snaps[1]
    assert ("dp", list(range(3, world, 8))) in [(n, list(r)) for n, r in snaps[1]]
