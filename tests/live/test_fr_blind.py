"""Hangs FR cannot see, live: a real coordinator, agent and job under `hangwatch run`.

The pipeline job (tests/live/pipeline_job.py, three gloo stages with
hand-written send/recv) trains for a few seconds, then its middle stage
stalls in Python. Gloo records no send/recv, and nobody reaches the step's
all_reduce, so no counter moves and no collective is in flight: only the
coordinator's no-progress rule can open the incident, and only the stacks
can name the stage. Expectations come from the job's plan (which stage
stalls, and how), never from the analyzer.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hangwatch.config import env_var
from tests.hardening.util import ranks_view, wait_for
from tests.live.conftest import has_compiler_stack, stop_job
from tests.support.chaos import AgentProc, CoordinatorProc, rss_bytes

pytestmark = [pytest.mark.torch, pytest.mark.slow]

STALL_TIMEOUT = 3.0
JOB = Path(__file__).with_name("pipeline_job.py")
WORLD = 3
MIDDLE = 1


def _start_job(
    tmp: Path, coord: CoordinatorProc, job_id: str, **plan: str
) -> subprocess.Popen[bytes]:
    run = tmp / "run"
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("HANGWATCH_", "PIPE_"))}
    environ.update({f"PIPE_{k.upper()}": v for k, v in plan.items()})
    environ["PIPE_MARK_DIR"] = str(tmp)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd = [
        sys.executable, "-m", "hangwatch", "run", "--run-dir", str(run), "--job-id", job_id,
        "--coordinator", coord.grpc, "--",
        *torchrun, "--nproc-per-node", str(WORLD), "--max-restarts", "0", str(JOB),
    ]  # fmt: skip
    with (tmp / "job.log").open("wb") as log:
        # A session of its own: torchrun's workers are killed with it.
        return subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=environ, start_new_session=True
        )


def _kill(job: subprocess.Popen[bytes]) -> None:
    stop_job(job, grace=0)


@contextlib.contextmanager
def _watched(
    tmp: Path, job_id: str, server_args: tuple[str, ...] = (), **plan: str
) -> Iterator[tuple[CoordinatorProc, AgentProc, subprocess.Popen[bytes]]]:
    """A coordinator, one agent on `<tmp>/run` and the pipeline job with `plan`, all started;
    the job killed and the agent and coordinator stopped on exit."""
    # Debug logs on both: a failure here has been seen once and not reproduced
    # (no incident, nothing logged after registration at info), so the next one
    # carries what each side saw.
    debug = ("--log-level", "debug")
    with CoordinatorProc(
        tmp / "data", stall_timeout=STALL_TIMEOUT, extra_args=(*debug, *server_args)
    ) as coord:
        agent = AgentProc(
            coordinator=coord.grpc, run_dir=tmp / "run", job_id=job_id, node_id="n0",
            log_path=tmp / "agent.log", extra_args=debug,
        )  # fmt: skip
        agent.start()
        job = _start_job(tmp, coord, job_id, **plan)
        try:
            yield coord, agent, job
        except AssertionError as e:
            raise AssertionError(f"{e}\n{_evidence(tmp, coord, job_id)}") from e
        finally:
            _kill(job)
            agent.stop()


def _evidence(tmp: Path, coord: CoordinatorProc, job_id: str) -> str:
    """What the coordinator shows of the job's ranks and the last of each log."""
    try:
        view: Any = ranks_view(coord, job_id)
    except Exception as e:  # the coordinator may be what failed
        view = f"unavailable: {e!r}"
    tails = []
    for name in ("agent.log", "data.coordinator.log", "job.log"):
        p = tmp / name
        text = p.read_text(errors="replace")[-6000:] if p.is_file() else "(none)"
        tails.append(f"--- {name} (last 6,000 characters)\n{text}")
    return f"ranks at the coordinator: {json.dumps(view, default=str)[:4000]}\n" + "\n".join(tails)


def _stall_once_steady(tmp: Path, coord: CoordinatorProc, job_id: str) -> None:
    """Let the middle stage stall (PIPE_STALL_FILE) once the coordinator has seen
    the job make steady progress: the rhythm rule, which pages a quiet period
    on the stall timeout, is armed only then. A stall after a fixed 4 s of
    training raced it: on a loaded machine the agent found the ranks late, the
    coordinator saw fewer than 5 moves, and only the bound (the 60 s start-up
    grace) was left; one full run waited 33 s for an incident and failed."""

    def armed() -> bool:
        return any(
            j["job"] == job_id and j["quiet_rule"] == "rhythm" for j in coord.api("/api/jobs")
        )

    wait_for(armed, 60, "the coordinator to see the job's rhythm")
    (tmp / "stall_now").touch()


def _stalled_at(tmp: Path) -> float | None:
    p = tmp / "stalled"
    return float(p.read_text().split()[0]) if p.is_file() else None


def _analysed(coord: CoordinatorProc, job_id: str) -> dict[str, Any] | None:
    rows = coord.api(f"/api/incidents?job={job_id}")
    done = [r for r in rows if r["status"] in ("analyzed", "resolved", "ended", "failed")]
    return coord.api(f"/api/incidents/{done[0]['id']}") if done else None


def _pids(coord: CoordinatorProc, job_id: str) -> list[int] | None:
    pids = [int(r["pid"]) for r in ranks_view(coord, job_id).values()]
    return pids if len(pids) == WORLD else None


def _check_middle_stage_named(inc: dict[str, Any], state: str) -> None:
    assert inc["trigger"] == "no-progress", inc["reason"]
    rep = inc["report"]
    assert rep["basis"] == "stacks", rep["summary"]
    assert rep["verdict"] == "hang" and rep["lagging_ranks"] == [MIDDLE], rep["summary"]
    assert rep["summary"].startswith("From the stacks, not FR"), rep["summary"]
    rows = {r["rank"]: r for r in rep["stack_diagnosis"]["ranks"]}
    assert rows[MIDDLE]["state"] == state, rows
    assert "stall" in rows[MIDDLE]["detail"], rows[MIDDLE]
    # The end stages wait on it in p2p, and their stacks name it as the peer.
    for r in (0, 2):
        assert (rows[r]["state"], rows[r]["peer"]) == ("p2p", MIDDLE), rows[r]


@pytest.mark.timeout(120)
# A sleeping stage is named the same way in the quiet-period test below (one
# launch of the pipeline for both): here, one that spins on a CPU.
@pytest.mark.parametrize("how,state", [("spin", "compute")])
def test_a_stalled_pipeline_stage_is_named_from_its_stack(
    tmp_path: Path, how: str, state: str
) -> None:
    job_id = f"pipe-{how}"
    # 2,000 steps (100 s at 0.05 s a step): the stall, forever, comes first
    # however long the coordinator takes to see the rhythm.
    plan = {"stall_file": str(tmp_path / "stall_now"), "stall_how": how, "steps": "2000"}
    with _watched(tmp_path, job_id, **plan) as (coord, agent, _job):
        _stall_once_steady(tmp_path, coord, job_id)
        t0 = wait_for(lambda: _stalled_at(tmp_path), 60, "the middle stage to stall")
        inc = wait_for(lambda: _analysed(coord, job_id), STALL_TIMEOUT + 30, "the incident")
        _check_middle_stage_named(inc, state)
        # Named within the stall timeout plus 10 s of the stall (wall clock, one host).
        assert inc["created"] - t0 <= STALL_TIMEOUT + 10, (inc["created"], t0)
        assert inc["updated"] - t0 <= STALL_TIMEOUT + 10, (inc["updated"], t0)
        agent.check()


@pytest.mark.timeout(120)
def test_an_early_hang_is_named_within_the_bound(tmp_path: Path) -> None:
    """The middle stage blocks in its very first step, before any collective: no
    counter ever moves, so only the bound (the longer of the start-up grace and
    3 stall timeouts) can open the incident, from the first sight of the job."""
    job_id = "pipe-early"
    grace = 6.0
    bound = max(grace, 3 * STALL_TIMEOUT)
    args = ("--startup-grace", str(grace))
    with _watched(tmp_path, job_id, args, stall_after="0", stall_how="sleep") as (coord, agent, _):
        t0 = wait_for(lambda: _stalled_at(tmp_path), 60, "the middle stage to stall")
        inc = wait_for(lambda: _analysed(coord, job_id), bound + 30, "the incident")
        _check_middle_stage_named(inc, "sleeping")
        assert f"past the {bound:.0f}s bound" in inc["reason"], inc["reason"]
        # The quiet clock starts when the coordinator first sees the job, a little
        # before the stall: within the bound plus 10 s of the stall (one host's clock).
        assert inc["created"] - t0 <= bound + 10, (inc["created"], t0)
        agent.check()


@pytest.mark.timeout(120)
def test_a_torch_compile_on_a_shared_cache_is_work_not_a_hang(tmp_path: Path) -> None:
    """Every stage compiles its forward with torch.compile (inductor) before its
    first step, all on one cold cache: 26-49 s here, past the 20 s bound, with
    no counter moving. The stage building holds the cache's lock, its compiler
    on a CPU; the others wait for it, idle, which their agent's stack sample
    reads as torch.compile; a stage done first waits in send for the next one's
    compile (21.0 s against 24.0 s in one run), which the coordinator takes as
    waiting on that compile. No incident; the job ends.

    The bound is the start-up grace, 20 s, not 3 stall timeouts (9 s): in the
    first seconds every stage hashes torch's source tree (inductor's
    `build_code_hash`), bound by the disk, not a CPU. Measured in a full run
    beside the other test worker's databases and syncs: all three stages read
    0.035-0.04 cores at 11.9 s and were paged. CPU time and the run queue do
    not see a process waiting on I/O. The agent now reports storage I/O
    (RankProgress.io_bytes) and a rank moving a MiB a second is working, but
    whether that phase's waits are reads that reach the disk, or something
    storage accounting does not see (a writeback stall, a directory lock), was
    not measured in that run; so the phase stays covered by the start-up grace,
    as on a real cluster whose environment sits on a network filesystem
    (docs/operations.md)."""
    job_id = "pipe-compile"
    args = ("--startup-grace", "20")  # the bound: the grace, past 3 stall timeouts (9 s)
    plan = {"compile": "1", "steps": "40", "step_s": "0.02"}
    with _watched(tmp_path, job_id, args, **plan) as (coord, agent, job):
        assert job.wait(90) == 0, (tmp_path / "job.log").read_text()[-3000:]
        assert coord.api(f"/api/incidents?job={job_id}") == []
        agent.check()
    took = [float((tmp_path / f"compiled_{r}").read_text()) for r in range(WORLD)]
    print(f"compile took {took} s; bound 20 s")
    # The agent saw a stage inside torch.compile (agent/quietstack.py).
    assert "inside torch.compile" in (tmp_path / "agent.log").read_text()


@pytest.mark.timeout(120)
def test_a_quiet_period_that_ends_is_resolved_even_across_an_agent_restart(
    tmp_path: Path,
) -> None:
    """The middle stage sleeps 14 s, then trains on and the job exits 0. Its stack
    names it within the stall timeout plus 10 s. Issue 27: the node's agent is
    killed (-9) and restarted while the stage still sleeps; the restarted agent
    re-registers the same processes with the numbers they still have, which is
    no progress. The incident resolves only when the stage really wakes, as a
    transient stall of the middle stage, and it is the only one.

    What the incident cost each rank (issue 24): its RSS grew by less than
    20 MB across the dumps, and torch's compiler stack, absent before, was not
    loaded by them (the FR dump's call sites used to import torch._inductor)."""
    job_id = "pipe-agent-restart"
    # 400 steps: room for the coordinator to see the rhythm first (20 s at
    # 0.05 s a step), and the job still ends within a minute of the wake.
    plan = {"stall_for": "14", "steps": "400", "step_s": "0.03"}
    plan["stall_file"] = str(tmp_path / "stall_now")
    with _watched(tmp_path, job_id, **plan) as (coord, agent, job):
        _stall_once_steady(tmp_path, coord, job_id)
        t0 = wait_for(lambda: _stalled_at(tmp_path), 60, "the middle stage to stall")
        pids = wait_for(lambda: _pids(coord, job_id), 30, "the ranks registered")
        assert not any(has_compiler_stack(p) for p in pids)
        before: dict[int, int] = {}
        while not coord.api(f"/api/incidents?job={job_id}"):  # the last sample is the baseline
            before = {p: rss_bytes(p) for p in pids}
            time.sleep(0.1)
        inc = wait_for(lambda: _analysed(coord, job_id), STALL_TIMEOUT + 30, "the incident")
        for p in pids:
            grew = rss_bytes(p) - before[p]
            assert grew < 20 << 20, f"rank pid {p} grew {grew >> 20} MB across the incident"
            assert not has_compiler_stack(p), f"the incident loaded torch's compiler into {p}"
        _check_middle_stage_named(inc, "sleeping")
        # Named within the stall timeout plus 10 s of the stall (wall clock, one host).
        assert inc["created"] - t0 <= STALL_TIMEOUT + 10, (inc["created"], t0)
        assert inc["updated"] - t0 <= STALL_TIMEOUT + 10, (inc["updated"], t0)
        agent.kill()
        agent.start()
        assert job.wait(60) == 0, (tmp_path / "job.log").read_text()[-3000:]
        done = wait_for(
            lambda: (d := coord.api(f"/api/incidents/{inc['id']}"))["status"] == "resolved" and d,
            20,
            "the incident to resolve",
        )
        # Resolved when the stage woke (stall_s spans its whole sleep), not when
        # the agent came back a few seconds into it.
        assert 14 - 1 <= done["stall_s"] <= 14 + STALL_TIMEOUT, done
        assert done["transient"], done
        assert done["late_ranks"] == [MIDDLE], done
        assert len(coord.api(f"/api/incidents?job={job_id}")) == 1
        assert agent.starts == 2
        agent.check()


@pytest.mark.timeout(150)
def test_the_p2p_demo_names_the_recv_recv_cycle(tmp_path: Path) -> None:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("HANGWATCH_")}
    environ[env_var("run_dir")] = str(tmp_path / "run")
    r = subprocess.run(
        [sys.executable, "-m", "hangwatch", "demo", "--scenario", "p2p", "--ranks", "4",
         "--json", "--timeout", "60"],
        capture_output=True, text=True, timeout=120, env=environ,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    out = json.loads(r.stdout)
    assert (out["verdict"], out["basis"], out["lagging_ranks"]) == ("hang", "stacks", [0, 1])
    diag = out["stack_diagnosis"]
    assert diag["cycles"] == [[0, 1]], diag
    peers = {row["rank"]: (row["state"], row["peer"]) for row in diag["ranks"]}
    assert peers == {0: ("p2p", 1), 1: ("p2p", 0), 2: ("p2p", 0), 3: ("p2p", 1)}
    assert "ranks 0,1 deadlock in p2p" in out["summary"], out["summary"]
    # Seconds after the fault, not the demo's 60 s timeout.
    assert out["detection_s"] < out["stall_timeout_s"] + 10, out
