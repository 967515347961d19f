"""Incidents: decide when one starts, gather every rank's dump, analyse, store.

One incident per hang, not one per rank: while a job has an incident
collecting or being analysed no other opens, and every (group, seq) a closed
incident covered is remembered so the same stall, or the timeouts and exits it
causes later, join that incident instead of starting a new one.

Threads: a ticker (detection, lost agents, dump deadlines) and one analysis
worker. gRPC handlers call `on_event` and `on_dump_result`; both are short.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hangwatch.analyzer.report import Finding, Report
from hangwatch.server.metrics import Metrics
from hangwatch.server.state import Command, JobRegistry, StalledGroup
from hangwatch.server.store import IncidentStore

from hangwatch import formats
from hangwatch.wire import pb

log = logging.getLogger(__name__)

# Reasons that mean "nobody could look at this rank", as opposed to a rank
# whose own process refused a dump (frozen, gone): the former are unobserved,
# not guilty, unless other ranks' FR blames them.
AGENT_UNREACHABLE = "agent unreachable"
# How many of a job's latest stored incidents are read to dedupe a stall
# seen again after a restart.
STORED_DEDUPE_LOOKBACK = 20
NO_ANSWER = "no answer before deadline"
RESTARTED = "coordinator restarted before this rank's dump arrived"
_UNOBSERVED_PREFIXES = (AGENT_UNREACHABLE, NO_ANSWER, RESTARTED)

# Events that open an incident at once. A rank exiting is not one of them:
# at a normal job end ranks exit while their peers' last reports still show
# the final collective in flight. The detector's rank-lost rule (peers alive
# and in flight, no progress for the stall timeout) catches a real crash.
EVENT_TRIGGERS = {
    pb.EVENT_KIND_WATCHDOG_DUMP: "watchdog",
    pb.EVENT_KIND_COLLECTIVE_TIMEOUT: "timeout",
    pb.EVENT_KIND_BACKEND_UNHEALTHY: "backend-unhealthy",
}

Analyze = Callable[[Path, int | None], Report]


def default_analyze(path: Path, world_size: int | None) -> Report:
    from hangwatch.analyzer import analyze_path

    report: Report = analyze_path(path, world_size=world_size)
    return report


def _fr_stored(bundle: Path, rank: int) -> bool:
    """The rank's FR file, full or tail, is in place (uploads are renamed in only when whole)."""
    d = bundle / f"rank_{rank}"
    return (d / f"{formats.FR_FILE_PREFIX}{rank}").is_file() or (
        d / f"{formats.FR_TAIL_PREFIX}{rank}"
    ).is_file()


def fmt_ranks(ranks: list[int] | set[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5": incidents can name hundreds of ranks."""
    rs = sorted(set(ranks))
    if not rs:
        return "none"
    parts: list[str] = []
    start = prev = rs[0]
    for r in rs[1:]:
        if r == prev + 1:
            prev = r
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = r
    parts.append(str(start) if start == prev else f"{start}-{prev}")
    return ",".join(parts)


@dataclass
class _Collecting:
    incident_id: str
    job_id: str
    trigger: str
    created: float  # unix
    onset: float  # coordinator monotonic: best estimate of when the hang began
    deadline: float  # coordinator monotonic
    world_size: int | None
    expected: set[int]
    asked: dict[str, list[int]]  # agent -> its ranks, asked to dump
    dumped: set[int] = field(default_factory=set)
    unreachable: dict[int, str] = field(default_factory=dict)
    answered_agents: set[str] = field(default_factory=set)
    trigger_info: dict[str, Any] = field(default_factory=dict)
    finalizing: bool = False
    tail_context: int = 0  # > 0: agents upload FR tails first (two-phase collection)

    def accounted(self) -> bool:
        return self.expected <= (self.dumped | set(self.unreachable))


class IncidentManager:
    def __init__(
        self,
        *,
        store: IncidentStore,
        registry: JobRegistry,
        metrics: Metrics,
        stall_timeout: float,
        dump_deadline: float,
        analyze: Analyze = default_analyze,
        tick_s: float | None = None,
        full_dump_max_ranks: int = 256,
        tail_context: int = 8,
    ) -> None:
        self.store = store
        self.registry = registry
        self.metrics = metrics
        self.stall_timeout = stall_timeout
        self.dump_deadline = dump_deadline
        self._analyze = analyze
        self.full_dump_max_ranks = full_dump_max_ranks
        self.tail_context = max(0, tail_context)
        # The tick is the detector's share of detection latency: a tenth of the
        # timeout, at most half a second (a pass costs ~50 ms at 4,096 ranks).
        self._tick_s = tick_s if tick_s is not None else min(0.5, max(0.05, stall_timeout / 10))
        self._lock = threading.Lock()
        self._collecting: dict[str, _Collecting] = {}
        # job -> (last incident, coordinator time it opened): while the job has
        # made no progress since, any new symptom belongs to that same hang.
        self._last: dict[str, tuple[str, float]] = {}
        self._wake = threading.Event()
        self._next_scan = 0.0  # time.monotonic() of the next stall scan
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hangwatch-analyze")
        self._futures: set[Future[None]] = set()
        self._thread = threading.Thread(target=self._run, name="hangwatch-detector", daemon=True)

    # ---- lifecycle ----------------------------------------------------------

    def start(self) -> None:
        self._recover()
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        # Queued analyses are dropped and stay `collecting`: the next start
        # recovers them. One in progress gets `timeout` seconds to store its
        # result; past that shutdown goes on and the row is recovered likewise.
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            running = [f for f in self._futures if not f.done()]
        concurrent.futures.wait(running, timeout=timeout)

    def wait_idle(self, timeout: float) -> bool:
        """True once nothing is collecting or being analysed (tests, shutdown)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            with self._lock:
                busy = bool(self._collecting) or any(not f.done() for f in self._futures)
            if not busy:
                return True
            time.sleep(0.02)
        return False

    # ---- inputs from gRPC -----------------------------------------------------

    def on_event(self, ev: pb.Event) -> str:
        """Open or join an incident for an agent's event; returns its id or ""."""
        trigger = EVENT_TRIGGERS.get(ev.kind)
        if trigger is None:
            return ""
        key = self.registry.in_flight_key(ev.job_id)
        what = pb.EventKind.Name(ev.kind).removeprefix("EVENT_KIND_").lower().replace("_", " ")
        reason = f"{what} on rank {ev.rank}" if ev.rank >= 0 else what
        if ev.detail:
            reason += f": {ev.detail[:300]}"
        onset = self.registry.now() - max(0.0, ev.age_s)
        info = {
            "kind": trigger,
            "event": pb.EventKind.Name(ev.kind),
            "rank": ev.rank,
            "detail": ev.detail[:2000],
        }
        return self._open(ev.job_id, trigger, reason, onset, [key] if key else [], info)

    def on_dump_result(self, res: pb.DumpResult) -> bool:
        with self._lock:
            inc = self._collecting.get(res.incident_id)
            if inc is None or inc.job_id != res.job_id or inc.finalizing:
                return False
            for r in res.ranks_dumped:
                if r in inc.expected:
                    inc.dumped.add(r)
                    inc.unreachable.pop(r, None)
            for f in res.failures:
                if f.rank in inc.expected and f.rank not in inc.dumped:
                    inc.unreachable[f.rank] = f.reason or "dump failed"
            inc.answered_agents.add(res.agent_id)
        self.registry.retire_command(res.job_id, res.agent_id, res.incident_id)
        self._wake.set()
        return True

    def is_collecting(self, incident_id: str) -> bool:
        with self._lock:
            return incident_id in self._collecting

    # ---- the ticker ------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._tick()
            except Exception:
                log.exception("detector tick failed")
            self._wake.wait(self._tick_s)
            self._wake.clear()

    def _tick(self) -> None:
        for job_id, agent_id in self.registry.mark_lost_agents():
            self.metrics.inc("hangwatch_agents_lost_total")
            log.warning(
                "agent %s of job %s lost (no report for %.1fs)",
                agent_id,
                job_id,
                self.registry.agent_lost_timeout,
            )
        # A scan costs ~50 ms of GIL at 4,096 ranks. Run it once per tick, not
        # on every early wake-up (each CompleteDump wakes the ticker to check
        # collection), and not for a job whose incident is still open: it
        # could only join that incident, and its collection needs the CPU.
        scan = time.monotonic() >= self._next_scan
        if scan:
            self._next_scan = time.monotonic() + self._tick_s
        for job_id in self.registry.jobs() if scan else ():
            if self.registry.open_incident(job_id) is not None:
                continue
            stalls = self.registry.stalls(job_id, over_timeout_only=True)
            if stalls:
                self._on_stalls(job_id, stalls)
        now = self.registry.now()
        due: list[_Collecting] = []
        with self._lock:
            for inc in self._collecting.values():
                if not inc.finalizing and (inc.accounted() or now >= inc.deadline):
                    inc.finalizing = True
                    due.append(inc)
        for inc in due:
            self._submit(inc)

    def _on_stalls(self, job_id: str, stalls: list[StalledGroup]) -> None:
        keys = [(s.group, s.seq) for s in stalls]
        fresh = [s for s in stalls if self.registry.handled_by(job_id, (s.group, s.seq)) is None]
        if not fresh:
            return
        # The in-memory dedupe is lost when the coordinator restarts in the
        # middle of a hang; the incidents on disk still say what they covered.
        prior = self._stored_incident_for(job_id, [(s.group, s.seq) for s in fresh])
        if prior is not None:
            self.registry.mark_handled(job_id, keys, prior)
            return
        # The earliest stalled collective explains the rest (a subgroup hang
        # blocks the default group behind it).
        first = min(fresh, key=lambda s: (-s.stalled_for_s, s.seq, s.group))
        trigger = first.kind if first.kind in ("rank-lost", "agent-lost") else "stall"
        op = f" ({first.op})" if first.op else ""
        reason = (
            f"group {first.group} stalled at seq {first.seq}{op}: "
            f"ranks {fmt_ranks(first.waiting_ranks)} waiting"
        )
        if first.not_entered_ranks:
            reason += f", ranks {fmt_ranks(first.not_entered_ranks)} not entered"
        if first.kind == "mismatch":
            reason += ", but members entered different ops at that seq"
        if first.dead_ranks:
            reason += f", ranks {fmt_ranks(first.dead_ranks)} stopped or gone"
        if first.unobserved_ranks:
            reason += f", ranks {fmt_ranks(first.unobserved_ranks)} unobserved"
        reason += f"; no progress for {first.stalled_for_s:.1f}s"
        onset = self.registry.now() - first.stalled_for_s
        info = {
            "kind": trigger,
            "stalled": [
                {
                    "group": s.group,
                    "seq": s.seq,
                    "op": s.op,
                    "kind": s.kind,
                    "waiting_ranks": s.waiting_ranks,
                    "not_entered_ranks": s.not_entered_ranks,
                    "dead_ranks": s.dead_ranks,
                    "unobserved_ranks": s.unobserved_ranks,
                    "stalled_for_s": round(s.stalled_for_s, 3),
                }
                for s in stalls
            ],
        }
        self._open(job_id, trigger, reason, onset, keys, info)

    def _stored_incident_for(self, job_id: str, keys: list[tuple[str, int]]) -> str | None:
        """A stored incident of this job that already covers one of these
        stalled (group, seq) pairs, if any (only recent incidents are read)."""
        wanted = set(keys)
        for row in self.store.list_incidents(job_id=job_id, limit=STORED_DEDUPE_LOOKBACK):
            path = self.store.incident_dir(row.id) / formats.INCIDENT_FILE
            try:
                doc = json.loads(path.read_text(encoding="utf-8"))
                stalled = (doc.get("trigger") or {}).get("stalled") or []
                covered = {(str(x["group"]), int(x["seq"])) for x in stalled}
            except (OSError, ValueError, TypeError, KeyError, AttributeError):
                continue
            if covered & wanted and self._same_processes(job_id, row.id):
                return row.id
        return None

    def _same_processes(self, job_id: str, incident_id: str) -> bool:
        """Whether the stored incident was taken from the ranks running now: a
        job restarted under the same id reaches the same seqs again, and that
        is a new hang, not the old one."""
        bundle = self.store.incident_dir(incident_id)
        for meta_path in sorted(bundle.glob(f"rank_*/{formats.META_FILE}"))[:8]:
            try:
                meta = json.loads(meta_path.read_text(encoding="utf-8"))
                rank, pid = int(meta["rank"]), meta.get("pid")
            except (OSError, ValueError, TypeError, KeyError):
                continue
            live = self.registry.rank_meta(job_id, rank)
            if pid is not None and live is not None and live.get("pid") is not None:
                return bool(live["pid"] == pid)
        return False

    # ---- opening -------------------------------------------------------------------

    def _open(
        self,
        job_id: str,
        trigger: str,
        reason: str,
        onset: float,
        keys: list[tuple[str, int]],
        info: dict[str, Any],
    ) -> str:
        with self._lock:
            current = self.registry.open_incident(job_id)
            if current is not None:
                self.registry.mark_handled(job_id, keys, current)
                return current
            for k in keys:
                prior = self.registry.handled_by(job_id, k)
                if prior is not None:
                    return prior
            last = self._last.get(job_id)
            if last is not None and not self.registry.progressed_since(job_id, last[1]):
                self.registry.mark_handled(job_id, keys, last[0])
                return last[0]
            expected = set(self.registry.expected_ranks(job_id))
            agents, unreachable = self.registry.dump_targets(job_id)
            snap = self.registry.snapshot(job_id)
            world_size = snap.world_size if snap else None
            row = self.store.create_incident(
                job_id=job_id, reason=reason, trigger=trigger, ranks_expected=sorted(expected)
            )
            now = self.registry.now()
            inc = _Collecting(
                incident_id=row.id,
                job_id=job_id,
                trigger=trigger,
                created=row.created,
                onset=min(onset, now),
                deadline=now + self.dump_deadline,
                world_size=world_size,
                expected=expected,
                asked=agents,
                unreachable={r: why for r, why in unreachable.items() if r in expected},
                trigger_info=info,
                # Above this size full dumps cost more to collect than the
                # verdict is worth waiting for (docs/scaling.md); tails first.
                tail_context=(
                    max(1, self.tail_context) if len(expected) > self.full_dump_max_ranks else 0
                ),
            )
            self._collecting[row.id] = inc
            self._last.pop(job_id, None)
            self._last[job_id] = (row.id, now)
            while len(self._last) > 4096:  # bounded under job churn: oldest first
                del self._last[next(iter(self._last))]
            self.registry.set_open_incident(job_id, row.id)
            self.registry.mark_handled(job_id, keys, row.id)
        self.metrics.inc("hangwatch_incidents_opened_total", labels={"trigger": trigger})
        log.warning("incident %s opened for job %s (%s): %s", row.id, job_id, trigger, reason)
        cmd = Command(
            kind=pb.COMMAND_KIND_DUMP,
            incident_id=row.id,
            reason=reason,
            deadline_s=self.dump_deadline,
            expires=inc.deadline,
            tail_context=inc.tail_context,
        )
        # Commands first: the agents keep their own copies of the dumps, so a
        # data dir that cannot take incident.json right now loses nothing.
        for agent_id in agents:
            self.registry.push_command(job_id, agent_id, cmd)
        try:
            self._write_incident_json(inc, reason)
        except OSError as e:
            log.error("incident %s: cannot write %s: %s", row.id, formats.INCIDENT_FILE, e)
        self._wake.set()
        return row.id

    # ---- closing -------------------------------------------------------------------

    def _submit(self, inc: _Collecting) -> None:
        fut = self._pool.submit(self._finalize, inc)
        with self._lock:
            self._futures = {f for f in self._futures if not f.done()}
            self._futures.add(fut)

    def _finalize(self, inc: _Collecting) -> None:
        report: Report | None = None
        try:
            report = self._finalize_inner(inc)
        except Exception as e:
            log.exception("incident %s: finalizing failed", inc.incident_id)
            try:
                self.store.fail_incident(inc.incident_id, error=f"{type(e).__name__}: {e}")
            except Exception:
                log.exception("incident %s: could not record the failure", inc.incident_id)
            self.metrics.inc(
                "hangwatch_incidents_total", labels={"verdict": "failed", "trigger": inc.trigger}
            )
        finally:
            with self._lock:
                self._collecting.pop(inc.incident_id, None)
            for agent_id in inc.asked:
                self.registry.retire_command(inc.job_id, agent_id, inc.incident_id)
            self.registry.set_open_incident(inc.job_id, None)
            key = self.registry.in_flight_key(inc.job_id)
            if key is not None:
                # Whatever the job is stuck on now was covered by this incident.
                self.registry.mark_handled(inc.job_id, [key], inc.incident_id)
            if report is not None and inc.tail_context:
                self._ask_full(inc, report)

    def _ask_full(self, inc: _Collecting, report: Report) -> None:
        """Phase two: the lagging ranks' full FR history, for whoever reads the
        incident next. Only theirs: the verdict is already stored, and the
        other ranks' history stays on their nodes (docs/scaling.md)."""
        wanted = set(report.lagging_ranks)
        if not wanted:
            return
        expires = self.registry.now() + max(self.dump_deadline, 60.0)
        for agent_id, ranks in inc.asked.items():
            mine = tuple(sorted(wanted.intersection(ranks)))
            if mine:
                self.registry.push_command(
                    inc.job_id,
                    agent_id,
                    Command(
                        kind=pb.COMMAND_KIND_UPLOAD_FULL,
                        incident_id=inc.incident_id,
                        reason=f"full FR history of lagging rank(s) {fmt_ranks(list(mine))}",
                        deadline_s=expires - self.registry.now(),
                        expires=expires,
                        ranks=mine,
                    ),
                )
        log.info(
            "incident %s: asked for the full FR dumps of %s", inc.incident_id, fmt_ranks(wanted)
        )

    def _finalize_inner(self, inc: _Collecting) -> Report:
        # A rank whose FR file was stored (uploads land atomically) is dumped
        # even if its agent's CompleteDump missed the deadline: at thousands
        # of ranks collection can outlast it, and the evidence is on disk.
        bundle_dir = self.store.incident_dir(inc.incident_id)
        with self._lock:
            pending = inc.expected - inc.dumped
        stored = {r for r in pending if _fr_stored(bundle_dir, r)}
        with self._lock:
            for r in stored:
                inc.dumped.add(r)
                inc.unreachable.pop(r, None)
            for agent_id, ranks in inc.asked.items():
                for r in ranks:
                    if r in inc.expected and r not in inc.dumped and r not in inc.unreachable:
                        why = (
                            NO_ANSWER
                            if agent_id not in inc.answered_agents
                            else "agent reported no result for this rank"
                        )
                        inc.unreachable[r] = (
                            f"{why} ({self.dump_deadline:.0f}s)" if why == NO_ANSWER else why
                        )
            for r in inc.expected - inc.dumped - set(inc.unreachable):
                inc.unreachable[r] = NO_ANSWER
            dumped, unreachable = set(inc.dumped), dict(inc.unreachable)
        self.store.set_dump_outcome(
            inc.incident_id, ranks_dumped=dumped, ranks_unreachable=unreachable
        )
        self.metrics.inc("hangwatch_ranks_unreachable_total", len(unreachable))
        bundle = self.store.incident_dir(inc.incident_id)
        self._write_incident_json(inc, None, dumped=dumped, unreachable=unreachable)
        self._write_unreachable_meta(inc, bundle, unreachable)
        t0 = time.monotonic()
        report = self._analyze(bundle, inc.world_size)
        self.metrics.observe("hangwatch_analysis_seconds", time.monotonic() - t0)
        report = mark_unobserved(report, unreachable)
        detection_s = self.registry.now() - inc.onset
        self.store.finish_incident(inc.incident_id, report=report, detection_s=detection_s)
        self.metrics.inc(
            "hangwatch_incidents_total", labels={"verdict": report.verdict, "trigger": inc.trigger}
        )
        self.metrics.observe("hangwatch_detection_seconds", detection_s)
        log.warning(
            "incident %s analysed in %.2fs (%.1fs after onset): %s",
            inc.incident_id,
            time.monotonic() - t0,
            detection_s,
            report.summary,
        )
        return report

    # ---- bundle files ---------------------------------------------------------------

    def _write_incident_json(
        self,
        inc: _Collecting,
        reason: str | None,
        *,
        dumped: set[int] | None = None,
        unreachable: dict[int, str] | None = None,
    ) -> None:
        bundle = self.store.incident_dir(inc.incident_id)
        bundle.mkdir(parents=True, exist_ok=True)
        path = bundle / formats.INCIDENT_FILE
        doc: dict[str, Any]
        if reason is None and path.exists():
            doc = json.loads(path.read_text(encoding="utf-8"))
        else:
            doc = {
                "schema": formats.INCIDENT,
                "id": inc.incident_id,
                "job_id": inc.job_id,
                "reason": reason or "",
                "created_unix": inc.created,
                "trigger": inc.trigger_info,
                "world_size": inc.world_size,
                "ranks_expected": sorted(inc.expected),
                # > 0: ranks' FR dumps were collected as tails (hangwatch.frtail).
                "tail_context": inc.tail_context,
            }
        doc["ranks_dumped"] = sorted(dumped if dumped is not None else inc.dumped)
        doc["ranks_unreachable"] = {
            str(r): why
            for r, why in sorted(
                (unreachable if unreachable is not None else inc.unreachable).items()
            )
        }
        _atomic_write(path, json.dumps(doc, indent=2, sort_keys=False) + "\n")

    def _write_unreachable_meta(
        self, inc: _Collecting, bundle: Path, unreachable: dict[int, str]
    ) -> None:
        """For ranks nobody dumped, record what registration knew (host, pid,
        group memberships) so the analyzer can still place them in groups."""
        for r, why in unreachable.items():
            meta_path = bundle / f"rank_{r}" / formats.META_FILE
            if meta_path.exists():
                continue
            known = self.registry.rank_meta(inc.job_id, r)
            meta: dict[str, Any] = {
                "schema": formats.RANKMETA,
                "rank": r,
                "host": None,
                "pid": None,
                "process_state": "unknown",
                "groups": [],
            }
            if known:
                meta.update(known)
            meta["reachable"] = False
            meta["sources"] = {
                "fr": "none",
                "stacks": "none",
                "gpu": "none",
                "process": "coordinator",
            }
            meta["errors"] = {"fr": why, "stacks": why}
            meta_path.parent.mkdir(parents=True, exist_ok=True)
            _atomic_write(meta_path, json.dumps(meta, indent=2) + "\n")

    # ---- restart recovery -------------------------------------------------------------

    def _recover(self) -> None:
        """Incidents left collecting by a previous run: analyse what arrived."""
        for row in self.store.list_incidents(status="collecting", limit=10_000):
            bundle = self.store.incident_dir(row.id)
            have = {r for r in row.ranks_expected if _fr_stored(bundle, r)}
            inc = _Collecting(
                incident_id=row.id,
                job_id=row.job_id,
                trigger=row.trigger,
                created=row.created,
                onset=self.registry.now(),
                deadline=self.registry.now(),
                world_size=len(row.ranks_expected) or None,
                expected=set(row.ranks_expected),
                asked={},
                dumped=have,
                unreachable={r: RESTARTED for r in row.ranks_expected if r not in have},
                finalizing=True,
            )
            with self._lock:
                self._collecting[row.id] = inc
            log.warning(
                "incident %s was collecting when the coordinator stopped; analysing what arrived",
                row.id,
            )
            self._submit(inc)


def mark_unobserved(report: Report, unreachable: dict[int, str]) -> Report:
    """Make the verdict say which ranks nobody could observe. Each gets an
    `agent-unreachable` finding (unless the analyzer already gave one, from the
    bundle's meta.json); those the FR evidence does not blame are called
    unobserved, not guilty."""
    unobserved = sorted(r for r, why in unreachable.items() if why.startswith(_UNOBSERVED_PREFIXES))
    if not unobserved:
        return report
    covered = {r for f in report.findings if f.kind == "agent-unreachable" for r in f.ranks}
    blamed = set(report.lagging_ranks)
    missing = [r for r in unobserved if r not in covered]
    if missing:
        reasons = sorted({unreachable[r] for r in missing})
        report.findings.append(
            Finding(
                kind="agent-unreachable",
                ranks=missing,
                detail=(
                    f"no dump could be collected from ranks {fmt_ranks(missing)} "
                    f"({'; '.join(reasons)[:500]}); they are unobserved"
                ),
            )
        )
    innocent = [r for r in unobserved if r not in blamed]
    why = ", ".join(
        p for p in _UNOBSERVED_PREFIXES if any(unreachable[r].startswith(p) for r in unobserved)
    )
    note = f"Ranks {fmt_ranks(unobserved)} were unobserved ({why})"
    if innocent and len(innocent) < len(unobserved):
        note += f"; ranks {fmt_ranks(innocent)} are not blamed"
    elif innocent:
        note += " and are not blamed"
    report.summary = f"{report.summary.rstrip()} {note}.".strip()
    return report


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
