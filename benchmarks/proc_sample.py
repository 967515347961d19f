"""What the agent's per-rank /proc sample costs now that it counts the rank's children.

`agent.procstate.process_sample` runs for every rank on every poll, in the
agent (never in the rank). It reads the rank's /proc/<pid>/stat and, since
the CPU time includes the rank's child processes (torch.compile works in
compile workers), its main thread's `children` list and each live
descendant's stat. Anchor, measured in the same run: one read of the rank's
stat alone (`hook_protocol.proc_stat_fields`, what a sample cost before).

Run: `python benchmarks/proc_sample.py [--children 0 4 16] [--repeats 2000]`.
Prints the median time per sample and its ratio to the anchor.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

from hangwatch.agent.procstate import CpuTotal, RunqueueWait, process_sample

from hangwatch import hook_protocol

# A parent that starts N sleeping children, then sleeps: a rank with a
# DataLoader's or a compile pool's workers, idle.
PARENT = (
    "import subprocess, sys, time\n"
    "ps = [subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])"
    " for _ in range(int(sys.argv[1]))]\n"
    "print('ready', flush=True)\n"
    "time.sleep(600)\n"
)


def _median_us(fn: object, pid: int, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        fn(pid)  # type: ignore[operator]
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times) / 1000


def _polled(acc: RunqueueWait, io_total: CpuTotal | None = None) -> Callable[[int], None]:
    """One poll of a rank as the agent makes it: CPU time and run-queue wait,
    and with `io_total` storage I/O too (RankProgress.io_bytes)."""

    def poll(pid: int) -> None:
        waits: dict[int, int] = {}
        compilers: list[str] = []
        io: list[int] | None = None if io_total is None else []
        process_sample(pid, None, waits, compilers, io)
        acc.update(waits)
        if io_total is not None and io is not None:
            io_total.update(sum(io))

    return poll


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--children", type=int, nargs="+", default=[0, 4, 16])
    ap.add_argument("--repeats", type=int, default=2000)
    a = ap.parse_args()
    print(
        "children | anchor: stat only (us) | process_sample (us) | ratio "
        "| with run-queue wait (us) | ratio | and storage I/O, as the agent polls (us) | ratio"
    )
    for n in a.children:
        p = subprocess.Popen(
            [sys.executable, "-c", PARENT, str(n)],
            stdout=subprocess.PIPE,
            start_new_session=True,
        )
        try:
            assert p.stdout is not None and p.stdout.readline().strip() == b"ready"
            time.sleep(0.5)  # the children's interpreters are up
            anchor = _median_us(hook_protocol.proc_stat_fields, p.pid, a.repeats)
            sample = _median_us(process_sample, p.pid, a.repeats)
            full = _median_us(_polled(RunqueueWait()), p.pid, a.repeats)
            io = _median_us(_polled(RunqueueWait(), CpuTotal()), p.pid, a.repeats)
            print(
                f"{n:8d} | {anchor:22.1f} | {sample:19.1f} | {sample / anchor:5.1f}x "
                f"| {full:24.1f} | {full / anchor:5.1f}x | {io:40.1f} | {io / anchor:5.1f}x"
            )
        finally:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            if p.stdout is not None:
                p.stdout.close()


if __name__ == "__main__":
    main()
