"""Verdicts an on-call engineer can trust: blame only what the dumps prove,
name the collective the waiting majority is in, never call a visible hang
healthy (torch-free: synthetic dumps and copies of the golden dumps)."""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import pytest
from hangwatch.analyzer import analyze_path

from tests.analyzer.fr_dumps import SimJob

GOLDEN = Path(__file__).resolve().parents[1] / "golden"


def _golden(tmp_path: Path, name: str) -> Path:
    d = tmp_path / name
    shutil.copytree(GOLDEN / name, d)
    return d


def _truncate_dump(rank_dir: Path) -> None:
    for f in rank_dir.iterdir():
        if f.name not in ("meta.json", "stacks.txt"):
            f.write_bytes(f.read_bytes()[:50])


# ---------- 1. blame only what the dumps prove ----------


def test_missing_rank_is_no_dump_in_the_headline(tmp_path: Path) -> None:
    job = SimJob(4)
    for _ in range(5):
        job.all("0")
    job.all("0", ranks=[0, 1, 2], done=False)
    job.write(tmp_path, ranks=[0, 1, 2])  # rank 3: no dump
    rep = analyze_path(tmp_path, world_size=4)
    assert rep.verdict == "hang" and rep.lagging_ranks == [3]
    assert "never entered" not in rep.summary
    assert rep.summary == (
        "No dump from rank 3, which ranks 0-2 are waiting on in all_reduce #6 "
        "in group 0 (default_pg)."
    )
    assert any(f.kind == "missing-dump" and f.ranks == [3] for f in rep.findings)


def test_unreadable_dump_is_no_dump_in_the_headline(tmp_path: Path) -> None:
    job = SimJob(4)
    for _ in range(5):
        job.all("0")
    job.all("0", ranks=[0, 1, 2], done=False)
    job.write(tmp_path)
    (tmp_path / "nccl_trace_rank_3").write_bytes(b"\x80\x04garbage")
    rep = analyze_path(tmp_path)
    assert rep.errors and rep.ranks_missing == [3]
    assert rep.verdict == "hang" and rep.lagging_ranks == [3]
    assert rep.summary.startswith("No dump from rank 3")
    assert "never entered" not in rep.summary


def test_truncated_innocent_peer_is_not_blamed_beside_the_culprit(tmp_path: Path) -> None:
    # golden "compute": rank 2 is stuck in compute; rank 1's dump is truncated.
    d = _golden(tmp_path, "compute")
    _truncate_dump(d / "rank_1")
    rep = analyze_path(d)
    assert rep.errors and 1 in rep.ranks_missing
    assert rep.verdict == "hang" and rep.lagging_ranks == [2]
    assert rep.summary.startswith("Rank 2 never entered all_reduce #10")
    assert "no dump" not in rep.summary and "Ranks" not in rep.summary
    # Its absence is said, not blamed.
    f = next(f for f in rep.findings if f.kind == "missing-dump")
    assert f.ranks == [1] and "not blamed" in f.detail


def test_no_dump_ranks_are_blamed_when_no_dump_explains_the_stall(tmp_path: Path) -> None:
    # golden "gil": rank 2 has no dump; truncate rank 0's too: nobody with a
    # dump is behind, so the stall rests on the ranks without one.
    d = _golden(tmp_path, "gil")
    _truncate_dump(d / "rank_0")
    rep = analyze_path(d)
    assert rep.verdict == "hang" and rep.lagging_ranks == [0, 2]
    assert rep.summary.startswith("No dump from ranks 0,2, which ranks 1,3 are waiting on")


# ---------- 2. the stalled collective is what the waiting majority is in ----------


def _odd_one_out(
    tmp_path: Path, odd: int, op: str = "broadcast", sizes: list[list[int]] | None = None
) -> Path:
    job = SimJob(4)
    for _ in range(5):
        job.all("0")
    for r in range(4):
        if r == odd:
            job.ranks[r].coll("0", op, done=False, sizes=sizes or [[8]], dtypes=["Half"])
        else:
            job.ranks[r].coll("0", "all_reduce", done=False)
    return job.write(tmp_path)


@pytest.mark.parametrize("odd", [0, 1, 3])
def test_op_mismatch_names_the_majoritys_collective(tmp_path: Path, odd: int) -> None:
    rep = analyze_path(_odd_one_out(tmp_path, odd))
    assert rep.verdict == "mismatch" and rep.lagging_ranks == [odd]
    sc = rep.stalled_collective
    assert sc is not None
    assert (sc.op, sc.seq, sc.input_sizes, sc.dtypes) == ("all_reduce", 6, [[4]], ["Float"])
    assert sc.profiling_name == "nccl:all_reduce"
    assert rep.summary == (
        f"Rank {odd} disagrees with the rest of group 0 (default_pg) at all_reduce #6: op mismatch."
    )
    f = next(f for f in rep.findings if f.kind == "op-mismatch")
    assert f.ranks == [odd] and (f.group, f.seq) == ("0", 6)
    assert f"rank {odd} calls broadcast, input sizes [[8]], dtypes Half" in f.detail


@pytest.mark.parametrize("odd", [0, 3])
def test_size_mismatch_shows_the_majoritys_sizes(tmp_path: Path, odd: int) -> None:
    rep = analyze_path(_odd_one_out(tmp_path, odd, op="all_reduce", sizes=[[8]]))
    assert rep.lagging_ranks == [odd]
    sc = rep.stalled_collective
    assert sc is not None and (sc.op, sc.input_sizes) == ("all_reduce", [[4]])
    assert sc.dtypes == ["Float"]


# ---------- 3. never "healthy" when one rank's dump shows a hang ----------


def _lone_rank(tmp_path: Path, backend: str) -> Path:
    job = SimJob(4, backend=backend)
    for _ in range(3):
        job.all("0")
    job.all("0", ranks=[0], done=False)
    obj = job.ranks[0].dump_obj()
    # No member list anywhere: pg_config names no ranks, no bundle, no --world-size.
    obj["pg_config"] = {k: dict(v, ranks="[]") for k, v in obj["pg_config"].items()}
    (tmp_path / "nccl_trace_rank_0").write_bytes(pickle.dumps(obj))
    return tmp_path


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_one_rank_in_an_unfinished_collective_is_unknown_not_healthy(
    tmp_path: Path, backend: str
) -> None:
    rep = analyze_path(_lone_rank(tmp_path, backend))
    assert rep.verdict == "unknown"
    assert "membership is unknown" in rep.summary and "all_reduce #4" in rep.summary
    f = next(f for f in rep.findings if f.kind == "membership-unknown")
    assert f.ranks == [0] and (f.group, f.seq) == ("0", 4)
    assert "membership unknown" in f.detail
    (g,) = rep.groups
    assert g.ranks == [0] and not g.membership_known


def test_membership_unknown_is_shown_in_the_terminal_report(tmp_path: Path) -> None:
    from hangwatch.analyzer.render import render
    from rich.console import Console

    rep = analyze_path(_lone_rank(tmp_path, "nccl"))
    console = Console(record=True, width=200)
    render(rep, console)
    text = console.export_text()
    assert text.startswith("[unknown]") and "membership unknown" in text


def test_world_size_makes_the_lone_rank_a_hang(tmp_path: Path) -> None:
    rep = analyze_path(_lone_rank(tmp_path, "nccl"), world_size=4)
    assert rep.verdict == "hang" and rep.lagging_ranks == [1, 2, 3]
    assert not any(f.kind == "membership-unknown" for f in rep.findings)
    assert all(g.membership_known for g in rep.groups)
