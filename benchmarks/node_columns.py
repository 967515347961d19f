"""Tails decoded on the nodes against tails decoded by the analyzer: one bundle, both ways.

    python benchmarks/node_columns.py BUNDLE [--repeats 3]

BUNDLE: an incident bundle of node archives (`coordinator_load.py --keep
DIR` leaves one under DIR/incidents/). Two copies are made: one with every
archive's `fr_columns` member removed (the anchor: the analyzer decodes each
tail, as before the agents decoded them), one with it rebuilt by the agent's
decoder (`hangwatch.analyzer.packed.pack`), so it always matches this
checkout's decoder. Then `hangwatch analyze COPY --json` runs in a fresh
process on each, alternating, and the two reports must be the same bytes.

Prints the medians and their ratio, and what the member costs a node:
the decoder's time for one node's tails (in process; the agent's child adds
its start, see docs/benchmarks.md) and the compressed bytes it adds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hangwatch.analyzer import packed

from hangwatch import formats
from hangwatch.formats import nodearchive


def _rebuild(src: Path, dst: Path, *, columns: bool) -> tuple[list[float], int, int]:
    """`src` copied to `dst` with each archive's columns member dropped or
    rebuilt; (seconds to pack each node, archive bytes, member bytes deflated)."""
    shutil.copytree(src, dst)
    pack_s: list[float] = []
    total = added = 0
    for path in nodearchive.archives(dst):
        data = path.read_bytes()
        members = [
            (m.rank, m.name, nodearchive.read_bytes(data, m))
            for m in nodearchive.check(data, None)
            if m.name != formats.FR_COLUMNS_FILE
        ]
        if columns:
            t = time.perf_counter()
            cols = packed.pack([f for f in members if formats.is_tail_fr_name(f[1])])
            pack_s.append(time.perf_counter() - t)
            if cols:
                first = min(r for r, _, _ in members)
                without = len(nodearchive.build(members))
                members.append((first, formats.FR_COLUMNS_FILE, cols))
        out = nodearchive.build(members)
        if columns and cols:
            added += len(out) - without
        total += len(out)
        path.write_bytes(out)
    return pack_s, total, added


def _analyze(bundle: Path) -> tuple[float, bytes]:
    t = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "hangwatch", "analyze", str(bundle), "--json"],
        capture_output=True,
        check=False,
    )
    wall = time.perf_counter() - t
    if done.returncode != 0:
        raise SystemExit(f"analyze failed ({done.returncode}): {done.stderr.decode()[-2000:]}")
    return wall, done.stdout


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    if not nodearchive.archives(args.bundle):
        raise SystemExit(f"{args.bundle}: no node archives (nodes/node_<R>.zip)")
    with tempfile.TemporaryDirectory(prefix="hangwatch-cols-") as tmp:
        plain, cols = Path(tmp) / "tails", Path(tmp) / "columns"
        _, plain_bytes, _ = _rebuild(args.bundle, plain, columns=False)
        pack_s, cols_bytes, added = _rebuild(args.bundle, cols, columns=True)
        times: dict[str, list[float]] = {"tails": [], "columns": []}
        reports: dict[str, bytes] = {}
        for _ in range(args.repeats):
            for name, path in (("tails", plain), ("columns", cols)):
                wall, out = _analyze(path)
                times[name].append(wall)
                reports[name] = out
        same = reports["tails"] == reports["columns"]
        n_nodes = len(pack_s)
        out_doc = {
            "bundle": str(args.bundle),
            "nodes": n_nodes,
            "analyze_tails_s": [round(x, 2) for x in times["tails"]],
            "analyze_columns_s": [round(x, 2) for x in times["columns"]],
            "median_tails_s": round(statistics.median(times["tails"]), 2),
            "median_columns_s": round(statistics.median(times["columns"]), 2),
            "ratio": round(
                statistics.median(times["columns"]) / statistics.median(times["tails"]), 3
            ),
            "same_report": same,
            "pack_ms_per_node_median": round(statistics.median(pack_s) * 1000, 2)
            if pack_s
            else None,
            "bytes_without": plain_bytes,
            "bytes_with": cols_bytes,
            "member_bytes_per_node": round(added / max(n_nodes, 1)),
            "loadavg_1m": round(os.getloadavg()[0], 2),
        }
    if args.json:
        print(json.dumps(out_doc))
    else:
        print(
            f"{n_nodes} node archives, {args.repeats} alternating runs of `hangwatch analyze --json`"
        )
        print(
            f"  tails decoded here (anchor) median {out_doc['median_tails_s']:.2f} s  "
            f"{out_doc['analyze_tails_s']}"
        )
        print(
            f"  decoded on the nodes        median {out_doc['median_columns_s']:.2f} s  "
            f"{out_doc['analyze_columns_s']}  {out_doc['ratio']:.2f}x anchor"
        )
        print(f"  same report: {same}")
        print(
            f"  per node: pack {out_doc['pack_ms_per_node_median']} ms (median, in process), "
            f"+{out_doc['member_bytes_per_node']} bytes deflated "
            f"({cols_bytes / max(plain_bytes, 1) - 1:+.0%} of the archives)"
        )
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
