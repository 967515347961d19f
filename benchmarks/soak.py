"""Soak: a healthy gloo job watched for minutes; does anything in hangwatch grow?

    python benchmarks/soak.py --minutes 10 [--interval 10] [--world 2] [--out soak.json]

Starts a real coordinator (`hangwatch server`), one agent polling at 1 Hz and
`--world` real gloo ranks of the hang zoo's `healthy` scenario (hook attached,
stepping until stopped). Every `--interval` seconds it records the resident
set size (VmRSS) of the coordinator, the agent and each rank. The report
gives, per process, the RSS after warm-up, at the end, the maximum, and the
least-squares slope over the samples after warm-up (the first 20% of the run,
at least one interval: imports and caches fill up then). A flat process has a
slope near zero; a leak shows as a steady MB/min.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# Run as `python benchmarks/soak.py`, sys.path[0] is benchmarks/; the
# repository root goes first so `tests.support` imports (test support
# shared with the tests, not shipped in the wheel).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hangwatch.config import env_var
from hangwatch.testing.launch import launch_job
from tests.support.chaos import AgentProc, CoordinatorProc, rss_bytes

JOB = "soak"
WARMUP_FRACTION = 0.2


def slope_per_min(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, MB) points, in MB per minute."""
    n = len(points)
    if n < 2:
        return 0.0
    mx = sum(t for t, _ in points) / n
    my = sum(v for _, v in points) / n
    den = sum((t - mx) ** 2 for t, _ in points)
    if den == 0:
        return 0.0
    return 60.0 * sum((t - mx) * (v - my) for t, v in points) / den


def summarize(samples: list[dict[str, Any]], interval: float) -> dict[str, dict[str, float]]:
    """Per process: MB after warm-up, at the end, max, slope (MB/min) after warm-up."""
    if not samples:
        return {}
    duration = samples[-1]["t"]
    warm = max(interval, WARMUP_FRACTION * duration)
    out: dict[str, dict[str, float]] = {}
    for name in samples[0]["rss_mb"]:
        series = [(s["t"], s["rss_mb"][name]) for s in samples if name in s["rss_mb"]]
        steady = [p for p in series if p[0] >= warm] or series[-1:]
        out[name] = {
            "after_warmup_mb": round(steady[0][1], 2),
            "end_mb": round(series[-1][1], 2),
            "max_mb": round(max(v for _, v in series), 2),
            "growth_after_warmup_mb": round(series[-1][1] - steady[0][1], 2),
            "slope_mb_per_min": round(slope_per_min(steady), 3),
        }
    return out


def run_soak(
    *, seconds: float, interval: float, world: int, workdir: Path, poll_interval: float = 1.0
) -> dict[str, Any]:
    """Run the soak; returns {"samples": [...], "summary": {...}, ...}."""
    coord = CoordinatorProc(workdir / "data", stall_timeout=10.0, agent_lost_timeout=10.0)
    run_dir = workdir / "run"
    agent = AgentProc(
        coordinator=coord.grpc,
        run_dir=run_dir,
        job_id=JOB,
        node_id="soak-node",
        log_path=workdir / "agent.log",
        poll_interval=poll_interval,
    )
    samples: list[dict[str, Any]] = []
    with coord:
        agent.start()
        try:
            with launch_job(
                "healthy",
                world,
                workdir=workdir / "job",
                attach=True,
                steps_before_fault=10**9,  # never reaches its end: stopped by us
                step_time=0.05,
                extra_env={env_var("run_dir"): str(run_dir), env_var("job_id"): JOB},
            ) as job:
                pids = {"coordinator": coord.pid, "agent": agent.pid}
                pids.update({f"rank{r}": p for r, p in enumerate(job.pids)})
                t0 = time.monotonic()
                while True:
                    t = time.monotonic() - t0
                    job.check_no_crash()
                    agent.check()
                    samples.append(
                        {
                            "t": round(t, 2),
                            "rss_mb": {n: rss_bytes(p) / 2**20 for n, p in pids.items()},
                        }
                    )
                    if t >= seconds:
                        break
                    time.sleep(min(interval, max(0.0, seconds - t)))
                incidents = coord.api(f"/api/incidents?job={JOB}")
                ranks = coord.api(f"/api/jobs/{JOB}/ranks")
        finally:
            agent.stop()
    return {
        "seconds": seconds,
        "interval_s": interval,
        "world": world,
        "poll_interval_s": poll_interval,
        "samples": samples,
        "summary": summarize(samples, interval),
        "false_alarms": len(incidents),
        "ranks_observed_at_end": sum(1 for r in ranks["ranks"] if r["observed"]),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--interval", type=float, default=10.0, help="Seconds between RSS samples.")
    p.add_argument("--world", type=int, default=2, help="Number of gloo ranks.")
    p.add_argument("--out", type=Path, default=None, help="Write the full result as JSON here.")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="hangwatch-soak-") as tmp:
        res = run_soak(
            seconds=a.minutes * 60, interval=a.interval, world=a.world, workdir=Path(tmp)
        )
    if a.out:
        a.out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"soak: {a.minutes:g} min, {a.world} ranks, agent poll {res['poll_interval_s']:g} s, "
          f"{len(res['samples'])} samples; false alarms: {res['false_alarms']}")  # fmt: skip
    print(f"{'process':<12} {'warm MB':>9} {'end MB':>9} {'max MB':>9} {'growth':>8} {'MB/min':>8}")
    for name, s in res["summary"].items():
        print(
            f"{name:<12} {s['after_warmup_mb']:>9.1f} {s['end_mb']:>9.1f} {s['max_mb']:>9.1f} "
            f"{s['growth_after_warmup_mb']:>8.2f} {s['slope_mb_per_min']:>8.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
