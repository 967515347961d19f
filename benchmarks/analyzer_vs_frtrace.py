"""Time hangwatch's analyzer against torch's own `fr_trace` on the same dumps.

One run: generate (or reuse) synthetic NCCL dumps of a hung TP x DP job with
one lagging rank, then time, each as a fresh subprocess so that interpreter
start-up and imports count the same for all three:

  pickle    plain `pickle.load` of every file, serially, result dropped: the
            floor any analyzer that reads the pickles pays
  hangwatch `python -m hangwatch analyze DIR --json`
  frtrace   `python -m torch.distributed.flight_recorder.fr_trace DIR -p PREFIX`

Peak RSS is the larger of the child's own `ru_maxrss` (from `wait4`) and the
peak of its whole process tree's summed RSS sampled from /proc every 50 ms,
so an analyzer that fans out to worker processes is charged for all of them.

It prints one JSON object (times, RSS, medians, ratios) and says whether both
analyzers name the generator's lagging rank. fr_trace does not name a culprit
for a hang; it prints, for every collective some member never joined, the
"missing ranks". Its suspect here is the rank it names missing most often, and
every other rank it names missing is reported as `frtrace_innocent_named`.

Usage:
    python benchmarks/analyzer_vs_frtrace.py --ranks 128 --repeat 3
    python benchmarks/analyzer_vs_frtrace.py --ranks 4096 --skip-frtrace --keep /data/d4096
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gen_nccl_dumps as gen

_PICKLE_FLOOR = r"""
import os, pickle, sys, time
d, prefix = sys.argv[1], sys.argv[2]
files = sorted(f for f in os.listdir(d) if f.startswith(prefix))
t = time.perf_counter()
n = 0
for f in files:
    with open(os.path.join(d, f), "rb") as fh:
        n += len(pickle.load(fh)["entries"])
print(f"{time.perf_counter() - t:.6f} {len(files)} {n}")
"""


@dataclass(kw_only=True)
class Timed:
    wall_s: float
    cpu_s: float  # user + sys of the child and every descendant it reaped
    peak_rss_mib: float
    returncode: int
    stdout: str
    stderr: str
    timed_out: bool = False


@dataclass(kw_only=True)
class Series:
    runs: list[dict[str, Any]] = field(default_factory=list)

    def median(self, key: str) -> float | None:
        """Median over the runs that succeeded; failed runs time nothing."""
        return _median([r[key] for r in self.runs if r.get(key) is not None and not r.get("error")])


def _tree_rss_kib(root: int) -> int:
    """Summed VmRSS of `root` and its descendants, from /proc (0 if gone)."""
    total, stack, seen = 0, [root], set()
    while stack:
        pid = stack.pop()
        if pid in seen:
            continue
        seen.add(pid)
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
                        break
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/children") as f:
                    stack.extend(int(c) for c in f.read().split())
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return total


def run_timed(cmd: Sequence[str], *, timeout_s: float, env: dict[str, str] | None = None) -> Timed:
    """Run `cmd`, return wall time, peak RSS and its output.

    `wait4` is used instead of `Popen.wait` to get this child's own rusage.
    Output goes to temp files, not pipes, so a chatty child never blocks.
    """
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(list(cmd), stdout=out, stderr=err, env=env)
        peak_tree = 0
        done = threading.Event()

        def sample() -> None:
            nonlocal peak_tree
            while not done.is_set():
                peak_tree = max(peak_tree, _tree_rss_kib(proc.pid))
                done.wait(0.05)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        timed_out = False
        killer = threading.Timer(timeout_s, proc.kill)
        killer.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            killer.cancel()
            done.set()
            sampler.join()
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode < 0 and wall >= timeout_s:
            timed_out = True
        out.seek(0)
        err.seek(0)
        # ru_maxrss is KiB on Linux.
        peak_kib = max(usage.ru_maxrss, peak_tree)
        return Timed(
            wall_s=round(wall, 3),
            cpu_s=round(usage.ru_utime + usage.ru_stime, 3),
            peak_rss_mib=round(peak_kib / 1024, 1),
            returncode=proc.returncode,
            stdout=out.read().decode(errors="replace"),
            stderr=err.read().decode(errors="replace"),
            timed_out=timed_out,
        )


_MISSING_RE = re.compile(r"^missing ranks: \{([\d, ]*)\}", re.M)
_CULPRIT_RE = re.compile(r"Culprit rank (\d+)")


def parse_frtrace(text: str) -> dict[str, Any]:
    """What fr_trace's log says. Its "missing ranks" lines are the only place
    it names ranks for a hang; "Culprit rank" appears for mismatches."""
    missing: Counter[int] = Counter()
    for m in _MISSING_RE.finditer(text):
        for r in m.group(1).split(","):
            if r.strip():
                missing[int(r)] += 1
    culprits = Counter(int(m.group(1)) for m in _CULPRIT_RE.finditer(text))
    top: list[int] = []
    if missing:
        best = max(missing.values())
        top = sorted(r for r, c in missing.items() if c == best)
    return {
        "missing_counts": {str(r): c for r, c in sorted(missing.items())},
        "culprit_counts": {str(r): c for r, c in sorted(culprits.items())},
        "top": top,
        "aborted": "Too many mismatches" in text,
    }


def _commit() -> str | None:
    """The checkout's commit, so a result names the analyzer it measured."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def _median(vals: list[float]) -> float | None:
    return round(statistics.median(vals), 3) if vals else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a and b else None


def _tail(s: str, n: int = 2000) -> str:
    return s if len(s) <= n else "..." + s[-n:]


@contextlib.contextmanager
def dump_dir(keep: str | None) -> Iterator[Path]:
    if keep:
        p = Path(keep)
        p.mkdir(parents=True, exist_ok=True)
        yield p
        return
    with tempfile.TemporaryDirectory(prefix="hangwatch-bench-") as d:
        yield Path(d)


def ensure_dumps(d: Path, job: gen.Job, log: Any) -> tuple[gen.Truth, float | None]:
    """Reuse dumps in `d` when they came from the same job; else generate."""
    try:
        truth = gen.read_truth(str(d))
        same = (
            truth.ranks,
            truth.entries,
            truth.tp,
            truth.seed,
            truth.lagging_rank,
            truth.format,
        ) == (
            job.ranks,
            job.entries,
            job.tp,
            job.seed,
            job.lagging,
            job.fmt,
        )
        files = [f for f in os.listdir(d) if f.startswith(truth.prefix)]
        if same and len(files) == job.ranks:
            log(f"reusing {job.ranks} dumps in {d}")
            return truth, None
    except (FileNotFoundError, TypeError, json.JSONDecodeError):
        pass
    for f in os.listdir(d):
        if f.startswith(job.prefix) or f == gen.TRUTH_FILE:
            os.unlink(d / f)
    log(f"generating {job.ranks} ranks x {job.entries} entries into {d}")
    t = time.perf_counter()
    truth = gen.generate(job, str(d))
    return truth, time.perf_counter() - t


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, required=True)
    p.add_argument("--entries", type=int, default=2000)
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lagging", type=int, default=None)
    p.add_argument("--keep", default=None, help="write (or reuse) the dumps here and keep them")
    p.add_argument("--skip-frtrace", action="store_true")
    p.add_argument("--repeat", type=int, default=1, help="runs of pickle and hangwatch (medians)")
    p.add_argument("--frtrace-repeat", type=int, default=1)
    p.add_argument("--frtrace-timeout", type=float, default=1800.0)
    p.add_argument("--timeout", type=float, default=600.0, help="per hangwatch/pickle run")
    ns = p.parse_args(argv)

    def log(msg: str) -> None:
        print(f"[bench] {msg}", file=sys.stderr, flush=True)

    job = gen.make_job(
        ranks=ns.ranks, entries=ns.entries, tp=ns.tp, lagging=ns.lagging, seed=ns.seed
    )
    py = sys.executable
    result: dict[str, Any] = {
        "ranks": ns.ranks,
        "entries": ns.entries,
        "tp": ns.tp,
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "commit": _commit(),
    }
    failed = False
    with dump_dir(ns.keep) as d:
        truth, gen_s = ensure_dumps(d, job, log)
        files = [d / f for f in os.listdir(d) if f.startswith(truth.prefix)]
        result["lagging_truth"] = truth.lagging_rank
        result["generate_s"] = round(gen_s, 2) if gen_s is not None else None
        result["dump_mib"] = round(sum(f.stat().st_size for f in files) / 2**20, 1)

        pick, hw, fr = Series(), Series(), Series()
        lagging_seen: list[list[int]] = []
        for i in range(ns.repeat):
            # pickle first: it also warms the page cache for the others.
            t = run_timed([py, "-c", _PICKLE_FLOOR, str(d), truth.prefix], timeout_s=ns.timeout)
            if t.returncode != 0:
                log(f"pickle floor failed:\n{_tail(t.stderr)}")
                return 1
            inner, nfiles, nentries = t.stdout.split()
            pick.runs.append(
                {
                    "wall_s": t.wall_s,
                    "cpu_s": t.cpu_s,
                    "load_s": float(inner),
                    "peak_rss_mib": t.peak_rss_mib,
                }
            )
            log(
                f"pickle run {i + 1}: load {float(inner):.2f}s wall {t.wall_s:.2f}s ({nfiles} files, {nentries} entries)"
            )

            t = run_timed(
                [py, "-m", "hangwatch", "analyze", str(d), "--json"], timeout_s=ns.timeout
            )
            run: dict[str, Any] = {
                "wall_s": t.wall_s,
                "cpu_s": t.cpu_s,
                "peak_rss_mib": t.peak_rss_mib,
                "rc": t.returncode,
            }
            try:
                rep = json.loads(t.stdout)
                run["lagging_ranks"] = sorted(rep.get("lagging_ranks") or [])
                run["verdict"] = rep.get("verdict")
                lagging_seen.append(run["lagging_ranks"])
            except json.JSONDecodeError:
                run["error"] = f"rc={t.returncode}, no JSON on stdout; stderr: {_tail(t.stderr)}"
                failed = True
                log(f"hangwatch run {i + 1} failed: {run['error']}")
            hw.runs.append(run)
            log(
                f"hangwatch run {i + 1}: {t.wall_s:.2f}s {t.peak_rss_mib:.0f} MiB -> {run.get('lagging_ranks')}"
            )

        if not ns.skip_frtrace:
            for i in range(ns.frtrace_repeat):
                cmd = [
                    py,
                    "-m",
                    "torch.distributed.flight_recorder.fr_trace",
                    str(d),
                    "-p",
                    truth.prefix,
                ]
                t = run_timed(cmd, timeout_s=ns.frtrace_timeout)
                # fr_trace logs its analysis to stderr.
                parsed = parse_frtrace(t.stdout + t.stderr)
                run = {
                    "wall_s": t.wall_s,
                    "cpu_s": t.cpu_s,
                    "peak_rss_mib": t.peak_rss_mib,
                    "rc": t.returncode,
                    "timed_out": t.timed_out,
                    **parsed,
                }
                if t.returncode != 0 and not t.timed_out:
                    run["error"] = _tail(t.stderr)
                fr.runs.append(run)
                log(
                    f"fr_trace run {i + 1}: {t.wall_s:.1f}s {t.peak_rss_mib:.0f} MiB top={parsed['top']}"
                    + (" (TIMED OUT)" if t.timed_out else "")
                )

    result["pickle"] = {
        "load_s_median": pick.median("load_s"),
        "wall_s_median": pick.median("wall_s"),
        "cpu_s_median": pick.median("cpu_s"),
        "peak_rss_mib_median": pick.median("peak_rss_mib"),
        "runs": pick.runs,
    }
    result["hangwatch"] = {
        "wall_s_median": hw.median("wall_s"),
        "cpu_s_median": hw.median("cpu_s"),
        "peak_rss_mib_median": hw.median("peak_rss_mib"),
        "runs": hw.runs,
    }
    hw_lag = (
        lagging_seen[0]
        if lagging_seen and all(x == lagging_seen[0] for x in lagging_seen)
        else None
    )
    result["hangwatch_lagging"] = hw_lag
    hw_ok = hw_lag == [truth.lagging_rank]
    # Wall ratios are the headline; CPU ratios survive a busy machine better
    # (and charge hangwatch for every worker process it uses).
    result["hangwatch_over_pickle"] = _ratio(hw.median("wall_s"), pick.median("wall_s"))
    result["hangwatch_over_pickle_cpu"] = _ratio(hw.median("cpu_s"), pick.median("cpu_s"))
    disagreements: list[str] = []
    if failed:
        disagreements.append("hangwatch failed (see hangwatch.runs[].error)")
    elif not hw_ok:
        disagreements.append(
            f"hangwatch named {lagging_seen} but the lagging rank is {truth.lagging_rank}"
        )
    if fr.runs:
        last = fr.runs[-1]
        fr_ok = last["top"] == [truth.lagging_rank] and not last["timed_out"]
        ok_runs = [r for r in fr.runs if not r["timed_out"] and r["rc"] == 0]
        fr_wall = _median([r["wall_s"] for r in ok_runs])
        fr_cpu = _median([r["cpu_s"] for r in ok_runs])
        result["frtrace"] = {
            "wall_s_median": fr_wall,
            "cpu_s_median": fr_cpu,
            "peak_rss_mib_median": _median([r["peak_rss_mib"] for r in ok_runs]),
            "runs": fr.runs,
        }
        result["frtrace_top"] = last["top"]
        result["frtrace_innocent_named"] = sorted(
            int(r) for r in last["missing_counts"] if int(r) != truth.lagging_rank
        )
        hw_wall = hw.median("wall_s")
        if fr_wall is None and last["timed_out"] and hw_wall:
            result["frtrace_over_hangwatch"] = (
                f">{ns.frtrace_timeout / hw_wall:.1f} (fr_trace timed out)"
            )
        else:
            result["frtrace_over_hangwatch"] = _ratio(fr_wall, hw_wall)
        result["frtrace_over_hangwatch_cpu"] = _ratio(fr_cpu, hw.median("cpu_s"))
        if not fr_ok:
            disagreements.append(
                f"fr_trace's most-named missing rank is {last['top']}, "
                f"the lagging rank is {truth.lagging_rank}"
                + (" (fr_trace timed out)" if last["timed_out"] else "")
            )
        result["agree"] = hw_ok and fr_ok and hw_lag == last["top"]
    else:
        result["frtrace"] = "skipped"
        result["agree"] = None
    result["hangwatch_correct"] = hw_ok
    if disagreements:
        result["disagreement"] = "; ".join(disagreements)
        log("DISAGREEMENT: " + result["disagreement"])
    print(json.dumps(result, indent=1))
    return 1 if failed or not hw_ok else 0


if __name__ == "__main__":
    sys.exit(main())
