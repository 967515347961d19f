"""Stragglers, live and long: time to name a slow rank, and false names on a healthy job.

    python benchmarks/straggler_live.py [--cases 0.5:90,0.1:330,0:600] [--how spin|sleep]
                                        [--world 4] [--out F]

Each case is SLOWDOWN:SECONDS. A real coordinator (`hangwatch server`), one
agent polling at its default 1 Hz and `--world` real gloo ranks of
tests/live/straggler_job.py under `hangwatch run`; with SLOWDOWN > 0 rank 2
does that fraction of extra CPU compute per step (`--how spin`; on a small
machine that CPU is also taken from the other ranks) or of extra waiting
(`--how sleep`: adds to the step exactly); with 0 nobody is slow. The clock
starts when every rank has been scored once (training is running and read).
The case watches `/api/jobs/{job}/stragglers` every second for SECONDS and
reports when the slow rank was first named, and every other rank ever named
(a false name). The job is synchronous, so every rank's median step time is
the job's: what a slow rank costs shows as the job's step time against the
healthy case's (`job_cost`, with a `0:` case in the same run). Quote medians
over repeated runs: these machines are noisy.
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
from typing import Any

# Run as `python benchmarks/straggler_live.py`, sys.path[0] is benchmarks/;
# the repository root goes first so `tests.support` imports.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hangwatch.config import env_var
from tests.support.chaos import AgentProc, CoordinatorProc
from tests.support.lateness_api import wait_scored

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "live" / "straggler_job.py"
SLOW_RANK = 2


def run_case(
    slowdown: float, seconds: float, world: int, tmp: Path, how: str = "spin"
) -> dict[str, Any]:
    job = f"straggler-{slowdown:g}"
    run_dir, store = tmp / "run", tmp / "store"
    environ = {k: v for k, v in os.environ.items() if not k.startswith("HANGWATCH_")}
    environ[env_var("job_id")] = job
    slow = SLOW_RANK if slowdown > 0 else -1
    with CoordinatorProc(tmp / "data") as coord:
        agent = AgentProc(
            coordinator=coord.grpc, run_dir=run_dir, job_id=job, node_id="node",
            log_path=tmp / "agent.log", poll_interval=1.0,
        )  # fmt: skip
        agent.start()
        ranks = [_rank(environ, run_dir, store, r, world, seconds, slow, slowdown, how, tmp)
                 for r in range(world)]  # fmt: skip
        try:
            started = wait_scored(coord.api, job, world, timeout=120)
            named_at: float | None = None
            false: dict[int, float] = {}
            view: dict[str, Any] = {}
            while time.monotonic() - started < seconds:
                agent.check()
                view = coord.api(f"/api/jobs/{job}/stragglers")
                t = time.monotonic() - started
                for s in view["stragglers"]:
                    if s["rank"] == slow and named_at is None:
                        named_at = t
                    elif s["rank"] != slow:
                        false.setdefault(s["rank"], t)
                if slow >= 0 and named_at is not None:
                    break
                time.sleep(1.0)
        finally:
            Path(str(store) + ".stop").touch()
            outs = [p.communicate(timeout=120)[0] for p in ranks]
            agent.stop()
        bad = [r for r, p in enumerate(ranks) if p.returncode != 0]
        if bad:
            raise RuntimeError(
                f"ranks {bad} failed: {(tmp / f'rank{bad[0]}.log').read_text()[-2000:]}"
            )
    step_ms = [float(o.split()[1]) for o in outs]
    return {
        "slowdown": slowdown,
        "how": how,
        "watched_s": seconds,
        "named_s": None if named_at is None else round(named_at, 1),
        "false_names": {str(r): round(t, 1) for r, t in false.items()},
        "step_ms": step_ms,
        "job_step_ms": statistics.median(step_ms),
        "scores": {r["rank"]: round(r["score"], 3) for r in view.get("ranks", [])},
    }


def _rank(
    environ: dict[str, str], run_dir: Path, store: Path, rank: int, world: int,
    seconds: float, slow: int, slowdown: float, how: str, tmp: Path,
) -> subprocess.Popen[str]:  # fmt: skip
    argv = [sys.executable, "-m", "hangwatch", "run", "--run-dir", str(run_dir), "--",
            sys.executable, str(SCRIPT), str(store), str(rank), str(world),
            str(seconds + 300), str(slow), str(slowdown), how]  # fmt: skip
    with (tmp / f"rank{rank}.log").open("wb") as log:
        return subprocess.Popen(argv, env=environ, stdout=subprocess.PIPE, stderr=log, text=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="0.5:90,0.1:330,0:600", help="SLOWDOWN:SECONDS,...")
    ap.add_argument("--how", choices=("spin", "sleep"), default="spin")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    results = []
    for case in args.cases.split(","):
        slowdown, seconds = (float(x) for x in case.split(":"))
        with tempfile.TemporaryDirectory(prefix="hw-straggler-live-") as d:
            res = run_case(slowdown, seconds, args.world, Path(d), args.how)
        results.append(res)
        named = "nobody slow" if slowdown == 0 else f"named after {res['named_s']} s"
        print(
            f"slowdown {slowdown:>4g} (job step {res['job_step_ms']:.1f} ms): {named}; "
            f"false names {res['false_names'] or 'none'} in {seconds:g} s; scores {res['scores']}",
            flush=True,
        )
    healthy = [r["job_step_ms"] for r in results if r["slowdown"] == 0]
    for r in results:
        if healthy and r["slowdown"] > 0:
            r["job_cost"] = round(r["job_step_ms"] / healthy[0] - 1, 3)
            print(f"slowdown {r['slowdown']:g}: the job's steps {r['job_cost']:+.1%} vs healthy")
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
