"""Local ranks: discovery from rank-info files, and per-rank FR progress tracking.

Progress comes from the status-only FR dump (`pg_status`, a few hundred bytes)
served by the hook's Python handler. Entries (the full dump, ~1 MB for 2,000
entries) are fetched only when a collective has been in flight longer than a
threshold, and are streamed as deltas by record_id.

All ages are measured on the agent's own monotonic clock, from the moment the
agent first saw a state; wall clocks are never compared across hosts.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

from hangwatch.agent import endpoint
from hangwatch.agent.procstate import process_state

from hangwatch import formats, hook_protocol
from hangwatch.wire import pb

log = logging.getLogger("hangwatch.agent")

STATUS_TIMEOUT_S = 0.5
FULL_TIMEOUT_S = 2.0
# After the Python status handler times out (GIL held), use the C++ full dump
# and retry the Python handler this much later: each timed-out request keeps
# one worker-server thread waiting for the GIL, so retries must stay rare.
PYTHON_RETRY_S = 30.0
# While something stays in flight, refresh entries at most this often.
ENTRIES_REFRESH_S = 10.0
# Bound on the (group, seq) -> op name cache per rank.
MAX_OPS = 8192


@dataclass
class GroupState:
    name: str
    last_enqueued: int = -1
    last_completed: int = -1
    last_started: int = -1
    completed_changed_at: float = field(default_factory=time.monotonic)
    inflight_seq: int | None = None
    inflight_since: float = 0.0


@dataclass
class RankTracker:
    """What the agent knows about one local rank."""

    info: dict[str, Any]
    rankinfo_path: str
    rankinfo_mtime: float
    groups: dict[str, GroupState] = field(default_factory=dict)
    pg_names: dict[int, str] = field(default_factory=dict)
    ops: dict[tuple[str, int], str] = field(default_factory=dict)
    last_record_id: int = -1
    state: int = pb.PROCESS_STATE_RUNNING
    fr_ok_at: float | None = None
    python_ok: bool = True
    python_retry_at: float = 0.0
    last_entries_fetch: float | None = None
    unresponsive_reported: bool = False
    exited_reported: bool = False
    events_offset: int = 0
    last_exception: str = ""
    mapping_warned: set[int] = field(default_factory=set)
    # Highest collective seq per group whose entry says retired (gloo's completion signal).
    retired_seq: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.apply_info(self.info)

    @property
    def pid(self) -> int:
        return int(self.info["pid"])

    @property
    def rank(self) -> int:
        return int(self.info["rank"])

    @property
    def socket(self) -> str | None:
        sock = self.info.get("socket")
        return str(sock) if sock else None

    def apply_info(self, info: dict[str, Any]) -> None:
        self.info = info
        for g in info.get("groups", []):
            name = str(g["name"])
            self.pg_names[int(g["pg_id"])] = name
            self.groups.setdefault(name, GroupState(name=name))

    def rank_info_pb(self) -> pb.RankInfo:
        i = self.info
        return pb.RankInfo(
            rank=int(i["rank"]),
            local_rank=int(i.get("local_rank", -1)),
            world_size=int(i["world_size"]),
            pid=int(i["pid"]),
            backend=str(i.get("backend", "")),
            torch_version=str(i.get("torch_version", "")),
            fr_source=str(i.get("fr_source") or ""),
            groups=[
                pb.GroupInfo(
                    name=str(g["name"]),
                    desc=str(g.get("desc", "")),
                    pg_id=int(g["pg_id"]),
                    ranks=[int(r) for r in g.get("ranks", [])],
                )
                for g in i.get("groups", [])
            ],
        )

    # --- progress ---------------------------------------------------------

    def apply_status(self, doc: dict[str, Any], now: float) -> None:
        for key, st in (doc.get("pg_status") or {}).items():
            try:
                pg_id = int(key)
            except ValueError:
                continue
            name = self.pg_names.get(pg_id)
            if name is None:
                if pg_id not in self.mapping_warned:
                    self.mapping_warned.add(pg_id)
                    log.warning(
                        "rank %d: FR pg_id %d is not in the rank-info file", self.rank, pg_id
                    )
                continue
            g = self.groups.setdefault(name, GroupState(name=name))
            enq = int(st.get("last_enqueued_collective", -1))
            comp = int(st.get("last_completed_collective", -1))
            # gloo can leave the last finished collective uncounted in pg_status
            # (measured: (enqueued 5, completed 4) on an idle rank whose entry #5
            # is retired); the entries, when fetched, settle it.
            comp = max(comp, min(enq, self.retired_seq.get(name, -1)))
            started = int(st.get("last_started_collective", -1))
            if comp != g.last_completed:
                g.completed_changed_at = now
            g.last_enqueued, g.last_completed, g.last_started = enq, comp, started
            if enq > comp:
                seq = comp + 1
                if g.inflight_seq != seq:
                    g.inflight_seq, g.inflight_since = seq, now
            else:
                g.inflight_seq = None
        self.fr_ok_at = now

    def oldest_inflight_age(self, now: float) -> float:
        ages = [now - g.inflight_since for g in self.groups.values() if g.inflight_seq is not None]
        return max(ages, default=0.0)

    def needs_entries(self, now: float, threshold_s: float) -> bool:
        stalled_since = [
            g.inflight_since
            for g in self.groups.values()
            if g.inflight_seq is not None and now - g.inflight_since >= threshold_s
        ]
        if not stalled_since:
            return False
        last = self.last_entries_fetch
        return last is None or last < max(stalled_since) or now - last >= ENTRIES_REFRESH_S

    def progress_pb(self, now: float) -> pb.RankProgress:
        groups = []
        for g in self.groups.values():
            gp = pb.GroupProgress(
                group=g.name,
                last_enqueued=g.last_enqueued,
                last_completed=g.last_completed,
                last_started=g.last_started,
                completed_unchanged_s=max(0.0, now - g.completed_changed_at),
            )
            if g.inflight_seq is not None:
                op = self.ops.get((g.name, g.inflight_seq), "")
                gp.oldest_in_flight.CopyFrom(
                    pb.InFlight(
                        seq=g.inflight_seq,
                        op=op.split(":", 1)[-1],
                        age_s=max(0.0, now - g.inflight_since),
                    )
                )
            groups.append(gp)
        fr_age = 0.0 if self.fr_ok_at is None else max(0.0, now - self.fr_ok_at)
        return pb.RankProgress(
            rank=self.rank,
            state=self.state,  # type: ignore[arg-type]
            groups=groups,
            fr_age_s=fr_age,
        )

    # --- entries ----------------------------------------------------------

    def ingest_entries(self, doc: dict[str, Any]) -> list[pb.FrEntry]:
        """Learn op names and the true pg_id -> name map; return entries not sent before."""
        new: list[pb.FrEntry] = []
        now_ns = time.time_ns()  # same host as the rank: its clock, not another host's
        for e in doc.get("entries") or []:
            pg = e.get("process_group") or ["", ""]
            name = str(pg[0])
            pg_id = int(e.get("pg_id", -1))
            known = self.pg_names.get(pg_id)
            if name and known != name:
                if known is not None and pg_id not in self.mapping_warned:
                    self.mapping_warned.add(pg_id)
                    log.warning(
                        "rank %d: pg_id %d is group %r in FR entries, not %r; using FR's",
                        self.rank,
                        pg_id,
                        name,
                        known,
                    )
                self.pg_names[pg_id] = name
                self.groups.setdefault(name, GroupState(name=name))
            seq = int(e.get("collective_seq_id", 0) or 0)
            profiling = str(e.get("profiling_name", ""))
            if not e.get("is_p2p"):
                self.ops[(name, seq)] = profiling
                if e.get("retired") and seq > self.retired_seq.get(name, -1):
                    self.retired_seq[name] = seq
            rid = int(e.get("record_id", -1))
            if rid <= self.last_record_id:
                continue
            self.last_record_id = rid
            created = int(e.get("time_created_ns", 0) or 0)
            new.append(
                pb.FrEntry(
                    rank=self.rank,
                    record_id=rid,
                    group=name,
                    collective_seq=seq,
                    p2p_seq=int(e.get("p2p_seq_id", 0) or 0),
                    profiling_name=profiling,
                    state=str(e.get("state", "")),
                    retired=bool(e.get("retired", False)),
                    is_p2p=bool(e.get("is_p2p", False)),
                    age_s=max(0.0, (now_ns - created) / 1e9) if created else 0.0,
                    input_sizes_json=json.dumps(e.get("input_sizes", [])),
                    input_dtypes_json=json.dumps(e.get("input_dtypes", [])),
                )
            )
        if len(self.ops) > MAX_OPS:
            for key in sorted(self.ops, key=lambda k: k[1])[: len(self.ops) - MAX_OPS]:
                del self.ops[key]
        return new


@dataclass
class PollResult:
    entries: list[pb.FrEntry] = field(default_factory=list)
    events: list[tuple[int, int, str]] = field(default_factory=list)  # (kind, rank, detail)


def poll_rank(t: RankTracker, now: float, entries_after_s: float) -> PollResult:
    """One poll of one rank. Never raises for an unreachable or dead rank."""
    out = PollResult()
    state = process_state(t.pid, t.info.get("proc_starttime"))
    if state in (pb.PROCESS_STATE_GONE, pb.PROCESS_STATE_ZOMBIE):
        t.state = state
        if not t.exited_reported:
            t.exited_reported = True
            detail = "process gone" if state == pb.PROCESS_STATE_GONE else "process is a zombie"
            if t.last_exception:
                detail += f"; last uncaught exception: {t.last_exception}"
            out.events.append((pb.EVENT_KIND_RANK_EXITED, t.rank, detail))
        return out
    if state == pb.PROCESS_STATE_STOPPED or not t.socket:
        # A stopped process cannot answer; asking would only queue requests in it.
        t.state = state if t.socket else pb.PROCESS_STATE_UNRESPONSIVE
        return out
    doc: dict[str, Any] | None = None
    if t.python_ok or now >= t.python_retry_at:
        try:
            doc = json.loads(
                endpoint.call(t.socket, hook_protocol.STATUS, timeout=STATUS_TIMEOUT_S)
            )
            t.python_ok = True
        except (TimeoutError, endpoint.EndpointError, ValueError) as e:
            t.python_ok = False
            t.python_retry_at = now + PYTHON_RETRY_S
            log.debug("rank %d: status handler failed (%s); using the full dump", t.rank, e)
    full: dict[str, Any] | None = None
    if doc is None or t.needs_entries(now, entries_after_s):
        try:
            full = json.loads(
                endpoint.call(t.socket, hook_protocol.FR_TRACE_JSON, timeout=FULL_TIMEOUT_S)
            )
            t.last_entries_fetch = now
        except (TimeoutError, endpoint.EndpointError, ValueError) as e:
            log.debug("rank %d: fr_trace_json failed: %s", t.rank, e)
    if full is not None:
        out.entries = t.ingest_entries(full)
        if doc is None:
            doc = full
    if doc is None:
        t.state = pb.PROCESS_STATE_UNRESPONSIVE
        if not t.unresponsive_reported:
            t.unresponsive_reported = True
            out.events.append(
                (pb.EVENT_KIND_RANK_UNRESPONSIVE, t.rank, "FR endpoint does not answer")
            )
        return out
    t.apply_status(doc, now)
    t.state = pb.PROCESS_STATE_RUNNING
    t.unresponsive_reported = False
    return out


def read_hook_events(t: RankTracker, run_dir: str) -> list[tuple[int, int, str]]:
    """New lines of the rank's HOOK_EVENT file, as (kind, rank, detail) events to report."""
    path = hook_protocol.events_path(run_dir, t.pid)
    try:
        with open(path, "rb") as f:
            f.seek(t.events_offset)
            data = f.read(1 << 20)
    except OSError:
        return []
    end = data.rfind(b"\n")
    if end < 0:
        return []
    t.events_offset += end + 1
    out: list[tuple[int, int, str]] = []
    for raw in data[: end + 1].splitlines():
        try:
            ev = json.loads(raw)
        except ValueError:
            log.warning("rank %d: unreadable hook event line %r", t.rank, raw[:200])
            continue
        if ev.get("schema") != formats.HOOK_EVENT:
            continue
        detail = str(ev.get("detail", ""))
        if ev.get("kind") == "collective-timeout":
            out.append((pb.EVENT_KIND_COLLECTIVE_TIMEOUT, int(ev.get("rank", t.rank)), detail))
        else:
            t.last_exception = detail
    return out


def scan_rankinfo(run_dir: str) -> dict[int, tuple[dict[str, Any], str, float]]:
    """pid -> (rank-info dict, path, mtime) for every readable rank-info file."""
    found: dict[int, tuple[dict[str, Any], str, float]] = {}
    for path in glob.glob(os.path.join(hook_protocol.hook_dir(run_dir), "*.json")):
        try:
            mtime = os.stat(path).st_mtime
            with open(path, encoding="utf-8") as f:
                info = json.load(f)
        except (OSError, ValueError) as e:
            log.debug("skipping %s: %s", path, e)
            continue
        if not isinstance(info, dict) or info.get("schema") != formats.RANKINFO:
            continue
        try:
            found[int(info["pid"])] = (info, path, mtime)
        except (KeyError, TypeError, ValueError):
            log.warning("skipping %s: no pid", path)
    return found
