"""End to end, real processes: coordinator, agent and a 4-rank gloo job per scenario.

One coordinator (its own process) serves every test in the module; each test
runs `hangwatch demo --coordinator ... --json`, which starts a real agent and
real gloo ranks under the hook, injects the scenario and waits for the
coordinator's verdict. Expectations come from the scenario's ground truth in
`hangwatch.testing.scenarios`, never from the analyzer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hangwatch.config import env_var
from hangwatch.testing.backends import COMPLETION_UNKNOWN
from hangwatch.testing.scenarios import get_scenario
from tests.helpers import BACKENDS, E2E_SCENARIOS, skip_unless_backend
from tests.live.conftest import POLL_INTERVAL, STALL_TIMEOUT

pytestmark = [pytest.mark.torch, pytest.mark.slow]

WORLD = 4


def _demo(
    coordinator: dict[str, str],
    scenario: str,
    tmp_path: Path,
    backend: str = "gloo",
    *extra: str,
    env: dict[str, str] | None = None,
) -> dict:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("HANGWATCH_")}
    environ.update(env or {})
    environ[env_var("run_dir")] = str(tmp_path / "run")
    environ[env_var("poll_interval")] = str(POLL_INTERVAL)
    # A job id of its own: the coordinator is shared, and the previous test's
    # job (its ranks killed as its demo ended) may still report to it.
    job_id = f"e2e-{tmp_path.name}"
    r = subprocess.run(
        [sys.executable, "-m", "hangwatch", "demo", "--scenario", scenario, "--ranks", str(WORLD),
         "--coordinator", coordinator["grpc"], "--stall-timeout", str(STALL_TIMEOUT), "--json",
         "--timeout", "90", "--backend", backend, "--job-id", job_id, *extra],
        capture_output=True, text=True, timeout=150, env=environ,
    )  # fmt: skip
    assert r.returncode == 0, (
        f"demo failed ({r.returncode}):\n{r.stderr[-4000:]}\nstdout: {r.stdout[-4000:]}"
    )
    return json.loads(r.stdout)


def _check_incident(out: dict, name: str, backend: str) -> None:
    """The demo's report of scenario `name` against the scenario's ground truth."""
    sc = get_scenario(name).for_backend(backend)
    assert out["schema"] == "hangwatch.report/1"
    assert out["incident_id"]
    assert out["injected_ranks"] == sc.guilty_ranks(WORLD)
    assert out["verdict"] == sc.verdict, out["summary"]
    assert out["lagging_ranks"] == sc.lagging_ranks(WORLD), out["summary"]

    # Every rank is accounted for: dumped, or unreachable with a reason.
    unreachable = {int(r) for r in out["ranks_unreachable"]}
    assert set(out["ranks_dumped"]) | unreachable == set(range(WORLD))
    # The GIL holder's FR still comes from the C++ worker server; only a
    # stopped process cannot be dumped at all.
    silent_stopped = set(sc.silent_ranks(WORLD)) if name == "frozen" else set()
    # A frozen rank cannot answer: it must be reported unreachable AND blamed;
    # every other live rank's dump must have been collected.
    assert unreachable == silent_stopped, out["ranks_unreachable"]
    for r in silent_stopped:
        assert r in out["lagging_ranks"]

    expected = sc.stalled(WORLD, sc.default_steps)
    st = out["stalled_collective"]
    if expected is None:
        assert st is None, out["summary"]
    else:
        assert st is not None, out["summary"]
        assert (st["group"], st["seq"], st["op"]) == (expected.group, expected.seq, expected.op)
    assert out["detection_s"] > 0
    # Where FR does not record completion the report must say so, every time.
    kinds = {f["kind"] for f in out["findings"]}
    assert ("completion-unknown" in kinds) == (backend in COMPLETION_UNKNOWN), kinds


# On gloo, "skip" and "two" run one after the other under one job id in the test
# below, and are checked there in full: each launch is four torch imports, so
# they are not launched here again for gloo.
SAME_JOB = ("skip", "two")
LIVE_CASES = [
    (name, backend)
    for backend in BACKENDS
    for name in E2E_SCENARIOS
    if not (backend == "gloo" and name in SAME_JOB)
]


@pytest.mark.timeout(170)
@pytest.mark.parametrize(("name", "backend"), LIVE_CASES)
def test_live_incident(
    coordinator: dict[str, str], name: str, backend: str, tmp_path: Path
) -> None:
    skip_unless_backend(backend)
    _check_incident(_demo(coordinator, name, tmp_path, backend), name, backend)


@pytest.mark.timeout(170)
@pytest.mark.parametrize("backend", BACKENDS)
def test_live_healthy_job_raises_no_incident(
    coordinator: dict[str, str], backend: str, tmp_path: Path
) -> None:
    skip_unless_backend(backend)
    out = _demo(coordinator, "healthy", tmp_path, backend)
    assert out["incidents"] == []


@pytest.mark.timeout(300)
def test_demo_takes_only_the_incident_its_own_run_caused(
    coordinator: dict[str, str], tmp_path: Path
) -> None:
    """Two runs against one coordinator under one job id: the second must not be
    handed the first one's incident (it used to be, with a negative detection time).
    On gloo only, as before; the hook-recorded backends run skip and two in
    test_live_incident."""
    backend = "gloo"
    first = _demo(coordinator, "skip", tmp_path / "a", backend, "--job-id", f"samejob-{backend}")
    # A stall timeout asked of the demo is not the one in force: the coordinator's is.
    second = _demo(
        coordinator, "two", tmp_path / "b", backend, "--job-id", f"samejob-{backend}",
        "--stall-timeout", "7",
    )  # fmt: skip
    # Each is its scenario's incident, checked in full as test_live_incident does.
    _check_incident(first, "skip", backend)
    _check_incident(second, "two", backend)
    assert second["incident_id"] != first["incident_id"]
    assert second["stall_timeout_s"] == STALL_TIMEOUT
