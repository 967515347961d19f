"""The benchmark's synthetic NCCL dumps, and both analyzers reading them.

Small (8 ranks x 50 entries) so it costs seconds: the generator must produce
dumps torch's own fr_trace accepts, and hangwatch and fr_trace must both point
at the rank the generator made lag.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from hangwatch.safepickle import safe_loads

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
RANKS, ENTRIES, TP = 8, 50, 4


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses resolve their module by name
    spec.loader.exec_module(mod)
    return mod


gen = _load("gen_nccl_dumps")
bench = _load("analyzer_vs_frtrace")


@pytest.fixture(scope="module")
def dumps(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    out = tmp_path_factory.mktemp("nccl")
    job = gen.make_job(ranks=RANKS, entries=ENTRIES, tp=TP, seed=7)
    truth = gen.generate(job, str(out), workers=1)
    return out, truth


def _read(out: Path, rank: int) -> dict[str, Any]:
    data = (out / f"{gen.DEFAULT_PREFIX}{rank}").read_bytes()
    dump = safe_loads(data)  # builtin types only, like torch's own dumps
    assert isinstance(dump, dict)
    return dump


@pytest.mark.timeout(30)
def test_dumps_have_torch_shape_and_the_hang(dumps: tuple[Path, Any]) -> None:
    out, truth = dumps
    lag = truth.lagging_rank
    assert 0 <= lag < RANKS
    for rank in range(RANKS):
        d = _read(out, rank)
        assert d["version"] == "2.10"
        assert set(d) == {"version", "pg_config", "comm_lib_version", "pg_status", "entries"}
        # default, TP and DP group, each listing its members as torch does (a string)
        assert len(d["pg_config"]) == 3
        assert all(rank in json.loads(g["ranks"]) for g in d["pg_config"].values())
        es = d["entries"]
        assert len(es) == ENTRIES
        ids = [e["record_id"] for e in es]
        assert ids == sorted(ids) and ids[0] > 100_000  # a wrapped ring buffer
        assert all(e["frames"] and e["profiling_name"].startswith("nccl:") for e in es)
        hang = [
            e
            for e in es
            if e["process_group"][0] == truth.hang_group
            and e["collective_seq_id"] == truth.hang_seq
        ]
        if rank == lag:
            assert not hang, "the lagging rank must lack the collective it never entered"
            assert es[-1]["state"] == "completed"
        else:
            # every other rank is stuck somewhere: one started op, then queued ones
            states = [e["state"] for e in es]
            assert states.count("started") == 1
            assert states[-1] == "scheduled"
            if truth.hang_group in d["pg_config"]:
                assert hang and hang[0]["state"] == "started"
        for pg, st in d["pg_status"].items():
            assert st["last_completed_collective"] <= st["last_enqueued_collective"], pg


@pytest.mark.timeout(30)
def test_generator_is_deterministic(tmp_path: Path) -> None:
    job = gen.make_job(ranks=RANKS, entries=20, tp=TP, seed=3)
    a, b = tmp_path / "a", tmp_path / "b"
    gen.generate(job, str(a), workers=1)
    gen.generate(job, str(b), workers=2)
    for rank in range(RANKS):
        name = f"{gen.DEFAULT_PREFIX}{rank}"
        assert (a / name).read_bytes() == (b / name).read_bytes()


@pytest.mark.timeout(60)
def test_hangwatch_names_the_lagging_rank(dumps: tuple[Path, Any]) -> None:
    from hangwatch.analyzer import analyze_path

    out, truth = dumps
    report = analyze_path(out)
    assert report.lagging_ranks == [truth.lagging_rank], report.summary
    # The stalled collective must be one the lagging rank never entered.
    sc = report.stalled_collective
    assert sc is not None
    assert truth.lagging_rank in sc.missing_ranks


@pytest.mark.torch
@pytest.mark.timeout(60)
def test_frtrace_names_the_lagging_rank(dumps: tuple[Path, Any]) -> None:
    out, truth = dumps
    cmd = [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(out)]
    cmd += ["-p", gen.DEFAULT_PREFIX]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=50, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr
    parsed = bench.parse_frtrace(proc.stdout + proc.stderr)
    assert parsed["top"] == [truth.lagging_rank], proc.stderr[-3000:]
    assert not parsed["aborted"]


@pytest.mark.timeout(60)
def test_benchmark_script_end_to_end(tmp_path: Path) -> None:
    # fr_trace is covered above; skipping it here saves a second torch import.
    script = BENCH / "analyzer_vs_frtrace.py"
    cmd = [sys.executable, str(script), "--ranks", str(RANKS), "--entries", "30"]
    cmd += ["--tp", str(TP), "--seed", "5", "--keep", str(tmp_path / "d"), "--skip-frtrace"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout)
    assert res["hangwatch_correct"] is True, res.get("disagreement")
    assert res["hangwatch_lagging"] == [res["lagging_truth"]]
    assert res["frtrace"] == "skipped" and res["agree"] is None
    for key in ("pickle", "hangwatch"):
        assert res[key]["wall_s_median"] > 0
        assert res[key]["cpu_s_median"] > 0
        assert res[key]["peak_rss_mib_median"] > 0
    assert res["hangwatch_over_pickle"] > 0
