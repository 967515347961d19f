"""Where each group's members stand (Report.groups): the lowest completed and
highest entered seq, and the members grouped by where they are, furthest
behind first (analyzer.evidence.group_progress)."""

from __future__ import annotations

from pathlib import Path

import pytest
from fr_dumps import SimJob
from hangwatch.analyzer import analyze_path
from hangwatch.analyzer.report import GroupPosition, GroupProgress


def _by_group(groups: list[GroupProgress]) -> dict[str, GroupProgress]:
    return {g.group: g for g in groups}


@pytest.mark.timeout(60)
def test_each_group_stands_where_its_members_do(tmp_path: Path) -> None:
    job = SimJob(8)
    job.group("1", [0, 1, 2, 3], desc="tp_a")
    job.group("2", [4, 5, 6, 7], desc="tp_b")
    for _ in range(3):
        job.all("0")
    # Group 1: ranks 0 and 1 two ahead of ranks 2 and 3, one of those in flight.
    job.all("1", ranks=[0, 1, 2, 3])
    job.all("1", ranks=[0, 1])
    job.all("1", ranks=[0, 1], done=False)
    # Group 2: rank 7 behind everyone; rank 4 has completed less than 5 and 6
    # but entered more (two in flight, as NCCL's queue allows): ordered by
    # what it completed first.
    job.all("2")
    job.all("2", ranks=[4, 5, 6])
    job.all("2", ranks=[5, 6])
    job.all("2", ranks=[4], done=False)
    job.all("2", ranks=[4], done=False)
    job.write(tmp_path)

    groups = _by_group(analyze_path(tmp_path).groups)

    world = groups["0"]
    assert (world.min_completed, world.max_enqueued) == (3, 3)
    assert world.positions == [GroupPosition(ranks=list(range(8)), completed=3, enqueued=3)]

    a = groups["1"]
    assert (a.group_desc, a.min_completed, a.max_enqueued) == ("tp_a", 1, 3)
    assert a.positions == [
        GroupPosition(ranks=[2, 3], completed=1, enqueued=1),
        GroupPosition(ranks=[0, 1], completed=2, enqueued=3),
    ]

    b = groups["2"]
    assert (b.min_completed, b.max_enqueued) == (1, 4)
    assert b.positions == [
        GroupPosition(ranks=[7], completed=1, enqueued=1),
        GroupPosition(ranks=[4], completed=2, enqueued=4),
        GroupPosition(ranks=[5, 6], completed=3, enqueued=3),
    ]
