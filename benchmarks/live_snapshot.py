"""What the live view of one job costs under the registry's lock.

    python benchmarks/live_snapshot.py --ranks 4096 16384 --repeats 3

`JobRegistry.snapshot` builds the dashboard's live view of a job (every
rank, group and agent, and the stall scan). What it does holding the
registry's lock (the stall scan and the copy of the numbers,
`views.capture`) is time in which no progress report is applied and the
gRPC handlers wait; the views are built after. Measured on a simulated job (`tests.support.simagents`: 8
ranks a node, the Megatron-style TP/PP/DP groups), in one process, without
gRPC. The anchor, in the same run: one round of every agent's progress
report applied to the same registry (what a second of a healthy job at 1 Hz
costs the coordinator's handlers). Medians over `--repeats`.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hangwatch.server.ingest import validate
from hangwatch.server.live.stalls import scan_stalls
from hangwatch.server.live.views import capture

from benchmarks.ingest_path import _build
from hangwatch.wire import pb


def measure(ranks: int, repeats: int) -> tuple[float, float, float, int]:
    """(whole snapshot s, of it under the lock s, one round of reports s,
    groups), medians."""
    fleet, registry, clock, bodies = asyncio.run(_build(ranks, "columns"))
    try:
        parsed = [pb.ProgressReport.FromString(pair[0]) for pair in bodies]
        checked = [validate.progress_report(r) for r in parsed]
        rounds, snaps, locked = [], [], []
        for k in range(repeats):
            t = time.perf_counter()
            for req, cols in zip(parsed, checked, strict=True):
                req.report_seq = k + 1
                registry.report_progress(req, cols)
            rounds.append(time.perf_counter() - t)
            clock.t += 1.0
            t = time.perf_counter()
            snap = registry.snapshot("bench")
            snaps.append(time.perf_counter() - t)
            assert snap is not None and len(snap.ranks) == ranks
            # What `snapshot` does while it holds the lock: the stall scan and
            # the copy of the numbers (the same calls, timed on their own).
            job = registry._jobs["bench"]
            t = time.perf_counter()
            scan_stalls(job, clock.t, registry.stall_timeout)
            capture(job, clock.t)
            locked.append(time.perf_counter() - t)
        return (
            statistics.median(snaps),
            statistics.median(locked),
            statistics.median(rounds),
            len(snap.groups),
        )
    finally:
        fleet.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    print(
        "ranks | groups | anchor: one round of reports (s) | snapshot (s) | ratio"
        " | of it under the lock (s) | ratio"
    )
    for n in a.ranks:
        snap, locked, anchor, groups = measure(n, a.repeats)
        print(
            f"{n:5d} | {groups:6d} | {anchor:33.3f} | {snap:12.3f} | {snap / anchor:5.1f}x"
            f" | {locked:24.3f} | {locked / anchor:5.1f}x"
        )


if __name__ == "__main__":
    main()
