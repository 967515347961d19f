"""Diagnosis on hand-built dumps shaped exactly like torch's (NCCL and gloo)."""

from __future__ import annotations

from pathlib import Path

import pytest
from fr_dumps import SimJob, write_meta
from hangwatch.analyzer import analyze, analyze_path, load_dumps
from hangwatch.analyzer.report import Report

pytestmark = pytest.mark.timeout(30)


def kinds(rep: Report) -> list[str]:
    return [f.kind for f in rep.findings]


def _bundle_without_rank_2(tmp_path: Path, job: SimJob, process_state: str) -> Path:
    """A 3-rank bundle in `tmp_path`: ranks 0 and 1 reachable with their dumps, rank 2's
    agent unreachable (no dump, its process in `process_state`); returns rank 2's dir."""
    groups = [{"name": "0", "desc": "default_pg", "pg_id": 0, "ranks": [0, 1, 2]}]
    for r in (0, 1):
        rd = write_meta(tmp_path, r, reachable=True, process_state="sleeping", groups=groups)
        (rd / f"fr_trace_rank_{r}").write_bytes(job.ranks[r].dump_bytes())
    return write_meta(tmp_path, 2, reachable=False, process_state=process_state, groups=groups)


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
@pytest.mark.parametrize("json_form", [False, True])
def test_one_rank_never_enters(tmp_path: Path, backend: str, json_form: bool) -> None:
    job = SimJob(4, backend=backend)
    for _ in range(5):
        job.all("0")
    job.all("0", ranks=[0, 1, 2], done=False)  # rank 3 never calls #6
    job.write(tmp_path, json_form=json_form)
    rep = analyze_path(tmp_path)
    assert rep.verdict == "hang"
    assert rep.lagging_ranks == [3]
    sc = rep.stalled_collective
    assert sc is not None
    assert (sc.group, sc.seq, sc.op) == ("0", 6, "all_reduce")
    assert sc.entered_ranks == [0, 1, 2] and sc.missing_ranks == [3]
    assert sc.group_desc == "default_pg" and sc.input_sizes == [[4]] and sc.dtypes == ["Float"]
    assert (
        rep.summary
        == "Rank 3 never entered all_reduce #6 in group 0 (default_pg); ranks 0-2 are waiting in it."
    )
    assert "stuck-outside-collective" in kinds(rep)
    ev = rep.evidence[3]
    assert ev.last_completed is not None and ev.last_completed.seq == 5
    if not json_form:
        assert ev.frames and ev.frames[0].filename == "train.py"
    assert Report.from_dict(rep.to_dict()).to_dict() == rep.to_dict()


def test_nccl_async_scheduled_ranks_are_not_blamed(tmp_path: Path) -> None:
    """Healthy NCCL ranks run ahead with many collectives still scheduled."""
    job = SimJob(4)
    job.all("0")
    for r in range(4):  # everyone entered #2; nobody finished it
        job.ranks[r].coll("0", done=False, state="started")
    for r in (0, 1, 2):  # 0-2 enqueued #3, #4 asynchronously
        job.ranks[r].coll("0", done=False).coll("0", done=False)
    job.write(tmp_path / "a")
    rep = analyze_path(tmp_path / "a")
    # #2 is the lowest unfinished collective and every member entered it:
    # rank 3 being behind on *enqueueing* is not evidence against it.
    assert rep.verdict == "healthy" and rep.lagging_ranks == []

    job = SimJob(4)
    job.all("0")
    job.all("0", ranks=[0, 1, 2])  # 0-2 finished #2 on their GPUs ...
    job.ranks[3].coll("0", done=False, state="started")  # ... rank 3 did not
    for r in (0, 1, 2):
        job.ranks[r].coll("0", done=False).coll("0", done=False)
    job.write(tmp_path / "b")
    rep = analyze_path(tmp_path / "b")
    # 0-2 now wait in #3, which rank 3 never enqueued.
    assert rep.verdict == "hang" and rep.lagging_ranks == [3]
    assert rep.stalled_collective is not None and rep.stalled_collective.seq == 3
    assert "not-entered" in kinds(rep)  # rank 3 is itself still inside #2


def test_missing_rank_with_world_size(tmp_path: Path) -> None:
    job = SimJob(4, backend="gloo")
    job.all("0")
    job.all("0", ranks=[0, 1, 2], done=False)
    job.write(tmp_path, ranks=[0, 1, 2])  # no dump from rank 3
    without = analyze_path(tmp_path)
    # Nobody names rank 3, so it is not "missing"; but group 0's membership is
    # known only from the dumps of ranks 0-2, which sit in an unfinished
    # all_reduce: a member without a dump would be invisible. Not healthy.
    assert without.ranks_missing == [] and without.verdict == "unknown"
    f = next(f for f in without.findings if f.kind == "membership-unknown")
    assert f.group == "0" and f.ranks == [0, 1, 2] and f.seq == 2
    assert "--world-size" in without.summary
    rep = analyze_path(tmp_path, world_size=4)
    assert rep.ranks_missing == [3]
    assert rep.verdict == "hang" and rep.lagging_ranks == [3]
    assert "missing-dump" in kinds(rep)


def test_frozen_rank_in_a_bundle(tmp_path: Path) -> None:
    job = SimJob(3, backend="gloo")
    job.all("0")
    job.all("0", ranks=[0, 1], done=False)
    rd = _bundle_without_rank_2(tmp_path, job, process_state="stopped")
    (rd / "stacks.txt").write_text("Thread 7 (idle): MainThread\n  compute (model.py:88)\n")
    rep = analyze_path(tmp_path)
    assert rep.verdict == "hang" and rep.lagging_ranks == [2]
    assert rep.ranks_missing == [2]
    assert "frozen" in kinds(rep)
    assert rep.evidence[2].reachable is False and rep.evidence[2].process_state == "stopped"
    assert "model.py:88" in (rep.evidence[2].stacks or "")


def test_two_lagging_ranks(tmp_path: Path) -> None:
    job = SimJob(6)
    job.all("0")
    job.all("0", ranks=[0, 2, 3, 5], done=False)
    job.write(tmp_path)
    rep = analyze_path(tmp_path)
    assert rep.lagging_ranks == [1, 4]
    assert rep.summary.startswith("Ranks 1,4 never entered all_reduce #2")


def test_subgroup_hang_blames_the_root_not_default_group_waiters(tmp_path: Path) -> None:
    job = SimJob(4, backend="gloo")
    job.group("1", [0, 1])
    job.all("0")
    job.ranks[0].coll("1", done=False)  # rank 0 waits in group 1 for rank 1
    job.all("0", ranks=[2, 3], done=False)  # 2, 3 wait in the default group for 0 and 1
    job.write(tmp_path)
    rep = analyze_path(tmp_path, world_size=4)
    assert rep.verdict == "hang"
    assert rep.lagging_ranks == [1]
    assert rep.stalled_collective is not None and rep.stalled_collective.group == "1"
    assert rep.summary == (
        "Rank 1 never entered all_reduce #1 in group 1 (ranks 0,1); rank 0 is waiting in it; "
        "2 other ranks are blocked behind it."
    )
    edges = {(e.waiter, e.waits_on, e.group) for e in rep.waits_for}
    assert (0, 1, "1") in edges and (2, 0, "0") in edges


def test_cross_group_deadlock(tmp_path: Path) -> None:
    job = SimJob(2, backend="gloo")
    job.group("1", [0, 1])
    job.all("0")
    job.ranks[0].coll("0", done=False)  # rank 0 enters default #2 first
    job.ranks[1].coll("1", done=False)  # rank 1 enters group 1 #1 first
    job.write(tmp_path)
    rep = analyze_path(tmp_path)
    assert rep.verdict == "hang"
    assert rep.lagging_ranks == [0, 1]
    f = next(f for f in rep.findings if f.kind == "cross-group-deadlock")
    assert f.ranks == [0, 1] and "0" in f.detail and "1" in f.detail
    assert rep.summary.startswith("Cross-group deadlock")


def test_op_mismatch(tmp_path: Path) -> None:
    job = SimJob(3)
    job.all("0")
    job.ranks[0].coll("0", "all_reduce", done=False)
    job.ranks[1].coll("0", "all_reduce", done=False)
    job.ranks[2].coll("0", "broadcast", done=False)
    job.write(tmp_path)
    rep = analyze_path(tmp_path)
    assert rep.verdict == "mismatch" and rep.lagging_ranks == [2]
    assert "op-mismatch" in kinds(rep)
    assert rep.stalled_collective is not None and rep.stalled_collective.seq == 2


@pytest.mark.parametrize(
    ("op", "good", "bad", "kind"),
    [
        ("all_reduce", {"sizes": [[4]]}, {"sizes": [[5]]}, "size-mismatch"),
        ("all_reduce", {"sizes": [[4]]}, {"sizes": [[4]], "out_sizes": [[5]]}, "size-mismatch"),
        (
            "_all_gather_base",
            {"sizes": [[4]], "out_sizes": [[16]]},
            {"sizes": [[4]], "out_sizes": [[12]]},
            "size-mismatch",
        ),
        (
            "_reduce_scatter_base",
            {"sizes": [[16]], "out_sizes": [[4]]},
            {"sizes": [[16]], "out_sizes": [[5]]},
            "size-mismatch",
        ),
        ("all_reduce", {"dtypes": ["Float"]}, {"dtypes": ["BFloat16"]}, "dtype-mismatch"),
        (
            "all_reduce",
            {"dtypes": ["Float"]},
            {"dtypes": ["Float"], "out_dtypes": ["Half"]},
            "dtype-mismatch",
        ),
    ],
)
def test_size_and_dtype_rules(tmp_path: Path, op: str, good: dict, bad: dict, kind: str) -> None:
    job = SimJob(4)
    for r in range(4):
        job.ranks[r].coll("0", op, done=False, **(bad if r == 1 else good))
    job.write(tmp_path)
    rep = analyze_path(tmp_path)
    assert rep.verdict == "mismatch", rep.findings
    assert rep.lagging_ranks == [1]
    assert kind in kinds(rep)


def test_all_gather_numel_rule_holds_for_correct_sizes(tmp_path: Path) -> None:
    job = SimJob(4)
    job.all("0", "_all_gather_base", sizes=[[2, 3]], out_sizes=[[8, 3]])
    job.all("0", "_reduce_scatter_base", sizes=[[8, 3]], out_sizes=[[2, 3]])
    job.all("0", "broadcast", dtypes=["Long"])
    job.write(tmp_path)
    rep = analyze_path(tmp_path)
    assert rep.verdict == "healthy" and not rep.findings


def test_all_to_all_sizes_are_never_a_mismatch(tmp_path: Path) -> None:
    job = SimJob(2)
    job.ranks[0].coll("0", "all_to_all", sizes=[[10, 4]], out_sizes=[[7, 4]])
    job.ranks[1].coll("0", "all_to_all", sizes=[[6, 4]], out_sizes=[[9, 4]])
    job.write(tmp_path)
    assert analyze_path(tmp_path).verdict == "healthy"


def test_state_difference_is_not_a_mismatch(tmp_path: Path) -> None:
    job = SimJob(2)
    job.ranks[0].coll("0", done=True)
    job.ranks[1].coll("0", done=False, state="started")
    job.write(tmp_path)
    rep = analyze_path(tmp_path)
    assert rep.verdict == "healthy" and rep.lagging_ranks == []


def test_coalesced_ops_compare_by_type_only(tmp_path: Path) -> None:
    job = SimJob(2)
    job.ranks[0].coll("0", "all_reduce", coalesced=3, sizes=[[4]])
    job.ranks[1].coll("0", "all_reduce", coalesced=3, sizes=[[8]])
    job.all("0", done=False, ranks=[0])
    job.write(tmp_path)
    loaded = load_dumps(tmp_path)
    assert (loaded.entries["collective_seq_id"] == 1).sum() == 8  # 3 members + closing, per rank
    rep = analyze(loaded)
    assert rep.verdict == "hang" and rep.lagging_ranks == [1]
    assert not {"size-mismatch", "op-mismatch"} & set(kinds(rep))


def test_p2p_unmatched_send(tmp_path: Path) -> None:
    job = SimJob(4)
    job.group("9", [1, 3], "PIPELINE_MODEL_PARALLEL_GROUP")
    job.all("0")
    job.ranks[1].coll("9").p2p("9", "send", 3, done=True)
    job.ranks[3].coll("9").p2p("9", "recv", 1, done=True)
    job.ranks[1].p2p("9", "send", 3)  # rank 3 never posts the matching recv
    job.write(tmp_path)
    loaded = load_dumps(tmp_path)
    sends = loaded.entries[loaded.entries["op"] == "send"]
    assert set(sends["peer_src"]) == {0} and set(sends["peer_dst"]) == {1}  # group-local
    rep = analyze(loaded)
    assert rep.verdict == "hang" and rep.lagging_ranks == [3]
    f = next(f for f in rep.findings if f.kind == "p2p-unmatched")
    # torch names the peers in the group's numbering: the detail gives the global ranks too.
    assert f.ranks == [1, 3]
    assert "send 0->1 (group ranks; global 1->3) #2 in group 9, posted by rank 1" in f.detail
    assert rep.stalled_collective is not None and rep.stalled_collective.op == "send"


def test_p2p_matched_pair_in_flight_is_not_blamed(tmp_path: Path) -> None:
    job = SimJob(2)
    job.all("0")
    job.ranks[0].p2p("0", "send", 1)
    job.ranks[1].p2p("0", "recv", 0)
    job.write(tmp_path)
    rep = analyze_path(tmp_path)
    assert rep.verdict == "healthy" and rep.lagging_ranks == []


def test_ring_buffer_wraparound_is_not_evidence(tmp_path: Path) -> None:
    job = SimJob(3, backend="gloo", buffer_size=8)
    for _ in range(20):
        job.all("0")
    for _ in range(6):  # rank 2 ran more of another group: its buffer starts later
        job.group("1", [2], "solo")
        job.ranks[2].coll("1")
    job.all("0", ranks=[0, 2], done=False)
    job.write(tmp_path)
    loaded = load_dumps(tmp_path)
    first = loaded.entries.groupby("rank")["collective_seq_id"].min().to_dict()
    assert first[0] != first[2]  # buffers cover different seq ranges
    rep = analyze(loaded)
    assert rep.verdict == "hang" and rep.lagging_ranks == [1]
    assert rep.stalled_collective is not None and rep.stalled_collective.seq == 21
    assert "buffer-wrapped" in kinds(rep)


def test_status_only_dump_still_diagnoses(tmp_path: Path) -> None:
    job = SimJob(3)
    job.all("0")
    job.all("0", ranks=[0, 1], done=False)
    for r in range(3):
        obj = job.ranks[r].dump_obj()
        del obj["entries"]  # includeCollectives=False
        import pickle

        (tmp_path / f"status_{r}").write_bytes(pickle.dumps(obj))
    rep = analyze_path(tmp_path)
    assert rep.verdict == "hang" and rep.lagging_ranks == [2]


def test_no_collective_in_flight_offline_is_healthy_and_in_an_incident_is_honest(
    tmp_path: Path,
) -> None:
    job = SimJob(2, backend="gloo")
    for _ in range(3):
        job.all("0")
    job.write(tmp_path / "offline")
    rep = analyze_path(tmp_path / "offline")
    assert rep.verdict == "healthy"
    assert rep.summary.startswith("FR shows no stalled collective")
    assert "gloo-p2p-blind-spot" in kinds(rep)

    b = tmp_path / "bundle"
    for r in (0, 1):
        rd = write_meta(b, r, reachable=True, process_state="sleeping")
        (rd / f"fr_trace_rank_{r}").write_bytes(job.ranks[r].dump_bytes())
    rep = analyze_path(b)
    assert rep.verdict == "no-culprit-visible"
    assert rep.lagging_ranks == [] and rep.stalled_collective is None
    f = next(f for f in rep.findings if f.kind == "no-collective-in-flight")
    assert "stacks" in f.detail and "gloo" in f.detail


def test_group_filter(tmp_path: Path) -> None:
    job = SimJob(4)
    job.group("1", [0, 1])
    job.group("2", [2, 3])
    job.ranks[0].coll("1", done=False)
    job.ranks[2].coll("2")
    job.ranks[3].coll("2")
    job.write(tmp_path)
    assert analyze_path(tmp_path).lagging_ranks == [1]
    only2 = analyze_path(tmp_path, group="2")
    assert only2.verdict == "healthy" and [g.group for g in only2.groups] == ["2"]


def test_version_2_0_dump_diagnoses(tmp_path: Path) -> None:
    job = SimJob(3)
    job.all("0")
    job.all("0", ranks=[0, 1], done=False)
    job.write(tmp_path, version="2.0")
    rep = analyze_path(tmp_path)
    assert rep.verdict == "hang" and rep.lagging_ranks == [2]


def test_cross_group_deadlock_blames_the_rank_that_took_the_odd_order(tmp_path: Path) -> None:
    # Every rank trains on group "1" then the default group; rank 1 alone goes
    # to the default group first. Ranks 0,2,3 wait in group 1 for rank 1, and
    # rank 1 waits in the default group for them: a cycle whose odd one out is 1.
    job = SimJob(4, backend="gloo")
    job.group("1", [0, 1, 2, 3])
    job.all("1")
    job.all("0")
    for r in (0, 2, 3):
        job.ranks[r].coll("1", done=False)
    job.ranks[1].coll("0", done=False)
    job.write(tmp_path)
    rep = analyze_path(tmp_path)
    assert rep.verdict == "hang"
    assert rep.lagging_ranks == [1]
    assert rep.stalled_collective is not None
    assert (rep.stalled_collective.group, rep.stalled_collective.seq) == ("1", 2)
    f = next(f for f in rep.findings if f.kind == "cross-group-deadlock")
    assert f.ranks == [0, 1, 2, 3]
    assert rep.summary.startswith("Cross-group deadlock: rank 1 entered groups")


def test_unobserved_rank_is_not_blamed_beside_a_rank_that_never_entered(tmp_path: Path) -> None:
    # Rank 1 provably never entered (its dump says so); rank 2's agent was
    # unreachable, so nothing is known of it. Rank 1 explains the wait alone.
    job = SimJob(3, backend="gloo")
    job.all("0")
    job.all("0", ranks=[0], done=False)
    _bundle_without_rank_2(tmp_path, job, process_state="unknown")
    rep = analyze_path(tmp_path)
    assert rep.verdict == "hang" and rep.lagging_ranks == [1]
    assert rep.ranks_missing == [2]


def test_unobserved_rank_is_blamed_when_nothing_else_explains_the_wait(tmp_path: Path) -> None:
    job = SimJob(3, backend="gloo")
    job.all("0")
    job.all("0", ranks=[0, 1], done=False)
    _bundle_without_rank_2(tmp_path, job, process_state="unknown")
    rep = analyze_path(tmp_path)
    assert rep.verdict == "hang" and rep.lagging_ranks == [2]
