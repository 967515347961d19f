"""Launch a hang-zoo job: `world_size` real processes running `hangwatch.testing.job`.

    with launch_job("skip", 4, workdir=tmp, snapshot_after=1.5) as job:
        job.wait_snapshots(timeout=30)
        job.check_ground_truth()
        ...                                  # analyze job.snapshot_dir

Leaving the `with` block stops every rank and reaps it. Each rank's stdout,
stderr and status file live in `workdir`; a rank that dies unexpectedly is
reported with the tail of its stderr by every wait method.

This module does not import torch: only the ranks do.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hangwatch import env
from hangwatch.testing import job as job_mod
from hangwatch.testing.ports import free_port
from hangwatch.testing.scenarios import Scenario, get_scenario

SNAPSHOT_SUBDIR = "snapshot"
_POLL_S = 0.05
_ADDR_IN_USE = ("eaddrinuse", "address already in use")


class JobFailed(RuntimeError):
    """A rank died, or a wait timed out; the message carries the evidence."""


@dataclass(kw_only=True)
class RankProcess:
    rank: int
    proc: subprocess.Popen[bytes]
    stdout_path: Path
    stderr_path: Path
    status_path: Path


def _tail(path: Path, limit: int) -> str:
    try:
        data = path.read_bytes()
    except OSError as e:
        return f"<cannot read {path}: {e}>"
    return data[-limit:].decode("utf-8", "replace")


# eq=False: a handle is one running job, compared and hashed by identity.
@dataclass(kw_only=True, eq=False)
class JobHandle:
    """A running hang-zoo job. Use it as a context manager so ranks never outlive it."""

    scenario: Scenario
    world_size: int
    steps_before_fault: int
    workdir: Path
    snapshot_dir: Path | None
    master_port: int
    ranks: list[RankProcess]
    _terminated: bool = field(default=False, init=False, repr=False)

    # --- inspection -----------------------------------------------------------

    @property
    def pids(self) -> list[int]:
        return [r.proc.pid for r in self.ranks]

    def returncodes(self) -> list[int | None]:
        return [r.proc.poll() for r in self.ranks]

    def status(self, rank: int) -> dict[str, Any] | None:
        """The rank's last status (see `hangwatch.testing.job`), or None before the first."""
        try:
            return dict(json.loads(self.ranks[rank].status_path.read_text()))
        except FileNotFoundError:
            return None

    def stderr_tail(self, rank: int, limit: int = 4000) -> str:
        return _tail(self.ranks[rank].stderr_path, limit)

    def stdout_tail(self, rank: int, limit: int = 4000) -> str:
        return _tail(self.ranks[rank].stdout_path, limit)

    def check_no_crash(self) -> None:
        """Raise JobFailed, with each dead rank's stderr tail, if any rank exited non-zero."""
        if self._terminated:
            return
        dead = [(r.rank, rc) for r in self.ranks if (rc := r.proc.poll()) not in (None, 0)]
        if not dead:
            return
        parts = [f"scenario {self.scenario.name!r}: {len(dead)} rank(s) died unexpectedly"]
        for rank, rc in dead:
            parts.append(
                f"--- rank {rank} exit code {rc}; stderr tail ({self.ranks[rank].stderr_path}):"
            )
            parts.append(self.stderr_tail(rank))
        raise JobFailed("\n".join(parts))

    # --- waiting --------------------------------------------------------------

    def _wait_until(self, done: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while True:
            self.check_no_crash()
            if done():
                return
            if time.monotonic() > deadline:
                phases = {r.rank: (self.status(r.rank) or {}).get("phase") for r in self.ranks}
                raise JobFailed(
                    f"scenario {self.scenario.name!r}: timed out after {timeout:.0f}s waiting for "
                    f"{what}; rank phases {phases}, exit codes {self.returncodes()}"
                )
            time.sleep(_POLL_S)

    def _phase_at_least(self, rank: int, phases: tuple[str, ...]) -> bool:
        st = self.status(rank)
        return st is not None and st.get("phase") in phases

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Every rank has joined the process group and created its groups."""
        ok = (job_mod.PHASE_READY, job_mod.PHASE_FAULT, job_mod.PHASE_FINISHED)
        self._wait_until(
            lambda: all(self._phase_at_least(r, ok) for r in range(self.world_size)),
            timeout,
            "every rank to initialize",
        )

    def wait_fault_injected(self, timeout: float = 60.0) -> float:
        """Every rank has reached the fault step; returns the latest such time (unix)."""
        ok = (job_mod.PHASE_FAULT, job_mod.PHASE_FINISHED)
        self._wait_until(
            lambda: all(self._phase_at_least(r, ok) for r in range(self.world_size)),
            timeout,
            "every rank to reach the fault step",
        )
        times = [(self.status(r) or {}).get("fault_injected_unix") for r in range(self.world_size)]
        return max(float(t) for t in times if t is not None)

    def wait_snapshots(self, timeout: float = 60.0) -> Path:
        """Every rank that can still run Python has written its snapshot; returns the dir."""
        if self.snapshot_dir is None:
            raise ValueError("this job was launched without snapshot_after")
        expect = self.scenario.dumping_ranks(self.world_size)

        def written(rank: int) -> bool:
            st = self.status(rank) or {}
            if st.get("snapshot_error"):
                raise JobFailed(f"rank {rank} failed to write its snapshot: {st['snapshot_error']}")
            return bool(st.get("snapshot"))

        self._wait_until(
            lambda: all(written(r) for r in expect), timeout, f"snapshots from ranks {expect}"
        )
        return self.snapshot_dir

    def wait(self, timeout: float = 60.0) -> list[int]:
        """Wait for every rank to exit (healthy jobs); returns the exit codes."""
        self._wait_until(
            lambda: all(rc is not None for rc in self.returncodes()), timeout, "every rank to exit"
        )
        return [rc for rc in self.returncodes() if rc is not None]

    # --- ground truth -----------------------------------------------------------

    def in_flight(self) -> dict[int, list[dict[str, Any]]]:
        """Per dumping rank: the unretired FR entries its own snapshot saw."""
        out: dict[int, list[dict[str, Any]]] = {}
        for r in self.scenario.dumping_ranks(self.world_size):
            flights = (self.status(r) or {}).get("in_flight")
            if flights is not None:
                out[r] = list(flights)
        return out

    def check_ground_truth(self) -> None:
        """Check torch recorded the fault where the plan says it is.

        This validates the harness, not the analyzer: each dumping rank's own
        FR snapshot must show exactly the collective the scenario says that
        rank is blocked in (or nothing in flight).
        """
        expected = self.scenario.expected_in_flight(self.world_size, self.steps_before_fault)
        seen = self.in_flight()
        problems = []
        for r in self.scenario.dumping_ranks(self.world_size):
            if r not in seen:
                problems.append(f"rank {r}: no snapshot status")
                continue
            want = [expected[r].to_dict()] if r in expected else []
            if seen[r] != want:
                problems.append(f"rank {r}: FR shows in flight {seen[r]}, plan says {want}")
        if problems:
            raise JobFailed(
                f"scenario {self.scenario.name!r} ground truth does not match torch's FR:\n"
                + "\n".join(problems)
            )

    # --- shutdown -------------------------------------------------------------

    def terminate(self, grace: float = 5.0) -> list[int]:
        """Stop every rank and reap it; returns the exit codes. Safe to call twice."""
        self._terminated = True
        live = [r.proc for r in self.ranks if r.proc.poll() is None]
        for p in live:
            # SIGTERM first, then SIGCONT: a stopped rank gets the pending
            # SIGTERM as it resumes, before any of its own code runs again.
            _signal(p, signal.SIGTERM)
            _signal(p, signal.SIGCONT)
        deadline = time.monotonic() + grace
        for p in live:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal(p, signal.SIGKILL)
        codes = []
        for r in self.ranks:
            codes.append(r.proc.wait())
        return codes

    def __enter__(self) -> JobHandle:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.terminate()


def _signal(p: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        p.send_signal(sig)


def launch_job(
    scenario: Scenario | str,
    world_size: int,
    *,
    workdir: Path,
    steps_before_fault: int | None = None,
    snapshot_after: float | None = None,
    attach: bool = False,
    extra_env: Mapping[str, str] | None = None,
    snapshot_format: str = "pickle",
    snapshot_layout: str | None = None,
    portable_paths: bool = False,
    include_frames: bool = True,
    step_time: float | None = None,
    crash_rank: int | None = None,
    ready_timeout: float = 60.0,
    backend: str = "gloo",
    collective_timeout: float | None = None,
    fault_gate: Path | None = None,
) -> JobHandle:
    """Start the job and wait until every rank has joined the process group.

    The ranks are killed (SIGKILL, Linux) if the calling thread exits, so a
    killed test run leaves no orphans; launch from a thread that outlives the
    job. Retries once on a new port if the rendezvous port was taken meanwhile.
    `snapshot_layout` defaults to the scenario's (see `Scenario.snapshot_layout`).
    """
    sc = get_scenario(scenario) if isinstance(scenario, str) else scenario
    sc.check_world(world_size)
    steps = sc.default_steps if steps_before_fault is None else steps_before_fault
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    snapshot_dir = workdir / SNAPSHOT_SUBDIR if snapshot_after is not None else None
    for attempt in (1, 2):
        handle = _spawn(
            sc,
            world_size,
            steps=steps,
            workdir=workdir,
            snapshot_dir=snapshot_dir,
            snapshot_after=snapshot_after,
            attach=attach,
            extra_env=extra_env or {},
            snapshot_format=snapshot_format,
            snapshot_layout=snapshot_layout or sc.snapshot_layout,
            portable_paths=portable_paths,
            include_frames=include_frames,
            step_time=step_time,
            crash_rank=crash_rank,
            backend=backend,
            collective_timeout=collective_timeout,
            fault_gate=fault_gate,
        )
        try:
            handle.wait_ready(ready_timeout)
            return handle
        except BaseException as e:
            # The JobFailed message already carries the dead ranks' stderr.
            handle.terminate()
            in_use = any(s in handle.stderr_tail(0).lower() for s in _ADDR_IN_USE)
            if isinstance(e, JobFailed) and attempt == 1 and in_use:
                continue
            raise
    raise AssertionError("unreachable")


def _spawn(
    sc: Scenario,
    world_size: int,
    *,
    steps: int,
    workdir: Path,
    snapshot_dir: Path | None,
    snapshot_after: float | None,
    attach: bool,
    extra_env: Mapping[str, str],
    snapshot_format: str,
    snapshot_layout: str,
    portable_paths: bool,
    include_frames: bool,
    step_time: float | None,
    crash_rank: int | None,
    backend: str = "gloo",
    collective_timeout: float | None = None,
    fault_gate: Path | None = None,
) -> JobHandle:
    port = free_port()
    base_env = dict(os.environ)
    base_env.update(
        {
            env.WORLD_SIZE: str(world_size),
            env.MASTER_ADDR: "127.0.0.1",
            env.MASTER_PORT: str(port),
            env.TORCH_FR_BUFFER_SIZE: str(sc.fr_buffer_size),
        }
    )
    base_env.update(extra_env)
    ranks: list[RankProcess] = []
    try:
        for rank in range(world_size):
            status_path = workdir / f"rank_{rank}.status.json"
            status_path.unlink(missing_ok=True)
            cmd = [
                sys.executable,
                "-u",
                "-m",
                "hangwatch.testing.job",
                "--scenario",
                sc.name,
                "--steps-before-fault",
                str(steps),
                "--status-file",
                str(status_path),
                "--parent-pid",
                str(os.getpid()),
            ]
            if snapshot_dir is not None:
                cmd += [
                    "--snapshot-dir",
                    str(snapshot_dir),
                    "--snapshot-after",
                    str(snapshot_after),
                    "--snapshot-format",
                    snapshot_format,
                    "--snapshot-layout",
                    snapshot_layout,
                ]
            if portable_paths:
                cmd.append("--portable-paths")
            if not include_frames:
                cmd.append("--no-frames")
            if attach:
                cmd.append("--attach")
            if step_time is not None:
                cmd += ["--step-time", str(step_time)]
            if crash_rank is not None:
                cmd += ["--crash-rank", str(crash_rank)]
            if backend != "gloo":
                cmd += ["--backend", backend]
            if collective_timeout is not None:
                cmd += ["--collective-timeout", str(collective_timeout)]
            if fault_gate is not None:
                cmd += ["--fault-gate", str(fault_gate)]
            rank_env = dict(base_env)
            rank_env[env.RANK] = str(rank)
            rank_env[env.LOCAL_RANK] = str(rank)
            out_path = workdir / f"rank_{rank}.stdout"
            err_path = workdir / f"rank_{rank}.stderr"
            with open(out_path, "wb") as out, open(err_path, "wb") as err:
                proc = subprocess.Popen(
                    cmd, env=rank_env, stdout=out, stderr=err, stdin=subprocess.DEVNULL
                )
            ranks.append(
                RankProcess(
                    rank=rank,
                    proc=proc,
                    stdout_path=out_path,
                    stderr_path=err_path,
                    status_path=status_path,
                )
            )
    except BaseException:
        for r in ranks:
            _signal(r.proc, signal.SIGKILL)
            r.proc.wait()
        raise
    return JobHandle(
        scenario=sc,
        world_size=world_size,
        steps_before_fault=steps,
        workdir=workdir,
        snapshot_dir=snapshot_dir,
        master_port=port,
        ranks=ranks,
    )
