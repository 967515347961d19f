"""Stream order: a rank whose work every peer entered still waits on whatever its own older
unfinished work waits on; it is not a root (issue: pipeline-parallel innocents blamed).

The shapes are those of nvidia-resiliency-ext's real pipeline-parallel incidents
(test_conformance.py runs those when the data is present): a stage's queued collective
behind its own pending recv, a send queued behind a collective that waits on a stuck rank,
a GPU that never finishes an op its peers finished.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from fr_dumps import SimJob
from hangwatch.analyzer import analyze_path

pytestmark = pytest.mark.timeout(60)

CULPRIT_KINDS = {"not-entered", "stuck-outside-collective", "stuck-inside-op", "missing-dump"}


def _blamed(rep: object) -> set[int]:
    return {r for f in rep.findings if f.kind in CULPRIT_KINDS for r in f.ranks}  # type: ignore[attr-defined]


def _pipeline(tmp_path: Path) -> Path:
    """Rank 3 is stuck outside any collective (its peers' all_reduce waits on it).
    Rank 2's send to the first stage (rank 0) is queued behind that all_reduce; rank 0
    posted the matching recv, and its broadcast with rank 1 is queued behind the recv.
    Rank 2 has exchanged more p2p ops in the pipeline group (with rank 4) than rank 0:
    its p2p counter is ahead of rank 0's, which says nothing about rank 0."""
    job = SimJob(5)
    job.group("1", [0, 1], "TENSOR_MODEL_PARALLEL_GROUP")
    job.group("2", [2, 3], "TENSOR_MODEL_PARALLEL_GROUP")
    job.group("3", [0, 2, 4], "PIPELINE_MODEL_PARALLEL_GROUP")
    job.all("0")
    for _ in range(3):
        job.ranks[2].p2p("3", "send", 4, done=True)
        job.ranks[4].p2p("3", "recv", 2, done=True)
    job.all("2")
    job.all("1", "broadcast")
    job.ranks[2].coll("2", done=False)  # rank 3 never enters it
    job.ranks[2].p2p("3", "send", 0)
    job.ranks[0].p2p("3", "recv", 2)
    job.all("1", "broadcast", done=False)
    return job.write(tmp_path)


def test_a_stage_queued_behind_its_own_recv_is_not_blamed(tmp_path: Path) -> None:
    rep = analyze_path(_pipeline(tmp_path))
    assert rep.verdict == "hang"
    assert rep.lagging_ranks == [3]
    assert _blamed(rep) == {3}
    sc = rep.stalled_collective
    assert sc is not None and (sc.group, sc.seq) == ("2", 2) and sc.missing_ranks == [3]
    # Rank 0 posted the recv: it is not "p2p-unmatched" against rank 2's send.
    assert not [f for f in rep.findings if f.kind == "p2p-unmatched"]
    edges = {(e.waiter, e.waits_on) for e in rep.waits_for}
    # The chain the blame follows: 1 -> 0 (broadcast behind 0's recv) -> 2 (send
    # behind 2's all_reduce) -> 3.
    assert {(1, 0), (0, 2), (2, 3)} <= edges
    assert rep.roots == [3]


def test_the_chain_is_followed_from_any_selection_that_holds_it(tmp_path: Path) -> None:
    d = _pipeline(tmp_path)
    rep = analyze_path(d, selected_ranks=[0, 1, 2, 3])
    assert rep.verdict == "hang" and rep.lagging_ranks == [3]


def test_a_rank_stuck_inside_an_op_its_peer_finished_is_the_root(tmp_path: Path) -> None:
    """Rank 0's GPU never finishes the all_reduce rank 1 finished; rank 0's send to
    rank 2, which rank 2 posted the recv for, is queued behind it. Nobody 'never
    entered' anything: only stream order shows who rank 2 waits on."""
    job = SimJob(3)
    job.group("1", [0, 1], "TENSOR_MODEL_PARALLEL_GROUP")
    job.group("2", [0, 2], "PIPELINE_MODEL_PARALLEL_GROUP")
    job.all("0")
    job.ranks[1].coll("1", done=True)
    job.ranks[0].coll("1", done=False)
    job.ranks[0].p2p("2", "send", 2)
    job.ranks[2].p2p("2", "recv", 0)
    rep = analyze_path(job.write(tmp_path))
    assert rep.verdict == "hang"
    assert rep.lagging_ranks == [0]
    f = next(f for f in rep.findings if f.ranks == [0] and f.kind in CULPRIT_KINDS)
    assert f.kind == "stuck-inside-op"
    assert "all_reduce #1 in group 1" in f.detail and "recv #1 in group 2" in f.detail


def test_every_side_at_its_head_is_no_wait(tmp_path: Path) -> None:
    """A matched send/recv that heads both queues is in flight, not a hang."""
    job = SimJob(2)
    job.all("0")
    job.ranks[0].p2p("0", "send", 1)
    job.ranks[1].p2p("0", "recv", 0)
    job.all("0", done=False)
    rep = analyze_path(job.write(tmp_path))
    assert rep.verdict == "healthy" and rep.lagging_ranks == [] and rep.waits_for == []


def test_opposite_queue_orders_are_a_deadlock_not_two_innocents(tmp_path: Path) -> None:
    """Rank 0 queued group 1's collective before its send to rank 1; rank 1 queued the
    recv first: each op heads one queue and sits behind the other: a real cycle."""
    job = SimJob(3)
    job.group("1", [0, 1], "TENSOR_MODEL_PARALLEL_GROUP")
    job.all("0")
    job.ranks[0].coll("1", done=False)
    job.ranks[0].p2p("0", "send", 1)
    job.ranks[1].p2p("0", "recv", 0)
    job.ranks[1].coll("1", done=False)
    rep = analyze_path(job.write(tmp_path))
    assert rep.verdict == "hang"
    assert rep.cycles == [[0, 1]]
    assert set(rep.lagging_ranks) == {0, 1}
    assert 2 not in rep.lagging_ranks
