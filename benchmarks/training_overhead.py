"""What hangwatch costs a training job: per-poll cost inside a rank, and step-time overhead.

    python benchmarks/training_overhead.py [--seconds 10] [--entries 2000]

1. Poll cost: two real gloo ranks with the hook attached and a full FR buffer
   (--entries collectives). The script polls rank 0's endpoint the way the
   agent does and reads the rank's CPU time (utime+stime from /proc) around
   many polls: CPU µs spent inside the training process per poll, plus the
   agent-side latency of each call.
2. Step time: a 2-rank gloo all_reduce loop run for --seconds, once without
   hangwatch and once with the hook attached and a real agent polling at 1 Hz
   (reporting to a real in-process coordinator). Reports the median step
   time of each and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")


def worker(a: argparse.Namespace) -> int:
    if a.attach:
        import hangwatch

        hangwatch.attach(run_dir=a.run_dir, fr_buffer_size=max(2000, a.entries))
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{a.store}", rank=a.rank, world_size=2)
    t = torch.ones(1024)
    for _ in range(a.entries):
        dist.all_reduce(t)
    steps: list[float] = []
    dist.barrier()
    end = time.monotonic() + a.seconds
    go = torch.ones(1)
    while True:
        # Both ranks agree on when to stop, so neither is left in a collective.
        go.fill_(1.0 if time.monotonic() < end else 0.0)
        dist.all_reduce(go, op=dist.ReduceOp.MIN)
        if go.item() == 0.0:
            break
        s = time.perf_counter()
        dist.all_reduce(t)
        steps.append(time.perf_counter() - s)
    if a.rank == 0:
        print("STEPS " + json.dumps(steps), flush=True)
    if a.hold:
        while not os.path.exists(os.path.join(a.run_dir, "stop")):
            time.sleep(0.05)
    dist.destroy_process_group()
    return 0


def _spawn(
    tmp: Path, *, attach: bool, seconds: float, entries: int, hold: bool
) -> list[subprocess.Popen[str]]:
    procs = []
    for rank in range(2):
        cmd = [
            sys.executable,
            __file__,
            "--worker",
            "--rank",
            str(rank),
            "--store",
            str(tmp / "store"),
            "--run-dir",
            str(tmp / "run"),
            "--seconds",
            str(seconds),
            "--entries",
            str(entries),
        ]
        cmd += ["--attach"] if attach else []
        cmd += ["--hold"] if hold else []
        procs.append(
            subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    return procs


def _cpu_s(pid: int) -> float:
    from hangwatch import hook_protocol

    f = hook_protocol.proc_stat_fields(pid)
    assert f is not None
    return (int(f[11]) + int(f[12])) / CLK_TCK


def poll_cost(entries: int) -> dict[str, float]:
    from hangwatch.agent import endpoint

    from hangwatch import hook_protocol

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        procs = _spawn(tmp, attach=True, seconds=0.5, entries=entries, hold=True)
        try:
            out = procs[0].stdout
            assert out is not None
            for line in out:  # wait for the loop to finish: rank 0 then idles
                if line.startswith("STEPS"):
                    break
            time.sleep(1.0)
            info = next(
                json.loads(p.read_text())
                for p in (tmp / "run" / "hook").glob("*.json")
                if json.loads(p.read_text())["rank"] == 0
            )
            sock, pid = info["socket"], info["pid"]
            result: dict[str, float] = {}
            for name, handler, n in (
                ("status", hook_protocol.STATUS, 400),
                ("full_json", hook_protocol.FR_TRACE_JSON, 40),
            ):
                size = len(endpoint.call(sock, handler, timeout=5))
                idle0 = _cpu_s(pid)
                time.sleep(1.0)
                idle_per_s = _cpu_s(pid) - idle0  # the idle rank's own background CPU
                lat = []
                c0, w0 = _cpu_s(pid), time.monotonic()
                for _ in range(n):
                    s = time.perf_counter()
                    endpoint.call(sock, handler, timeout=5)
                    lat.append(time.perf_counter() - s)
                cpu = _cpu_s(pid) - c0 - idle_per_s * (time.monotonic() - w0)
                result[f"{name}_rank_cpu_us"] = max(0.0, cpu) / n * 1e6
                result[f"{name}_latency_ms_median"] = statistics.median(lat) * 1e3
                result[f"{name}_bytes"] = float(size)
            return result
        finally:
            (tmp / "run").mkdir(exist_ok=True)
            (tmp / "run" / "stop").touch()
            for p in procs:
                p.wait(30)


def step_times(*, attach: bool, seconds: float) -> list[float]:
    from hangwatch.agent.service import Agent
    from hangwatch.server.coordinator import Coordinator

    from hangwatch.config import Config

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        coord = agent = th = None
        if attach:
            coord = Coordinator(Config.of(data_dir=str(tmp / "data"), grpc_port=0, http_port=0))
            coord.start()
            agent = Agent(
                Config.of(
                    coordinator=coord.grpc_address,
                    run_dir=str(tmp / "run"),
                    poll_interval=1.0,
                    job_id="bench",
                    node_id="bench",
                )
            )
            th = threading.Thread(target=agent.run, daemon=True)
            th.start()
        procs = _spawn(tmp, attach=attach, seconds=seconds, entries=0, hold=False)
        try:
            out, err = procs[0].communicate(timeout=seconds + 120)
            procs[1].wait(60)
            for p in procs:
                if p.returncode != 0:
                    raise RuntimeError(f"worker exit {p.returncode}: {err[-2000:]}")
        finally:
            if agent is not None and th is not None:
                agent.stop.set()
                th.join(10)
            if coord is not None:
                coord.stop()
        line = next(ln for ln in out.splitlines() if ln.startswith("STEPS"))
        steps: list[float] = json.loads(line[len("STEPS ") :])
        if attach and agent is not None:
            assert agent.polls >= seconds * 0.5, "the agent did not poll"
        return steps


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--store", help=argparse.SUPPRESS)
    p.add_argument("--run-dir", help=argparse.SUPPRESS)
    p.add_argument("--attach", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--hold", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--seconds", type=float, default=10.0, help="Length of each step-time run.")
    p.add_argument("--entries", type=int, default=2000, help="FR entries in the poll-cost run.")
    p.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="Alternating without/with pairs; the ratio quoted is the median of the per-pair ratios.",
    )
    a = p.parse_args()
    if a.worker:
        return worker(a)
    cost = poll_cost(a.entries)
    for k, v in cost.items():
        print(f"poll {k}: {v:.1f}")
    # Alternate without/with so drift in the machine's load hits both sides;
    # quote the median of the per-pair ratios.
    ratios = []
    for i in range(a.rounds):
        base = step_times(attach=False, seconds=a.seconds)
        hooked = step_times(attach=True, seconds=a.seconds)
        mb, mh = statistics.median(base), statistics.median(hooked)
        ratios.append(mh / mb)
        print(
            f"round {i + 1}: without {len(base)} steps, median {mb * 1e6:.1f} us; "
            f"with hook + agent at 1 Hz {len(hooked)} steps, median {mh * 1e6:.1f} us; "
            f"ratio {mh / mb:.3f}"
        )
    print(
        f"median step-time ratio (with/without) over {a.rounds} rounds: {statistics.median(ratios):.3f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
