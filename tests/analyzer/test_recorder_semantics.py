"""How the analyzer reads a dump depends on who recorded it (torch-free).

torch 2.15's FlightRecorderHook records every backend that does not record
itself; its entries are `retired` at call return and its pg_status never
counts a completion (measured; see docs/compatibility.md). These dumps are
written field for field as the hook writes them for the `hwstore` backend,
with the backend name varied.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hangwatch.analyzer import analyze_path
from hangwatch.analyzer.decode import decode_dump
from hangwatch.analyzer.sniff import sniff_and_decode


def _hook_dump(backend: str, rank: int, entered: int, world: int) -> dict[str, object]:
    entries = [
        {
            "record_id": i,
            "pg_id": 0,
            "process_group": ["0", "default_pg"],
            "collective_seq_id": i + 1,
            "p2p_seq_id": 0,
            "op_id": i,
            "profiling_name": f"{backend}:all_reduce",
            "time_created_ns": 1_700_000_000_000_000_000 + i,
            "input_sizes": [[4]],
            "input_dtypes": ["Float"],
            "output_sizes": [[4]],
            "output_dtypes": ["Float"],
            "state": "scheduled",
            "time_discovered_started_ns": 0,
            "time_discovered_completed_ns": 0,
            "retired": True,
            "timeout_ms": 1800000,
            "is_p2p": False,
            "thread_name": "MainThread",
            "thread_id": "1",
        }
        for i in range(entered)
    ]
    return {
        "version": "2.10",
        "comm_lib_version": "",
        "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": str(list(range(world)))}},
        "pg_status": {
            "0": {
                "last_enqueued_collective": str(entered - 1),
                "last_started_collective": "-1",
                "last_completed_collective": "-1",
            }
        },
        "entries": entries,
    }


def _write(tmp_path: Path, backend: str, entered: list[int]) -> Path:
    for r, n in enumerate(entered):
        dump = _hook_dump(backend, r, n, len(entered))
        (tmp_path / f"fr_{backend}_rank_{r}").write_text(json.dumps(dump))
    return tmp_path


@pytest.mark.timeout(30)
@pytest.mark.parametrize("backend", ["nccl2", "nccl-lazy", "c10d", "hwstore"])
def test_hook_recorded_names_normalize_and_retired_is_not_done(
    backend: str, tmp_path: Path
) -> None:
    raw = json.dumps(_hook_dump(backend, 0, 3, 2)).encode()
    parsed = decode_dump(sniff_and_decode(raw))
    assert parsed.backend == backend and parsed.hooked and not parsed.completion_known
    assert parsed.columns["op"].strings() == ["all_reduce"] * 3
    assert not parsed.columns["retired"].any()
    # pg_status counts op_id from 0 there: normalized to the 1-based seq.
    assert parsed.pg_status["0"][0] == 3

    report = analyze_path(_write(tmp_path, backend, [3, 2]), world_size=2)
    assert report.verdict == "hang", report.summary
    assert report.lagging_ranks == [1]
    st = report.stalled_collective
    assert st is not None and (st.group, st.seq, st.op) == ("0", 3, "all_reduce")
    assert "completion-unknown" in {f.kind for f in report.findings}


@pytest.mark.timeout(30)
def test_everyone_entered_everything_is_unknown_not_healthy(tmp_path: Path) -> None:
    report = analyze_path(_write(tmp_path, "nccl2", [3, 3]), world_size=2)
    assert report.verdict == "unknown", report.summary
    assert report.lagging_ranks == []
    assert "completion-unknown" in {f.kind for f in report.findings}


@pytest.mark.timeout(30)
def test_a_self_recording_backend_keeps_retired_as_completion(tmp_path: Path) -> None:
    """The same bytes under gloo's name: retired is completion there, and all is done."""
    d = _hook_dump("gloo", 0, 3, 1)
    parsed = decode_dump(sniff_and_decode(json.dumps(d).encode()))
    assert not parsed.hooked and parsed.completion_known
    assert parsed.columns["retired"].all()


@pytest.mark.timeout(30)
def test_one_ranks_two_instances_merge_into_one_view(tmp_path: Path) -> None:
    """Rank 0 wrote to a hooked instance (group 0) and to gloo's (group 1): both count,
    and neither is "a second dump" of the other."""
    _write(tmp_path, "nccl2", [3, 2])
    gloo = _hook_dump("gloo", 0, 2, 1)
    gloo["pg_config"] = {"1": {"name": "1", "desc": "cpu", "ranks": "[0]"}}
    for e in gloo["entries"]:  # type: ignore[attr-defined]
        e["process_group"] = ["1", "cpu"]
    gloo["pg_status"] = {
        "0": {
            "last_enqueued_collective": "2",
            "last_started_collective": "-1",
            "last_completed_collective": "2",
        }
    }
    (tmp_path / "fr_trace_rank_0").write_text(json.dumps(gloo))
    report = analyze_path(tmp_path, world_size=2)
    assert not [e for e in report.errors if "second dump" in e.error], report.errors
    assert {g.group for g in report.groups} == {"0", "1"}
    assert report.verdict == "hang" and report.lagging_ranks == [1], report.summary
