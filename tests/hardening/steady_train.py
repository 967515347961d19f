"""A real gloo rank that trains steadily and logs every step's duration.

    python steady_train.py --rank R --world W --store FILE --run-dir D --job-id J --out DIR

Each step is a little real compute, `--step-time` seconds of sleep (the data
loader) and an all_reduce. Appends `<end monotonic> <duration s> <step>` to
DIR/steps_<R>.txt after every step (CLOCK_MONOTONIC is system-wide, so the
tests line these up with the moments they injected faults). Exits when
DIR/stop exists. Once DIR/hang exists, rank `--culprit` stops calling
collectives and the others block in their next all_reduce: a real hang that
starts whenever the test chooses.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import os
import signal
import sys
import time


def _die_with_parent() -> None:
    # A rank blocked in a collective never exits by itself: let the kernel
    # clean up if the test process dies.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--store", required=True)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--job-id", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--culprit", type=int, default=-1)
    p.add_argument("--step-time", type=float, default=0.02)
    a = p.parse_args()
    _die_with_parent()

    import hangwatch

    res = hangwatch.attach(run_dir=a.run_dir, job_id=a.job_id)
    if not res.ok:
        print(f"attach failed: {res.reasons}", file=sys.stderr, flush=True)
        return 3

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{a.store}",
        rank=a.rank,
        world_size=a.world,
        timeout=datetime.timedelta(seconds=600),
    )
    stop = os.path.join(a.out, "stop")
    hang = os.path.join(a.out, "hang")
    w = torch.randn(64, 64)
    x = torch.randn(64, 64)
    step = 0
    with open(os.path.join(a.out, f"steps_{a.rank}.txt"), "a", buffering=1) as log:
        while not os.path.exists(stop):
            if a.rank == a.culprit and os.path.exists(hang):
                while not os.path.exists(stop):
                    time.sleep(0.05)
                break
            t0 = time.monotonic()
            for _ in range(4):
                x = torch.tanh(x @ w)
            time.sleep(a.step_time)
            grad = x.sum(dim=0)
            dist.all_reduce(grad)
            t1 = time.monotonic()
            log.write(f"{t1:.6f} {t1 - t0:.6f} {step}\n")
            step += 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
