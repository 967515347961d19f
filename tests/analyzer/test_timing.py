"""Verdicts that read time: dumps written at different moments are not one snapshot.

Torch-free: dumps built as torch writes them (fr_dumps.SimJob). The live
counterpart, on torch's own abort-hook dumps from the compiled hwhooks
backend, is tests/live/test_nccl2_path.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from fr_dumps import SimJob, write_meta
from hangwatch.analyzer import analyze_path
from hangwatch.analyzer.report import FindingKind, Report

S = 1_000_000_000  # ns


def _job(late_s: float = 0.0, *, timeout_ms: int = 3000, late_rank: int = 1) -> SimJob:
    """3 ranks, 10 finished all_reduces, then #11 entered by all and finished by none;
    `late_rank` entered it `late_s` after the others."""
    job = SimJob(3)
    for _ in range(10):
        job.all()
    job.all(done=False)
    for r in job.ranks:
        e = r.entries[-1]
        e["timeout_ms"] = timeout_ms
        if r.rank == late_rank:
            e["time_created_ns"] += int(late_s * S)
    return job


def _newest_ns(job: SimJob) -> int:
    return max(e["time_created_ns"] for r in job.ranks for e in r.entries)


def _write(job: SimJob, d: Path, *, written_after_s: float | None = None) -> Path:
    """Each file's write time `written_after_s` after the newest entry (None: now,
    which for these 2023 timestamps reads as a later copy, not the dump's time)."""
    job.write(d)
    if written_after_s is not None:
        t = (_newest_ns(job) + int(written_after_s * S)) / S
        for f in d.iterdir():
            os.utime(f, (t, t))
    return d


def _kinds(report: Report) -> set[str]:
    return {f.kind for f in report.findings}


@pytest.mark.timeout(30)
def test_the_rank_that_entered_last_is_named_with_its_lateness(tmp_path: Path) -> None:
    # Rank 1 came 8 s after ranks 0 and 2, who had a 3 s timeout: each dump
    # is its rank's own abort-hook dump, and all three show #11 unfinished.
    report = analyze_path(_write(_job(8.0), tmp_path))
    assert report.verdict == "hang"
    assert report.lagging_ranks == [1]
    sc = report.stalled_collective
    assert sc is not None and (sc.group, sc.seq, sc.op) == ("0", 11, "all_reduce")
    late = [f for f in report.findings if f.kind == FindingKind.LATE_ARRIVAL]
    assert [f.ranks for f in late] == [[1]]
    assert "8.000s after the others" in late[0].detail
    assert "past their 3s timeout" in report.summary


@pytest.mark.timeout(30)
def test_a_late_rank_is_never_an_innocent_one(tmp_path: Path) -> None:
    for late_rank in (0, 2):
        report = analyze_path(_write(_job(8.0, late_rank=late_rank), tmp_path / str(late_rank)))
        assert (report.verdict, report.lagging_ranks) == ("hang", [late_rank])


@pytest.mark.timeout(30)
def test_everyone_entered_together_long_before_the_dumps_is_never_healthy(
    tmp_path: Path,
) -> None:
    report = analyze_path(_write(_job(0.0), tmp_path, written_after_s=120.0))
    assert report.verdict == "no-culprit-visible"
    assert report.lagging_ranks == []
    assert FindingKind.ENTERED_NONE_FINISHED in _kinds(report)
    assert "the fault is below it (network, GPU)" in report.summary
    sc = report.stalled_collective
    assert sc is not None and sc.seq == 11


@pytest.mark.timeout(30)
def test_a_collective_just_entered_by_everyone_is_still_healthy(tmp_path: Path) -> None:
    # A manual dump that caught #11 a second after everyone entered it: a
    # single snapshot cannot tell slow from stuck, and nobody came late.
    report = analyze_path(_write(_job(0.0), tmp_path, written_after_s=1.0))
    assert report.verdict == "healthy"
    assert not _kinds(report) & {FindingKind.LATE_ARRIVAL, FindingKind.ENTERED_NONE_FINISHED}


@pytest.mark.timeout(30)
def test_lateness_inside_the_timeout_is_named_only_once_a_stall_is_known(tmp_path: Path) -> None:
    # 8 s late against a 600 s timeout, dumped right after: maybe just slow.
    job = _job(8.0, timeout_ms=600_000)
    assert analyze_path(_write(job, tmp_path / "plain")).verdict == "healthy"
    # The same dumps in an incident bundle (a stall was reported): rank 1 is named.
    bundle = tmp_path / "bundle"
    for r in range(3):
        rd = write_meta(bundle, r)
        (rd / f"nccl_trace_rank_{r}").write_bytes(job.ranks[r].dump_bytes())
    report = analyze_path(bundle)
    assert (report.verdict, report.lagging_ranks) == ("hang", [1])


@pytest.mark.timeout(30)
def test_clocks_of_different_hosts_need_a_wider_margin(tmp_path: Path) -> None:
    def bundle(d: Path, hosts: list[str]) -> Report:
        job = _job(1.2, timeout_ms=1000)
        for r in range(3):
            rd = write_meta(d, r, host=hosts[r])
            (rd / f"nccl_trace_rank_{r}").write_bytes(job.ranks[r].dump_bytes())
        return analyze_path(d)

    one = bundle(tmp_path / "one", ["node-a"] * 3)
    assert (one.verdict, one.lagging_ranks) == ("hang", [1])
    assert "one host's clock" in next(
        f.detail for f in one.findings if f.kind == FindingKind.LATE_ARRIVAL
    )
    # 1.2 s across unmeasured clocks is within the margin: nobody is named
    # from time, and the stall is still not called healthy.
    two = bundle(tmp_path / "two", ["node-a", "node-b", "node-a"])
    assert two.lagging_ranks == []
    assert two.verdict == "no-culprit-visible"
    assert "not measured against each other" in next(
        f.detail for f in two.findings if f.kind == FindingKind.ENTERED_NONE_FINISHED
    )


@pytest.mark.timeout(30)
def test_measured_clock_offsets_put_hosts_on_one_clock(tmp_path: Path) -> None:
    # Rank 1's host runs 5 s fast; the agent measured it (offset -5 s, error 2 ms).
    # Uncorrected, rank 1 would read 5 s late and be blamed; corrected, rank 2
    # is the one that came 3 s after the others.
    job = _job(3.0, timeout_ms=1000, late_rank=2)
    job.ranks[1].entries[-1]["time_created_ns"] += 5 * S
    d = tmp_path / "b"
    for r in range(3):
        rd = write_meta(
            d,
            r,
            host="node-b" if r == 1 else "node-a",
            clock_offset_ns=-5 * S if r == 1 else 0,
            clock_error_ns=2_000_000,
        )
        (rd / f"nccl_trace_rank_{r}").write_bytes(job.ranks[r].dump_bytes())
    report = analyze_path(d)
    assert (report.verdict, report.lagging_ranks) == ("hang", [2]), report.summary
    late = next(f for f in report.findings if f.kind == FindingKind.LATE_ARRIVAL)
    assert "by the agents' offsets, within 0.004s" in late.detail
