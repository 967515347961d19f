"""The hang zoo against the offline analyzer: golden dumps and freshly generated ones.

Expectations always come from the scenario's ground truth (the injection
plan in `hangwatch.testing.scenarios`), never from an earlier analyzer run.

* Golden tests (no torch, fast): `tests/golden/<name>/` hold real 4-rank gloo
  dumps made by `python -m tests.support.make_golden tests/golden`.
* Live tests (`torch`): a real 4-rank gloo job per scenario that the
  end-to-end tests do not already launch (`helpers.E2E_SCENARIOS`); each rank
  that can still run Python snapshots its own flight recorder, then the
  analyzer reads the snapshot directory.
* Harness self-tests: a healthy job exits 0 (checked by the live `healthy`
  test); a crashing rank surfaces its stderr.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hangwatch.analyzer.report import Report
from helpers import (
    BACKENDS,
    E2E_SCENARIOS,
    GOLDEN_DIR,
    free_port,
    observed_verdict,
    skip_unless_backend,
)

from hangwatch.testing.backends import COMPLETION_UNKNOWN
from hangwatch.testing.scenarios import SCENARIOS, get_scenario
from tests.support.make_golden import GOLDENS, MANIFEST, MAX_TOTAL_BYTES

WORLD = 4
# Each rank enters its blocking collective microseconds after the fault step;
# a second is ample even on a loaded 2-core machine, and 11 jobs pay it.
SNAPSHOT_AFTER_S = 1.0
GOLDEN_DIRS = sorted(p for p in GOLDEN_DIR.iterdir() if (p / MANIFEST).is_file())


def _analyze(path: Path, world_size: int) -> Report:
    # Imported here so a broken analyzer fails the tests that use it, not the
    # harness self-tests collected from this module.
    from hangwatch.analyzer import analyze_path

    return analyze_path(path, world_size=world_size)


def _manifest(golden: Path) -> dict[str, Any]:
    return dict(json.loads((golden / MANIFEST).read_text()))


# --- golden dumps (torch-free) ------------------------------------------------------


@pytest.mark.timeout(30)
@pytest.mark.parametrize("golden", GOLDEN_DIRS, ids=lambda p: p.name)
def test_golden_dump_matches_ground_truth(golden: Path) -> None:
    manifest = _manifest(golden)
    report = _analyze(golden, manifest["world_size"])
    assert observed_verdict(report) == manifest["expected"], (
        f"{golden.name}: {report.summary}\nfindings: {report.findings}"
    )
    # Ranks that could not dump (stopped, GIL held) must be reported as missing.
    assert set(manifest["ranks_without_dump"]) <= set(report.ranks_missing)


@pytest.mark.timeout(10)
def test_golden_set_is_complete_small_and_current() -> None:
    names = {p.name for p in GOLDEN_DIRS}
    assert names == {g.dirname for g in GOLDENS}, "run make_golden to refresh tests/golden"
    assert {_manifest(p)["scenario"] for p in GOLDEN_DIRS} == set(SCENARIOS)
    total = sum(f.stat().st_size for f in GOLDEN_DIR.rglob("*") if f.is_file())
    assert total < MAX_TOTAL_BYTES
    for golden in GOLDEN_DIRS:
        m = _manifest(golden)
        sc = get_scenario(m["scenario"])
        # The manifests must agree with today's ground truth, or the plan drifted.
        assert m["expected"] == sc.expected(m["world_size"], m["steps_before_fault"]), golden.name
        assert m["injected_ranks"] == sc.guilty_ranks(m["world_size"])
        dumps = sorted(int(f.name.rsplit("_", 1)[1]) for f in golden.rglob("fr_trace_rank_*"))
        assert dumps == sc.dumping_ranks(m["world_size"]), golden.name


# --- live: real gloo ranks -------------------------------------------------------------

LIVE_HERE = sorted(set(SCENARIOS) - set(E2E_SCENARIOS))


@pytest.mark.timeout(10)
def test_every_scenario_runs_live_somewhere() -> None:
    assert set(E2E_SCENARIOS) <= set(SCENARIOS)
    assert set(LIVE_HERE) | set(E2E_SCENARIOS) == set(SCENARIOS)
    assert "healthy" in LIVE_HERE  # the harness self-test below relies on it


@pytest.mark.torch
# About 6 s each on an idle 2-core machine; the slack is for a loaded one.
@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", LIVE_HERE)
def test_live_scenario_matches_ground_truth(name: str, backend: str, tmp_path: Path) -> None:
    from hangwatch.testing.launch import launch_job

    skip_unless_backend(backend)
    sc = get_scenario(name).for_backend(backend)
    with launch_job(
        sc,
        WORLD,
        workdir=tmp_path,
        snapshot_after=SNAPSHOT_AFTER_S,
        include_frames=False,
        ready_timeout=60,
        backend=backend,
    ) as job:
        snapshot = job.wait_snapshots(timeout=30)
        job.check_ground_truth()
        if name == "healthy":
            # Doubles as the harness self-test that a healthy job exits 0 everywhere.
            assert job.wait(timeout=30) == [0] * WORLD
            assert [(job.status(r) or {}).get("phase") for r in range(WORLD)] == [
                "finished"
            ] * WORLD
        steps = job.steps_before_fault
    # Every rank is reaped, the stopped one included.
    assert all(rc is not None for rc in job.returncodes())
    report = _analyze(snapshot, WORLD)
    assert observed_verdict(report) == sc.expected(WORLD, steps), f"{name}: {report.summary}"
    assert set(sc.silent_ranks(WORLD)) <= set(report.ranks_missing)
    kinds = {f.kind for f in report.findings}
    # Where FR does not record completion the report must say so, every time.
    assert ("completion-unknown" in kinds) == (backend in COMPLETION_UNKNOWN), kinds


# --- harness self-tests ------------------------------------------------------------------


@pytest.mark.torch
@pytest.mark.timeout(45)
def test_crashing_rank_surfaces_its_stderr(tmp_path: Path) -> None:
    from hangwatch.testing.launch import JobFailed, launch_job

    with (
        launch_job("healthy", 2, workdir=tmp_path, crash_rank=1) as job,
        pytest.raises(JobFailed) as err,
    ):
        job.wait(timeout=30)
    message = str(err.value)
    # The rank raises with its gloo group never destroyed: Python exits 1, or,
    # now and then under load, torch's teardown of that group during
    # interpreter finalization calls std::terminate ("terminate called without
    # an active exception", SIGABRT, -6: once in a full-suite run here; 30
    # reruns with both cores busy all exited 1). The harness must report
    # whichever it was.
    rc = job.returncodes()[1]
    assert rc in (1, -6)
    assert f"rank 1 exit code {rc};" in message
    assert "RuntimeError: injected crash on rank 1" in message


@pytest.mark.torch
@pytest.mark.timeout(60)
def test_launch_retries_once_when_the_rendezvous_port_is_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import socket

    from hangwatch.testing import launch

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        picks = iter([taken])
        # The first pick loses the inherent race; later picks are real.
        monkeypatch.setattr(launch, "free_port", lambda: next(picks, None) or free_port())
        with launch.launch_job("healthy", 2, workdir=tmp_path, steps_before_fault=1) as job:
            assert job.master_port != taken
            assert job.wait(timeout=30) == [0, 0]
