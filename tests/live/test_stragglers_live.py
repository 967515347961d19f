"""Stragglers, live: a real coordinator, a real agent and 4 real gloo ranks under `hangwatch run`.

One rank does half as much work again per step (real CPU compute): the
coordinator names it, and nobody else, within a minute of training starting.
The same job without the slow rank, run beside it: nobody is named, while
every rank is scored. Longer runs (a 10% slowdown, a 10-minute healthy job):
benchmarks/straggler_live.py.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest

from hangwatch.config import env_var
from tests.live.conftest import POLL_INTERVAL
from tests.support.lateness_api import wait_scored

pytestmark = [pytest.mark.torch, pytest.mark.slow]

WORLD = 4
SLOW = 2
# Scoring ticks (one per poll interval, 0.5 s) the healthy job must pass unnamed.
HEALTHY_TICKS = 30
SCRIPT = Path(__file__).with_name("straggler_job.py")


def _get(coordinator: dict[str, str], path: str) -> Any:
    with urllib.request.urlopen(coordinator["http"] + path, timeout=10) as r:
        return json.loads(r.read())


@contextmanager
def _job(coordinator: dict[str, str], tmp: Path, job_id: str, slow: int) -> Iterator[Path]:
    """Agent and ranks running; yields the stop file. Every process must end cleanly."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("HANGWATCH_")}
    environ[env_var("job_id")] = job_id
    environ[env_var("poll_interval")] = str(POLL_INTERVAL)  # the coordinator's tick
    run_dir, store = tmp / "run", tmp / "store"
    with ExitStack() as files:
        yield from _processes(coordinator, tmp, environ, run_dir, store, slow, files)


def _processes(
    coordinator: dict[str, str],
    tmp: Path,
    environ: dict[str, str],
    run_dir: Path,
    store: Path,
    slow: int,
    files: ExitStack,
) -> Iterator[Path]:
    def log(name: str) -> Any:
        return files.enter_context((tmp / name).open("wb"))

    agent = subprocess.Popen(
        [sys.executable, "-m", "hangwatch", "agent", "--coordinator", coordinator["grpc"],
         "--run-dir", str(run_dir), "--node-id", f"node-{environ[env_var('job_id')]}"],
        env=environ, stdout=subprocess.DEVNULL, stderr=log("agent.log"),
    )  # fmt: skip
    ranks = [_rank(environ, run_dir, store, r, slow, log(f"rank{r}.log")) for r in range(WORLD)]
    stop = Path(str(store) + ".stop")
    try:
        yield stop
    finally:
        stop.touch()
        outs = []
        for r, p in enumerate(ranks):
            try:
                out, _ = p.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                out, _ = p.communicate()
            outs.append(out)
            assert p.returncode == 0, (tmp / f"rank{r}.log").read_text()[-3000:]
        agent.terminate()
        assert agent.wait(20) == 0, (tmp / "agent.log").read_text()[-3000:]
        for r, out in enumerate(outs):
            print(f"rank {r}: {out.strip()}")  # the step times, for whoever reads the log


def _rank(
    environ: dict[str, str], run_dir: Path, store: Path, rank: int, slow: int, log: Any
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "hangwatch", "run", "--run-dir", str(run_dir), "--",
         sys.executable, str(SCRIPT), str(store), str(rank), str(WORLD), "120", str(slow)],
        env=environ, stdout=subprocess.PIPE, stderr=log, text=True,
    )  # fmt: skip


def _wait_scored(coordinator: dict[str, str], job_id: str, timeout: float = 90) -> float:
    return wait_scored(lambda path: _get(coordinator, path), job_id, WORLD, timeout)


@pytest.mark.timeout(300)
def test_live_slow_rank_is_named_and_a_healthy_job_beside_it_names_nobody(
    coordinator: dict[str, str], tmp_path: Path
) -> None:
    """Two jobs on one coordinator at once (half the wall time of one after the
    other, and each is the other's noisy neighbour): in one, rank SLOW is about
    50% slower per step; the other is healthy."""
    slow_job, healthy_job = "straggler-slow", "straggler-healthy"
    (tmp_path / "slow").mkdir()
    (tmp_path / "healthy").mkdir()
    with (
        _job(coordinator, tmp_path / "slow", slow_job, SLOW),
        _job(coordinator, tmp_path / "healthy", healthy_job, -1),
    ):
        started = {j: _wait_scored(coordinator, j) for j in (slow_job, healthy_job)}
        slow_view: dict[str, Any] = {}
        named_after: float | None = None
        healthy_view: dict[str, Any] = {}
        # Until the slow rank is named and every healthy rank has 30 scoring
        # ticks behind it, none of which named anybody.
        while (
            named_after is None
            or min((r["ticks"] for r in healthy_view.get("ranks", [])), default=0) < HEALTHY_TICKS
        ):
            if named_after is None:
                slow_view = _get(coordinator, f"/api/jobs/{slow_job}/stragglers")
                if slow_view["stragglers"]:
                    named_after = time.monotonic() - started[slow_job]
                elif time.monotonic() - started[slow_job] > 75:
                    break
            healthy_view = _get(coordinator, f"/api/jobs/{healthy_job}/stragglers")
            assert healthy_view["stragglers"] == [], healthy_view
            if time.monotonic() - started[healthy_job] > 90:
                break  # the tick count is asserted below, with the view
            time.sleep(1.0)
        print(f"named after {named_after} s: {slow_view['stragglers']}")
        assert [s["rank"] for s in slow_view["stragglers"]] == [SLOW], slow_view
        assert named_after is not None and named_after <= 60, slow_view
        (s,) = slow_view["stragglers"]
        assert s["kind"] == "host" and s["host"] == socket.gethostname()
        assert s["score"] >= 0.1 and s["late_ms"] > 0
        text = urllib.request.urlopen(coordinator["http"] + "/metrics", timeout=10).read().decode()
        assert f'hangwatch_job_stragglers{{job="{slow_job}"}} 1.0' in text
        assert f'hangwatch_job_stragglers{{job="{healthy_job}"}} 0.0' in text
        assert all(r["ticks"] >= HEALTHY_TICKS for r in healthy_view["ranks"]), healthy_view
        print("healthy scores:", {r["rank"]: round(r["score"], 3) for r in healthy_view["ranks"]})
