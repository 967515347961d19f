"""Regenerate the golden hang-zoo dumps: `python -m tests.support.make_golden OUT_DIR`.

Each golden directory is one real 4-rank gloo job's self-snapshot (see
`hangwatch.testing.snapshot`), with machine paths stripped, plus a
`manifest.json` whose `expected` block is the scenario's ground truth. A
directory is written only after the dumps were checked against the plan
(`JobHandle.check_ground_truth`), so a golden file can never encode a fault
that did not happen the way the manifest says.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hangwatch.testing.launch import launch_job
from hangwatch.testing.scenarios import get_scenario

MANIFEST = "manifest.json"
MANIFEST_SCHEMA = "hangwatch.zoo-golden/1"
WORLD_SIZE = 4
SNAPSHOT_AFTER_S = 1.5
MAX_TOTAL_BYTES = 3 * 1024 * 1024


@dataclass(frozen=True, kw_only=True)
class GoldenSpec:
    dirname: str
    scenario: str
    format: str = "pickle"
    layout: str | None = None  # None: the scenario's own (Scenario.snapshot_layout)


GOLDENS = (
    GoldenSpec(dirname="skip", scenario="skip"),
    # torch's own dump-on-timeout shape: JSON files side by side, no stacks or meta.
    GoldenSpec(dirname="skip-json", scenario="skip", format="json", layout="plain"),
    GoldenSpec(dirname="compute", scenario="compute"),
    GoldenSpec(dirname="frozen", scenario="frozen"),
    GoldenSpec(dirname="two", scenario="two"),
    GoldenSpec(dirname="mismatch", scenario="mismatch"),
    GoldenSpec(dirname="subgroup", scenario="subgroup"),
    GoldenSpec(dirname="order", scenario="order"),
    GoldenSpec(dirname="wrap", scenario="wrap"),
    GoldenSpec(dirname="p2p", scenario="p2p"),
    GoldenSpec(dirname="healthy", scenario="healthy"),
    GoldenSpec(dirname="gil", scenario="gil"),
)


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def make_one(spec: GoldenSpec, out_dir: Path, *, command: str) -> Path:
    sc = get_scenario(spec.scenario)
    dest = out_dir / spec.dirname
    layout = spec.layout or sc.snapshot_layout
    with tempfile.TemporaryDirectory(prefix=f"hangwatch-golden-{spec.dirname}-") as tmp:
        with launch_job(
            sc,
            WORLD_SIZE,
            workdir=Path(tmp),
            snapshot_after=SNAPSHOT_AFTER_S,
            snapshot_format=spec.format,
            snapshot_layout=layout,
            portable_paths=True,
        ) as job:
            snap = job.wait_snapshots(timeout=120)
            job.check_ground_truth()
            if sc.name == "healthy":
                codes = job.wait(timeout=60)
                if codes != [0] * WORLD_SIZE:
                    raise RuntimeError(f"healthy job exited with {codes}")
            steps = job.steps_before_fault
            staged = Path(tmp) / "golden"
            shutil.copytree(snap, staged)
        manifest = {
            "schema": MANIFEST_SCHEMA,
            "scenario": sc.name,
            "description": sc.description,
            "world_size": WORLD_SIZE,
            "torch_version": importlib.metadata.version("torch"),
            "format": spec.format,
            "layout": layout,
            "steps_before_fault": steps,
            "injected_ranks": sc.guilty_ranks(WORLD_SIZE),
            "ranks_without_dump": sc.silent_ranks(WORLD_SIZE),
            "expected": sc.expected(WORLD_SIZE, steps),
            "generated_by": command,
        }
        (staged / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        if dest.exists():
            shutil.rmtree(dest)
        shutil.copytree(staged, dest)
    return dest


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.support.make_golden", description=__doc__)
    p.add_argument("out_dir", type=Path)
    p.add_argument(
        "--only",
        nargs="+",
        metavar="DIRNAME",
        choices=[g.dirname for g in GOLDENS],
        help="Regenerate only these golden directories.",
    )
    ns = p.parse_args(argv)
    specs = [g for g in GOLDENS if not ns.only or g.dirname in ns.only]
    ns.out_dir.mkdir(parents=True, exist_ok=True)
    # An absolute path would put this machine's layout into every manifest.
    shown = "OUT_DIR" if ns.out_dir.is_absolute() else ns.out_dir.as_posix()
    command = f"python -m tests.support.make_golden {shown}"
    for spec in specs:
        t0 = time.monotonic()
        dest = make_one(spec, ns.out_dir, command=command)
        print(
            f"{spec.dirname}: {_dir_bytes(dest)} bytes in {time.monotonic() - t0:.1f}s", flush=True
        )
    total = _dir_bytes(ns.out_dir)
    print(f"total: {total} bytes")
    if total > MAX_TOTAL_BYTES:
        print(f"golden set is over {MAX_TOTAL_BYTES} bytes", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
