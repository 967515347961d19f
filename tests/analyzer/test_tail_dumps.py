"""Tails of flight-recorder dumps (hangwatch.frtail) must give the verdict the full dumps give.

Phase one of a large incident collects only each rank's tail; the analyzer
then runs on tails alone, or on a mix where some ranks' full dumps followed.
The parity tests cut every dump of every golden scenario and of the real
NCCL incidents and compare the reports; the rest pin the tail rule itself
and how the loader chooses between a rank's tail and its full dump.
"""

from __future__ import annotations

import importlib.util
import json
import pickle
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from fr_dumps import SimJob, write_meta
from hangwatch.analyzer import analyze, analyze_path, load_dumps
from hangwatch.analyzer.decode import decode_dump
from hangwatch.analyzer.report import Report
from hangwatch.analyzer.sniff import sniff_and_decode
from helpers import CONFORMANCE_DIR, GOLDEN_DIR, REPO_ROOT, observed_verdict

from hangwatch import formats
from hangwatch.frtail import DEFAULT_CONTEXT, TAIL_KEY, is_tail, tail_dump, tail_entries

GOLDEN_DIRS = sorted(p for p in GOLDEN_DIR.iterdir() if (p / "manifest.json").is_file())
INCIDENTS = ["gpu_error_2nd", "lock_gil_1st"]


# --- helpers ---------------------------------------------------------------------------


def _world_size(src: Path) -> int | None:
    manifest = src / "manifest.json"
    return int(json.loads(manifest.read_text())["world_size"]) if manifest.is_file() else None


def _encode_like(original: bytes, obj: dict[str, Any]) -> bytes:
    if original.lstrip()[:1] in (b"{", b"["):
        return json.dumps(obj, separators=(",", ":")).encode()
    return pickle.dumps(obj, protocol=2)


def _tail_name(name: str) -> str:
    # Bundle names follow formats; other names (NCCL's `_dump_<R>`) stay, so
    # the loader has to recognize a tail by its marker, not its name.
    if name.startswith(formats.FR_FILE_PREFIX):
        return formats.FR_TAIL_PREFIX + name[len(formats.FR_FILE_PREFIX) :]
    return name


def _copy_with_tails(
    src: Path, dst: Path, *, context: int = DEFAULT_CONTEXT, keep_full: frozenset[int] = frozenset()
) -> dict[str, int]:
    """Copy `src` to `dst` with every FR dump cut to its tail, read and written
    in its own encoding; ranks in `keep_full` keep their full dump too.
    Returns entry and byte totals before and after."""
    dumps = {rel: r for r, rel in load_dumps(src).files.items()}
    totals = {"entries": 0, "entries_kept": 0, "bytes": 0, "bytes_kept": 0}
    for f in sorted(p for p in src.rglob("*") if p.is_file()):
        rel = f.relative_to(src)
        data = f.read_bytes()
        out = dst / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        rank = dumps.get(str(rel))
        if rank is None:
            out.write_bytes(data)
            continue
        full = sniff_and_decode(data)  # the analyzer's own decoder: pickles unpickled safely
        tail = tail_dump(full, context=context)
        encoded = _encode_like(data, tail)
        out.with_name(_tail_name(f.name)).write_bytes(encoded)
        if rank in keep_full:
            out.write_bytes(data)
        totals["entries"] += len(full.get("entries") or [])
        totals["entries_kept"] += len(tail["entries"] or [])
        totals["bytes"] += len(data)
        totals["bytes_kept"] += len(encoded)
    return totals


def _without_wrap(report: Report) -> list[dict[str, Any]]:
    # A tail starts past record 0 by construction, so the analyzer calls every
    # tail's buffer wrapped; that finding is about the file, not the hang.
    return [f for f in report.to_dict()["findings"] if f["kind"] != "buffer-wrapped"]


def _assert_same_diagnosis(full: Report, tail: Report, name: str) -> None:
    assert observed_verdict(tail) == observed_verdict(full), (
        f"{name}: tails say {tail.summary!r}\nfull dumps say {full.summary!r}"
    )
    assert tail.to_dict()["stalled_collective"] == full.to_dict()["stalled_collective"], name
    assert _without_wrap(tail) == _without_wrap(full), name
    assert tail.to_dict()["waits_for"] == full.to_dict()["waits_for"], name
    assert tail.ranks_missing == full.ranks_missing, name


def _check_parity(src: Path, dst: Path, context: int) -> None:
    ws = _world_size(src)
    full = analyze_path(src, world_size=ws)
    _copy_with_tails(src, dst, context=context)
    loaded = load_dumps(dst, world_size=ws)
    assert loaded.errors == []
    assert loaded.tail_ranks == loaded.ranks_loaded == full.ranks_loaded
    tail = analyze(loaded, world_size=ws)
    assert tail.tail_ranks == tail.ranks_loaded
    assert "buffer-wrapped" not in {f.kind for f in tail.findings}
    assert Report.from_dict(json.loads(tail.to_json())).tail_ranks == tail.tail_ranks
    if context == DEFAULT_CONTEXT:
        _assert_same_diagnosis(full, tail, src.name)
    else:
        # Less context may drop findings about finished history (a gloo job
        # whose p2p ops are invisible anyway); the verdict must not move.
        assert observed_verdict(tail) == observed_verdict(full), f"{src.name}: {tail.summary}"


# --- parity: golden scenarios and real NCCL incidents -----------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("context", [DEFAULT_CONTEXT, 1, 0])
@pytest.mark.parametrize("golden", GOLDEN_DIRS, ids=lambda p: p.name)
def test_golden_verdict_is_the_same_on_tails(golden: Path, context: int, tmp_path: Path) -> None:
    manifest = json.loads((golden / "manifest.json").read_text())
    _check_parity(golden, tmp_path / golden.name, context)
    tail = analyze_path(tmp_path / golden.name, world_size=manifest["world_size"])
    assert observed_verdict(tail) == manifest["expected"]


@pytest.mark.timeout(60)
@pytest.mark.skipif(
    not CONFORMANCE_DIR.is_dir(), reason=f"conformance data not present at {CONFORMANCE_DIR}"
)
@pytest.mark.parametrize("context", [DEFAULT_CONTEXT, 0])
@pytest.mark.parametrize("incident", INCIDENTS)
def test_nccl_incident_verdict_is_the_same_on_tails(
    incident: str, context: int, tmp_path: Path
) -> None:
    src = CONFORMANCE_DIR / incident
    _check_parity(src, tmp_path / incident, context)
    assert sorted(analyze_path(tmp_path / incident).lagging_ranks) == [9, 14]


def _gen() -> ModuleType:
    # Its own module name, as in test_many_groups: other tests load the same
    # file under theirs and pickle its functions for a pool.
    name = "gen_nccl_dumps_tail_tests"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(
        name, REPO_ROOT / "benchmarks" / "gen_nccl_dumps.py"
    )
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.timeout(120)
@pytest.mark.parametrize("queue_depth", [1, 4])
def test_full_ring_buffers_shrink_to_a_tail_with_the_same_verdict(
    queue_depth: int, tmp_path: Path
) -> None:
    # Torch's default ring of 2,000 entries, a hang wave spread over TP, DP
    # and default groups, ranks that enqueued ahead of the one blocking them.
    gen = _gen()
    src = tmp_path / "full"
    job = gen.make_job(ranks=8, entries=2000, tp=4, seed=3, queue_depth=queue_depth)
    truth = gen.generate(job, str(src), workers=1)
    totals = _copy_with_tails(src, tmp_path / "tail")
    full = analyze_path(src)
    tail = analyze_path(tmp_path / "tail")
    _assert_same_diagnosis(full, tail, f"generated, queue depth {queue_depth}")
    assert tail.lagging_ranks == [truth.lagging_rank]
    assert totals["entries"] == 8 * 2000
    assert totals["entries_kept"] < totals["entries"] * 0.03
    assert totals["bytes_kept"] < totals["bytes"] * 0.03


# --- the loader: a rank's tail and its full dump ------------------------------------------


@pytest.mark.timeout(30)
def test_full_dump_next_to_a_tail_wins_without_an_error(tmp_path: Path) -> None:
    golden = GOLDEN_DIR / "wrap"  # ring buffers wrapped: tails really are shorter
    manifest = json.loads((golden / "manifest.json").read_text())
    dst = tmp_path / "mixed"
    _copy_with_tails(golden, dst, keep_full=frozenset({1, 3}))
    assert (dst / "rank_3" / f"{formats.FR_TAIL_PREFIX}3").is_file()
    assert (dst / "rank_3" / f"{formats.FR_FILE_PREFIX}3").is_file()
    loaded = load_dumps(dst, world_size=manifest["world_size"])
    assert loaded.errors == []
    assert loaded.tail_ranks == [0, 2]
    assert loaded.files[3] == f"rank_3/{formats.FR_FILE_PREFIX}3"
    assert loaded.files[0] == f"rank_0/{formats.FR_TAIL_PREFIX}0"
    full = load_dumps(golden)
    for r in (1, 3):
        assert (loaded.entries["rank"] == r).sum() == (full.entries["rank"] == r).sum()
    report = analyze(loaded, world_size=manifest["world_size"])
    assert observed_verdict(report) == manifest["expected"]
    assert report.errors == []
    assert report.tail_ranks == [0, 2]
    # Full dumps of a wrapped ring still say so; tails do not pretend to.
    wrapped = [f.ranks for f in report.findings if f.kind == "buffer-wrapped"]
    assert wrapped == [[1, 3]]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("tail_first", [True, False])
def test_full_wins_whatever_the_order_or_age(tail_first: bool, tmp_path: Path) -> None:
    job = SimJob(2)
    for _ in range(20):
        job.all("0")
    job.all("0", ranks=[0], done=False)
    d = write_meta(tmp_path, 0)
    full, tail = job.ranks[0].dump_obj(), tail_dump(job.ranks[0].dump_obj(), context=2)
    # Names sort either way; the tail is written last, so it is the newer file.
    a, b = ("a_dump_0", "b_dump_0") if tail_first else ("b_dump_0", "a_dump_0")
    (d / b).write_bytes(pickle.dumps(full))
    (d / a).write_bytes(json.dumps(tail).encode())
    loaded = load_dumps(tmp_path)
    assert loaded.errors == []
    assert loaded.files == {0: f"rank_0/{b}"}
    assert loaded.tail_ranks == []
    assert len(loaded.entries) == len(full["entries"]) == 21


@pytest.mark.timeout(30)
def test_two_full_dumps_or_two_tails_still_conflict(tmp_path: Path) -> None:
    job = SimJob(1)
    job.all("0")
    for kind, obj in (
        ("full", job.ranks[0].dump_obj()),
        ("tail", tail_dump(job.ranks[0].dump_obj())),
    ):
        d = tmp_path / kind
        d.mkdir()
        (d / "a_0").write_bytes(pickle.dumps(obj))
        (d / "b_0").write_bytes(pickle.dumps(obj))
        loaded = load_dumps(d)
        assert len(loaded.errors) == 1
        assert "second dump for rank 0" in loaded.errors[0].error
        assert loaded.tail_ranks == ([0] if kind == "tail" else [])


@pytest.mark.timeout(30)
def test_unreadable_full_dump_leaves_the_tail(tmp_path: Path) -> None:
    job = SimJob(1)
    job.all("0")
    (tmp_path / "fr_tail_rank_0").write_bytes(pickle.dumps(tail_dump(job.ranks[0].dump_obj())))
    (tmp_path / "fr_trace_rank_0").write_bytes(b"\x80\x02}q\x00(truncated")
    loaded = load_dumps(tmp_path)
    assert [e.file for e in loaded.errors] == ["fr_trace_rank_0"]
    assert loaded.tail_ranks == [0]
    assert loaded.files == {0: "fr_tail_rank_0"}


@pytest.mark.parametrize("json_form", [False, True])
def test_the_marker_does_not_trip_the_decoder(json_form: bool) -> None:
    job = SimJob(2)
    job.all("0")
    raw = job.ranks[0].dump_obj(json_form=json_form)
    tail = tail_dump(raw)
    data = json.dumps(tail).encode() if json_form else pickle.dumps(tail, protocol=2)
    parsed = decode_dump(sniff_and_decode(data))
    assert parsed.tail
    assert parsed.n_entries == 1
    assert not decode_dump(raw).tail


# --- the tail rule --------------------------------------------------------------------


def _e(
    group: str,
    seq: int,
    *,
    done: bool,
    gloo: bool = False,
    p2p: bool = False,
    is_p2p_key: bool = True,
) -> dict[str, Any]:
    e: dict[str, Any] = {
        "process_group": (group, ""),
        "pg_id": int(group) if group.isdigit() else 9,
        "collective_seq_id": 0 if p2p else seq,
        "p2p_seq_id": seq if p2p else 0,
        "profiling_name": ("gloo" if gloo else "nccl") + (":send 0->1" if p2p else ":all_reduce"),
        "state": "scheduled" if gloo or not done else "completed",
        "retired": done,
    }
    if is_p2p_key:
        e["is_p2p"] = p2p
    return e


def _seqs(entries: list[dict[str, Any]]) -> list[tuple[str, bool, int]]:
    return [
        (
            e["process_group"][0],
            "send" in e["profiling_name"],
            e["p2p_seq_id"] or e["collective_seq_id"],
        )
        for e in entries
    ]


def test_gloo_entries_are_finished_only_by_retired() -> None:
    # Gloo never leaves "scheduled"; `retired` alone marks completion.
    entries = [_e("0", s, done=s <= 10, gloo=True) for s in range(1, 14)]
    kept = tail_entries(entries, context=3)
    assert [e["collective_seq_id"] for e in kept] == [8, 9, 10, 11, 12, 13]


def test_a_finished_group_keeps_its_last_context_entries() -> None:
    entries = [_e("0", s, done=True) for s in range(1, 30)]
    assert [e["collective_seq_id"] for e in tail_entries(entries, context=4)] == [26, 27, 28, 29]
    assert tail_entries(entries[:3], context=4) == entries[:3]


def test_p2p_ops_are_a_stream_of_their_own() -> None:
    # Group 1 interleaves finished collectives with p2p ops, the newest open:
    # the p2p stream is cut at its own oldest open op, the collectives keep
    # only their context, as if the other stream were not there.
    entries = []
    for s in range(1, 21):
        entries.append(_e("1", s, done=True))
        entries.append(_e("1", s, done=s < 15, p2p=True))
    kept = _seqs(tail_entries(entries, context=2))
    assert [s for g, p, s in kept if p] == [13, 14, 15, 16, 17, 18, 19, 20]
    assert [s for g, p, s in kept if not p] == [19, 20]


def test_p2p_without_is_p2p_key_is_read_from_the_op_name() -> None:
    # FR 2.0 has no is_p2p; the analyzer reads p2p from the name, so must the tail.
    entries = []
    for s in range(1, 11):
        entries.append(_e("0", s, done=s < 10, is_p2p_key=False))
        entries.append(_e("0", s, done=True, p2p=True, is_p2p_key=False))
    kept = _seqs(tail_entries(entries, context=1))
    assert [(p, s) for _, p, s in kept] == [(False, 9), (False, 10), (True, 10)]


def test_entry_order_is_preserved_across_groups() -> None:
    entries = []
    for s in range(1, 40):
        entries.append(_e("0", s, done=s < 30))
        if s % 3 == 0:
            entries.append(_e("7", s // 3, done=True))
        if s % 5 == 0:
            entries.append(_e("2", s // 5, done=s < 20, p2p=True))
    kept = tail_entries(entries, context=DEFAULT_CONTEXT)
    positions = [next(i for i, e in enumerate(entries) if e is k) for k in kept]
    assert positions == sorted(positions)
    assert len(set(map(id, kept))) == len(kept)


def test_context_zero_keeps_the_open_entries_and_each_streams_newest() -> None:
    entries = [_e("0", s, done=s < 5) for s in range(1, 9)]
    entries += [_e("3", s, done=True) for s in range(1, 9)]
    entries += [_e("3", s, done=True, p2p=True) for s in range(1, 4)]
    kept = _seqs(tail_entries(entries, context=0))
    assert kept == [("0", False, s) for s in range(5, 9)] + [("3", False, 8), ("3", True, 3)]
    with pytest.raises(ValueError, match="context must be >= 0"):
        tail_entries(entries, context=-1)


@pytest.mark.timeout(30)
def test_context_zero_keeps_a_finished_p2p_stream_visible(tmp_path: Path) -> None:
    # Rank 1's last work in group 0 was p2p, so its pg_status counters are p2p
    # counts (20). Were its finished p2p entries all dropped, group 0 would
    # look collective-only, and "last enqueued 20" would say rank 1 entered
    # all_reduce #2, which it never did.
    job = SimJob(3)
    job.all("0")
    for _ in range(20):
        job.ranks[1].p2p("0", "send", 2, done=True)
        job.ranks[2].p2p("0", "recv", 1, done=True)
    job.all("0", ranks=[0, 2], done=False)
    for r in range(3):
        obj = tail_dump(job.ranks[r].dump_obj(), context=0)
        (tmp_path / f"fr_tail_rank_{r}").write_bytes(pickle.dumps(obj, protocol=2))
    report = analyze_path(tmp_path)
    assert report.verdict == "hang" and report.lagging_ranks == [1], report.summary
    assert report.stalled_collective is not None and report.stalled_collective.seq == 2


def test_tail_dump_marks_a_copy_and_keeps_the_rest() -> None:
    job = SimJob(2)
    for _ in range(30):
        job.all("0")
    job.all("0", ranks=[0], done=False)
    raw = job.ranks[0].dump_obj()
    before = list(raw["entries"])
    tail = tail_dump(raw, context=2)
    assert raw["entries"] == before and not is_tail(raw)
    assert is_tail(tail)
    assert tail[TAIL_KEY] == {"context": 2, "entries_total": 31, "entries_kept": 3}
    assert {k: v for k, v in tail.items() if k not in ("entries", TAIL_KEY)} == {
        k: v for k, v in raw.items() if k != "entries"
    }
    # A dump with no entries (status only) is still marked: it is a tail.
    status_only = tail_dump({"version": "2.10", "pg_status": {}})
    assert is_tail(status_only)
    assert status_only[TAIL_KEY]["entries_total"] == 0


def test_max_members_drops_only_big_groups_member_lists() -> None:
    dump = {
        "version": "2.10",
        "pg_config": {
            "0": {"name": "0", "desc": "default_pg", "ranks": str(list(range(100)))},
            "tp": {"name": "tp", "desc": "TP", "ranks": "[0, 1, 2, 3]"},
            "dp": {"name": "dp", "desc": "DP", "ranks": list(range(0, 100, 4))},
        },
        "entries": [],
    }
    out = tail_dump(dump, context=8, max_members=64)
    assert "ranks" not in out["pg_config"]["0"] and out["pg_config"]["0"]["desc"] == "default_pg"
    assert out["pg_config"]["tp"]["ranks"] == "[0, 1, 2, 3]"
    assert out["pg_config"]["dp"]["ranks"] == list(range(0, 100, 4))
    assert out[TAIL_KEY]["members_dropped"] == ["0"]
    assert "ranks" in dump["pg_config"]["0"]  # the caller's dump is not touched
    assert "members_dropped" not in tail_dump(dump, context=8)[TAIL_KEY]


def test_stacks_inside_meta_json_reach_the_evidence(tmp_path: Path) -> None:
    """A tails-first bundle carries each rank's stacks in meta.json, not stacks.txt."""
    import shutil

    src = GOLDEN_DIR / "skip"
    dst = tmp_path / "skip"
    shutil.copytree(src, dst)
    text = (dst / "rank_0" / formats.STACKS_FILE).read_text()
    (dst / "rank_0" / formats.STACKS_FILE).unlink()
    meta0 = json.loads((dst / "rank_0" / formats.META_FILE).read_text())
    (dst / "rank_0" / formats.META_FILE).write_text(json.dumps({**meta0, "stacks": text}))
    meta1 = json.loads((dst / "rank_1" / formats.META_FILE).read_text())
    (dst / "rank_1" / formats.META_FILE).write_text(json.dumps({**meta1, "stacks": {"x": 1}}))
    report = analyze_path(dst)
    assert report.evidence[0].stacks == text
    assert [e.error for e in report.errors] == ["meta.json 'stacks' is not text; ignored"]
    assert report.lagging_ranks == analyze_path(src).lagging_ranks
