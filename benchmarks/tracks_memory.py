"""What the straggler monitor's tracks cost the coordinator's memory a rank.

    python benchmarks/tracks_memory.py --ranks 4096 --groups 5 --rounds 5

`server.live.tracks.Tracks` keeps one row of arrays per (group, rank) of a
job. Rows are added as a tick first reads them: while a job registers, a
few agents (8 ranks each) at a time. Each round is a fresh process that adds
`--ranks` x `--groups` rows `--batch` ranks at a time, then pushes every row
`--pushes` times, as that many scored ticks do, each push off level on each
counter with probability `--odd-share` (a healthy job's noise: 2%), and reads
its own RSS growth (what the coordinator's "memory per rank" counts).

The anchor is what the rows hold: the arrays' bytes a row times the rows,
and the pool's rings for rows with more odd pushes than a row keeps, nothing
spare. RSS is printed as a ratio to it (1.0: no spare room, no freed copies
left resident). Medians over `--rounds` processes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

ROUND = """
import json, statistics, sys, time
import numpy as np
sys.path.insert(0, {repo!r})
from hangwatch.server.live.tracks import Tracks

def rss_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))

ranks, groups, batch, pushes, share = {ranks}, {groups}, {batch}, {pushes}, {share}
rng = np.random.default_rng(1)
t = Tracks()
before = rss_kb()
for first in range(0, ranks, batch):
    rank = np.repeat(np.arange(first, min(first + batch, ranks)), groups)
    gid = np.tile(np.arange(groups), len(rank) // groups)
    t.find(gid.astype(np.int32), rank.astype(np.int64))
registered = rss_kb()
# The rows as the scorer has them: looked up by (group, rank).
rows = t.find(
    np.tile(np.arange(groups), ranks).astype(np.int32), np.repeat(np.arange(ranks), groups)
)
zero = np.zeros(t.n_rows)


def noise() -> np.ndarray:
    return np.where(rng.random(t.n_rows) < share, rng.choice([-1.0, 1.0], t.n_rows), 0.0)


push_s, column_s = [], []
for _ in range(pushes):
    gap, started, err = noise(), noise(), np.zeros(t.n_rows, np.int64)
    t0 = time.perf_counter()
    t.push(rows, gap, zero, started, err)
    t1 = time.perf_counter()
    # The anchor: one float column read and written through the same rows.
    t.late_s[rows] = t.late_s[rows] + 0.0
    column_s.append(time.perf_counter() - t1)
    push_s.append(t1 - t0)
pushed = rss_kb()
not_rows = getattr(t, "_NOT_ROWS", ("keys", "rows"))
pool = getattr(t, "pool", None)
row_bytes = sum(
    v.itemsize * (v.size // len(v))
    for k, v in vars(t).items()
    if isinstance(v, np.ndarray) and k not in not_rows
) + t.keys.itemsize + t.rows.itemsize
print(json.dumps({{
    "rows": t.n_rows, "capacity": len(t.gid), "row_bytes": row_bytes,
    "pooled": getattr(t, "pool_used", 0), "pool_row_bytes": 0 if pool is None else pool.shape[1],
    "registered_kb": registered - before, "pushed_kb": pushed - before,
    "push_ms": statistics.median(push_s) * 1e3, "column_ms": statistics.median(column_s) * 1e3,
}}))
"""


def one_round(ranks: int, groups: int, batch: int, pushes: int, share: float) -> dict[str, int]:
    code = ROUND.format(
        repo=str(REPO), ranks=ranks, groups=groups, batch=batch, pushes=pushes, share=share
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=300
    )
    result: dict[str, int] = json.loads(out.stdout)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=4096)
    p.add_argument("--groups", type=int, default=5, help="groups a rank is in")
    p.add_argument("--batch", type=int, default=8, help="ranks whose rows are added at once")
    p.add_argument("--pushes", type=int, default=30, help="scored ticks")
    p.add_argument("--odd-share", type=float, default=0.02, help="pushes off level, each counter")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    runs = [
        one_round(args.ranks, args.groups, args.batch, args.pushes, args.odd_share)
        for _ in range(args.rounds)
    ]
    first = runs[0]
    anchor_kb = (
        first["rows"] * first["row_bytes"] + first["pooled"] * first["pool_row_bytes"]
    ) / 1024
    reg = statistics.median(r["registered_kb"] for r in runs)
    pushed = statistics.median(r["pushed_kb"] for r in runs)
    out = {
        "ranks": args.ranks,
        "groups": args.groups,
        "batch": args.batch,
        "rows": first["rows"],
        "capacity": first["capacity"],
        "row_bytes": first["row_bytes"],
        "pooled": first["pooled"],
        "anchor_kb_per_rank": round(anchor_kb / args.ranks, 3),
        "registered_kb_per_rank": round(reg / args.ranks, 3),
        "pushed_kb_per_rank": round(pushed / args.ranks, 3),
        "registered_ratio": round(reg / anchor_kb, 2),
        "pushed_ratio": round(pushed / anchor_kb, 2),
        "pushed_kb_per_rank_each": [round(r["pushed_kb"] / args.ranks, 3) for r in runs],
        "push_ms": round(statistics.median(r["push_ms"] for r in runs), 3),
        "push_x_column": round(statistics.median(r["push_ms"] / r["column_ms"] for r in runs), 1),
    }
    if args.json:
        print(json.dumps(out))
        return
    print(
        f"{args.ranks} ranks x {args.groups} groups, rows added {args.batch} ranks at a time: "
        f"{out['rows']} rows in room for {out['capacity']}, {out['row_bytes']} B a row, "
        f"{out['pooled']} rings in the pool"
    )
    print(f"  anchor (the rows' bytes)     {out['anchor_kb_per_rank']:.2f} KB a rank")
    print(
        f"  RSS, rows added              {out['registered_kb_per_rank']:.2f} KB a rank "
        f"({out['registered_ratio']:.2f}x)"
    )
    print(
        f"  RSS, after {args.pushes} pushes         {out['pushed_kb_per_rank']:.2f} KB a rank "
        f"({out['pushed_ratio']:.2f}x)  each round: {out['pushed_kb_per_rank_each']}"
    )
    print(
        f"  a push of every row          {out['push_ms']:.2f} ms "
        f"({out['push_x_column']:.1f}x one column read and written)"
    )


if __name__ == "__main__":
    main()
