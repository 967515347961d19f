"""What one progress report costs the coordinator, without gRPC: parse, check, apply.

    python benchmarks/ingest_path.py --ranks 4096 --rounds 5

The gRPC handler for ReportProgress does three things per report on the
coordinator's CPU: protobuf parses the bytes, `ingest.validate` checks them,
and the registry applies them. This measures each, in one process, for a
simulated fleet's reports (8 ranks x 4 groups per node agent, the simulated
Megatron layout of `tests.support.simagents`), registered into a real
`JobRegistry`. Two reports per agent one step apart alternate, so every
report moves `last_completed` (the registry's full update path).

The straggler monitor's part of the same reports (filing them, and scoring a
tick) is measured too, with agents reading on the 1 s grid with a synced clock.

The anchor is the parse alone of the per-rank form (`ProgressReport.ranks`):
every other figure is printed as a ratio to it, measured in the same run.
Medians over `--rounds` passes over every agent's report.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hangwatch.server.ingest import validate
from hangwatch.server.live.registry import JobRegistry
from hangwatch.server.live.stragglers import StragglerMonitor

from hangwatch import pollgrid
from hangwatch.wire import pb
from tests.support.simagents import OPS_PER_STEP, RANKS_PER_AGENT, FleetSpec
from tests.support.simagents.fleet import FleetState


class _Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _median_us(fn: Callable[[int], None], n: int, rounds: int) -> float:
    """Median over rounds of the mean µs per call of fn(i) for i in range(n)."""
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for i in range(n):
            fn(i)
        out.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(out)


async def _build(
    ranks: int, form: str
) -> tuple[FleetState, JobRegistry, _Clock, list[list[bytes]]]:
    spec = FleetSpec(target="127.0.0.1:1", job_id="bench", ranks=ranks, epoch=time.time())
    fleet = FleetState(spec)
    clock = _Clock()
    registry = JobRegistry(agent_lost_timeout=1e9, stall_timeout=1e9, clock=clock)
    now = time.time()
    bodies: list[list[bytes]] = []
    for a in fleet.agents:
        a.session_id = registry.register(a.register_request())
        a.coordinator_reads_columns = form == "columns"
        pair = [a.progress_report(now + k * OPS_PER_STEP * spec.op_s) for k in range(2)]
        bodies.append([a.as_sent(r).SerializeToString() for r in pair])
    await asyncio.gather(*(a.channel.close() for a in fleet.agents))
    return fleet, registry, clock, bodies


def _measure_form(form: str, ranks: int, rounds: int) -> tuple[dict[str, float], int, int]:
    """(µs per report of each step, reports, bytes per report) for one wire form."""
    fleet, registry, clock, bodies = asyncio.run(_build(ranks, form))
    n = len(bodies)
    parsed = [[pb.ProgressReport.FromString(b) for b in pair] for pair in bodies]
    # What validation hands the registry (the columns unpacked), made once here
    # so that "apply" times the registry alone.
    checked = [[validate.progress_report(r) for r in pair] for pair in parsed]
    seq = [0]

    def parse(i: int) -> None:
        pb.ProgressReport.FromString(bodies[i][0])

    def check(i: int) -> None:
        validate.progress_report(parsed[i][0])

    def apply(i: int) -> None:
        seq[0] += 1
        req = parsed[i][seq[0] % 2]
        req.report_seq = seq[0]
        clock.t += 1e-4
        registry.report_progress(req, checked[i][seq[0] % 2])

    rows = {"parse": _median_us(parse, n, rounds), "validate": _median_us(check, n, rounds)}
    rows["apply"] = _median_us(apply, n, rounds)
    fleet.close()
    return rows, n, len(bodies[0][0])


def live_bytes_per_rank(ranks: int, form: str) -> float:
    """What the registry holds per rank once every agent registered and
    reported twice (tracemalloc: Python allocations made from then on, the
    reports themselves parsed before). Each report is checked and unpacked
    inside the window, as the handler does for each report it takes: what
    the registry keeps of an unpacked report (a plan holds its rank and cell
    columns) is then counted, and what it drops is not."""
    fleet, _, _, bodies = asyncio.run(_build(ranks, form))
    requests = [a.register_request() for a in fleet.agents]
    parsed = [[pb.ProgressReport.FromString(b) for b in pair] for pair in bodies]
    fleet.close()
    gc.collect()
    tracemalloc.start()
    try:
        registry = JobRegistry(agent_lost_timeout=1e9, stall_timeout=1e9, clock=_Clock())
        for req, pair in zip(requests, parsed, strict=True):
            sid = registry.register(req)
            for j, rep in enumerate(pair):
                rep.session_id, rep.report_seq = sid, j + 1
                registry.report_progress(rep, validate.progress_report(rep))
        gc.collect()
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    return held / ranks


def _measure_stragglers(ranks: int, ticks: int) -> tuple[dict[str, float], dict[str, float]]:
    """The straggler monitor's share of the same reports, columns form: filing
    them (`observe`, in the gRPC handler) and scoring a tick (its own thread,
    the same GIL), each agent reading on the 1 s grid with a synced clock as a
    real agent does. µs per rank report, and per rank per scored tick.

    And a tick's working set, bytes a rank: tracemalloc's peak over
    `score_ready` less what was held before it, over two more ticks traced
    after the timed ones (their tracks: benchmarks/tracks_memory.py). The heap
    keeps what a tick needs every second, so it is in a running coordinator's RSS.
    And what filed reports hold until their tick is scored, bytes a rank:
    three ticks of every agent's reports."""
    now = [0]  # the monitor's clock, ns: set for each tick below
    monitor = StragglerMonitor(tick_s=1.0, clock_ns=lambda: now[0])

    async def build() -> FleetState:
        spec = FleetSpec(target="127.0.0.1:1", job_id="bench", ranks=ranks, epoch=time.time())
        fleet = FleetState(spec)
        for a in fleet.agents:
            a.session_id = "0" * 32
            a.coordinator_reads_columns = True
            monitor.register(a.register_request())
        await asyncio.gather(*(a.channel.close() for a in fleet.agents))
        return fleet

    fleet = asyncio.run(build())
    first = time.time_ns() // 1_000_000_000
    observe: list[float] = []
    score: list[float] = []

    def file_tick(k: int, into: StragglerMonitor = monitor) -> float:
        """Every agent's report for tick `k` filed; returns the seconds `observe` took."""
        at = pollgrid.instant_ns(k, 1_000_000_000)
        now[0] = at + 50_000_000  # the reports arrive 50 ms after the instant
        reports = [a.as_sent(a.progress_report(at / 1e9, status_at_ns=at)) for a in fleet.agents]
        checked = [validate.progress_report(r) for r in reports]
        t0 = time.perf_counter()
        for r, c in zip(reports, checked, strict=True):
            into.observe(r, c)
        return time.perf_counter() - t0

    for k in range(first, first + ticks + 2):
        filed_s = file_tick(k)
        t1 = time.perf_counter()
        monitor.score_ready()
        t2 = time.perf_counter()
        if k >= first + 2:  # scoring starts once ticks close (CLOSE_AFTER_TICKS)
            observe.append(filed_s / ranks * 1e6)
            score.append((t2 - t1) / ranks * 1e6)
    peaks = []
    tracemalloc.start()
    try:
        for k in range(first + ticks + 2, first + ticks + 4):
            file_tick(k)
            gc.collect()
            held = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            monitor.score_ready()
            peaks.append(tracemalloc.get_traced_memory()[1] - held)
    finally:
        tracemalloc.stop()
    # What filed reports hold before a tick is scored: three ticks of them
    # (CLOSE_AFTER_TICKS), filed into a monitor of their own entirely inside
    # the window, so what they share (an agent's one copy of its layout) is
    # counted once and nothing made before is left out. Nothing is scored:
    # no tracks are made.
    fresh = StragglerMonitor(tick_s=1.0, clock_ns=lambda: now[0])
    for a in fleet.agents:
        fresh.register(a.register_request())
    tracemalloc.start()
    try:
        for k in range(first + ticks + 4, first + ticks + 7):
            file_tick(k, fresh)
        gc.collect()
        filed = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    fleet.close()
    timing = {"observe": statistics.median(observe), "score_tick": statistics.median(score)}
    return timing, {"tick_working_set": max(peaks) / ranks, "filed_three_ticks": filed / ranks}


def measure(ranks: int, rounds: int) -> dict[str, Any]:
    """Both wire forms; the anchor is the parse of the per-rank messages."""
    out: dict[str, Any] = {"ranks": ranks, "ranks_per_report": RANKS_PER_AGENT}
    anchor = 0.0
    for form in ("messages", "columns"):
        rows, n, size = _measure_form(form, ranks, rounds)
        anchor = anchor or rows["parse"]
        total = sum(rows.values())
        out[form] = {
            "agents": n,
            "report_bytes": size,
            "us_per_report": rows,
            "us_per_rank_report": {k: v / RANKS_PER_AGENT for k, v in rows.items()},
            "ratio_to_anchor": {k: v / anchor for k, v in rows.items()},
            "total_us_per_rank_report": total / RANKS_PER_AGENT,
            "live_bytes_per_rank": live_bytes_per_rank(ranks, form),
        }
    out["columns_over_messages"] = (
        out["columns"]["total_us_per_rank_report"] / out["messages"]["total_us_per_rank_report"]
    )
    st, held = _measure_stragglers(ranks, max(4, rounds))
    out["stragglers"] = {
        "us_per_rank": st,
        "ratio_to_anchor": {k: v * RANKS_PER_AGENT / anchor for k, v in st.items()},
        "bytes_per_rank": held,
    }
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--ranks", type=int, default=4096, help="simulated ranks, 8 per agent (multiple of 32)"
    )
    ap.add_argument(
        "--rounds", type=int, default=5, help="passes over every agent's report; the median is kept"
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    res = measure(args.ranks, args.rounds)
    if args.json:
        print(json.dumps(res, indent=2))
        return 0
    for form in ("messages", "columns"):
        f = res[form]
        print(f"{form}: {res['ranks']} ranks, {f['agents']} reports of {f['report_bytes']} bytes")
        for k, v in f["us_per_report"].items():
            label = f"{k} (anchor)" if (form, k) == ("messages", "parse") else k
            print(
                f"  {label:<16} {v:8.1f} µs/report {f['us_per_rank_report'][k]:7.2f} µs/rank "
                f"{f['ratio_to_anchor'][k]:6.2f}x anchor"
            )
        print(f"  total            {f['total_us_per_rank_report']:.2f} µs per rank report")
        print(f"  registry         {f['live_bytes_per_rank']:.0f} bytes per rank")
    print(f"columns / messages: {res['columns_over_messages']:.2f}")
    st = res["stragglers"]
    print("straggler monitor, columns, synced agents on the 1 s grid:")
    print(
        f"  observe          {st['us_per_rank']['observe']:7.2f} µs/rank report"
        f" {st['ratio_to_anchor']['observe']:6.2f}x anchor (per report)"
    )
    print(
        f"  score a tick     {st['us_per_rank']['score_tick']:7.2f} µs/rank"
        f" {st['ratio_to_anchor']['score_tick']:6.2f}x anchor (per report)"
    )
    held = st["bytes_per_rank"]
    print(f"  a tick's working set {held['tick_working_set']:.0f} bytes per rank")
    print(f"  filed, three ticks {held['filed_three_ticks']:.0f} bytes per rank")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
