"""Timelines: the loaded FR entries as Chrome/Perfetto trace-event JSON.

One process track per rank (pid = rank) with one thread per process group
(tid = the group's index), each collective and p2p op a complete slice
("ph": "X", microseconds). Where FR recorded when work started and completed
(NCCL) the slice runs from creation to completion; where it did not (gloo,
hook-recorded backends) ops are laid out by sequence: a slice ends where the
next op of the same rank and group was created, and the last one runs to the
end of the dumps. Slices on one thread never overlap, because the trace-event
format wants slices on a thread nested: a slice is cut where the next one
starts, and the times FR recorded are kept in its args.

Times are each host's own wall clock (FR's time_created_ns), relative to the
earliest entry; ranks on different hosts are only as aligned as their clocks.
The stalled collective's slices are coloured and flagged in their args, and
each lagging rank's track carries an instant event saying what it failed to do.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Final

import pandas as pd
from hangwatch.analyzer.loader import LoadedDumps
from hangwatch.analyzer.report import Report

SCHEMA: Final = "hangwatch.trace/1"
# Trace-viewer colour names (catapult's reserved palette).
STALLED_COLOUR: Final = "terrible"
LAGGING_COLOUR: Final = "bad"
# Where a backend recorded no times at all, ops are this far apart (µs); also
# how far past the newest recorded time the unfinished ops are drawn.
SEQUENCE_STEP_US: Final = 1000.0


def _us(ns: int) -> float:
    return ns / 1000.0


def build_trace(loaded: LoadedDumps, report: Report | None = None) -> dict[str, Any]:
    """The trace document for `loaded` (and the verdict `report` marks on it)."""
    df = loaded.entries
    stalled = report.stalled_collective if report is not None else None
    lagging = set(report.lagging_ranks) if report is not None else set()
    created = df["time_created_ns"] if len(df) else pd.Series([], dtype="int64")
    timed = created[created > 0]
    t0 = int(timed.min()) if len(timed) else 0
    ends = [
        int(df[c][df[c] > 0].max())
        for c in ("time_created_ns", "time_discovered_started_ns", "time_discovered_completed_ns")
        if len(df) and (df[c] > 0).any()
    ]
    t_end = max(ends) if ends else 0
    group_order = sorted(
        loaded.groups, key=lambda g: (not g.isdigit(), int(g) if g.isdigit() else 0, g)
    )
    for g in df["group"].astype(str).unique() if len(df) else ():
        if g not in group_order:
            group_order.append(g)
    tids = {g: i for i, g in enumerate(group_order)}

    events: list[dict[str, Any]] = []
    ranks = sorted(set(loaded.ranks_loaded) | lagging)
    for rank in ranks:
        name = f"rank {rank}" + (" (lagging)" if rank in lagging else "")
        events.append(_meta("process_name", rank, 0, {"name": name}))
        events.append(_meta("process_sort_index", rank, 0, {"sort_index": rank}))
    seen_threads: set[tuple[int, str]] = set()
    # Unfinished ops run a step past the latest time any dump recorded, so
    # that the newest of them still shows.
    span_end_us = _us(t_end - t0) + SEQUENCE_STEP_US if t_end else 0.0
    for (rank, group), rows in df.groupby(["rank", "group"], observed=True, sort=True):
        group = str(group)
        rank = int(rank)
        if (rank, group) not in seen_threads:
            seen_threads.add((rank, group))
            desc = loaded.groups[group].desc if group in loaded.groups else ""
            label = f"group {group}" + (f" ({desc})" if desc else "")
            events.append(_meta("thread_name", rank, tids[group], {"name": label}))
        slices = row_slices(rows, t0, span_end_us)
        for s in slices:
            is_stalled = (
                stalled is not None
                and not s["args"]["is_p2p"]
                and group == stalled.group
                and s["args"]["seq"] == stalled.seq
            )
            if is_stalled:
                s["cname"] = STALLED_COLOUR
                s["args"]["stalled"] = True
            s["pid"] = rank
            s["tid"] = tids[group]
            events.append(s)
        span_end_us = max(span_end_us, max((s["ts"] + s["dur"] for s in slices), default=0.0))
    if report is not None:
        events.extend(_marks(report, lagging, tids, span_end_us))
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "schema": SCHEMA,
            "root": os.path.basename(os.path.normpath(loaded.root)),
            "t0_unix_ns": t0,
            "verdict": report.verdict if report is not None else None,
            "summary": report.summary if report is not None else None,
            "lagging_ranks": sorted(lagging),
        },
    }


def _meta(name: str, pid: int, tid: int, args: dict[str, Any]) -> dict[str, Any]:
    return {"ph": "M", "name": name, "pid": pid, "tid": tid, "args": args}


def row_slices(rows: pd.DataFrame, t0: int, span_end_us: float) -> list[dict[str, Any]]:
    """One rank's ops in one group, in the order the rank issued them."""
    rows = rows.sort_values(["time_created_ns", "record_id"], kind="stable")
    recs = rows.to_dict("records")
    by_sequence = not any(r["time_created_ns"] > 0 for r in recs)
    starts = [
        i * SEQUENCE_STEP_US if by_sequence else _us(max(0, r["time_created_ns"] - t0))
        for i, r in enumerate(recs)
    ]
    out: list[dict[str, Any]] = []
    for i, r in enumerate(recs):
        ts = starts[i]
        nxt = starts[i + 1] if i + 1 < len(recs) else None
        completed = int(r["time_discovered_completed_ns"])
        started = int(r["time_discovered_started_ns"])
        if completed > 0 and not by_sequence:
            end = _us(completed - t0)
            timing = "fr"
        elif nxt is not None:
            end = nxt
            timing = "sequence"
        else:
            end = max(span_end_us, ts + (SEQUENCE_STEP_US if by_sequence else 0.0))
            timing = "to-end"
        if nxt is not None:
            end = min(end, nxt)
        is_p2p = bool(r["is_p2p"])
        seq = int(r["p2p_seq_id"] if is_p2p else r["collective_seq_id"])
        op = str(r["op"] or r["profiling_name"])
        args: dict[str, Any] = {
            "group": str(r["group"]),
            "seq": seq,
            "is_p2p": is_p2p,
            "record_id": int(r["record_id"]),
            "profiling_name": str(r["profiling_name"]),
            "state": str(r["state"]),
            "retired": bool(r["retired"]),
            "input_sizes": str(r["input_sizes"]),
            "input_dtypes": str(r["input_dtypes"]),
            "timing": timing,
        }
        if started > 0:
            args["started_us"] = _us(started - t0)
        if completed > 0:
            args["completed_us"] = _us(completed - t0)
        out.append(
            {
                "ph": "X",
                "cat": "p2p" if is_p2p else "collective",
                "name": f"{op} #{seq}",
                "ts": ts,
                "dur": max(0.0, end - ts),
                "args": args,
            }
        )
    return out


def _marks(
    report: Report, lagging: Iterable[int], tids: dict[str, int], at_us: float
) -> list[dict[str, Any]]:
    """Instant events: the stall for the whole trace, and on each lagging rank's track."""
    sc = report.stalled_collective
    what = f"{sc.op} #{sc.seq} in group {sc.group}" if sc is not None else "the stalled collective"
    tid = tids.get(sc.group, 0) if sc is not None else 0
    out: list[dict[str, Any]] = [
        {
            "ph": "i",
            "s": "g",
            "name": f"{report.verdict}: {what}",
            "pid": min(lagging, default=0),
            "tid": tid,
            "ts": at_us,
            "args": {"summary": report.summary},
        }
    ]
    missing = set(sc.missing_ranks) if sc is not None else set()
    for rank in sorted(lagging):
        name = f"lagging: never entered {what}" if rank in missing else f"lagging: {what}"
        out.append(
            {
                "ph": "i",
                "s": "p",
                "name": name,
                "cname": LAGGING_COLOUR,
                "pid": rank,
                "tid": tid,
                "ts": at_us,
                "args": {"verdict": report.verdict},
            }
        )
    return out


def trace_path(
    path: str | os.PathLike[str], report: Report | None = None, *, world_size: int | None = None
) -> dict[str, Any]:
    """Load the dumps under `path` and build their trace; with no `report`,
    analyse them for the marks."""
    from hangwatch.analyzer.diagnose import analyze
    from hangwatch.analyzer.loader import load_dumps

    loaded = load_dumps(path, world_size=world_size)
    if report is None:
        report = analyze(loaded, world_size=world_size)
    return build_trace(loaded, report)


def write_trace(doc: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """Write it whole or not at all."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.write_text(json.dumps(doc), encoding="utf-8")
    os.replace(tmp, target)
