"""The running coordinator: store, live state, incident manager and the gRPC
server on its own event-loop thread. The CLI adds the HTTP dashboard on top;
tests and the demo start this object directly (port 0)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import threading
import urllib.parse
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
from hangwatch.analyzer.report import Report
from hangwatch.server.heap import HeapTrim
from hangwatch.server.incidents.action_records import ActionRecord
from hangwatch.server.incidents.analysis import IsolatedAnalyzer
from hangwatch.server.incidents.finalize import Analyze
from hangwatch.server.incidents.hosts import OffenderRule
from hangwatch.server.incidents.manager import IncidentManager
from hangwatch.server.incidents.store import IncidentRow, IncidentStore
from hangwatch.server.ingest.auth import TokenAuth
from hangwatch.server.ingest.service import CoordinatorService
from hangwatch.server.ingest.uploads import MAX_FILE_BYTES
from hangwatch.server.integrations.actions import ActionPolicy, ActionRunner
from hangwatch.server.integrations.gauges import LiveGauges
from hangwatch.server.integrations.metrics import Metrics
from hangwatch.server.integrations.notifications import Notifier, dashboard_base
from hangwatch.server.integrations.offenders import OffenderWatch
from hangwatch.server.live.registry import JobRegistry
from hangwatch.server.live.stragglers import STRAGGLER_EVENT, Straggler, StragglerMonitor
from hangwatch.server.workers import Worker, Workers, executor_threads

from hangwatch.addresses import hostport
from hangwatch.config import Config
from hangwatch.tls import server_credentials
from hangwatch.wire import agent_server_options, rpc

log = logging.getLogger(__name__)


def grpc_options(config: Config) -> list[tuple[str, Any]]:
    return agent_server_options(config.auth.max_message_bytes)


def _nothing() -> None:
    return None


class Coordinator:
    def __init__(
        self,
        config: Config,
        *,
        analyze: Analyze | None = None,
        max_file_bytes: int = MAX_FILE_BYTES,
        tick_s: float | None = None,
        http_address: str = "",
        clock: Callable[[], float] | None = None,
    ) -> None:
        """`http_address`: the dashboard's, bound before the coordinator is built
        (links and Health name it). `clock`: the registry's monotonic clock; a
        coordinator on a caller's clock starts no ticker, the caller ticks it."""
        self.config = config
        self.http_address = http_address
        self.data_dir = Path(config.serve.data_dir).resolve()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.token = config.auth.resolved_token()
        # SQLite in the data directory, or the PostgreSQL that many jobs'
        # coordinators share (--store); the bundles stay in the data directory.
        self.store = IncidentStore.open(
            config.serve.store,
            self.data_dir,
            password=config.serve.resolved_store_password(),
            incidents_root=Path(config.serve.incidents_dir) if config.serve.incidents_dir else None,
        )
        log.info("incident store: %s (%s)", self.store.describe(), self.store.kind)
        self.metrics = Metrics()
        # Built with no webhooks too, so that anything may publish to it.
        self.notifier = Notifier(
            config.respond.notify_url, metrics=self.metrics, link=self.incident_url
        )
        if config.respond.notify_url:
            self.store.on_status_change.append(self.notifier.publish_incident)
            watch = OffenderWatch(
                store=self.store,
                rule=OffenderRule.from_config(config),
                publish=self.notifier.publish,
                link=self.incident_url,
            )
            self.store.on_status_change.append(watch.on_status_change)
        self.registry = JobRegistry(
            agent_lost_timeout=config.detect.agent_lost_timeout,
            stall_timeout=config.detect.stall_timeout,
            startup_grace=config.detect.startup_grace,
            **({"clock": clock} if clock is not None else {}),
        )
        # Agents' bundles are untrusted: by default analyse them in a capped
        # child process (tests may pass an in-process analyze instead).
        self._isolated: IsolatedAnalyzer | None = None
        if analyze is None:
            self._isolated = IsolatedAnalyzer(
                memory_limit_bytes=config.serve.analyzer_memory_mb << 20
            )
            analyze = self._isolated
        self.actions = ActionRunner(
            ActionPolicy.from_config(config),
            store=self.store,
            registry=self.registry,
            metrics=self.metrics,
            publish=self._publish_action,
        )
        self.incidents = IncidentManager(
            store=self.store,
            registry=self.registry,
            metrics=self.metrics,
            stall_timeout=config.detect.stall_timeout,
            dump_deadline=config.detect.dump_deadline,
            analyze=analyze,
            tick_s=tick_s,
            full_dump_max_ranks=config.detect.full_dump_max_ranks,
            tail_context=config.detect.tail_context,
            on_analyzed=self.actions.on_analyzed,
        )
        self.stragglers = StragglerMonitor(
            tick_s=config.agent.poll_interval, on_flag=self._straggler_flagged
        )
        self.service = CoordinatorService(
            registry=self.registry,
            stragglers=self.stragglers,
            store=self.store,
            incidents=self.incidents,
            actions=self.actions,
            metrics=self.metrics,
            max_file_bytes=max_file_bytes,
            dashboard_url=http_address,
        )
        # /metrics serves what this coordinator sees: registry, store, stragglers, settings.
        self.metrics.add_collector(
            LiveGauges(self.registry, self.store, config, stragglers=lambda: self.stragglers)
        )
        self._scoring_stop = threading.Event()
        self._trim_heap = HeapTrim()
        self._scoring = threading.Thread(
            target=self._score_stragglers, name="hangwatch-stragglers", daemon=True
        )
        self.grpc_port = 0
        # The handlers' blocking work (SQLite, bundle files: asyncio.to_thread)
        # runs on this pool, made here so that its threads are declared. The
        # loop and its thread are made when gRPC starts: a coordinator built and
        # never started leaves no open loop behind.
        self._io_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="hangwatch-grpc-io")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        self._server: grpc.aio.Server | None = None
        self._start_timeout_s = 15.0
        self._grace_s = 3.0
        ticker = clock is None
        # Declared order: what everything else relies on first, the intake
        # (gRPC) last, so a stop, in reverse, ends the intake before the rest.
        self.workers = Workers(
            [
                Worker(
                    name="analyzer",
                    start=self._isolated.warm if self._isolated else _nothing,
                    stop=lambda left: self._isolated.close() if self._isolated else None,
                    threads=lambda: self._isolated.threads() if self._isolated else [],
                ),
                Worker(
                    name="notifier",
                    start=self.notifier.start,
                    stop=self.notifier.stop,
                    threads=self.notifier.threads,
                ),
                Worker(
                    name="actions",
                    start=_nothing,
                    stop=lambda left: self.actions.close(),
                    threads=self.actions.threads,
                ),
                Worker(
                    name="incidents",
                    # Recovered incidents publish their verdicts: after the notifier.
                    start=lambda: self.incidents.start(ticker=ticker),
                    stop=self.incidents.stop,
                    threads=self.incidents.threads,
                ),
                Worker(
                    name="stragglers",
                    start=self._scoring.start,
                    stop=self._stop_scoring,
                    threads=lambda: [self._scoring],
                ),
                Worker(
                    name="grpc",
                    start=self._start_grpc,
                    stop=self._stop_grpc,
                    threads=lambda: [
                        *([self._loop_thread] if self._loop_thread else []),
                        *executor_threads(self._io_pool),
                    ],
                ),
            ]
        )
        self._stopped = False

    def _score_stragglers(self) -> None:
        # Off the gRPC loop: scoring a tick of 4,096 ranks is tens of ms of Python.
        while not self._scoring_stop.wait(self.stragglers.tick_s / 2):
            try:
                scored = self.stragglers.score_ready()
            except Exception:
                log.exception("straggler scoring failed")
                continue
            if scored:
                # The tick's arrays were just freed, their holes still whole
                # (server/heap.py says what stays resident otherwise).
                self._trim_heap()

    def _straggler_flagged(self, job_id: str, s: Straggler) -> None:
        self.metrics.inc("hangwatch_stragglers_flagged_total")
        base = dashboard_base(self.config.serve.public_url, self.http_address)
        url = f"{base}/jobs/{urllib.parse.quote(job_id, safe='')}"
        item = {"id": f"{job_id}/rank-{s.rank}", "job": job_id, **dataclasses.asdict(s), "url": url}
        self.notifier.publish(
            STRAGGLER_EVENT,
            item,
            text=(
                f"[hangwatch] job {job_id}: rank {s.rank} ({s.host or 'unknown host'}) is a "
                f"straggler: its peers wait for it {100 * s.score:.0f}% of the time, "
                f"{s.late_ms:.1f} ms late per collective ({s.kind} side). {url}"
            ),
        )

    def _publish_action(self, event: str, row: IncidentRow, rec: ActionRecord) -> None:
        """`incident.action`: the incident as listed, plus the action that finished."""
        item = row.summary_fields()
        item["action"] = {"kind": rec.kind, "status": rec.status, "summary": rec.summary}
        text = f"[hangwatch] job {row.job_id}: {rec.kind} {rec.status}: {rec.summary}"
        self.notifier.publish(event, item, text=f"{text} {self.incident_url(row.id)}")

    def incident_url(self, incident_id: str) -> str:
        """The incident's dashboard page, as people outside this host open it."""
        base = dashboard_base(self.config.serve.public_url, self.http_address)
        return f"{base}/incidents/{incident_id}"

    @property
    def trace(self) -> Callable[[Path, Report | None], dict[str, Any]] | None:
        """Builds a bundle's trace-event document in the capped analyzer process
        (None with an in-process analyze: the page builds it in-process)."""
        return self._isolated.trace if self._isolated is not None else None

    @property
    def grpc_address(self) -> str:
        return hostport(self.config.serve.host, self.grpc_port)

    def start(self, timeout: float = 15.0) -> int:
        """Start every worker in order; returns the gRPC port."""
        self._start_timeout_s = timeout
        try:
            self.workers.start()
        except BaseException:
            self.store.close()
            raise
        log.info("gRPC serving on %s", self.grpc_address)
        log.info("heap: %s", self._trim_heap.describe())
        return self.grpc_port

    def _start_grpc(self) -> None:
        loop = self._loop = asyncio.new_event_loop()
        loop.set_default_executor(self._io_pool)
        self._loop_thread = threading.Thread(
            target=loop.run_forever, name="hangwatch-grpc", daemon=True
        )
        self._loop_thread.start()
        try:
            self.grpc_port = asyncio.run_coroutine_threadsafe(self._astart(), loop).result(
                self._start_timeout_s
            )
        except BaseException:
            self._stop_loop(5.0)
            raise

    async def _astart(self) -> int:
        interceptors = [TokenAuth(self.token, self.metrics)] if self.token else []
        server = grpc.aio.server(interceptors=interceptors, options=grpc_options(self.config))
        rpc.add_CoordinatorServicer_to_server(self.service, server)
        addr = hostport(self.config.serve.host, self.config.serve.grpc_port)
        creds = server_credentials(self.config.auth)
        port = server.add_secure_port(addr, creds) if creds else server.add_insecure_port(addr)
        if not port:
            raise OSError(f"cannot bind gRPC on {addr}")
        await server.start()
        self._server = server
        return port

    def stop(self, grace: float = 3.0, bound_s: float | None = None) -> None:
        """Bounded: every worker, last started first, within `bound_s` (default
        `grace` + 5 s) in all; gRPC calls in flight get `grace`, then are cancelled."""
        if self._stopped:
            return
        self._stopped = True
        self._grace_s = grace
        self.workers.stop(grace + 5.0 if bound_s is None else bound_s)
        self.store.close()

    def _stop_grpc(self, left: float) -> None:
        if self._server is not None and self._loop is not None:
            self.service.stopping.set()
            self._loop.call_soon_threadsafe(self.service.shutdown_streams)
            grace = min(self._grace_s, left)
            try:
                asyncio.run_coroutine_threadsafe(self._server.stop(grace), self._loop).result(
                    max(0.1, left)
                )
            except (concurrent.futures.TimeoutError, RuntimeError):
                log.warning("gRPC server did not stop within %.1fs", left)
        self._stop_loop(max(0.1, left))

    def _stop_scoring(self, left: float) -> None:
        self._scoring_stop.set()
        if self._scoring.is_alive():
            self._scoring.join(left)

    def _stop_loop(self, left: float) -> None:
        self._io_pool.shutdown(wait=False, cancel_futures=True)
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        loop.call_soon_threadsafe(loop.stop)
        if self._loop_thread is not None and self._loop_thread.is_alive():
            self._loop_thread.join(left)
        if not loop.is_running():
            loop.close()

    def __enter__(self) -> Coordinator:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
