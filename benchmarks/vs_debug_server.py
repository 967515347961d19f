"""hangwatch against torch's own cross-rank dump, on NCCL2's contract (torch >= 2.15).

    python benchmarks/vs_debug_server.py [--runs 3] [--world 3] [--timeout 3]
                                         [--dump-interval 60] [--out F]

The same job both ways: `--world` ranks on the compiled `hwhooks` backend
(completion and abort hooks, as ProcessGroupNCCL2), torch's collective
timeout `--timeout` seconds; rank 1 never enters all_reduce #10 (the hang
zoo's `skip`), so ranks 0 and 2.. time out and torch's abort hooks fire,
while rank 1's own collectives never time out.

* torch: `torch.distributed.debug.start_debug_server(dump_dir=...,
  dump_interval=--dump-interval)` on every rank (60 s is torch's default).
  Its rank-0 frontend polls `c10d_health_check` each interval and, when a
  backend reports unhealthy, asks every rank for `fr_dump_file`. Each rank
  writes `<TORCH_FR_DUMP_TEMP_FILE><rank>` (the timed-out ranks already did,
  from the abort hook). The ranks here catch the timeout and stay alive, or
  the frontend (a child of rank 0) would die with rank 0 as NCCL's default
  error handling ends it: the most favourable case for torch.
* hangwatch: `hangwatch demo --backend hwhooks --collective-timeout T
  --stall-timeout 300` (coordinator, agent, the hook; its own stall rule far
  away, so torch's abort is what starts it).

Needs `aiohttp`, `jinja2` and `tabulate` for torch's debug server (not
hangwatch dependencies). Reported per run, from torch's first abort (the earliest dump-file write, or
the hook's backend-abort event): when every rank's dump exists (torch) or
the incident opened and was analysed (hangwatch), and what each names: torch's
`fr_trace` and `hangwatch analyze` on torch's dumps, hangwatch's verdict on its
bundle. The anchor is torch's time to every rank's dump in the same run;
ratios are hangwatch's over it. Quote medians.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hangwatch.config import env_var
from tests.support.hookevents import first_abort_unix

_TORCH_JOB = """
import os, sys, time
from datetime import timedelta
import torch, torch.distributed as dist
from torch.distributed.debug import start_debug_server
from hangwatch.testing import backends

timeout, dump_dir, interval, port = float(sys.argv[1]), sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
dist.init_process_group(backends.register("hwhooks"), timeout=timedelta(seconds=timeout))
rank = dist.get_rank()
start_debug_server(port=port, dump_dir=dump_dir, dump_interval=interval)
for step in range(3):
    for _ in range(3):
        dist.all_reduce(torch.ones(16))
if rank == 1:
    time.sleep(3600)  # never enters all_reduce #10
try:
    dist.all_reduce(torch.ones(16))
except dist.DistBackendError:
    pass
time.sleep(3600)  # stay up: the debug server lives in the ranks
"""


def _free_port() -> int:
    from hangwatch.testing.ports import free_port

    return free_port()


def torch_run(world: int, timeout: float, interval: float, limit: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="hw-vs-debug-") as d:
        work = Path(d)
        dumps = work / "dumps"
        dumps.mkdir()
        script = work / "job.py"
        script.write_text(_TORCH_JOB)
        e = dict(os.environ)
        e.update(TORCH_FR_DUMP_TEMP_FILE=str(dumps / "fr_dump_"), TORCH_FR_BUFFER_SIZE="200")
        proc = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
             str(world), str(script), str(timeout), str(work / "periodic"), str(interval),
             str(_free_port())],
            env=e, stdout=subprocess.DEVNULL, stderr=(work / "job.log").open("wb"),
            start_new_session=True,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + limit
            want = [dumps / f"fr_dump_{r}" for r in range(world)]
            # First sight of each file, polled: the frontend rewrites every
            # rank's file at each interval once unhealthy, so write times move.
            seen: dict[Path, float] = {}
            while time.monotonic() < deadline and len(seen) < world and proc.poll() is None:
                for f in want:
                    if f not in seen and f.exists() and f.stat().st_size > 0:
                        seen[f] = time.time()
                time.sleep(0.05)
            if proc.poll() is not None:
                raise SystemExit(f"torch job exited: {(work / 'job.log').read_text()[-2000:]}")
            out: dict[str, Any] = {
                "ranks_dumped": sorted(int(f.name.rsplit("_", 1)[1]) for f in seen),
                "every_dump_s": (max(seen.values()) - min(seen.values()))
                if len(seen) == world
                else None,
            }
            time.sleep(1.0)  # the last file's write settles
            out["frtrace"] = _frtrace(dumps)
            out["hangwatch_on_torch_dumps"] = _analyze(dumps)
            return out
        finally:
            os.killpg(proc.pid, 9)
            proc.wait()


def _frtrace(dumps: Path) -> str:
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(dumps),
         "--prefix", "fr_dump_"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    text = (r.stdout + r.stderr).strip().splitlines()
    keep = [
        t for t in text if "rank" in t.lower() or "missing" in t.lower() or "error" in t.lower()
    ]
    return f"exit {r.returncode}: " + " | ".join((keep or text)[-6:])[:600]


def _analyze(dumps: Path) -> dict[str, Any]:
    from hangwatch.analyzer import analyze_path

    rep = analyze_path(dumps)
    return {"verdict": rep.verdict, "lagging_ranks": rep.lagging_ranks, "summary": rep.summary}


def hangwatch_run(world: int, timeout: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="hw-vs-debug-") as d:
        run_dir = Path(d) / "run"
        environ = {k: v for k, v in os.environ.items() if not k.startswith("HANGWATCH_")}
        environ[env_var("run_dir")] = str(run_dir)
        r = subprocess.run(
            [sys.executable, "-m", "hangwatch", "demo", "--scenario", "skip", "--ranks",
             str(world), "--backend", "hwhooks", "--collective-timeout", str(timeout),
             "--stall-timeout", "300", "--json", "--timeout", "120"],
            capture_output=True, text=True, timeout=240, env=environ,
        )  # fmt: skip
        if r.returncode != 0:
            raise SystemExit(f"demo failed ({r.returncode}): {r.stderr[-2000:]}")
        out = json.loads(r.stdout)
        first = first_abort_unix(run_dir)
        return {
            "incident_s": out["incident_created_unix"] - first,
            "analysed_s": out["incident_analysed_unix"] - first,
            "ranks_dumped": out["ranks_dumped"],
            "verdict": out["verdict"],
            "lagging_ranks": out["lagging_ranks"],
            "summary": out["summary"],
        }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--world", type=int, default=3)
    p.add_argument("--timeout", type=float, default=3.0, help="torch's collective timeout (s)")
    p.add_argument("--dump-interval", type=float, default=60.0, help="torch's (default 60 s)")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args()
    from hangwatch.testing import backends

    why = backends.unsupported_reason(backends.HWHOOKS)
    if why is not None:
        raise SystemExit(f"hwhooks cannot run here: {why}")
    backends.register(backends.HWHOOKS)  # built once, outside the timings
    runs = []
    for i in range(a.runs):
        t = torch_run(a.world, a.timeout, a.dump_interval, limit=a.dump_interval * 2 + 60)
        h = hangwatch_run(a.world, a.timeout)
        ratio = h["analysed_s"] / t["every_dump_s"] if t["every_dump_s"] else None
        runs.append({"torch": t, "hangwatch": h, "analysed_over_torch": ratio})
        print(json.dumps({"run": i, **runs[-1]}), flush=True)

    def med(xs: list[float | None]) -> float | None:
        ys = [x for x in xs if x is not None]
        return statistics.median(ys) if ys else None

    summary = {
        "world": a.world,
        "collective_timeout_s": a.timeout,
        "dump_interval_s": a.dump_interval,
        "runs": a.runs,
        "torch_every_dump_s_median": med([r["torch"]["every_dump_s"] for r in runs]),
        "hangwatch_incident_s_median": med([r["hangwatch"]["incident_s"] for r in runs]),
        "hangwatch_analysed_s_median": med([r["hangwatch"]["analysed_s"] for r in runs]),
        "analysed_over_torch_median": med([r["analysed_over_torch"] for r in runs]),
    }
    print(json.dumps(summary, indent=2))
    if a.out:
        a.out.write_text(json.dumps({"summary": summary, "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
