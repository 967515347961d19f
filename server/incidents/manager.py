"""Incidents: decide when one starts, gather every rank's dump, analyse, store.

One incident per hang, not one per rank: while a job has an incident
collecting or being analysed no other opens, and every (group, seq) a closed
incident covered is remembered so the same stall, or the timeouts and exits it
causes later, join that incident instead of starting a new one.

Threads: a ticker (detection, lost agents, dump deadlines) and one analysis
worker. gRPC handlers call `on_event` and `on_dump_result`; both are short.
The manager tells time only through the registry's clock, so tests can drive
the whole lifecycle with a fake one by calling `tick()` themselves.

The stages live in their own modules of this package: `triggers` (what opens
one), `collection` (asking for dumps, tracking answers), `bundle` (the files
the coordinator writes), `finalize` (analysis and the stored verdict) and
`lifecycle` (after the verdict).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from hangwatch.analyzer.report import Report
from hangwatch.server.incidents.bundle import write_incident_json
from hangwatch.server.incidents.collection import (
    Collection,
    fr_stored,
    tail_context_for,
)
from hangwatch.server.incidents.finalize import (
    Analyze,
    analyse_and_store,
    default_analyze,
    full_dump_commands,
    reanalyse_with_late,
    record_failure,
)
from hangwatch.server.incidents.lifecycle import (
    Watch,
    late_hint,
    publish_states,
    step,
    waits_on,
)
from hangwatch.server.incidents.store import (
    IncidentRow,
    IncidentStatus,
    IncidentStore,
    disk_full,
    refusal,
)
from hangwatch.server.incidents.triggers import (
    Trigger,
    event_trigger,
    quiet_trigger,
    stall_trigger,
    stored_incident_for,
)
from hangwatch.server.integrations.metrics import Metrics
from hangwatch.server.live.detector import JobQuiet
from hangwatch.server.live.registry import JobRegistry
from hangwatch.server.live.views import StalledGroup
from hangwatch.server.workers import executor_threads

from hangwatch import formats
from hangwatch.rankspec import format_ranks
from hangwatch.wire import pb

log = logging.getLogger(__name__)

# Jobs whose last incident is remembered for joining later symptoms to it.
LAST_INCIDENTS = 4096

# A verdict the full disk refused is tried again this often. Cheap: the
# analysis is kept, so a retry writes incident.json and one store row.
DISK_FULL_RETRY_S = 5.0

# Called once an incident opened in this run has its verdict stored:
# (incident, job, registry time it opened, report). server.actions acts on it.
OnAnalyzed = Callable[[str, str, float, Report], None]


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
        on_analyzed: OnAnalyzed | None = None,
    ) -> None:
        self.store = store
        self._on_analyzed = on_analyzed
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
        # Notified whenever an incident leaves collection or an analysis ends.
        self._idle = threading.Condition(self._lock)
        self._collecting: dict[str, Collection] = {}
        # job -> (last incident, coordinator time it opened, what its stall
        # waited on): until the job moved on since, a new symptom is that hang.
        self._last: dict[str, tuple[str, float, list[tuple[str, int, list[int]]]]] = {}
        # Incidents opened in this run and not yet resolved, ended or failed
        # (incident_lifecycle): looked at on every tick.
        self._watch: dict[str, Watch] = {}
        self._wake = threading.Event()
        self._next_scan = float("-inf")  # registry clock: the next stall scan
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hangwatch-analyze")
        self._futures: set[Future[None]] = set()
        # Incident -> ranks whose dumps arrived after its verdict, not yet
        # analysed in. At thousands of ranks many agents can answer just past the
        # deadline: their results coalesce into one re-analysis, not one each.
        self._late: dict[str, set[int]] = {}
        # Incidents whose verdict or state change, and jobs whose new incident,
        # the full disk refused: said and counted once, not on every attempt
        # (`_refused`).
        self._full_noted: set[str] = set()
        self._full_jobs: set[str] = set()
        self._thread = threading.Thread(target=self._run, name="hangwatch-detector", daemon=True)

    # ---- lifecycle ----------------------------------------------------------

    def start(self, *, ticker: bool = True) -> None:
        """Recover what a previous run left, then tick on a thread of its own;
        `ticker=False`: the caller ticks (a coordinator on a test's fake clock)."""
        self._recover()
        self._publish()
        if ticker:
            self._thread.start()

    def threads(self) -> list[threading.Thread]:
        """The ticker and the analysis pool's worker."""
        return [self._thread, *executor_threads(self._pool)]

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
        with self._idle:
            while self._collecting or any(not f.done() for f in self._futures):
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
            return True

    # ---- inputs from gRPC -----------------------------------------------------

    def on_event(self, ev: pb.Event) -> str:
        """Open or join an incident for an agent's event; returns its id or ""."""
        trigger = event_trigger(ev, self.registry)
        return self._open(ev.job_id, trigger) if trigger is not None else ""

    def on_dump_result(self, res: pb.DumpResult) -> bool:
        with self._lock:
            inc = self._collecting.get(res.incident_id)
            if inc is not None:
                if inc.job_id != res.job_id or inc.finalizing:
                    return False
                inc.apply_result(res)
        if inc is None:
            return self._late_result(res)
        self.registry.retire_command(res.job_id, res.agent_id, res.incident_id)
        self._wake.set()
        return True

    def _late_result(self, res: pb.DumpResult) -> bool:
        """A CompleteDump for an incident whose verdict is in: accepted when it
        brings ranks the verdict had as unreachable (their files were stored as
        they came), which are then analysed in with the rest, off this thread.
        Rare (a partition past the lost-agent timeout), so one row read here."""
        row = self.store.get_incident(res.incident_id)
        if row is None or row.job_id != res.job_id:
            return False
        if row.status in (IncidentStatus.COLLECTING, IncidentStatus.FAILED):
            return False
        late = {r for r in res.ranks_dumped if r in row.ranks_unreachable}
        if not late:
            return False
        with self._lock:
            queued = row.id in self._late
            self._late.setdefault(row.id, set()).update(late)
        if not queued:
            self._track(self._pool.submit(self._revise, row.id))
        self.registry.retire_command(res.job_id, res.agent_id, res.incident_id)
        return True

    def _revise(self, incident_id: str) -> None:
        with self._lock:
            late = self._late.pop(incident_id, set())
        try:
            row = self.store.get_incident(incident_id)
            if row is None:
                return
            bundle = self.store.incident_dir(incident_id)
            arrived = fr_stored(bundle, late)
            if not arrived:
                log.warning(
                    "incident %s: ranks %s reported dumped after the verdict, but no FR file "
                    "of theirs is stored; verdict unchanged",
                    incident_id,
                    format_ranks(late),
                )
                return
            dumped = set(row.ranks_dumped) | arrived
            unreachable = {r: w for r, w in row.ranks_unreachable.items() if r not in arrived}
            world = len(row.ranks_expected) or None
            reanalyse_with_late(
                incident_id, world, dumped, unreachable, store=self.store, analyze=self._analyze
            )
        except Exception:
            log.exception("incident %s: re-analysis with late dumps failed", incident_id)
        finally:
            self._publish()

    def is_collecting(self, incident_id: str) -> bool:
        with self._lock:
            return incident_id in self._collecting

    # ---- the ticker ------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception:
                log.exception("detector tick failed")
            self._wake.wait(self._tick_s)
            self._wake.clear()

    def tick(self) -> None:
        """One pass: lost agents, stall detection, collections due to finalize.
        The ticker thread calls it; tests on a fake clock call it directly."""
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
        now = self.registry.now()
        scan = now >= self._next_scan
        if scan:
            self._next_scan = now + self._tick_s
        for job_id in self.registry.jobs() if scan else ():
            if self.registry.open_incident(job_id) is not None:
                continue
            # One job's failure to open an incident must not stop the others'
            # detection, nor the collections and lifecycles below.
            try:
                stalls = self.registry.stalls(job_id, over_timeout_only=True)
                if stalls:
                    self._on_stalls(job_id, stalls)
                elif (quiet := self.registry.quiet(job_id)) is not None:
                    self._on_quiet(job_id, quiet)
            except Exception as e:
                self._refused(
                    self._full_jobs,
                    job_id,
                    e,
                    f"job {job_id}: stall detection failed",
                    f"job {job_id}: cannot open an incident: the stall is shown live, and "
                    "the incident opens once space frees (or the store is back)",
                )
                continue
            self._full_jobs.discard(job_id)
        self._ask_recovered()
        now = self.registry.now()
        due: list[Collection] = []
        with self._lock:
            for inc in self._collecting.values():
                if inc.due(now):
                    inc.finalizing = True
                    if inc.recovering:
                        inc.settle_recovered()
                    due.append(inc)
        for inc in due:
            self._submit(inc)
        self._lifecycle()

    def _lifecycle(self) -> None:
        """Resolve incidents whose job progressed again; end those whose job stopped."""
        with self._lock:
            watches = list(self._watch.values())
        done: list[str] = []
        for w in watches:
            try:
                if step(w, registry=self.registry, store=self.store, metrics=self.metrics):
                    done.append(w.incident_id)
            except Exception as e:
                self._refused(
                    self._full_noted,
                    w.incident_id,
                    e,
                    f"incident {w.incident_id}: lifecycle check failed",
                    f"incident {w.incident_id}: its state change waits and is stored once "
                    "space frees (or the store is back)",
                )
                continue
            self._full_noted.discard(w.incident_id)
        if done:
            with self._lock:
                for i in done:
                    self._watch.pop(i, None)
            self._publish()

    def _publish(self) -> None:
        try:
            publish_states(self.store, self.metrics)
        except Exception:
            log.exception("could not count incidents by state")

    def _on_stalls(self, job_id: str, stalls: list[StalledGroup]) -> None:
        keys = [(s.group, s.seq) for s in stalls]
        fresh = [s for s in stalls if self.registry.handled_by(job_id, (s.group, s.seq)) is None]
        if not fresh:
            return
        prior = stored_incident_for(
            self.store, self.registry, job_id, [(s.group, s.seq) for s in fresh]
        )
        if prior is not None:
            self.registry.mark_handled(job_id, keys, prior)
            return
        self._open(job_id, stall_trigger(stalls, fresh, self.registry.now()))

    def _on_quiet(self, job_id: str, quiet: JobQuiet) -> None:
        trigger = quiet_trigger(quiet, self.registry.now())
        if all(self.registry.handled_by(job_id, k) is None for k in trigger.keys):
            self._open(job_id, trigger)

    # ---- opening -------------------------------------------------------------------

    def _open(self, job_id: str, trigger: Trigger) -> str:
        keys = trigger.keys
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
            # Until the job moves on (registry.moved_past), a new symptom is the
            # last incident's hang: the crash of a stopped hung job's survivors
            # ("connection closed by peer") included. A restarted job (new
            # processes, whose first numbers are a baseline and not progress)
            # has moved on by definition.
            if (
                last is not None
                and not self.registry.moved_past(job_id, last[1], last[2])
                and not self.registry.restarted_since(job_id, last[1])
            ):
                self.registry.mark_handled(job_id, keys, last[0])
                return last[0]
            expected = set(self.registry.expected_ranks(job_id))
            agents, unreachable = self.registry.dump_targets(job_id)
            # The world size alone, not a snapshot: building the job's whole
            # live view took 0.5 s at 4,096 ranks, on the path to the first
            # DUMP command (py-spy of benchmarks/coordinator_load.py).
            world_size = self.registry.world_size(job_id)
            row = self.store.create_incident(
                job_id=job_id,
                reason=trigger.reason,
                trigger=trigger.kind,
                ranks_expected=sorted(expected),
            )
            now = self.registry.now()
            inc = Collection(
                incident_id=row.id,
                job_id=job_id,
                trigger=trigger.kind,
                created=row.created,
                onset=min(trigger.onset, now),
                deadline=now + self.dump_deadline,
                world_size=world_size,
                expected=expected,
                asked=agents,
                unreachable={r: why for r, why in unreachable.items() if r in expected},
                trigger_info=trigger.info,
                tail_context=tail_context_for(
                    len(expected), self.full_dump_max_ranks, self.tail_context
                ),
            )
            self._collecting[row.id] = inc
            waits = waits_on(trigger.info)
            self._watch[row.id] = Watch(
                incident_id=row.id,
                job_id=job_id,
                trigger=trigger.kind,
                opened=now,
                onset=inc.onset,
                late_hint=late_hint(trigger.info),
                waits_on=waits,
            )
            self._last.pop(job_id, None)
            self._last[job_id] = (row.id, now, waits)
            while len(self._last) > LAST_INCIDENTS:  # bounded under job churn: oldest first
                del self._last[next(iter(self._last))]
            self.registry.set_open_incident(job_id, row.id)
            self.registry.mark_handled(job_id, keys, row.id)
        self.metrics.inc("hangwatch_incidents_opened_total", labels={"trigger": trigger.kind})
        self._publish()
        log.warning(
            "incident %s opened for job %s (%s): %s", row.id, job_id, trigger.kind, trigger.reason
        )
        cmd = inc.dump_command(trigger.reason, self.dump_deadline)
        # Commands first: the agents keep their own copies of the dumps, so a
        # data dir that cannot take incident.json right now loses nothing.
        for agent_id in agents:
            self.registry.push_command(job_id, agent_id, cmd)
        try:
            write_incident_json(self.store.incident_dir(row.id), inc, trigger.reason)
        except OSError as e:
            log.error("incident %s: cannot write %s: %s", row.id, formats.INCIDENT_FILE, e)
        self._wake.set()
        return row.id

    # ---- closing -------------------------------------------------------------------

    def _submit(self, inc: Collection) -> None:
        self._track(self._pool.submit(self._finalize, inc))

    def _track(self, fut: Future[None]) -> None:
        with self._lock:
            self._futures = {f for f in self._futures if not f.done()}
            self._futures.add(fut)
        # Outside the lock: a future already done runs the callback right here.
        fut.add_done_callback(self._notify_idle)

    def _notify_idle(self, _fut: Future[None]) -> None:
        with self._idle:
            self._idle.notify_all()

    def _finalize(self, inc: Collection) -> None:
        report: Report | None = None
        try:
            report = self._finalize_inner(inc)
        except Exception as e:
            if disk_full(e):
                self._wait_for_space(inc, e)
                return
            log.exception("incident %s: finalizing failed", inc.incident_id)
            record_failure(inc, e, store=self.store, metrics=self.metrics)
        self._close(inc, report)

    def _refused(
        self, noted: set[str], key: str, error: Exception, failed: str, waits: str
    ) -> None:
        """A step that raised and is tried again (every tick, or every
        DISK_FULL_RETRY_S). A full data directory is said and counted once per
        `key` until the step succeeds and the caller discards the key, not on
        every attempt; any other error is logged with its traceback each time."""
        if not disk_full(error):
            log.error("%s", failed, exc_info=error)
            return
        if key in noted:
            return
        noted.add(key)
        self.metrics.inc("hangwatch_incident_writes_deferred_total")
        log.error("%s (%s: %s)", waits, refusal(error), error)

    def _wait_for_space(self, inc: Collection, error: Exception) -> None:
        """The disk refused the verdict: the incident stays open, collecting
        (every dump it holds stays; agents keep their copies), and is finalized
        again once space frees, with the verdict already made. Marking it
        failed would lose a verdict that every dump on disk still supports."""
        self._refused(
            self._full_noted,
            inc.incident_id,
            error,
            f"incident {inc.incident_id}: finalizing failed",
            f"incident {inc.incident_id}: its verdict waits and is stored once space "
            f"frees or the store is back (tried again every {DISK_FULL_RETRY_S:.0f}s)",
        )
        with self._idle:
            inc.retry_at = self.registry.now() + DISK_FULL_RETRY_S
            inc.finalizing = False
            self._idle.notify_all()

    def _close(self, inc: Collection, report: Report | None) -> None:
        """The incident leaves collection: analysed (`report`) or failed."""
        self._full_noted.discard(inc.incident_id)
        opened: float | None = None
        waits: list[tuple[str, int, list[int]]] = []
        with self._idle:
            self._collecting.pop(inc.incident_id, None)
            w = self._watch.get(inc.incident_id)
            if w is not None:
                w.outcome = IncidentStatus.ANALYZED if report is not None else IncidentStatus.FAILED
                opened, waits = w.opened, w.waits_on
            self._idle.notify_all()
        for agent_id in inc.asked:
            self.registry.retire_command(inc.job_id, agent_id, inc.incident_id)
        self.registry.set_open_incident(inc.job_id, None)
        key = self.registry.in_flight_key(inc.job_id)
        # Whatever the job is stuck on now was covered by this incident,
        # unless the job moved on since it opened: then the stall cleared
        # and what it waits on now is a later one of its own.
        moved = opened is not None and self.registry.moved_past(inc.job_id, opened, waits)
        if key is not None and not moved:
            self.registry.mark_handled(inc.job_id, [key], inc.incident_id)
        if report is not None and inc.tail_context:
            self._ask_full(inc, report)
        # Only incidents opened in this run: one recovered after a restart
        # was acted on, or not, by the run that opened it.
        acts = report is not None and opened is not None and not inc.recovering
        if acts and report is not None and opened is not None and self._on_analyzed:
            try:
                self._on_analyzed(inc.incident_id, inc.job_id, opened, report)
            except Exception:
                log.exception("incident %s: could not hand it to the actions", inc.incident_id)
        self._publish()
        self._wake.set()  # the lifecycle check may now close it

    def _finalize_inner(self, inc: Collection) -> Report:
        bundle = self.store.incident_dir(inc.incident_id)
        with self._lock:
            pending = inc.pending()
        # File checks outside the lock: thousands of stats must not hold up
        # the gRPC handlers.
        stored = fr_stored(bundle, pending)
        with self._lock:
            dumped, unreachable = inc.settle(stored, self.dump_deadline)
        if inc.asked and not inc.recovering:  # a recovered one began in an earlier run
            opened = inc.deadline - self.dump_deadline
            self.metrics.observe("hangwatch_collection_seconds", self.registry.now() - opened)
        return analyse_and_store(
            inc,
            dumped,
            unreachable,
            store=self.store,
            registry=self.registry,
            metrics=self.metrics,
            analyze=self._analyze,
        )

    def _ask_full(self, inc: Collection, report: Report) -> None:
        cmds = full_dump_commands(inc, report, self.registry.now(), self.dump_deadline)
        for agent_id, cmd in cmds:
            self.registry.push_command(inc.job_id, agent_id, cmd)
        if report.lagging_ranks:
            log.info(
                "incident %s: asked for the full FR dumps of %s",
                inc.incident_id,
                format_ranks(set(report.lagging_ranks)),
            )

    # ---- restart recovery -------------------------------------------------------------

    def _recover(self) -> None:
        """Incidents left collecting by a previous run: finish their collection.

        Each is watched like one opened in this run (it resolves on progress
        seen from now on, ends with its job) and is the job's open incident, so
        the same stall detected again joins it rather than opening a second."""
        now = self.registry.now()
        wait_s = self.registry.agent_lost_timeout + self.dump_deadline
        for row in self.store.list_incidents(status=IncidentStatus.COLLECTING, limit=10_000):
            inc = Collection.recovered(row, self.store.incident_dir(row.id), now, wait_s)
            with self._lock:
                self._collecting[row.id] = inc
                # Not "ended" before its agents had the time to come back: an
                # agent's deferred upload can finish the collection before the
                # agent re-registers the job (measured live: analysed 0.8 s after
                # the restart, and ended at once as a job nobody tracked).
                self._watch[row.id] = Watch.recovered(
                    row, now, onset=_onset_of(row, now), end_not_before=now + wait_s
                )
            log.warning(
                "incident %s was collecting when the coordinator stopped; asking its agents "
                "again as they re-register (%d of %d ranks on disk)",
                row.id,
                len(inc.dumped),
                len(inc.expected),
            )
        # Analysed and still open (the hang outlived the coordinator that named
        # it): watched from now on, so it resolves when the job really moves, or
        # ends with it. A re-registration is a baseline, not progress (issue 27).
        for row in self.store.list_incidents(status=IncidentStatus.ANALYZED, limit=10_000):
            if not row.is_open:
                continue
            with self._lock:
                self._watch[row.id] = Watch.recovered(
                    row, now, onset=_onset_of(row, now), end_not_before=now + wait_s
                )
            log.info("incident %s is open from before the restart; watching it", row.id)

    def _ask_recovered(self) -> None:
        """Each re-registered agent of a recovered incident's job is asked once
        more; the incident becomes the job's open one as soon as the job is back."""
        with self._lock:
            recovering = [i for i in self._collecting.values() if i.recovering and not i.finalizing]
        for inc in recovering:
            agents, _ = self.registry.dump_targets(inc.job_id)
            fresh = {a: ranks for a, ranks in agents.items() if a not in inc.asked}
            if not fresh:
                continue
            if self.registry.open_incident(inc.job_id) is None:
                self.registry.set_open_incident(inc.job_id, inc.incident_id)
            cmd = inc.dump_command(
                "the coordinator restarted during collection", self.dump_deadline
            )
            with self._lock:
                inc.asked.update(fresh)
            for agent_id in fresh:
                self.registry.push_command(inc.job_id, agent_id, cmd)


def _onset_of(row: IncidentRow, now: float) -> float:
    """A recovered incident's onset on this run's clock (`now`): its creation,
    mapped across the restart; the stall began at least that long ago."""
    return now - max(0.0, time.time() - row.created)
