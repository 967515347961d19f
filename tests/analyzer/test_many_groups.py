"""Jobs with hundreds of process groups (TP=2 at a few hundred ranks).

Once a job has more than ~127 group names the categorical `group` column's
codes widen past int8, and grouping by (rank, categorical) used to crash in
`compute_progress` with "Buffer dtype mismatch, expected 'const int8_t' but
got 'short'". The dumps come from the benchmark's NCCL-shaped generator, so
the truth (lagging rank, group, seq) is known.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pandas as pd
import pytest
from hangwatch.analyzer import analyze, load_dumps

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
RANKS, TP, ENTRIES = 416, 2, 12  # 208 TP groups + 2 DP groups + the default group


def _gen() -> ModuleType:
    # Its own module name: tests/benchmarks registers "gen_nccl_dumps" and
    # pickles its functions for a pool, which must keep resolving to theirs.
    name = "gen_nccl_dumps_analyzer_tests"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, BENCH / "gen_nccl_dumps.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses resolve their module by name
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def many_groups(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    gen = _gen()
    out = tmp_path_factory.mktemp("many_groups")
    job = gen.make_job(ranks=RANKS, entries=ENTRIES, tp=TP, seed=3)
    truth = gen.generate(job, str(out), workers=1)
    return out, truth


@pytest.mark.timeout(90)
def test_more_than_200_groups_names_the_lagging_rank(many_groups: tuple[Path, Any]) -> None:
    out, truth = many_groups
    loaded = load_dumps(out, workers=1)
    assert len(loaded.groups) > 200
    assert loaded.entries["group"].cat.codes.dtype.itemsize > 1  # past the int8 boundary
    report = analyze(loaded)
    assert report.verdict == "hang"
    assert report.lagging_ranks == [truth.lagging_rank]
    sc = report.stalled_collective
    assert sc is not None
    assert (sc.group, sc.seq, sc.op) == (truth.hang_group, truth.hang_seq, truth.hang_op)


@pytest.mark.timeout(90)
def test_more_than_200_groups_process_pool_loads_the_same(many_groups: tuple[Path, Any]) -> None:
    """Workers ship per-file columns back; merged, they equal a serial load."""
    out, truth = many_groups
    serial = load_dumps(out, workers=1)
    pooled = load_dumps(out, workers=2)
    pd.testing.assert_frame_equal(serial.entries, pooled.entries)
    assert serial.pg_status == pooled.pg_status
    assert serial.frames == pooled.frames
    assert analyze(pooled).lagging_ranks == [truth.lagging_rank]
