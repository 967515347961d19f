"""One rank of a hang-zoo training job: `python -m hangwatch.testing.job --scenario NAME`.

Reads torchrun-style RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT, joins a
gloo job, runs K healthy steps and then injects the scenario's fault (see
`hangwatch.testing.scenarios` for the plan and its ground truth). Progress goes
to `--status-file` (JSON, rewritten atomically) and to stdout as lines that
start with `hangwatch-zoo: `.

The gloo timeout is long on purpose: a hang must persist until the harness
kills the job, not turn into a timeout error midway through a test.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

from hangwatch import env
from hangwatch.testing.backends import BACKENDS
from hangwatch.testing.scenarios import (
    DEFAULT_GROUP,
    DEFAULT_STEP_OPS,
    SCENARIOS,
    Scenario,
    get_scenario,
)

STATUS_SCHEMA = "hangwatch.zoo-status/1"
STDOUT_TAG = "hangwatch-zoo: "

# Phases a rank's status file goes through, in order.
PHASE_STARTED = "started"
PHASE_READY = "ready"  # process group and extra groups are up
PHASE_FAULT = "fault"  # reached step K; the fault (if this rank has one) is next
PHASE_FINISHED = "finished"  # healthy job only: clean exit follows

_TENSOR_NUMEL = 16


class Status:
    """The rank's status file: one JSON object, replaced atomically on each update."""

    def __init__(self, path: Path | None, **fields: Any) -> None:
        self.path = path
        self.fields: dict[str, Any] = {"schema": STATUS_SCHEMA, **fields}
        self._lock = threading.Lock()

    def update(self, **fields: Any) -> None:
        with self._lock:
            self.fields.update(fields)
            self.fields["updated_unix"] = time.time()
            line = json.dumps(self.fields, sort_keys=True)
            print(STDOUT_TAG + line, flush=True)
            if self.path is None:
                return
            tmp = self.path.with_name(f".{self.path.name}.tmp")
            tmp.write_text(line)
            os.replace(tmp, self.path)


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    from hangwatch.testing.snapshot import FORMATS, LAYOUTS

    p = argparse.ArgumentParser(prog="python -m hangwatch.testing.job", description=__doc__)
    p.add_argument("--scenario", required=True, choices=sorted(SCENARIOS))
    p.add_argument(
        "--steps-before-fault",
        type=int,
        default=None,
        help="Healthy steps before the fault (default: the scenario's own).",
    )
    p.add_argument(
        "--step-time",
        type=float,
        default=None,
        help="Seconds of fake compute per step (default: the scenario's own).",
    )
    p.add_argument("--status-file", type=Path, default=None)
    p.add_argument(
        "--snapshot-dir", type=Path, default=None, help="Write this rank's FR dump here."
    )
    p.add_argument("--snapshot-after", type=float, default=1.5, help="Seconds after the fault.")
    p.add_argument("--snapshot-format", choices=FORMATS, default="pickle")
    p.add_argument("--snapshot-layout", choices=LAYOUTS, default="bundle")
    p.add_argument(
        "--portable-paths",
        action="store_true",
        help="Strip machine-specific path prefixes from dumped frames and stacks (golden files).",
    )
    p.add_argument(
        "--no-frames",
        action="store_true",
        help="Leave the FR entries' call-site frames out of the snapshot (much cheaper).",
    )
    p.add_argument("--attach", action="store_true", help="Call hangwatch.attach() at start.")
    p.add_argument("--collective-timeout", type=float, default=600.0)
    p.add_argument(
        "--backend",
        choices=BACKENDS,
        default="gloo",
        help="gloo; hwhooks: a compiled CPU backend with completion and abort hooks, "
        "recorded by torch 2.15's FlightRecorderHook as its default NCCL is; hwstore: "
        "the same without completion hooks, as any backend written in Python "
        "(hangwatch.testing.backends).",
    )
    p.add_argument(
        "--parent-pid",
        type=int,
        default=None,
        help="Die (SIGKILL) when this process, the launcher, goes away (Linux).",
    )
    p.add_argument(
        "--fault-gate",
        type=Path,
        default=None,
        help="After the steps before the fault, train on until this file exists, then"
        " inject it (every rank at the same step): for a launcher that waits for the"
        " coordinator to have seen something first.",
    )
    p.add_argument(
        "--crash-rank",
        type=int,
        default=None,
        help="This rank raises at step K instead (to test that crashes surface).",
    )
    return p.parse_args(argv)


def _env_int(name: str) -> int:
    try:
        return int(os.environ[name])
    except KeyError:
        raise SystemExit(
            f"{name} is not set: run under torchrun or hangwatch.testing.launch"
        ) from None
    except ValueError:
        raise SystemExit(f"{name}={os.environ[name]!r} is not an integer") from None


def _die_with_parent(parent_pid: int) -> None:
    """Have the kernel SIGKILL this rank when its launcher dies.

    A hung rank never exits on its own, and a stopped or GIL-holding one cannot
    run a watchdog thread, so only the kernel can clean up after a killed test
    run. PR_SET_PDEATHSIG is Linux-only; elsewhere the launcher's context
    manager is the only guard.
    """
    if not sys.platform.startswith("linux"):
        return
    pr_set_pdeathsig = 1
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:
        # The launcher died before prctl took effect.
        raise SystemExit(f"launcher (pid {parent_pid}) is gone")


def _attach() -> None:
    try:
        importlib.import_module("hangwatch.hook")
    except ImportError as e:
        raise SystemExit(f"--attach needs hangwatch.hook, which failed to import: {e}") from e
    import hangwatch

    hangwatch.attach()


class _Job:
    def __init__(self, ns: argparse.Namespace, scenario: Scenario, rank: int, world: int) -> None:
        import torch
        import torch.distributed as dist

        self.torch = torch
        self.dist = dist
        self.ns = ns
        self.scenario = scenario
        self.rank = rank
        self.world = world
        self.groups: dict[str, Any] = {}  # name -> ProcessGroup (None on non-members)
        self.members: dict[str, list[int]] = {}

    def create_groups(self) -> None:
        # Every rank creates every group, in the same order, members or not:
        # torch names groups by a per-process counter, and new_group is
        # collective over the whole world.
        c10d = self.dist.distributed_c10d
        self.members[DEFAULT_GROUP] = list(range(self.world))
        for i, ranks in enumerate(self.scenario.groups(self.world), start=1):
            pg = self.dist.new_group(list(ranks))
            name = str(i)
            if self.rank in ranks:
                actual = c10d._get_process_group_name(pg)
                if actual != name:
                    raise RuntimeError(
                        f"torch named extra group #{i} {actual!r}, the plan expects {name!r}: "
                        "the scenario's ground truth would be wrong"
                    )
            self.groups[name] = pg
            self.members[name] = list(ranks)

    def group_infos(self) -> list[Any]:
        from hangwatch.formats import GroupInfo

        infos = [
            GroupInfo(name=DEFAULT_GROUP, desc="default_pg", ranks=self.members[DEFAULT_GROUP])
        ]
        infos += [
            GroupInfo(name=n, desc="undefined", ranks=r)
            for n, r in self.members.items()
            if n != DEFAULT_GROUP
        ]
        return infos

    def _tensor(self, step: int) -> Any:
        return self.torch.full((_TENSOR_NUMEL,), float(self.rank + step))

    def extra_group_ops(self, step: int) -> None:
        for name in self.scenario.trains_on:
            if self.rank in self.members[name]:
                self.dist.all_reduce(self._tensor(step), group=self.groups[name])

    def default_group_ops(self, step: int, *, first_op: str = "all_reduce") -> None:
        assert DEFAULT_STEP_OPS == ("all_reduce", "broadcast", "all_gather")
        grad = self._tensor(step)
        if first_op == "all_reduce":
            self.dist.all_reduce(grad)
        else:
            # The mismatch fault: same tensor size, different op.
            self.dist.broadcast(grad, src=0)
        flag = self._tensor(step)
        self.dist.broadcast(flag, src=0)
        gathered = self.torch.empty(_TENSOR_NUMEL * self.world)
        self.dist.all_gather_single(gathered, self._tensor(step))

    def step(self, step: int) -> None:
        self.extra_group_ops(step)
        time.sleep(self.scenario.step_time if self.ns.step_time is None else self.ns.step_time)
        self.default_group_ops(step)


def _stall_outside_collectives() -> None:
    """Block forever outside any collective, like a data loader that never yields."""
    never = threading.Event()
    while not never.wait(3600):
        pass


def _spin_in_python_compute() -> None:
    """Burn CPU in pure Python forever (the GIL is released every switch interval)."""
    x = 0
    while True:
        for i in range(100_000):
            x = (x * 31 + i) % 1_000_003


def _hold_gil_in_c() -> None:
    """Sleep in libc with the GIL held: PyDLL, unlike CDLL, does not release it."""
    libc = ctypes.PyDLL(None)
    libc.sleep.argtypes = [ctypes.c_uint]
    while True:
        libc.sleep(3600)


def _inject(job: _Job, step: int, status: Status) -> None:
    """Run step `step` with the scenario's fault. Returns only for `healthy`."""
    name = job.scenario.name
    rank, world = job.rank, job.world
    guilty = set(job.scenario.guilty_ranks(world))
    if job.ns.crash_rank == rank:
        raise RuntimeError(f"injected crash on rank {rank} at step {step}")
    if name == "healthy":
        return
    if name == "p2p":
        t = job._tensor(step)
        if rank in (0, 1):
            peer = 1 - rank
            job.dist.recv(t, src=peer)
            job.dist.send(t, dst=peer)
        else:
            job.dist.recv(t, src=rank % 2)
    elif rank not in guilty:
        job.step(step)
    elif name in ("skip", "two", "wrap", "subgroup"):
        _stall_outside_collectives()
    elif name == "compute":
        _spin_in_python_compute()
    elif name == "frozen":
        os.kill(os.getpid(), signal.SIGSTOP)
        _stall_outside_collectives()
    elif name == "gil":
        _hold_gil_in_c()
    elif name == "mismatch":
        job.extra_group_ops(step)
        job.default_group_ops(step, first_op="broadcast")
    elif name == "order":
        job.default_group_ops(step)
        job.extra_group_ops(step)
    else:
        raise AssertionError(f"scenario {name!r} has no injector")
    raise RuntimeError(
        f"rank {rank} completed the fault step of scenario {name!r}: the hang did not happen"
    )


def main(argv: Sequence[str] | None = None) -> int:
    ns = _parse(argv)
    if ns.parent_pid is not None:
        _die_with_parent(ns.parent_pid)
    scenario = get_scenario(ns.scenario)
    rank, world = _env_int(env.RANK), _env_int(env.WORLD_SIZE)
    scenario.check_world(world)
    steps = scenario.default_steps if ns.steps_before_fault is None else ns.steps_before_fault
    if steps < 0:
        raise SystemExit("--steps-before-fault must be >= 0")
    status = Status(
        ns.status_file,
        rank=rank,
        world_size=world,
        pid=os.getpid(),
        scenario=scenario.name,
        steps_before_fault=steps,
        phase=PHASE_STARTED,
        injects_fault=rank in scenario.guilty_ranks(world),
        fault_injected_unix=None,
        snapshot=None,
        in_flight=None,
    )
    status.update()
    # FR records nothing unless its buffer is sized before the first collective.
    os.environ.setdefault(env.TORCH_FR_BUFFER_SIZE, str(scenario.fr_buffer_size))
    if ns.attach:
        _attach()
    job = _Job(ns, scenario, rank, world)
    job.torch.set_num_threads(1)
    from hangwatch.testing import backends

    backend = backends.register(ns.backend)
    job.dist.init_process_group(
        backend, rank=rank, world_size=world, timeout=timedelta(seconds=ns.collective_timeout)
    )
    job.create_groups()
    status.update(phase=PHASE_READY)
    for step in range(steps):
        job.step(step)
    if ns.fault_gate is not None:
        steps = _train_until(job, steps, ns.fault_gate)
        status.update(steps_before_fault=steps)

    snapshot_thread = None
    if ns.snapshot_dir is not None and rank not in scenario.silent_ranks(world):
        # A stopped rank would write nothing; don't let it write after SIGCONT either.
        snapshot_thread = threading.Thread(
            target=_snapshot_later, args=(job, status), name="zoo-snapshot", daemon=True
        )
    status.update(phase=PHASE_FAULT, fault_injected_unix=time.time())
    if snapshot_thread is not None:
        snapshot_thread.start()
    _inject(job, steps, status)

    # Healthy: let the snapshot see every rank idle, then leave together.
    if snapshot_thread is not None:
        snapshot_thread.join()
    job.dist.barrier()
    job.dist.destroy_process_group()
    status.update(phase=PHASE_FINISHED)
    return 0


def _train_until(job: _Job, step: int, gate: Path) -> int:
    """Train on until `gate` exists; returns the step the fault comes at. The ranks
    agree on that step with a MAX all_reduce of what each saw: one that saw the
    file a step before another would otherwise inject alone."""
    while True:
        seen = job.torch.tensor([1.0 if gate.exists() else 0.0])
        job.dist.all_reduce(seen, op=job.dist.ReduceOp.MAX)
        if seen.item():
            return step
        job.step(step)
        step += 1


def _snapshot_later(job: _Job, status: Status) -> None:
    from hangwatch.testing.snapshot import write_snapshot

    ns = job.ns
    time.sleep(ns.snapshot_after)
    try:
        path, flights = write_snapshot(
            ns.snapshot_dir,
            rank=job.rank,
            groups=job.group_infos(),
            fmt=ns.snapshot_format,
            layout=ns.snapshot_layout,
            portable=ns.portable_paths,
            frames=not ns.no_frames,
        )
    except Exception as e:
        # The main thread is blocked in a collective: make the failure visible
        # in the status file and stderr instead of dying silently.
        status.update(snapshot_error=f"{type(e).__name__}: {e}")
        raise
    status.update(snapshot=str(path), in_flight=flights)


if __name__ == "__main__":
    sys.exit(main())
