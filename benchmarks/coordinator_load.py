"""One coordinator, N simulated ranks, the real protocol: how fast is an incident?

    python benchmarks/coordinator_load.py --ranks 4096 --json

Starts `hangwatch server` as its own process (temp data dir, ports 0), then:

1. a fleet of simulated node agents (8 ranks each, `tests.support.simagents`)
   registers and reports progress at 1 Hz; the coordinator's CPU is sampled
   while the job is healthy;
2. one rank stops before a TP collective; the run waits for the incident to be
   stored and reads it from the HTTP API: detection, fan-out and collection
   (first DUMP command -> last CompleteDump acknowledged, timed by the agents),
   the analyzer's own time (from the coordinator's log line), the verdict, and
   whether every rank is accounted for;
3. a separate process pushes progress reports as fast as the coordinator acks
   them (a second job of the same shape) to measure ingest capacity, with
   the stalled job still connected.

Coordinator CPU comes from /proc/<pid>/stat (utime+stime) and its RSS from
/proc/<pid>/status, both sampled every 0.2 s: the healthy job's RSS is the
median over its measuring window, `--settle-s` after registration; peak RSS
is VmHWM. Prints one JSON object
(`--json`) or a short table. Exits 1 if the verdict is wrong or a rank is not
accounted for.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

# Run as `python benchmarks/coordinator_load.py`, sys.path[0] is benchmarks/; the
# repository root goes first so `tests.support` imports (test support
# shared with the tests, not shipped in the wheel).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support.simagents import (
    CoordinatorProcess,
    Fleet,
    IngestProbe,
    IngestSpec,
    proc_cpu_s,
    proc_status_kb,
)


def _py_spy(py_spy: str, pid: int, out: str) -> subprocess.Popen[bytes]:
    """A py-spy recording of `pid` (raw collapsed stacks, 50 Hz) until SIGINT."""
    cmd = [py_spy, "record", "--pid", str(pid), "--rate", "50", "--format", "raw"]
    return subprocess.Popen(
        [*cmd, "--output", out, "--nonblocking"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _quantile(xs: list[float], q: float) -> float | None:
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None


def _sys_s(pid: int) -> float:
    """Kernel CPU seconds of a process (stime): syscalls, filesystem, syncs."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[12]) / os.sysconf("SC_CLK_TCK")


ANALYSED_RE = re.compile(r"incident (\S+) analysed in ([0-9.]+)s")


class CpuSampler:
    """(wall time, process CPU seconds, RSS) every `period` s, so any window's
    CPU and memory can be read."""

    def __init__(self, pid: int, period: float = 0.2) -> None:
        self.pid = pid
        # (wall, cpu, of which kernel, RSS in kB)
        self.samples: list[tuple[float, float, float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(period,), daemon=True)
        self._thread.start()

    def _run(self, period: float) -> None:
        while not self._stop.is_set():
            try:
                sample = (
                    time.time(),
                    proc_cpu_s(self.pid),
                    _sys_s(self.pid),
                    proc_status_kb(self.pid, "VmRSS"),
                )
            except (OSError, KeyError):  # gone, or a zombie without VmRSS
                return
            self.samples.append(sample)
            self._stop.wait(period)

    def window(self, t0: float, t1: float) -> dict[str, float]:
        """CPU seconds and mean cores used between two wall times."""
        inside = [s for s in self.samples if t0 <= s[0] <= t1]
        if len(inside) < 2:
            return {"cpu_s": 0.0, "sys_s": 0.0, "cores": 0.0, "wall_s": t1 - t0}
        (a_t, a_c, a_s, _), (b_t, b_c, b_s, _) = inside[0], inside[-1]
        return {
            "cpu_s": round(b_c - a_c, 2),
            "sys_s": round(b_s - a_s, 2),
            "cores": round((b_c - a_c) / (b_t - a_t), 3),
            "wall_s": round(b_t - a_t, 2),
        }

    def rss_mb(self, t0: float, t1: float) -> tuple[float, float]:
        """Median and largest RSS between two wall times, MB. One reading
        is not the job's memory: at 4,096 ranks the healthy coordinator's RSS
        moves by 3-7 MB from one second to the next (the straggler tick's
        arrays, gRPC's buffers), and it was still growing 6 s after
        registration, where a single reading used to be taken."""
        rss = [s[3] for s in self.samples if t0 <= s[0] <= t1]
        if not rss:
            return (float("nan"), float("nan"))
        return (round(statistics.median(rss) / 1024, 1), round(max(rss) / 1024, 1))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2)


class RelayProcesses:
    """`--relays N`: that many `hangwatch relay` processes at the fleet's nice
    (they stand for relays on other machines), each forwarding to `target`."""

    def __init__(self, n: int, target: str, window_s: float, nice: int, log_dir: Path) -> None:
        self.procs: list[subprocess.Popen[str]] = []
        self.addresses: list[str] = []
        self.logs = [log_dir / f"relay-{i}.log" for i in range(n)]
        cmd = [sys.executable, "-m", "hangwatch", "relay", "--grpc-port", "0", "--http-port", "0"]
        cmd += ["--coordinator", target, "--relay-window", str(window_s)]
        env = {k: v for k, v in os.environ.items() if not k.startswith("HANGWATCH_")}
        for log in self.logs:
            with log.open("wb") as err:
                p = subprocess.Popen(
                    ["nice", "-n", str(nice), *cmd], stdout=subprocess.PIPE, stderr=err,
                    env=env, text=True,
                )  # fmt: skip
            self.procs.append(p)
            assert p.stdout is not None
            line = p.stdout.readline()
            if not line.startswith("hangwatch relay: grpc="):
                raise RuntimeError(f"a relay did not start: {line!r} {log.read_text()}")
            self.addresses.append(line.split()[2].removeprefix("grpc="))
        end = time.monotonic() + 30
        up = ("forwarding progress to", "carrying agents' commands from")
        while not all(u in log.read_text() for log in self.logs for u in up):
            if time.monotonic() > end:
                raise RuntimeError("a relay did not reach the coordinator in 30 s")
            time.sleep(0.1)
        self.samplers = [CpuSampler(p.pid) for p in self.procs]

    def cores(self, t0: float, t1: float) -> float:
        return round(sum(s.window(t0, t1)["cores"] for s in self.samplers), 3)

    def stop(self) -> None:
        for s in self.samplers:
            s.stop()
        for p in self.procs:
            p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(15)
            if p.stdout is not None:
                p.stdout.close()


def run(args: argparse.Namespace) -> dict[str, Any]:
    keep = Path(args.keep) if args.keep else None
    tmp = None if keep else tempfile.TemporaryDirectory(prefix="hangwatch-load-")
    data_dir = keep or Path(tmp.name)  # type: ignore[union-attr]
    data_dir.mkdir(parents=True, exist_ok=True)
    job = f"load-{args.ranks}"
    lagging = args.lagging if args.lagging is not None else (args.ranks * 5) // 7 + 3
    out: dict[str, Any] = {
        "ranks": args.ranks,
        "agents": args.ranks // 8,
        "job": job,
        "fleet_nice": args.fleet_nice,
        "fleet_transport": args.fleet_transport,
        "fleet_form": args.fleet_form,
        "compress": not args.no_compress,
        "report_interval_s": args.report_interval,
        "relays": args.relays,
        "relay_window_s": args.relay_window if args.relays else None,
        "calls_via_relay": bool(args.relays) and not args.direct_calls,
        "coordinator_env": args.coordinator_env,
    }
    coord = CoordinatorProcess(
        data_dir,
        stall_timeout=args.stall_timeout,
        dump_deadline=args.dump_deadline,
        agent_lost_timeout=args.agent_lost_timeout,
        extra_args=["--full-dump-max-ranks", str(args.full_dump_max_ranks)],
        extra_env=dict(kv.split("=", 1) for kv in args.coordinator_env),
    )
    pid = coord.pid
    sampler = CpuSampler(pid)
    relays = (
        RelayProcesses(args.relays, coord.grpc, args.relay_window, args.fleet_nice, data_dir)
        if args.relays
        else None
    )
    fleet = Fleet(
        target=coord.grpc,
        job_id=job,
        ranks=args.ranks,
        procs=args.procs,
        entries=args.entries,
        prehash_full=args.ranks <= args.full_dump_max_ranks,
        compress=not args.no_compress,
        nice=args.fleet_nice,
        transport=args.fleet_transport,
        form=args.fleet_form,
        report_interval_s=args.report_interval,
        progress_relays=tuple(relays.addresses) if relays else (),
        calls_via_relay=not args.direct_calls,
    )
    profiler: subprocess.Popen[bytes] | None = None
    try:
        # The coordinator with no job yet (imports, threads, pools): what the
        # per-rank figures below are counted from.
        out["coordinator_rss_idle_mb"] = round(proc_status_kb(pid, "VmRSS") / 1024, 1)
        t0 = time.time()
        fleet.start()
        # 4,096 simulated nodes took 145 s to start and register on 2 cores.
        fleet.wait_ready(timeout=max(120.0, 0.015 * args.ranks))
        fleet_samplers = [CpuSampler(p) for p in fleet.pids]
        out["register_s"] = round(time.time() - t0, 2)
        out["coordinator_rss_registered_mb"] = round(proc_status_kb(pid, "VmRSS") / 1024, 1)
        out["coordinator_kb_per_rank_registered"] = _kb_per_rank(out, "registered", args.ranks)
        time.sleep(args.settle_s)
        t_h = time.time()
        healthy_prof = (
            _py_spy(args.py_spy, pid, args.profile_healthy) if args.profile_healthy else None
        )
        time.sleep(args.healthy_s)
        if healthy_prof is not None:
            healthy_prof.send_signal(signal.SIGINT)
            healthy_prof.wait(60)
        healthy = sampler.window(t_h, time.time())
        out["healthy_cpu_cores"] = round(healthy["cores"], 3)
        if relays is not None:
            # Where the relays' work went: other machines' CPU, reported beside.
            out["healthy_relay_cores"] = relays.cores(t_h, time.time())
        # Per rank report at the healthy rate: what 1 Hz costs scales with it.
        out["healthy_cpu_us_per_rank_report"] = round(
            healthy["cores"] * args.report_interval / args.ranks * 1e6, 1
        )
        rss_median, rss_max = sampler.rss_mb(t_h, time.time())
        out["coordinator_rss_healthy_mb"] = rss_median
        out["coordinator_rss_healthy_max_mb"] = rss_max
        out["coordinator_kb_per_rank_healthy"] = _kb_per_rank(out, "healthy", args.ranks)
        # How the RSS settles after registration: one reading every 5 s.
        t_reg = t0 + out["register_s"]
        out["coordinator_rss_mb_every_5s"] = [
            sampler.rss_mb(t_reg + k, t_reg + k + 0.5)[0]
            for k in range(0, int(time.time() - t_reg), 5)
        ]

        if args.profile:
            profiler = _py_spy(args.py_spy, pid, args.profile)
        hang = fleet.stall(lagging)
        t_stall = fleet.stall_time()
        budget = args.stall_timeout + args.dump_deadline + args.analyze_budget_s
        inc = coord.wait_incident(job, budget)
        t_stored = time.time()
        if profiler is not None:
            profiler.send_signal(signal.SIGINT)
            profiler.wait(60)
        time.sleep(0.5)  # let the agents' last CompleteDump bookkeeping land
        st = fleet.stats()

        analyze_s = None
        for m in ANALYSED_RE.finditer(coord.log()):
            if m.group(1) == inc["id"]:
                analyze_s = float(m.group(2))
        created, updated = float(inc["created"]), float(inc["updated"])
        report = inc.get("report") or {}
        sc = report.get("stalled_collective") or {}
        expected_group = fleet.topo.group_name("tp", hang.lagging)
        out |= {
            "lagging_expected": hang.lagging,
            "lagging_ranks": inc.get("lagging_ranks"),
            "verdict": inc.get("verdict"),
            "status": inc.get("status"),
            "error": inc.get("error"),
            "stalled_group": sc.get("group"),
            "stalled_seq": sc.get("seq"),
            "expected_group": expected_group,
            "expected_seq": hang.seq,
            "incidents": inc["incidents_for_job"],
            "ranks_dumped": len(inc.get("ranks_dumped") or []),
            "ranks_unreachable": len(inc.get("ranks_unreachable") or {}),
            "ranks_accounted": len(inc.get("ranks_dumped") or [])
            + len(inc.get("ranks_unreachable") or {}),
            "stall_to_detect_s": round(created - t_stall, 3),
            "incident_s": round(updated - created, 3),
            "first_command_s": _delta(st["first_command_at"], created),
            # Half and nine tenths of the agents had their DUMP this long after it opened.
            "command_p50_s": _delta(_quantile(st["command_ats"], 0.5), created),
            "command_p90_s": _delta(_quantile(st["command_ats"], 0.9), created),
            "fanout_s": _delta(st["last_command_at"], created),
            "fanout_collect_s": _delta(st["last_done_at"], created),
            "analyze_s": analyze_s,
            "incident_minus_analyze_s": round(updated - created - analyze_s, 3)
            if analyze_s is not None
            else None,
            "detection_s": inc.get("detection_s"),
            "api_seen_after_store_s": round(t_stored - updated, 3),
            "bytes_uploaded": st["bytes_uploaded"],
            "files_uploaded": st["files_uploaded"],
            "two_phase": st["tail_dumps"] > 0,
            "full_uploads": st["full_uploads"],
            "incident_cpu": sampler.window(created, updated),
            "fanout_cpu": sampler.window(created, st["last_done_at"] or updated),
            "fanout_fleet_cores": round(
                sum(
                    f.window(created, st["last_done_at"] or updated)["cores"]
                    for f in fleet_samplers
                ),
                3,
            ),
            # The relays' share of the fan-out: with --relays the agents'
            # uploads pass through them (on this machine's cores, at the fleet's nice).
            "fanout_relay_cores": relays.cores(created, st["last_done_at"] or updated)
            if relays is not None
            else None,
            "fleet": {
                k: st[k]
                for k in (
                    "register_retries",
                    "reports_sent",
                    "rank_reports_sent",
                    "reports_failed",
                    "reports_unknown",
                    "entry_batches",
                    "dump_commands",
                    "dumps_done",
                    "dumps_rejected",
                    "errors",
                )
            },
        }
        out["correct"] = bool(
            inc.get("lagging_ranks") == [hang.lagging]
            and sc.get("group") == expected_group
            and sc.get("seq") == hang.seq
            and out["ranks_accounted"] == args.ranks
            and out["incidents"] == 1
        )

        # The first variant is the anchor: the others print a ratio to it.
        for variant in args.ingest_variants.split(",") if args.ingest_s > 0 else ():
            transport, _, form = variant.partition("/")
            before = fleet.stats()["rank_reports_sent"]
            probe = IngestProbe(
                IngestSpec(
                    target=coord.grpc,
                    job_id=f"ingest-{args.ranks}-{transport}-{form or 'columns'}",
                    ranks=args.ranks,
                    seconds=args.ingest_s,
                    in_flight=args.ingest_in_flight,
                    transport=transport,
                    form=form or "columns",
                )
            )
            res = probe.wait(timeout=120 + args.ingest_s)
            cpu = sampler.window(res["flood_start"], res["flood_end"])
            # The stalled job's agents keep their heartbeat meanwhile: their
            # reports (probe registration included, so an upper bound) share the CPU.
            background = fleet.stats()["rank_reports_sent"] - before
            per = cpu["cpu_s"] / max(1, res["rank_reports"]) * 1e6
            ingest = out.setdefault("ingest", {})
            anchor = next(iter(ingest.values()), None)
            ingest[variant] = {
                **{k: (round(v, 3) if isinstance(v, float) else v) for k, v in res.items()},
                "coordinator_cores": round(cpu["cores"], 3),
                "background_rank_reports": background,
                "coordinator_cpu_us_per_rank_report": round(per, 1),
                "cpu_ratio_to_anchor": round(
                    per / anchor["coordinator_cpu_us_per_rank_report"] if anchor else 1.0, 3
                ),
            }
            out.setdefault("ingest_reports_per_s", {})[variant] = round(res["rank_reports_per_s"])
        out["coordinator_peak_rss_mb"] = round(proc_status_kb(pid, "VmHWM") / 1024, 1)
        out["coordinator_cpu_total_s"] = round(proc_cpu_s(pid), 1)
    finally:
        if profiler is not None and profiler.poll() is None:
            profiler.kill()
        try:
            try:
                fleet.stop()
            finally:
                # A fleet that fails to stop raises; its relays still go (8 were
                # left running for an hour after one such run).
                if relays is not None:
                    relays.stop()
        finally:
            sampler.stop()
            out["coordinator_exit"] = coord.stop()
            if tmp is not None:
                tmp.cleanup()
    out["loadavg_1m"] = os.getloadavg()[0]
    out["cpus"] = os.cpu_count()
    return out


def _kb_per_rank(out: dict[str, Any], stage: str, ranks: int) -> float:
    """RSS at `stage` over the idle coordinator's, KB a rank."""
    grown = out[f"coordinator_rss_{stage}_mb"] - out["coordinator_rss_idle_mb"]
    return round(grown * 1024 / ranks, 2)


def _delta(t: float | None, base: float) -> float | None:
    return None if t is None else round(t - base, 3)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=512, help="simulated ranks (multiple of 32)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--stall-timeout", type=float, default=5.0)
    p.add_argument(
        "--dump-deadline",
        type=float,
        default=None,
        help="default max(120, 0.05 s per rank): long, so the run measures collection, not the deadline",
    )
    p.add_argument("--agent-lost-timeout", type=float, default=30.0)
    p.add_argument("--procs", type=int, default=2, help="processes the simulated agents run in")
    p.add_argument("--entries", type=int, default=2000, help="FR entries per rank dump")
    p.add_argument(
        "--no-compress", action="store_true", help="phase-one streams without gzip (A/B)"
    )
    p.add_argument(
        "--fleet-nice",
        type=int,
        default=10,
        help="nice of the simulated agents: they stand for other machines, so on a small box"
        " they yield the CPU to the coordinator (0: compete as equals)",
    )
    p.add_argument(
        "--full-dump-max-ranks",
        type=int,
        default=256,
        help="the coordinator's setting: larger incidents collect FR tails first",
    )
    p.add_argument("--lagging", type=int, default=None, help="rank that stalls")
    p.add_argument(
        "--settle-s",
        type=float,
        default=20.0,
        help="after registration, wait this long before measuring the healthy job "
        "(its RSS grew for about 15 s at 4,096 ranks)",
    )
    p.add_argument(
        "--healthy-s",
        type=float,
        default=10.0,
        help="measure the healthy job's CPU and RSS (median) over this long",
    )
    p.add_argument("--ingest-s", type=float, default=5.0, help="0 skips the ingest probe")
    p.add_argument("--ingest-in-flight", type=int, default=128)
    p.add_argument(
        "--fleet-transport",
        choices=("stream", "unary"),
        default="stream",
        help="how the simulated job's agents send progress (unary: as older agents)",
    )
    p.add_argument(
        "--fleet-form",
        choices=("columns", "messages"),
        default="columns",
        help="how the simulated job's agents write ranks (messages: as older agents)",
    )
    p.add_argument(
        "--ingest-variants",
        default="unary/messages,stream/messages,stream/columns",
        help="TRANSPORT/FORM pairs to flood, in order; the first is the anchor",
    )
    p.add_argument("--analyze-budget-s", type=float, default=900.0)
    p.add_argument("--keep", help="data dir to use and keep (default: a temp dir)")
    p.add_argument("--profile", help="py-spy raw (collapsed) profile of the incident window")
    p.add_argument(
        "--report-interval",
        type=float,
        default=1.0,
        help="seconds between an agent's reports (above 1 where the fleet cannot keep 1 Hz)",
    )
    p.add_argument(
        "--relays",
        type=int,
        default=0,
        help="`hangwatch relay` processes the fleet's progress goes through (0: none)",
    )
    p.add_argument("--relay-window", type=float, default=0.25)
    p.add_argument(
        "--direct-calls",
        action="store_true",
        help="with --relays: agents register, upload and complete straight to the coordinator,"
        " as before relays carried those calls (each agent then holds a connection to it)",
    )
    p.add_argument(
        "--coordinator-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="set in the coordinator's environment only, e.g. an allocator's setting (repeatable)",
    )
    p.add_argument("--profile-healthy", help="py-spy raw profile of the healthy window")
    p.add_argument("--py-spy", default="py-spy")
    args = p.parse_args(argv)
    if args.dump_deadline is None:
        args.dump_deadline = max(120.0, 0.05 * args.ranks)
    out = run(args)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for k, v in out.items():
            print(f"{k:34} {v}")
    return 0 if out.get("correct") else 1


if __name__ == "__main__":
    sys.exit(main())
