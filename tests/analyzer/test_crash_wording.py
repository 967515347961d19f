"""A crash incident's verdict opens with the crash, offline as live.

The coordinator records the crash (who, how, the exception) in incident.json's
trigger; the analyzer reads it there, so `hangwatch analyze BUNDLE` on a crash
bundle tells the same story as the dashboard, and no sentence assumes a stall.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hangwatch.analyzer import analyze_path

from hangwatch import formats
from hangwatch.formats import IncidentDoc
from tests.helpers import GOLDEN_DIR

EXC = "RuntimeError: rank 1: corrupt sample in batch 10"


def _bundle(tmp_path: Path, golden: str, trigger: dict[str, object]) -> Path:
    d = tmp_path / golden
    shutil.copytree(GOLDEN_DIR / golden, d)
    doc = IncidentDoc(id="crash-1", job_id="job", reason="rank 1 crashed", trigger=trigger)
    (d / formats.INCIDENT_FILE).write_text(json.dumps(doc.to_json()))
    return d


def _world(golden: str) -> int:
    return int(json.loads((GOLDEN_DIR / golden / "manifest.json").read_text())["world_size"])


@pytest.mark.timeout(60)
def test_no_culprit_after_a_crash_reads_the_survivors_not_a_stall(tmp_path: Path) -> None:
    crash = {"kind": "crash", "rank": 1, "how": "exit code 1", "exception": EXC}
    report = analyze_path(_bundle(tmp_path, "healthy", crash), world_size=_world("healthy"))
    # The culprit is in the structured fields every consumer reads, not only in prose.
    assert (report.verdict, report.lagging_ranks) == ("crash", [1]), report.summary
    # Then where each rank stood in its own FR; FR's "no culprit visible" reading
    # is about a hang, and after a crash the culprit is known: it is left out.
    assert report.summary == (
        f"Rank 1 crashed (exit code 1): {EXC}. In FR, rank 1 last entered all_gather #9 in "
        "group 0; ranks 0,2,3 had entered all_gather #9 in group 0."
    ), report.summary
    assert "A stall was reported" not in report.summary
    [first] = [f for f in report.findings if f.kind == "rank-crashed"]
    assert first.ranks == [1] and EXC in first.detail


@pytest.mark.timeout(60)
def test_a_hang_behind_a_named_crash_blames_the_crashed_rank(tmp_path: Path) -> None:
    """The skip bundle: FR blames the rank that never entered. With a crash trigger
    naming another rank, the crash is the cause; FR's reading follows it."""
    plain = analyze_path(GOLDEN_DIR / "skip", world_size=_world("skip"))
    survivor = next(r for r in range(_world("skip")) if r not in plain.lagging_ranks)
    crash = {"kind": "crash", "rank": survivor, "how": "exit code 1", "exception": EXC}
    report = analyze_path(_bundle(tmp_path, "skip", crash), world_size=_world("skip"))
    assert (report.verdict, report.lagging_ranks) == ("crash", [survivor])
    assert report.summary.endswith(plain.summary)
    assert report.stalled_collective == plain.stalled_collective  # where the others waited


@pytest.mark.timeout(60)
def test_a_hang_after_a_crash_keeps_its_verdict_behind_the_crash(tmp_path: Path) -> None:
    plain = analyze_path(GOLDEN_DIR / "skip", world_size=_world("skip"))
    crash = {"kind": "crash", "rank": -1, "how": "killed by SIGKILL", "exception": ""}
    report = analyze_path(_bundle(tmp_path, "skip", crash), world_size=_world("skip"))
    assert (report.verdict, report.lagging_ranks) == (plain.verdict, plain.lagging_ranks)
    assert report.summary == f"A rank crashed (killed by SIGKILL). {plain.summary}"


@pytest.mark.timeout(60)
def test_hostile_crash_text_stays_one_bounded_line(tmp_path: Path) -> None:
    crash = {"kind": "crash", "rank": True, "how": "x\n" * 500, "exception": "\x1b[2J" + "E" * 9000}
    report = analyze_path(_bundle(tmp_path, "healthy", crash), world_size=_world("healthy"))
    head = report.summary.split(". In the survivors'")[0]
    assert head.startswith("A rank crashed (") and "\n" not in head and "\x1b" not in head
    assert len(head) < 500


@pytest.mark.timeout(60)
def test_a_stall_incident_is_not_worded_as_a_crash(tmp_path: Path) -> None:
    report = analyze_path(
        _bundle(tmp_path, "healthy", {"kind": "stall"}), world_size=_world("healthy")
    )
    assert report.summary.startswith("A stall was reported"), report.summary


@pytest.mark.timeout(30)
def test_a_survivor_s_error_after_the_crash_is_a_consequence() -> None:
    from hangwatch.analyzer.crash import with_crash
    from hangwatch.analyzer.report import Finding, FindingKind, Report

    closed = (
        "rank 0: uncaught exception in thread MainThread: RuntimeError: Connection closed by peer"
    )
    own = f"rank 1: uncaught exception in thread MainThread: {EXC}"
    fr = Report(
        verdict="hang",
        summary="Rank 1 never entered all_reduce #16 in group 0 (default_pg); rank 0 is waiting in it.",
        lagging_ranks=[1],
        findings=[
            Finding(kind=FindingKind.STUCK_OUTSIDE_COLLECTIVE, ranks=[1], detail="stuck"),
            Finding(kind=FindingKind.THREAD_EXCEPTION, ranks=[0], detail=closed),
            Finding(kind=FindingKind.THREAD_EXCEPTION, ranks=[1], detail=own),
        ],
    )
    head = f"Rank 1 crashed (process gone): {EXC}"
    rep = with_crash(fr, {"kind": "crash", "rank": 1}, head)
    assert (rep.verdict, rep.lagging_ranks) == ("crash", [1])
    kinds = [(f.kind, f.ranks) for f in rep.findings]
    # Dead, not stuck; rank 0's error follows from it; rank 1's own exception stays.
    assert kinds == [
        (FindingKind.RANK_CRASHED, [1]),
        (FindingKind.CRASH_CONSEQUENCE, [0]),
        (FindingKind.THREAD_EXCEPTION, [1]),
    ]
    assert rep.findings[1].detail.startswith(closed) and "consequence" in rep.findings[1].detail
    assert rep.summary == f"{head}. {fr.summary}"


@pytest.mark.timeout(60)
def test_the_survivors_positions_say_what_the_dead_rank_never_reached(tmp_path: Path) -> None:
    """The skip bundle as a crash of the rank FR blames: the survivors had entered
    the collective it never reached, and the summary says so from the evidence."""
    plain = analyze_path(GOLDEN_DIR / "skip", world_size=_world("skip"))
    [dead] = plain.lagging_ranks
    crash = {"kind": "crash", "rank": dead, "how": "exit code 1", "exception": EXC}
    report = analyze_path(_bundle(tmp_path, "skip", crash), world_size=_world("skip"))
    sc = plain.stalled_collective
    assert sc is not None
    others = sorted(r for r in range(_world("skip")) if r != dead)
    assert all(report.evidence[r].last_entered.seq == sc.seq for r in others)  # type: ignore[union-attr]
    assert (
        f"ranks {','.join(map(str, others))} had entered {sc.op} #{sc.seq} in group {sc.group}, "
        f"which rank {dead} never reached"
    ) in report.summary, report.summary
    # FR's own reading of that stall still follows.
    assert report.summary.endswith(plain.summary)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("damage", ["one-rank-left", "missing-and-unreadable"])
def test_positions_after_a_crash_from_partial_and_damaged_dumps(
    tmp_path: Path, damage: str
) -> None:
    """The skip bundle as a crash of its lagging rank, with survivors' dumps gone
    or unreadable: the verdict stays `crash` naming the dead rank, and the
    positions say which survivors left no dump rather than guessing where they
    were (never a healthy reading)."""
    plain = analyze_path(GOLDEN_DIR / "skip", world_size=_world("skip"))
    [dead] = plain.lagging_ranks
    crash = {"kind": "crash", "rank": dead, "how": "exit code 1", "exception": EXC}
    d = _bundle(tmp_path, "skip", crash)
    survivors = sorted(r for r in range(_world("skip")) if r != dead)
    if damage == "one-rank-left":
        gone = survivors[1:]
        for r in gone:
            shutil.rmtree(d / f"rank_{r}")
        kept = survivors[:1]
    else:
        gone = survivors[:2]
        shutil.rmtree(d / f"rank_{gone[0]}")
        (d / f"rank_{gone[1]}" / f"fr_trace_rank_{gone[1]}").write_bytes(b"\x80\x04not a pickle")
        kept = survivors[2:]
    report = analyze_path(d, world_size=_world("skip"))
    assert (report.verdict, report.lagging_ranks) == ("crash", [dead]), report.summary
    assert "healthy" not in report.summary.lower()
    no_dump = ",".join(map(str, gone))
    assert f"{'rank' if len(gone) == 1 else 'ranks'} {no_dump}: no dump" in report.summary, (
        report.summary
    )
    [alive] = kept
    sc = plain.stalled_collective
    assert sc is not None
    assert (
        f"rank {alive} had entered {sc.op} #{sc.seq} in group {sc.group}, which rank {dead} never reached"
        in (report.summary)
    ), report.summary
