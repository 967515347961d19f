"""Timelines (analyzer/trace.py, `hangwatch analyze --trace`): valid trace-event JSON,
one track per rank, the stalled collective and the lagging ranks marked."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from hangwatch.analyzer.trace import SCHEMA, STALLED_COLOUR, trace_path

from tests.helpers import CONFORMANCE_DIR, GOLDEN_DIR

GOLDEN = sorted(p for p in GOLDEN_DIR.iterdir() if (p / "manifest.json").is_file())


def check_format(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The trace-event format's rules for what we emit; returns the slices."""
    assert set(doc) >= {"traceEvents"} and isinstance(doc["traceEvents"], list)
    json.loads(json.dumps(doc))  # plain JSON, nothing else
    slices = []
    for e in doc["traceEvents"]:
        assert e["ph"] in ("M", "X", "i"), e
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int), e
        if e["ph"] == "M":
            assert e["name"] in ("process_name", "process_sort_index", "thread_name"), e
            continue
        assert isinstance(e["ts"], float | int) and e["ts"] >= 0, e
        if e["ph"] == "X":
            assert isinstance(e["dur"], float | int) and e["dur"] >= 0, e
            slices.append(e)
        else:
            assert e["s"] in ("g", "p", "t"), e
    # Slices on one thread never overlap (the format wants them nested).
    by_track: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
    for s in slices:
        by_track[(s["pid"], s["tid"])].append(s)
    for track in by_track.values():
        track.sort(key=lambda s: s["ts"])
        for a, b in itertools.pairwise(track):
            assert a["ts"] + a["dur"] <= b["ts"] + 1e-6, (a, b)
    return slices


def test_cli_trace_of_the_golden_skip_dumps(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    r = subprocess.run(
        [sys.executable, "-m", "hangwatch", "analyze", str(GOLDEN_DIR / "skip"), "--json",
         "--trace", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    manifest = json.loads((GOLDEN_DIR / "skip" / "manifest.json").read_text())
    doc = json.loads(out.read_text())
    slices = check_format(doc)
    assert doc["otherData"]["schema"] == SCHEMA
    assert doc["otherData"]["lagging_ranks"] == report["lagging_ranks"] == [1]

    names = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"}
    world = manifest.get("world_size", 4)
    assert sorted(names) == list(range(world))
    assert names[1] == "rank 1 (lagging)" and names[0] == "rank 0"
    reduces: dict[int, list[int]] = defaultdict(list)
    for s in slices:
        if s["name"].startswith("all_reduce #"):
            reduces[s["pid"]].append(s["args"]["seq"])
    assert sorted(reduces) == list(range(world))  # every rank has its all_reduce slices
    # Rank 1 never entered all_reduce #10; the others are stuck in it, coloured.
    assert 10 not in reduces[1] and all(10 in reduces[r] for r in (0, 2, 3))
    stalled = [s for s in slices if s["args"].get("stalled")]
    assert sorted(s["pid"] for s in stalled) == [0, 2, 3]
    assert all(s["cname"] == STALLED_COLOUR and s["name"] == "all_reduce #10" for s in stalled)
    marks = [e for e in doc["traceEvents"] if e["ph"] == "i" and e["s"] == "p"]
    assert [(m["pid"], m["name"]) for m in marks] == [
        (1, "lagging: never entered all_reduce #10 in group 0")
    ]
    # gloo records no start or completion: slices are laid out by sequence.
    assert {s["args"]["timing"] for s in slices} <= {"sequence", "to-end"}


@pytest.mark.parametrize("case", GOLDEN, ids=lambda p: p.name)
def test_every_golden_set_gives_a_valid_trace(case: Path) -> None:
    doc = trace_path(case)
    slices = check_format(doc)
    tracks = {e["pid"] for e in doc["traceEvents"] if e["name"] == "process_name"}
    assert {s["pid"] for s in slices} <= tracks
    threads = {(e["pid"], e["tid"]) for e in doc["traceEvents"] if e["name"] == "thread_name"}
    assert {(s["pid"], s["tid"]) for s in slices} <= threads


@pytest.mark.skipif(
    not CONFORMANCE_DIR.is_dir(), reason=f"conformance data not present at {CONFORMANCE_DIR}"
)
def test_real_nccl_incident() -> None:
    doc = trace_path(CONFORMANCE_DIR / "lock_gil_1st")
    slices = check_format(doc)
    ranks = {e["pid"] for e in doc["traceEvents"] if e["name"] == "process_name"}
    assert ranks == set(range(16))
    # A rank whose dump kept no entries still has its (empty) track.
    assert {s["pid"] for s in slices} <= ranks and len({s["pid"] for s in slices}) >= 12
    # Every entry these dumps kept is still `scheduled` (no start, no completion
    # recorded): laid out by sequence on each rank's own clock.
    assert {s["args"]["timing"] for s in slices} <= {"sequence", "to-end"}
    assert {s["args"]["state"] for s in slices} == {"scheduled"}
    assert any(s["args"].get("stalled") for s in slices)
    lagging = set(doc["otherData"]["lagging_ranks"])
    assert lagging and {e["pid"] for e in doc["traceEvents"] if e.get("s") == "p"} == lagging


def test_recorded_start_and_completion_are_used_and_never_overlap() -> None:
    """NCCL-style rows (state completed, real times): the slice runs from
    creation to completion, cut where the next op starts, FR's times kept."""
    import pandas as pd
    from hangwatch.analyzer import trace

    ms = 1_000_000
    rows = pd.DataFrame(
        {
            "record_id": [0, 1, 2],
            "time_created_ns": [10 * ms, 20 * ms, 22 * ms],
            "time_discovered_started_ns": [11 * ms, 21 * ms, 0],
            "time_discovered_completed_ns": [15 * ms, 30 * ms, 0],
            "collective_seq_id": [1, 2, 3],
            "p2p_seq_id": [0, 0, 0],
            "is_p2p": [False, False, False],
            "op": ["all_reduce", "all_reduce", "broadcast"],
            "profiling_name": ["nccl:all_reduce", "nccl:all_reduce", "nccl:broadcast"],
            "group": ["0", "0", "0"],
            "state": ["completed", "completed", "scheduled"],
            "retired": [True, True, False],
            "input_sizes": ["[[4]]"] * 3,
            "input_dtypes": ["Float"] * 3,
        }
    )
    s1, s2, s3 = trace.row_slices(rows, 10 * ms, 40_000.0)
    assert (s1["ts"], s1["dur"], s1["args"]["timing"]) == (0.0, 5000.0, "fr")
    assert s1["args"]["started_us"] == 1000.0 and s1["args"]["completed_us"] == 5000.0
    # Completed at 30 ms, but #3 was created at 22 ms: cut there, the real end kept.
    assert (s2["ts"], s2["dur"], s2["args"]["completed_us"]) == (10_000.0, 2000.0, 20_000.0)
    assert (s3["ts"], s3["dur"], s3["args"]["timing"]) == (12_000.0, 28_000.0, "to-end")
