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
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any

from hangwatch.agent import endpoint
from hangwatch.agent.numbering import Numbering, raw_key
from hangwatch.agent.procstate import CpuTotal, RunqueueWait, process_sample

from hangwatch import formats, hook_protocol
from hangwatch.formats import HookEvent, HookEventKind, RankInfo, Recorder
from hangwatch.formats.checks import read_file
from hangwatch.recorders import COMPLETION_TRACKED, KIND_GENERIC
from hangwatch.wire import COLLECTIVES_UNKNOWN, group_info, next_seq, pb

log = logging.getLogger("hangwatch.agent")

STATUS_TIMEOUT_S = 0.5
FULL_TIMEOUT_S = 2.0
# After the Python status handler times out (GIL held), use the C++ full dump
# and retry the Python handler this much later: each timed-out request keeps
# one worker-server thread waiting for the GIL, so retries must stay rare.
PYTHON_RETRY_S = 30.0
# ... except the first two retries after an answer, 2 s and 4 s apart: a rank
# starved of CPU misses the 0.5 s too (measured: 1 of 3 ranks compiling on one
# cold inductor cache beside another job, 2 cores), and while the handler is
# taken for stuck the quiet-period stack sample (quietstack.py) is not asked
# either, so such a rank read "idle, not in torch.compile" for 30 s, past the
# coordinator's 20 s start-up grace: a false incident. A rank whose GIL stays
# held costs at most two more waiting threads than before.
PYTHON_RETRY_QUICK_S: tuple[float, ...] = (2.0, 4.0)
# While something stays in flight, refresh entries at most this often.
ENTRIES_REFRESH_S = 10.0
# How often to ask torch's c10d_health_check (2.15): a C++ handler, cheap.
HEALTH_POLL_S = 5.0
# Bound on the (group, seq) -> op name cache per rank.
MAX_OPS = 8192
MAX_EXCEPTIONS = 8  # thread exceptions kept per rank for its bundle
# Groups whose pg_status also counts p2p (agent/numbering.py) get their
# collective numbering from FR entries: read once a rank has started, again
# this often while it moves (a full dump costs the rank 30-50 ms of CPU at
# 2,000 entries, docs/ARCHITECTURE.md), and once whenever such a group goes
# quiet for QUIET_S, which makes its counts exact for as long as it stays so.
CALIBRATE_S = 30.0
QUIET_S = 1.0


@dataclass
class GroupState:
    name: str
    # The recorder instance this group's progress is read from.
    instance: str = formats.GENERIC_INSTANCE
    # False for a hook-recorded group whose recorder never reports completion:
    # then only last_enqueued means anything, and the coordinator compares it across ranks.
    completion_known: bool = True
    last_enqueued: int = -1
    last_completed: int = -1
    last_started: int = -1
    completed_changed_at: float = field(default_factory=time.monotonic)
    enqueued_changed_at: float = field(default_factory=time.monotonic)
    inflight_seq: int | None = None
    inflight_since: float = 0.0
    # Collective counts where pg_status also counts p2p (agent/numbering.py).
    numbering: Numbering = field(default_factory=Numbering)

    def changed_at(self) -> float:
        return max(self.completed_changed_at, self.enqueued_changed_at)

    def collectives(self) -> tuple[int, int] | None:
        return self.numbering.collectives(self.last_enqueued, self.last_completed)


@dataclass
class RankTracker:
    """What the agent knows about one local rank."""

    info: RankInfo
    rankinfo_path: str
    rankinfo_mtime: float
    groups: dict[str, GroupState] = field(default_factory=dict)
    recorders: dict[str, Recorder] = field(default_factory=dict)
    # (recorder instance, that instance's local pg_id) -> group name
    pg_names: dict[tuple[str, int], str] = field(default_factory=dict)
    ops: dict[tuple[str, int], str] = field(default_factory=dict)
    last_record_id: dict[str, int] = field(default_factory=dict)
    state: int = pb.PROCESS_STATE_RUNNING
    fr_ok_at: float | None = None
    python_ok: bool = True
    python_retry_at: float = 0.0
    python_failures: int = 0  # status requests timed out since its last answer
    last_entries_fetch: float | None = None
    # Entries were read once the rank had entered a collective (numbering.py's first look).
    looked: bool = False
    unresponsive_reported: bool = False
    exited_reported: bool = False
    events_offset: int = 0
    last_exception: str = ""
    # Uncaught exceptions of its threads, newest last (bounded): the bundle's evidence.
    exceptions: list[str] = field(default_factory=list)
    mapping_warned: set[tuple[str, int]] = field(default_factory=set)
    # None: not asked yet; False: this torch has no c10d_health_check.
    health_supported: bool | None = None
    health_checked_at: float = -math.inf  # never: the first poll asks
    unhealthy: tuple[str, ...] = ()
    # Per group, the pg_status value (numbering.raw_key) of the newest entry that
    # says retired (gloo's completion signal).
    retired_seq: dict[str, int] = field(default_factory=dict)
    # Wall clock (ns) of the last status read: the instant the straggler signal compares.
    status_wall_ns: int = 0
    cpu_time_ns: int = 0  # the process tree's CPU time at the last poll, only growing (0 = unknown)
    cpu: CpuTotal = field(default_factory=CpuTotal)
    runqueue: RunqueueWait = field(default_factory=RunqueueWait)
    # Storage bytes its process tree read and wrote, only growing (0 = unknown).
    io_bytes: int = 0
    io: CpuTotal = field(default_factory=CpuTotal)
    # Where the hook leaves its numbers as the rank exits (hook_protocol.final_status_path;
    # "" = not looked for), and whether they were applied.
    final_status_path: str = ""
    final_status: bool = False
    # Inside torch.compile at the last quiet-period stack sample (agent/quietstack.py).
    in_compile: bool = False
    # A compiler process ran under the rank at the last poll (procstate.COMPILERS).
    compiler_running: bool = False
    stack_sampled_at: float = float("-inf")
    # When this agent found the rank (monotonic): a rank with no group yet is
    # quiet since then, not since forever.
    found_at: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.apply_info(self.info)

    @property
    def pid(self) -> int:
        return self.info.pid

    @property
    def rank(self) -> int:
        return self.info.rank

    @property
    def finished(self) -> bool:
        """In or past Python's exit, with no uncaught exception (RankProgress.finished)."""
        return self.final_status and not self.last_exception

    @property
    def socket(self) -> str | None:
        return self.info.socket or None

    def apply_info(self, info: RankInfo) -> None:
        self.info = info
        recs = list(info.recorders)
        if not recs:
            # A rank-info file without recorders (a hook that found none yet):
            # the generic instance, numbered in group-creation order.
            ordered = sorted(info.groups, key=lambda g: -1 if g.pg_id is None else g.pg_id)
            recs = [
                Recorder(
                    instance=formats.GENERIC_INSTANCE,
                    kind=KIND_GENERIC,
                    completion=COMPLETION_TRACKED,
                    groups=tuple(g.name for g in ordered),
                    json_handler=hook_protocol.FR_TRACE_JSON,
                )
            ]
        self.recorders = {r.instance: r for r in recs}
        for r in recs:
            for pg_id, name in enumerate(r.groups):
                self.pg_names[(r.instance, pg_id)] = name
                g = self.groups.get(name)
                if g is None:
                    # The first recorder listing a group is the one it is read through.
                    self.groups[name] = GroupState(
                        name=name,
                        instance=r.instance,
                        completion_known=r.completion == COMPLETION_TRACKED,
                    )
        for gi in info.groups:
            self.groups.setdefault(gi.name, GroupState(name=gi.name))

    def rank_info_pb(self) -> pb.RankInfo:
        i = self.info
        return pb.RankInfo(
            rank=i.rank,
            local_rank=i.local_rank,
            world_size=i.world_size,
            pid=i.pid,
            backend=i.backend,
            torch_version=i.torch_version,
            fr_source=i.fr_source,
            groups=[
                group_info(
                    name=g.name,
                    desc=g.desc,
                    pg_id=-1 if g.pg_id is None else g.pg_id,
                    members=g.ranks,
                )
                for g in i.groups
            ],
        )

    # --- progress ---------------------------------------------------------

    def apply_status(self, doc: dict[str, Any], now: float, instance: str | None = None) -> None:
        """Apply the hook's FRSTATUS answer, or one instance's plain FR dump."""
        if doc.get("schema") == formats.FRSTATUS:
            for rd in doc.get("recorders") or []:
                dump = rd.get("dump") if isinstance(rd, dict) else None
                if isinstance(dump, dict) and isinstance(dump.get("pg_status") or {}, dict):
                    self._apply_pg_status(
                        str(rd.get("instance", "")), dump.get("pg_status") or {}, now
                    )
                elif isinstance(rd, dict):
                    log.debug(
                        "rank %d: recorder %s: %s", self.rank, rd.get("instance"), rd.get("error")
                    )
        else:
            self._apply_pg_status(
                instance or formats.GENERIC_INSTANCE, doc.get("pg_status") or {}, now
            )
        self.fr_ok_at = now

    def _apply_pg_status(self, instance: str, pg_status: dict[str, Any], now: float) -> None:
        rec = self.recorders.get(instance)
        offset = rec.status_offset if rec else 0
        for key, st in pg_status.items():
            try:
                pg_id = int(key)
            except ValueError:
                continue
            name = self.pg_names.get((instance, pg_id))
            if name is None:
                if (instance, pg_id) not in self.mapping_warned:
                    self.mapping_warned.add((instance, pg_id))
                    log.warning(
                        "rank %d: FR pg_id %d of recorder %s is not in the rank-info file",
                        self.rank,
                        pg_id,
                        instance,
                    )
                continue
            g = self.groups.setdefault(name, GroupState(name=name, instance=instance))
            if g.instance != instance:
                continue  # a group in two recorders is read through its first one
            enq = _shift(int(st.get("last_enqueued_collective", -1)), offset)
            comp = _shift(int(st.get("last_completed_collective", -1)), offset)
            started = _shift(int(st.get("last_started_collective", -1)), offset)
            if not g.completion_known and comp >= 0:
                # This recorder does report completion after all: trust it from now on.
                g.completion_known = True
            if g.completion_known:
                # gloo can leave the last finished collective uncounted in pg_status
                # (measured: (enqueued 5, completed 4) on an idle rank whose entry #5
                # is retired); the entries, when fetched, settle it.
                comp = max(comp, min(enq, self.retired_seq.get(name, -1)))
            if comp != g.last_completed:
                g.completed_changed_at = now
            if enq != g.last_enqueued:
                g.enqueued_changed_at = now
            g.last_enqueued, g.last_completed, g.last_started = enq, comp, started
            g.numbering.apply(enq, comp)
            if not g.completion_known:
                # Nothing says whether the newest collective finished: it is the
                # one this rank would be waiting in, since it last entered one.
                if enq >= 0:
                    g.inflight_seq, g.inflight_since = enq, g.enqueued_changed_at
                else:
                    g.inflight_seq = None
            elif enq > comp:
                seq = next_seq(comp)
                if g.inflight_seq != seq:
                    g.inflight_seq, g.inflight_since = seq, now
            else:
                g.inflight_seq = None

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
        if last is None or last < max(stalled_since):
            return True
        # Where completion is unknown an idle rank looks in flight forever:
        # fetch once per stall there, not every ENTRIES_REFRESH_S.
        known = any(g.completion_known for g in self.groups.values() if g.inflight_seq is not None)
        return known and now - last >= ENTRIES_REFRESH_S

    def needs_calibration(self, now: float) -> bool:
        """Time to read FR entries for the collective numbering (CALIBRATE_S)."""
        last = self.last_entries_fetch
        if last is None or not self.looked:
            # The first look, once the rank has done something: which groups count p2p.
            return any(g.last_enqueued >= 0 for g in self.groups.values())
        if last >= max((g.changed_at() for g in self.groups.values()), default=0.0):
            return False  # nothing moved since the last read
        if now - last >= CALIBRATE_S:
            return True
        return any(
            g.collectives() is None and now - g.changed_at() >= QUIET_S
            for g in self.groups.values()
        )

    def progress_pb(self, now: float) -> pb.RankProgress:
        groups = []
        for g in self.groups.values():
            gp = pb.GroupProgress(
                group=g.name,
                last_enqueued=g.last_enqueued,
                last_completed=g.last_completed,
                last_started=g.last_started,
                completed_unchanged_s=max(0.0, now - g.completed_changed_at),
                completion_unknown=not g.completion_known,
            )
            seq, op = g.inflight_seq, ""
            coll = g.collectives()
            if g.numbering.counts_p2p:
                enq, comp = g.numbering.enqueued, g.numbering.completed
                gp.collectives_enqueued = COLLECTIVES_UNKNOWN if enq is None else enq
                gp.collectives_completed = COLLECTIVES_UNKNOWN if comp is None else comp
                if coll is not None and seq is not None:
                    # In flight is tracked (and aged) by pg_status value; reported as a collective.
                    seq = next_seq(coll[1]) if coll[0] > coll[1] else None
            if seq is not None:
                if coll is not None:
                    op = self.ops.get((g.name, seq), "")
                gp.oldest_in_flight.CopyFrom(
                    pb.InFlight(
                        seq=seq,
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
            status_at_ns=self.status_wall_ns,
            cpu_time_ns=self.cpu_time_ns,
            runqueue_wait_ns=self.runqueue.total_ns,
            finished=self.finished,
            in_compile=self.in_compile,
            compiler_running=self.compiler_running,
            io_bytes=self.io_bytes,
        )

    # --- entries ----------------------------------------------------------

    def ingest_entries(
        self, doc: dict[str, Any], instance: str = formats.GENERIC_INSTANCE
    ) -> list[pb.FrEntry]:
        """Learn op names and the true pg_id -> name map; return entries not sent before."""
        new: list[pb.FrEntry] = []
        rec = self.recorders.get(instance)
        retired_is_done = rec is None or rec.completion == COMPLETION_TRACKED
        kind = rec.kind if rec else KIND_GENERIC
        last_rid = self.last_record_id.get(instance, -1)
        now_ns = time.time_ns()  # same host as the rank: its clock, not another host's
        for e in doc.get("entries") or []:
            pg = e.get("process_group") or ["", ""]
            name = str(pg[0])
            pg_id = int(e.get("pg_id", -1))
            known = self.pg_names.get((instance, pg_id))
            if name and known != name:
                if known is not None and (instance, pg_id) not in self.mapping_warned:
                    self.mapping_warned.add((instance, pg_id))
                    log.warning(
                        "rank %d: pg_id %d of recorder %s is group %r in FR entries, not %r; "
                        "using FR's",
                        self.rank,
                        pg_id,
                        instance,
                        name,
                        known,
                    )
                self.pg_names[(instance, pg_id)] = name
                self.groups.setdefault(name, GroupState(name=name, instance=instance))
            seq = int(e.get("collective_seq_id", 0) or 0)
            profiling = str(e.get("profiling_name", ""))
            raw = raw_key(kind, e, seq)
            g = self.groups.get(name)
            if g is not None and g.instance == instance and raw is not None:
                # A p2p entry carries the count of collectives before it (0: none).
                g.numbering.learn(raw, seq if seq > 0 else -1, bool(e.get("is_p2p")))
            if not e.get("is_p2p"):
                self.ops[(name, seq)] = profiling
                key = seq if raw is None else raw
                if retired_is_done and e.get("retired") and key > self.retired_seq.get(name, -1):
                    self.retired_seq[name] = key
            rid = int(e.get("record_id", -1))
            if rid <= last_rid:
                continue
            last_rid = rid
            self.last_record_id[instance] = rid
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


def python_retry_s(failures: int) -> float:
    """How long after a status request timed out to ask again, `failures`
    requests having timed out before it since the rank last answered."""
    quick = PYTHON_RETRY_QUICK_S
    return quick[failures] if failures < len(quick) else PYTHON_RETRY_S


@dataclass
class PollResult:
    # New FR entries since the last fetch. The agent does not send them (the
    # coordinator discards ReportEntries); fetching them is how the tracker
    # learns op names, and callers that inspect a poll still can.
    entries: list[pb.FrEntry] = field(default_factory=list)
    events: list[tuple[int, int, str]] = field(default_factory=list)  # (kind, rank, detail)


def poll_rank(t: RankTracker, now: float, entries_after_s: float) -> PollResult:
    """One poll of one rank. Never raises for an unreachable or dead rank."""
    out = PollResult()
    read_final_status(t, now)
    waits: dict[int, int] = {}
    compilers: list[str] = []
    io: list[int] = []
    state, cpu_ns = process_sample(t.pid, t.info.proc_starttime, waits, compilers, io)
    t.cpu_time_ns = t.cpu.update(cpu_ns)
    t.io_bytes = t.io.update(sum(io))
    t.compiler_running = bool(compilers)
    t.runqueue.update(waits)
    if state in (pb.PROCESS_STATE_GONE, pb.PROCESS_STATE_ZOMBIE):
        t.state = state
        if not t.exited_reported:
            t.exited_reported = True
            detail = "process gone" if state == pb.PROCESS_STATE_GONE else "process is a zombie"
            if t.last_exception:
                # The hook saw it die of an exception: a crash, not a normal end.
                # (/proc shows no exit code of a process that is not our child.)
                detail += f"; uncaught exception: {t.last_exception}"
                out.events.append((pb.EVENT_KIND_RANK_CRASHED, t.rank, detail))
            else:
                out.events.append((pb.EVENT_KIND_RANK_EXITED, t.rank, detail))
        return out
    if t.final_status:
        # Its exit handlers ran and removed the endpoint: nothing more to ask.
        t.state = state
        return out
    if state == pb.PROCESS_STATE_STOPPED or not t.socket:
        # A stopped process cannot answer; asking would only queue requests in it.
        t.state = state if t.socket else pb.PROCESS_STATE_UNRESPONSIVE
        return out
    doc: dict[str, Any] | None = None
    if t.python_ok or now >= t.python_retry_at:
        t.status_wall_ns = time.time_ns()
        try:
            doc = json.loads(
                endpoint.call(t.socket, hook_protocol.STATUS, timeout=STATUS_TIMEOUT_S)
            )
            t.python_ok = True
            t.python_failures = 0
        except (TimeoutError, endpoint.EndpointError, ValueError) as e:
            t.python_ok = False
            t.python_retry_at = now + python_retry_s(t.python_failures)
            t.python_failures += 1
            log.debug("rank %d: status handler failed (%s); using the full dump", t.rank, e)
    if doc:
        # Applied before deciding on entries, so that the first look comes in
        # the poll that first sees a collective (and applied again below,
        # with what the entries taught).
        t.apply_status(doc, now)
    if doc is None or t.needs_entries(now, entries_after_s) or t.needs_calibration(now):
        # torch's C++ handlers, one per recorder instance: they answer while the GIL is held.
        wall_ns = time.time_ns()
        fulls = _fetch_full_dumps(t)
        if fulls:
            t.last_entries_fetch = now
            if doc is None:
                t.status_wall_ns = wall_ns
            t.looked |= any(g.last_enqueued >= 0 for g in t.groups.values())
        for instance, full in fulls:
            out.entries.extend(t.ingest_entries(full, instance))
            if doc is None:
                t.apply_status(full, now, instance)
        if doc is None and fulls:
            doc = {}  # status already applied from the full dumps
    if doc is None and read_final_status(t, now):
        t.state = state  # it began to exit during this poll: not unresponsive
        return out
    if doc is None:
        t.state = pb.PROCESS_STATE_UNRESPONSIVE
        if not t.unresponsive_reported:
            t.unresponsive_reported = True
            out.events.append(
                (pb.EVENT_KIND_RANK_UNRESPONSIVE, t.rank, "FR endpoint does not answer")
            )
        return out
    if doc:
        t.apply_status(doc, now)
    t.state = pb.PROCESS_STATE_RUNNING
    t.unresponsive_reported = False
    out.events.extend(check_health(t, now))
    return out


def check_health(
    t: RankTracker, now: float, *, timeout: float = STATUS_TIMEOUT_S
) -> list[tuple[int, int, str]]:
    """torch 2.15's watchdog health, as an event when a backend turns unhealthy.
    No answer within `timeout` leaves `health_supported` as it was: asked again
    HEALTH_POLL_S later."""
    if t.health_supported is False or now - t.health_checked_at < HEALTH_POLL_S or not t.socket:
        return []
    t.health_checked_at = now
    try:
        doc = json.loads(endpoint.call(t.socket, hook_protocol.HEALTH_CHECK, timeout=timeout))
    except endpoint.EndpointError as e:
        if "HTTP 404" in str(e):
            t.health_supported = False  # older torch: no such handler
        log.debug("rank %d: health check failed: %s", t.rank, e)
        return []
    except (TimeoutError, ValueError) as e:
        log.debug("rank %d: health check failed: %s", t.rank, e)
        return []
    t.health_supported = True
    if not isinstance(doc, dict) or doc.get("healthy", True) is not False:
        t.unhealthy = ()
        return []
    raw = doc.get("unhealthy_backends")
    bad = tuple(sorted(str(b) for b in raw if isinstance(b, str))) if isinstance(raw, list) else ()
    if bad == t.unhealthy and bad:
        return []  # already reported
    t.unhealthy = bad or ("?",)
    return [
        (
            pb.EVENT_KIND_BACKEND_UNHEALTHY,
            t.rank,
            f"torch reports backend {', '.join(bad) or '(unnamed)'} unhealthy (c10d_health_check)",
        )
    ]


def _fetch_full_dumps(t: RankTracker) -> list[tuple[str, dict[str, Any]]]:
    out = []
    assert t.socket is not None
    for rec in t.recorders.values():
        handler = rec.json_handler or hook_protocol.FR_TRACE_JSON
        try:
            out.append(
                (rec.instance, json.loads(endpoint.call(t.socket, handler, timeout=FULL_TIMEOUT_S)))
            )
        except (TimeoutError, endpoint.EndpointError, ValueError) as e:
            log.debug("rank %d: %s failed: %s", t.rank, handler, e)
    return out


def _shift(value: int, offset: int) -> int:
    """pg_status counter -> collective seq (-1 stays "none")."""
    return value + offset if value >= 0 else value


def read_hook_events(t: RankTracker, run_dir: str) -> list[tuple[int, int, str]]:
    """New lines of the rank's events file (HookEvent), as (kind, rank, detail) to report."""
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
            ev = HookEvent.from_bytes(raw)
        except formats.FormatError as e:
            log.warning("rank %d: unreadable hook event line: %s", t.rank, e)
            continue
        detail = ev.detail
        if ev.kind == HookEventKind.COLLECTIVE_TIMEOUT:
            out.append((pb.EVENT_KIND_COLLECTIVE_TIMEOUT, ev.rank, detail))
        elif ev.kind == HookEventKind.BACKEND_ABORT:
            out.append((pb.EVENT_KIND_BACKEND_UNHEALTHY, ev.rank, detail))
        elif ev.kind != HookEventKind.UNCAUGHT_EXCEPTION:
            log.debug("rank %d: hook event %r not known here; ignored", t.rank, ev.kind)
        else:
            first = not t.last_exception
            t.last_exception = detail
            raised = f"thread {ev.thread or '?'}: {detail}"
            t.exceptions = [*t.exceptions, raised][-MAX_EXCEPTIONS:]
            if first and t.exited_reported:
                # The exit was seen before this line was read (both in one
                # poll): the exit went up as RANK_EXITED; now say it crashed.
                out.append(
                    (
                        pb.EVENT_KIND_RANK_CRASHED,
                        t.rank,
                        f"process gone; uncaught exception: {detail}",
                    )
                )
    return out


def read_final_status(t: RankTracker, now: float) -> bool:
    """Apply, once, the numbers the rank's hook wrote as its exit handlers ran
    (hook._at_exit); True once they are applied.

    Read as soon as the file exists, not once the process is gone: measured on
    torch 2.15 under load, a rank's interpreter takes 2.5-3 s from its exit
    handlers (which remove its endpoint) to its end, longer than a short stall
    timeout, and its last polled numbers can be a collective behind its peers'.
    Absent for a rank killed by a signal, or with no hook: its last polled
    numbers stand."""
    if t.final_status or not t.final_status_path:
        return t.final_status
    path = t.final_status_path
    try:
        doc = read_file(path, formats.FRSTATUS, formats.MAX_FRSTATUS_BYTES)
    except FileNotFoundError:
        return False
    except (OSError, formats.FormatError) as e:
        log.warning("rank %d: unreadable final FR status %s: %s", t.rank, path, e)
        t.final_status_path = ""  # said once; its polled numbers stand
        return False
    if not isinstance(doc, dict) or doc.get("schema") != formats.FRSTATUS:
        log.warning("rank %d: %s is not a %s document", t.rank, path, formats.FRSTATUS)
        t.final_status_path = ""
        return False
    t.apply_status(doc, now)
    t.final_status = True
    return True


def scan_rankinfo(run_dir: str) -> dict[int, tuple[RankInfo, str, float]]:
    """pid -> (rank info, path, mtime) for every readable rank-info file."""
    found: dict[int, tuple[RankInfo, str, float]] = {}
    for path in glob.glob(os.path.join(hook_protocol.hook_dir(run_dir), "*.json")):
        try:
            mtime = os.stat(path).st_mtime
            info = RankInfo.from_json(read_file(path, formats.RANKINFO, formats.MAX_RANKINFO_BYTES))
        except (OSError, formats.FormatError) as e:
            log.debug("skipping %s: %s", path, e)
            continue
        found[info.pid] = (info, path, mtime)
    return found
