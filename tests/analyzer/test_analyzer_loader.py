"""Loader: formats, names, versions, bundles, safety and bad input."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
from fr_dumps import SimJob, write_meta
from hangwatch.analyzer import analyze_path, load_dumps
from hangwatch.analyzer.discovery import parse_ranks
from hangwatch.analyzer.parse import parse_dump_bytes
from hangwatch.analyzer.sniff import DumpFormatError

from hangwatch.safepickle import UnsafePickleError, safe_loads

pytestmark = pytest.mark.timeout(30)


class _Exploit:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, (f"touch {self.marker}",))


def test_safe_loads_refuses_code_execution(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    data = pickle.dumps({"version": "2.10", "entries": [_Exploit(marker)]})
    with pytest.raises(UnsafePickleError, match=r"(posix|os)\.system"):
        safe_loads(data)
    with pytest.raises(DumpFormatError, match="unsafe pickle"):
        parse_dump_bytes(data)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "nccl_trace_rank_0").write_bytes(data)
    loaded = load_dumps(tmp_path / "d")
    assert not marker.exists()
    assert loaded.ranks_loaded == []
    assert loaded.errors[0].file == "nccl_trace_rank_0"
    assert "unsafe pickle" in loaded.errors[0].error


def test_safe_loads_builtin_values_roundtrip() -> None:
    obj = {"a": [1, 2.5, None, True, ("x", b"y")], "b": {"c": "d"}}
    assert safe_loads(pickle.dumps(obj)) == obj


@pytest.mark.parametrize("json_form", [False, True])
def test_pickle_and_json_normalize_identically(json_form: bool) -> None:
    job = SimJob(2)
    job.all("0")
    job.ranks[0].p2p("0", "send", 1)
    job.ranks[1].p2p("0", "recv", 0)
    d = parse_dump_bytes(job.ranks[0].dump_bytes(json_form=json_form))
    assert d["version"] == "2.10"
    assert d["pg_status"]["0"] == {"last_enqueued": 1, "last_started": -1, "last_completed": 1}
    e0, e1 = d["entries"]
    assert (e0["group"], e0["group_desc"], e0["op"], e0["collective_seq_id"]) == (
        "0",
        "default_pg",
        "all_reduce",
        1,
    )
    assert e0["state"] == "completed" and e0["time_discovered_completed_ns"] > 0
    assert (e1["op"], e1["is_p2p"], e1["peer_src"], e1["peer_dst"], e1["p2p_seq_id"]) == (
        "send",
        True,
        0,
        1,
        1,
    )
    assert e0["input_sizes"] == "[[4]]" and e0["in_numel"] == 4
    # Frames are kept only where evidence can point: the open p2p op, not the finished all_reduce.
    assert ("frames" in e1) is (not json_form)
    assert "frames" not in e0


def test_string_seq_ids_and_int_dtypes_are_accepted() -> None:
    job = SimJob(1)
    job.all("0")
    obj = job.ranks[0].dump_obj(json_form=True)
    obj["entries"][0]["collective_seq_id"] = "1"
    obj["entries"][0]["record_id"] = "0"
    obj["entries"][0]["input_dtypes"] = [6]
    d = parse_dump_bytes(json.dumps(obj).encode())
    assert d["entries"][0]["collective_seq_id"] == 1
    assert d["entries"][0]["input_dtypes"] == "6"


def test_version_2_0_fills_defaults(tmp_path: Path) -> None:
    job = SimJob(2)
    job.all("0")
    job.ranks[0].p2p("0", "send", 1)
    obj = job.ranks[0].dump_obj(version="2.0")
    assert "is_p2p" not in obj["entries"][1] and "nccl_version" in obj
    d = parse_dump_bytes(pickle.dumps(obj))
    assert d["entries"][1]["is_p2p"] is True  # inferred from "send 0->1"
    assert d["entries"][0]["retired"] is False and d["entries"][0]["thread_name"] == ""
    assert d["comm_lib_version"] == "2.21.5"


def test_rank_from_file_name_and_prefix(tmp_path: Path) -> None:
    job = SimJob(4)
    job.all("0")
    names = ["nccl_trace_rank_0", "sub/comm_lib_trace_rank_1", "rank_2.json", "job-host-a_3"]
    for r, n in enumerate(names):
        p = tmp_path / n
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(job.ranks[r].dump_bytes(json_form=n.endswith(".json")))
    (tmp_path / "README").write_text("not a dump, no rank number")
    loaded = load_dumps(tmp_path)
    assert loaded.ranks_loaded == [0, 1, 2, 3]
    assert loaded.errors == []
    assert load_dumps(tmp_path, prefix="rank_").ranks_loaded == [2]
    assert load_dumps(tmp_path, selected_ranks="0,2-3").ranks_loaded == [0, 2, 3]


def test_duplicate_rank_keeps_the_fuller_dump(tmp_path: Path) -> None:
    job = SimJob(1)
    job.all("0")
    (tmp_path / "a_0").write_bytes(job.ranks[0].dump_bytes())
    job.all("0")
    (tmp_path / "b_0").write_bytes(job.ranks[0].dump_bytes())
    loaded = load_dumps(tmp_path)
    assert len(loaded.entries) == 2
    assert [e.file for e in loaded.errors] == ["a_0"]
    assert "kept b_0" in loaded.errors[0].error


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"", "empty file"),
        (b"\x89PNG\r\n\x1a\n" + b"\0" * 20, "PNG"),
        (b'{"hello": "world"}', "no 'version' key"),
        (b'{"version": "2.10", "entries": {"a": 1}}', "expected a list"),
        (
            b'{"version": "2.10", "entries": [{"process_group": ["0", ""], "profiling_name": "nccl:x"}]}',
            "collective_seq_id",
        ),
        (b"random garbage that is neither", "neither pickle nor JSON"),
        (
            b'{"version": "2.10", "pg_status": {"0": {"last_enqueued_collective": "x"}}}',
            "not an integer",
        ),
    ],
)
def test_bad_files_become_errors_and_the_rest_loads(
    tmp_path: Path, content: bytes, reason: str
) -> None:
    job = SimJob(2)
    job.all("0")
    job.write(tmp_path, ranks=[0])
    (tmp_path / "nccl_trace_rank_1").write_bytes(content)
    loaded = load_dumps(tmp_path)
    assert loaded.ranks_loaded == [0]
    assert len(loaded.errors) == 1
    assert loaded.errors[0].file == "nccl_trace_rank_1"
    assert reason in loaded.errors[0].error
    assert "\n" not in loaded.errors[0].error


def test_truncated_pickle_is_an_error(tmp_path: Path) -> None:
    data = SimJob(1).ranks[0].dump_bytes()
    (tmp_path / "x_0").write_bytes(data[: len(data) // 2])
    loaded = load_dumps(tmp_path)
    assert loaded.ranks_loaded == [] and "corrupt pickle" in loaded.errors[0].error


def test_size_cap_and_entry_cap(tmp_path: Path) -> None:
    job = SimJob(1)
    for _ in range(5):
        job.all("0")
    job.write(tmp_path)
    assert "byte limit" in load_dumps(tmp_path, max_file_bytes=100).errors[0].error
    assert "exceeds the limit" in load_dumps(tmp_path, max_entries=3).errors[0].error


def test_parallel_load_matches_serial(tmp_path: Path) -> None:
    job = SimJob(8)
    for _ in range(30):
        job.all("0")
    job.write(tmp_path)
    serial = load_dumps(tmp_path, workers=1)
    par = load_dumps(tmp_path, workers=2)
    assert par.ranks_loaded == serial.ranks_loaded == list(range(8))
    cols = ["rank", "record_id", "collective_seq_id", "op", "group", "state"]
    assert par.entries[cols].astype(str).equals(serial.entries[cols].astype(str))
    assert par.entries["op"].dtype.name == "category"


def test_pg_status_is_mapped_to_group_names(tmp_path: Path) -> None:
    job = SimJob(4)
    job.group("5", [0, 1], "TP")
    job.group("7", [2, 3], "TP")
    job.all("5")
    job.all("0")
    job.write(tmp_path)
    loaded = load_dumps(tmp_path)
    st = loaded.pg_status[2]
    assert set(st) == {"0", "7"}
    # Group 7 saw no collective, so no entry ties its pg_id to its name: creation order does.
    assert st["7"].last_completed == -1 and st["7"].mapped_by == "creation-order"
    assert st["0"].last_completed == 1 and st["0"].mapped_by == "entries"
    assert loaded.pg_status[0]["5"].last_completed == 1
    assert (
        loaded.groups["5"].ranks == [0, 1] and loaded.groups["5"].membership_source == "pg_config"
    )


def test_gloo_groups_come_from_dumps_or_world_size(tmp_path: Path) -> None:
    job = SimJob(3, backend="gloo")
    job.group("1", [0, 1])
    job.all("1")
    job.all("0", ranks=[0, 1])
    job.write(tmp_path, ranks=[0, 1])
    loaded = load_dumps(tmp_path)
    assert loaded.groups["1"].membership_source == "dumps"
    assert loaded.groups["0"].ranks == [0, 1]
    loaded3 = load_dumps(tmp_path, world_size=3)
    assert loaded3.groups["0"].ranks == [0, 1, 2]
    assert loaded3.groups["0"].membership_source == "world_size"


def test_bundle_meta_and_stacks(tmp_path: Path) -> None:
    job = SimJob(2, backend="gloo")
    job.all("0")
    rd = write_meta(
        tmp_path,
        0,
        process_state="sleeping",
        reachable=True,
        groups=[{"name": "0", "desc": "default_pg", "pg_id": 0, "ranks": [0, 1]}],
        sources={"fr": "worker-server", "stacks": "py-spy"},
    )
    (rd / "fr_trace_rank_0").write_bytes(job.ranks[0].dump_bytes())
    (rd / "stacks.txt").write_text("Thread 1 (idle): MainThread\n    step (train.py:12)\n")
    write_meta(
        tmp_path,
        1,
        process_state="stopped",
        reachable=False,
        groups=[{"name": "0", "pg_id": 0, "ranks": [0, 1]}],
    )
    (tmp_path / "incident.json").write_text(
        json.dumps({"schema": "hangwatch.incident/1", "id": "i1"})
    )
    loaded = load_dumps(tmp_path)
    assert loaded.ranks_loaded == [0]
    assert set(loaded.rank_meta) == {0, 1}
    assert "train.py:12" in (loaded.rank_meta[0].stacks or "")
    assert loaded.incident is not None and loaded.incident.id == "i1"
    assert loaded.groups["0"].membership_source == "bundle"


def test_analyze_path_on_a_single_file(tmp_path: Path) -> None:
    job = SimJob(1)
    job.all("0")
    job.write(tmp_path)
    rep = analyze_path(tmp_path / "nccl_trace_rank_0")
    assert rep.ranks_loaded == [0] and rep.verdict == "healthy"


def test_parse_ranks() -> None:
    assert parse_ranks("0,3,5-7") == {0, 3, 5, 6, 7}
    with pytest.raises(ValueError):
        parse_ranks("7-5")
