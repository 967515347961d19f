"""What the agent's quiet-period stack sample costs a rank, against its status poll.

`agent/quietstack.py` asks a rank whose counters have been quiet for 1 s for
its Python stacks (torch's `dump_traceback` handler on the rank's worker
server), at most once every 5 s. Anchor, measured in the same run: the status
poll the agent makes of every rank on every poll (0.5 s by default), the
hook's `hangwatch_status` handler. Both are timed from outside, as the agent
calls them, against one real rank under the hook (a world of one on gloo,
`--collectives` all_reduces recorded, `--threads` extra threads sleeping as a
real job's data loader and logging threads do), whose main thread sleeps.

    python benchmarks/quiet_sample.py [--reps 300] [--threads 8]

Prints, for each handler, the median wall time of one call, the rank's CPU
time per call (from /proc over the whole batch), and the ratio to the anchor;
then both as a share of one core at the agent's rates.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hangwatch.agent import endpoint, quietstack

from hangwatch import hook_protocol
from hangwatch.testing.ports import free_port

RANK = """
import os, sys, threading, time
import hangwatch
hangwatch.attach(run_dir=sys.argv[1])
import torch, torch.distributed as dist
dist.init_process_group("gloo", rank=0, world_size=1)
t = torch.ones(8)
for _ in range(int(sys.argv[2])):
    dist.all_reduce(t)
for _ in range(int(sys.argv[3])):
    threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
print("ready", flush=True)
time.sleep(3600)
"""
POLL_S = 0.5  # the agent's default poll interval: one status call a rank each


def _cpu_s(pid: int) -> float:
    fields = hook_protocol.proc_stat_fields(pid)
    assert fields is not None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _measure(sock: str, pid: int, handler: str, reps: int) -> tuple[float, float]:
    """(median wall ms per call, rank CPU ms per call)."""
    times = []
    cpu0 = _cpu_s(pid)
    for _ in range(reps):
        t0 = time.perf_counter()
        endpoint.call(sock, handler, timeout=5.0)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3, (_cpu_s(pid) - cpu0) / reps * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--collectives", type=int, default=2000)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
        p = subprocess.Popen(
            [sys.executable, "-c", RANK, d, str(a.collectives), str(a.threads)],
            env=env,
            stdout=subprocess.PIPE,
        )
        try:
            assert p.stdout is not None and p.stdout.readline().strip() == b"ready"
            [info] = (json.loads(f.read_text()) for f in (Path(d) / "hook").glob("*.json"))
            sock = str(info["socket"])
            rows = {}
            for handler in (hook_protocol.STATUS, hook_protocol.DUMP_TRACEBACK):
                _measure(sock, p.pid, handler, 20)  # warm
                rows[handler] = _measure(sock, p.pid, handler, a.reps)
        finally:
            p.kill()
            p.wait()
            if p.stdout is not None:
                p.stdout.close()
    anchor_cpu = rows[hook_protocol.STATUS][1]
    print("handler | wall ms (median) | rank CPU ms/call | CPU ratio to anchor")
    for handler, (wall, cpu) in rows.items():
        print(f"{handler} | {wall:.3f} | {cpu:.3f} | {cpu / anchor_cpu:.1f}x")
    status_share = anchor_cpu / 1e3 / POLL_S
    sample_share = rows[hook_protocol.DUMP_TRACEBACK][1] / 1e3 / quietstack.RESAMPLE_S
    print(
        f"share of a core: status every {POLL_S:g}s {status_share:.5%}, "
        f"stack sample every {quietstack.RESAMPLE_S:g}s while quiet {sample_share:.5%} "
        f"({sample_share / status_share:.2f}x the status poll's)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
