"""Membership inferred from complete dumps: a rank whose whole history never names a group is not in it.

Raw gloo dumps say nothing of a subgroup's members (pg_config is empty), and
without bundle metadata the analyzer used to call such a group's membership
unknown. When every rank of the world left its complete history (from record
0, no tail, every pg_status group named), the ranks that mention the group
are all of its members, and the report says the list was inferred.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from fr_dumps import SimJob
from hangwatch.analyzer import analyze_path


def _opposite_orders(buffer_size: int | None = None) -> SimJob:
    """World 3; groups 1 and 2 over ranks {0, 1}, entered in opposite orders."""
    job = SimJob(3, backend="gloo", buffer_size=buffer_size)
    job.group("1", [0, 1])
    job.group("2", [0, 1])
    for _ in range(3):
        job.all("0")
        job.all("1")
        job.all("2")
    job.ranks[0].coll("1", done=False)
    job.ranks[1].coll("2", done=False)
    return job


@pytest.mark.timeout(30)
def test_complete_histories_give_membership_and_the_deadlock(tmp_path: Path) -> None:
    d = _opposite_orders().write(tmp_path, name="fr_trace_rank_{rank}")
    report = analyze_path(d, world_size=3)
    assert (report.verdict, report.lagging_ranks) == ("hang", [0, 1]), report.summary
    kinds = {f.kind for f in report.findings}
    assert "cross-group-deadlock" in kinds and "membership-unknown" not in kinds, kinds
    groups = {g.group: g for g in report.groups}
    for g in ("1", "2"):
        assert (groups[g].ranks, groups[g].membership_source) == ([0, 1], "inferred")
        assert groups[g].membership_known


@pytest.mark.timeout(30)
def test_a_wrapped_history_or_a_missing_rank_infers_nothing(tmp_path: Path) -> None:
    # Rank 2 left no dump: whether it is in groups 1 and 2 is not known.
    d = _opposite_orders().write(tmp_path / "two", name="fr_trace_rank_{rank}", ranks=[0, 1])
    groups = {g.group: g for g in analyze_path(d, world_size=3).groups}
    assert groups["1"].membership_source == "dumps"
    # Ring buffers that lost their oldest records: a group may have been used there.
    d = _opposite_orders(buffer_size=6).write(tmp_path / "wrapped", name="fr_trace_rank_{rank}")
    report = analyze_path(d, world_size=3)
    assert {g.group: g for g in report.groups}["1"].membership_source == "dumps"
    assert report.verdict != "healthy"
