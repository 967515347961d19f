"""Straggler detection: time to name a slow rank, and false alarms, over slowdowns and job sizes.

    python benchmarks/straggler.py [--ranks 16,64,256,1024] [--slowdowns 10,25,50] [--seeds 2]

Each run replays a simulated job (tests/support/simagents/lateness.py: agents
of 8 ranks on a 1 s grid of the coordinator's clock, each off by up to
--clock-error-ms, ranks read up to 3 ms apart, only changed ranks reported)
through the coordinator's real `StragglerMonitor` on a fake clock. One rank
is slower by the given share of its compute from the start; the job runs
--seconds (300: the five minutes a 10% straggler must be named in). Healthy
runs (no slow rank) last --healthy-seconds (600) at several noise levels.

Reported per cell: median seconds until the slow rank is named (over seeds;
"-" when some seed never named it), ranks named that were not slow, and the
monitor's CPU per tick (observe + scoring), the coordinator's cost.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support.simagents.lateness import SimJob, replay


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--ranks", type=_ints, default=[16, 64, 256, 1024])
    p.add_argument("--slowdowns", type=_ints, default=[10, 25, 50], help="percent")
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--seconds", type=float, default=300.0)
    p.add_argument("--healthy-seconds", type=float, default=600.0)
    p.add_argument("--jitter", type=float, default=0.02, help="relative sd of compute per chunk")
    p.add_argument("--healthy-jitters", default="0.02,0.05,0.2")
    p.add_argument("--clock-error-ms", type=float, default=0.5)
    a = p.parse_args()
    logging.disable(logging.WARNING)
    err = a.clock_error_ms / 1e3
    print(
        f"jitter {a.jitter:g}, clock error up to {a.clock_error_ms:g} ms, {a.seeds} seeds, "
        f"{a.seconds:g} s per slow run, {a.healthy_seconds:g} s per healthy run"
    )
    print("| ranks | slowdown | named after (median, s) | per seed | others named | CPU per tick |")
    print("|---|---|---|---|---|---|")
    for n in a.ranks:
        for pct in a.slowdowns:
            named: list[float | None] = []
            others = 0
            cpu: list[float] = []
            for seed in range(a.seeds):
                slow = (seed * 7 + 3) % n
                job = SimJob(ranks=n, jitter=a.jitter, slow={slow: pct / 100}, seed=seed)
                r = replay(job, a.seconds, clock_error_s=err, seed=seed + 1)
                named.append(r.first_flag(slow))
                others += len(r.others({slow}))
                cpu.append(r.score_s / r.ticks)
            got = [x for x in named if x is not None]
            med = f"{statistics.median(got):.0f}" if len(got) == len(named) else "-"
            seeds = ", ".join("never" if x is None else f"{x:.0f}" for x in named)
            print(
                f"| {n} | {pct}% | {med} | {seeds} | {others} | "
                f"{statistics.median(cpu) * 1e3:.1f} ms |",
                flush=True,
            )
    print()
    print("| ranks | jitter | seconds | ranks named (false alarms) | CPU per tick |")
    print("|---|---|---|---|---|")
    for n in a.ranks:
        for jitter in (float(x) for x in a.healthy_jitters.split(",") if x):
            alarms = 0
            cpu = []
            for seed in range(a.seeds):
                r = replay(
                    SimJob(ranks=n, jitter=jitter, seed=100 + seed),
                    a.healthy_seconds,
                    clock_error_s=err,
                    seed=seed + 1,
                )
                alarms += len(r.flags)
                cpu.append(r.score_s / r.ticks)
            print(
                f"| {n} | {jitter:g} | {a.healthy_seconds:g} x {a.seeds} | {alarms} | "
                f"{statistics.median(cpu) * 1e3:.1f} ms |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
