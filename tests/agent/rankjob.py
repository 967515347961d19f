"""A real gloo rank for the agent/hook tests: `python rankjob.py --rank R --world W --store F ...`.

Modes:
  healthy  all ranks loop over all_reduce until <run_dir>/stop exists
  hang     after --steps collectives, rank --culprit stops calling them (sleeps);
           the others block in the next all_reduce
  timeout  like hang, but the process group timeout is --pg-timeout seconds, so
           the waiting ranks raise a collective timeout that escapes to the top
  compile  after --steps collectives, rank --culprit runs torch.compile, whose
           backend waits on <run_dir>/compile.lock as inductor's builds wait on
           its cache's lock; the others wait in the next all_reduce, which all
           ranks finish once the lock is free; then all wait for the stop file
  gil      all ranks wait for the stop file; each time <run_dir>/hold_gil
           appears, rank --culprit removes it and holds the GIL for --hold-s
           seconds in one C call (printing HOLDING before, RELEASED after), as
           a rank busy in C code, or starved of CPU, leaves its handlers waiting
Attach modes: call (hangwatch.attach()), thread (forced fallback endpoint), none.
--backend hwstore: the default group and the pairs run on the asynchronous
store backend that torch 2.15 records through FlightRecorderHook; the "head"
subgroup stays gloo, so a rank writes to two recorder instances.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time


def _lock_waiting_backend(lock_path: str):  # type: ignore[no-untyped-def]
    """A torch.compile backend that first waits for a file lock, as inductor's
    C++ and Triton builds wait for their cache's (torch.utils._filelock)."""

    def backend(gm, example_inputs):  # type: ignore[no-untyped-def]
        from torch.utils._filelock import FileLock

        with FileLock(lock_path):
            pass
        return gm.forward

    return backend


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--store", required=True)
    p.add_argument("--run-dir", required=True)
    p.add_argument(
        "--mode", default="healthy", choices=["healthy", "hang", "timeout", "compile", "gil"]
    )
    p.add_argument("--attach", default="call", choices=["call", "thread", "none"])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--culprit", type=int, default=1)
    p.add_argument("--pg-timeout", type=float, default=300.0)
    p.add_argument("--interval", type=float, default=0.05)
    p.add_argument("--hold-s", type=int, default=3)
    p.add_argument("--backend", default="gloo", choices=["gloo", "hwstore", "hwhooks"])
    a = p.parse_args()

    if a.attach != "none":
        import hangwatch
        from hangwatch import hook

        res = hangwatch.attach(run_dir=a.run_dir, force_thread_server=a.attach == "thread")
        print(f"ATTACH ok={res.ok} deferred={res.deferred} reasons={res.reasons}", flush=True)
    else:
        hook = None

    import torch
    import torch.distributed as dist

    from hangwatch.testing import backends

    backend = backends.register(a.backend)
    dist.init_process_group(
        backend,
        init_method=f"file://{a.store}",
        rank=a.rank,
        world_size=a.world,
        timeout=datetime.timedelta(seconds=a.pg_timeout),
    )
    # A subgroup of everyone but the last rank, then pairs: exercises pg_id order.
    sub = dist.new_group(list(range(max(1, a.world - 1))), group_desc="head", backend="gloo")
    pairs, _ = dist.new_subgroups(2)
    t = torch.ones(8)
    for _ in range(a.steps):
        dist.all_reduce(t)
        if a.rank in range(max(1, a.world - 1)):
            dist.all_reduce(t, group=sub)
        dist.all_reduce(t, group=pairs)
    if hook is not None:
        print(f"STATUS {hook.status()}", flush=True)
    print("READY", flush=True)
    stop = os.path.join(a.run_dir, "stop")
    if a.mode == "compile":
        if a.rank == a.culprit:
            lock = os.path.join(a.run_dir, "compile.lock")
            t = torch.compile(lambda x: x * 2, backend=_lock_waiting_backend(lock))(t)
        dist.all_reduce(t)
        print("COMPILED", flush=True)
        while not os.path.exists(stop):
            time.sleep(a.interval)
        return 0
    if a.mode == "gil":
        import ctypes

        # PyDLL: the call keeps the GIL (CDLL's would release it).
        libc_sleep = ctypes.PyDLL(None).sleep
        hold = os.path.join(a.run_dir, "hold_gil")
        while not os.path.exists(stop):
            if a.rank == a.culprit and os.path.exists(hold):
                os.remove(hold)
                print("HOLDING", flush=True)
                libc_sleep(a.hold_s)
                print("RELEASED", flush=True)
            time.sleep(a.interval)
        return 0
    if a.mode == "healthy" or a.rank == a.culprit:
        while not os.path.exists(stop):
            if a.mode == "healthy":
                dist.all_reduce(t)
            time.sleep(a.interval)
        return 0
    dist.all_reduce(t)  # blocks: the culprit never joins
    return 0


if __name__ == "__main__":
    sys.exit(main())
