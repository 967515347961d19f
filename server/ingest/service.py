"""The Coordinator gRPC service (grpc.aio) and its bearer-token interceptor.

asyncio, not a thread pool: every agent holds a WatchCommands stream open for
its whole life, and a thread per stream would cap the number of nodes at the
pool size and starve the unary calls behind them. Handlers only touch
thread-safe state (short locks); SQLite writes and fsyncs go to worker threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import Any, Final, NoReturn

import grpc
from hangwatch.server.incidents.manager import IncidentManager
from hangwatch.server.incidents.store import IncidentStore, disk_full
from hangwatch.server.ingest import validate
from hangwatch.server.ingest.batches import (
    FileBatch,
    GroupSync,
    HeldBytes,
    discard,
    rename_in,
    write_parts,
)
from hangwatch.server.ingest.requests import next_request
from hangwatch.server.ingest.uploads import MAX_FILE_BYTES, FileUpload, UploadError, UploadTracker
from hangwatch.server.ingest.validate import Invalid
from hangwatch.server.ingest.watches import RelayedWatches, messages
from hangwatch.server.integrations.actions import ActionRunner
from hangwatch.server.integrations.metrics import Metrics
from hangwatch.server.live.registry import JobRegistry, StaleSession
from hangwatch.server.live.stragglers import StragglerMonitor

from hangwatch import __version__, progress_columns
from hangwatch.formats import nodearchive
from hangwatch.wire import MAX_RELAYED_REPORTS, pb, rpc

log = logging.getLogger(__name__)

# How often an idle command stream re-checks its session and shutdown, as a
# backstop only: a new command, a replaced session (Mailbox.inherit), an
# evicted job and shutdown each wake the stream at once. Every agent holds one
# stream: at 1 s, 512 agents woke the coordinator's loop 512 times a second
# for nothing (an asyncio.wait_for each: a task, a timer and a cancel).
STREAM_RECHECK_S = 30.0
# Incidents whose (job, expected ranks) the upload path keeps at hand.
INCIDENT_KEY_CACHE = 64

# hangwatch_progress_ranks_total's two series.
_COLUMNS: Final = {"form": "columns"}
_MESSAGES: Final = {"form": "messages"}
# Relays named in the metrics' `relay` label: a few per rack, so a few hundred
# at the largest jobs; past this many, ids are counted as "other" (a relay
# that changed its id on every reconnect must not grow the scrape for ever).
MAX_RELAY_LABELS: Final = 1024


class CoordinatorService(rpc.CoordinatorServicer):
    def __init__(
        self,
        *,
        registry: JobRegistry,
        store: IncidentStore,
        incidents: IncidentManager,
        metrics: Metrics,
        poll_interval_s: float = 0.0,
        max_file_bytes: int = MAX_FILE_BYTES,
        stragglers: StragglerMonitor | None = None,
        actions: ActionRunner | None = None,
        dashboard_url: str = "",
    ) -> None:
        self.actions = actions
        self.registry = registry
        self.stragglers = stragglers
        self.store = store
        self.incidents = incidents
        self.metrics = metrics
        self.poll_interval_s = poll_interval_s
        self.max_file_bytes = max_file_bytes
        self.uploads = UploadTracker()
        self.held = HeldBytes()
        self.group_sync = GroupSync(store.incidents_root)
        self._incident_keys: OrderedDict[str, tuple[str, frozenset[int]]] = OrderedDict()
        self.stopping = threading.Event()
        # The HTTP side is bound before the coordinator is built; Health reports it.
        self.dashboard_url = dashboard_url
        self._streams: set[asyncio.Event] = set()
        # RelayProgress streams open per relay label (on the gRPC loop only).
        self._relay_streams: dict[str, int] = {}

    def shutdown_streams(self) -> None:
        """Ask every open command stream to end (called on the server's loop)."""
        self.stopping.set()
        for ev in list(self._streams):
            ev.set()

    # ---- helpers -----------------------------------------------------------

    def _ok(self, method: str) -> None:
        self.metrics.inc("hangwatch_grpc_requests_total", labels={"method": method, "code": "OK"})

    async def _fail(
        self,
        context: grpc.aio.ServicerContext[Any, Any],
        method: str,
        code: grpc.StatusCode,
        msg: str,
    ) -> NoReturn:
        self.metrics.inc(
            "hangwatch_grpc_requests_total", labels={"method": method, "code": code.name}
        )
        log.info("%s rejected (%s): %s", method, code.name, msg)
        await context.abort(code, msg)
        raise AssertionError("unreachable")  # abort raises

    async def _check(
        self,
        context: grpc.aio.ServicerContext[Any, Any],
        method: str,
        check: Callable[[], None],
    ) -> None:
        """Refuse a request that `check` finds invalid, as INVALID_ARGUMENT."""
        try:
            check()
        except Invalid as e:
            await self._fail(context, method, grpc.StatusCode.INVALID_ARGUMENT, str(e))

    # ---- RPCs --------------------------------------------------------------

    async def Register(
        self, request: pb.RegisterRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.RegisterResponse:
        await self._check(context, "Register", lambda: validate.register_request(request))
        session_id = self.registry.register(request)
        if self.stragglers is not None:
            self.stragglers.register(request)
        try:
            await asyncio.to_thread(self.store.touch_job, request.job_id)
        except Exception as e:
            # The job's row in the history is bookkeeping; watching its ranks is
            # the point. A full data directory must not turn agents away.
            if not disk_full(e):
                raise
            log.error(
                "job %s: not recorded in the history, the data directory is full (%s)",
                request.job_id,
                e,
            )
        log.info(
            "agent %s (%s) registered %d ranks for job %s",
            request.agent_id,
            request.host,
            len(request.ranks),
            request.job_id,
        )
        self._ok("Register")
        return pb.RegisterResponse(
            session_id=session_id,
            poll_interval_s=self.poll_interval_s,
            # Three heartbeats per lost-agent timeout: one late report is not a loss.
            heartbeat_s=self.registry.agent_lost_timeout / 3,
            progress_stream=True,
            progress_columns=True,
            node_archives=True,
        )

    def _apply_progress(self, request: pb.ProgressReport) -> bool:
        """Check and apply one progress report (any transport); False for an
        unknown session. Raises Invalid for one it refuses."""
        try:
            columns = validate.progress_report(request)  # unpacked once, read twice
            self.registry.report_progress(request, columns)
        except progress_columns.ColumnsError as e:
            raise Invalid(str(e)) from None
        except StaleSession:
            return False
        if request.ranks:
            self.metrics.inc("hangwatch_progress_ranks_total", len(request.ranks), _MESSAGES)
        if columns is not None:
            self.metrics.inc("hangwatch_progress_ranks_total", len(columns.rank), _COLUMNS)
        if self.stragglers is not None:
            self.stragglers.observe(request, columns)
        return True

    async def _progress(
        self,
        method: str,
        request: pb.ProgressReport,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> bool:
        """One progress report, unary or streamed: False for an unknown session."""
        try:
            known = self._apply_progress(request)
        except Invalid as e:
            await self._fail(context, method, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        self._ok(method)
        return known

    async def ReportProgress(
        self, request: pb.ProgressReport, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ProgressAck:
        return pb.ProgressAck(known=await self._progress("ReportProgress", request, context))

    async def StreamProgress(
        self,
        request_iterator: AsyncIterator[pb.ProgressReport],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[pb.ProgressAck]:
        """ReportProgress's work per message, without a call per report: the
        stream answers only a report whose session is unknown, and then ends.
        Each report is let go before the next is read (ingest.requests)."""
        while (request := await next_request(context)) is not None:
            known = await self._progress("StreamProgress", request, context)
            seq = request.report_seq
            del request
            if not known:
                yield pb.ProgressAck(known=False, report_seq=seq)
                return

    def _relay_label(self, relay_id: str) -> str:
        """The metrics' name for a relay: its id where printable and short."""
        label = relay_id if relay_id.isprintable() and 0 < len(relay_id) <= 128 else "invalid"
        if label not in self._relay_streams and len(self._relay_streams) >= MAX_RELAY_LABELS:
            return "other"
        return label

    def _relay_open(self, label: str, delta: int) -> None:
        n = self._relay_streams[label] = self._relay_streams.get(label, 0) + delta
        self.metrics.set("hangwatch_relay_streams", n, {"relay": label})

    async def RelayProgress(
        self,
        request_iterator: AsyncIterator[pb.ProgressBatch],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[pb.RelayAck]:
        """StreamProgress's work for every report of each batch, in order. A
        report that is refused or whose session is unknown is answered for the
        relay to pass on to its agent; the batch stream goes on. Counted per
        relay (named by its first batch) for the metrics: reports, and streams
        open, which falls to 0 when a relay is gone. A batch is let go before
        the next is read (ingest.requests): a relay's batch is ~16 reports of
        ~2.5 KB at 64 nodes, 64 at 256, each parsed into ~50-190 KB."""
        label: str | None = None
        try:
            while (batch := await next_request(context)) is not None:
                if label is None:
                    label = self._relay_label(batch.relay_id)
                    self._relay_open(label, +1)
                acks = self._relay_batch(batch)
                n = len(batch.reports)
                del batch
                if acks is None:
                    await self._fail(
                        context,
                        "RelayProgress",
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"{n} reports in one batch (at most {MAX_RELAYED_REPORTS})",
                    )
                self.metrics.inc("hangwatch_relay_reports_total", n, {"relay": label})
                self._ok("RelayProgress")
                if acks:
                    yield pb.RelayAck(acks=acks)
        finally:
            if label is not None:
                self._relay_open(label, -1)

    def _relay_batch(self, batch: pb.ProgressBatch) -> list[pb.RelayedAck] | None:
        """Apply a batch's reports; the answers for the relay to pass on, or
        None for a batch over MAX_RELAYED_REPORTS (refused whole)."""
        if len(batch.reports) > MAX_RELAYED_REPORTS:
            return None
        acks: list[pb.RelayedAck] = []
        for report in batch.reports:
            try:
                known = self._apply_progress(report)
            except Invalid as e:
                log.info("RelayProgress from %r: a report refused: %s", batch.relay_id, e)
                acks.append(
                    pb.RelayedAck(
                        session_id=report.session_id,
                        report_seq=report.report_seq,
                        known=True,
                        invalid=str(e) or "invalid report",
                    )
                )
                continue
            if not known:
                acks.append(
                    pb.RelayedAck(session_id=report.session_id, report_seq=report.report_seq)
                )
        return acks

    async def ReportEntries(
        self, request: pb.EntryBatch, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.EntryAck:
        try:
            validate.entry_batch(request)
            self.registry.report_entries(request)
        except Invalid as e:
            await self._fail(context, "ReportEntries", grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except StaleSession:
            self._ok("ReportEntries")
            return pb.EntryAck(known=False)  # the agent registers again
        self._ok("ReportEntries")
        return pb.EntryAck(known=True)

    async def ReportEvent(
        self, request: pb.Event, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.EventAck:
        try:
            validate.event(request)
            self.registry.record_event(request)
        except Invalid as e:
            await self._fail(context, "ReportEvent", grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except StaleSession:
            # The event still matters: the agent re-registers and resends it,
            # but say so rather than silently dropping it.
            await self._fail(
                context,
                "ReportEvent",
                grpc.StatusCode.FAILED_PRECONDITION,
                "unknown session: re-register",
            )
        incident_id = await asyncio.to_thread(self.incidents.on_event, request)
        self._ok("ReportEvent")
        return pb.EventAck(incident_id=incident_id)

    async def WatchCommands(
        self, request: pb.WatchRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.Command]:
        await self._check(context, "WatchCommands", lambda: validate.sender(request))
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()

        def waker() -> None:
            loop.call_soon_threadsafe(wake.set)

        try:
            token = self.registry.add_waker(
                request.session_id, request.job_id, request.agent_id, waker
            )
        except StaleSession:
            await self._fail(
                context,
                "WatchCommands",
                grpc.StatusCode.FAILED_PRECONDITION,
                "unknown session: re-register",
            )
        self._streams.add(wake)
        delivered: set[tuple[str, int]] = set()
        try:
            while not self.stopping.is_set():
                wake.clear()
                try:
                    cmds = self.registry.pending_commands(
                        request.session_id, request.job_id, request.agent_id
                    )
                except StaleSession:
                    return  # a newer Register replaced this session; the agent opens a new stream
                now = self.registry.now()
                for cmd in cmds:
                    if (cmd.incident_id, cmd.kind) not in delivered:
                        delivered.add((cmd.incident_id, cmd.kind))
                        yield cmd.to_pb(now)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wake.wait(), timeout=STREAM_RECHECK_S)
        finally:
            # Runs on normal end, on client disconnect (the task is cancelled)
            # and on server shutdown: no waker outlives its stream.
            self._streams.discard(wake)
            self.registry.remove_waker(request.job_id, request.agent_id, token)

    async def RelayCommands(
        self,
        request_iterator: AsyncIterator[pb.CommandWatch],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[pb.RelayedCommands]:
        """WatchCommands for every agent whose call a relay holds, on one stream
        (ingest.watches). Ends when the relay closes its side, on shutdown, or
        with INVALID_ARGUMENT for a watch that names no valid sender."""
        watches = RelayedWatches(self.registry, asyncio.get_running_loop())
        reader = asyncio.create_task(watches.read(context))
        reader.add_done_callback(lambda _: watches.wake.set())
        self._streams.add(watches.wake)
        every = False
        try:
            while not self.stopping.is_set():
                for msg in messages(watches.due(every=every)):
                    yield msg
                if reader.done():
                    break
                every = not await watches.wait(STREAM_RECHECK_S)
            error = None if reader.cancelled() or not reader.done() else reader.exception()
            if isinstance(error, Invalid):
                await self._fail(
                    context, "RelayCommands", grpc.StatusCode.INVALID_ARGUMENT, str(error)
                )
            if error is not None:
                raise error
            self._ok("RelayCommands")
        finally:
            reader.cancel()
            self._streams.discard(watches.wake)
            watches.close()

    async def UploadBundle(
        self,
        request_iterator: AsyncIterator[pb.BundleChunk],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> pb.UploadAck:
        up: FileUpload | None = None
        claimed = finished = False
        error: tuple[grpc.StatusCode, str] | None = None
        try:
            # Each chunk (up to a MiB, parsed and its data copied) is let go
            # before the next is read (ingest.requests).
            while (chunk := await next_request(context)) is not None:
                if up is None:
                    up = await self._begin_upload(chunk)
                    if up.already_complete():
                        self.metrics.inc(
                            "hangwatch_upload_files_total", labels={"outcome": "duplicate"}
                        )
                        finished = True
                        self._ok("UploadBundle")
                        return pb.UploadAck(
                            incident_id=up.key.incident_id,
                            rank=up.key.rank,
                            file_name=up.key.file_name,
                            bytes_stored=up.final.stat().st_size,
                            complete=True,
                            duplicate=True,
                        )
                    self.uploads.claim(up.key)
                    claimed = True
                    await asyncio.to_thread(up.open)
                up.add(chunk)
                last, sha256 = chunk.last, chunk.sha256
                del chunk
                if last:
                    await asyncio.to_thread(up.finish, sha256)
                    finished = True
                    self.metrics.inc("hangwatch_upload_bytes_total", up.written)
                    self.metrics.inc("hangwatch_upload_files_total", labels={"outcome": "stored"})
                    self._ok("UploadBundle")
                    return pb.UploadAck(
                        incident_id=up.key.incident_id,
                        rank=up.key.rank,
                        file_name=up.key.file_name,
                        bytes_stored=up.written,
                        complete=True,
                    )
            error = (grpc.StatusCode.INVALID_ARGUMENT, "stream ended before the chunk marked last")
        except (Invalid, UploadError, _NotFound) as e:
            error = _refusal(e)
        finally:
            if up is not None and not finished and claimed:
                up.abort()
            if claimed and up is not None:
                self.uploads.release(up.key)
        self.metrics.inc("hangwatch_upload_files_total", labels={"outcome": "rejected"})
        await self._fail(context, "UploadBundle", *error)

    async def UploadFiles(
        self,
        request_iterator: AsyncIterator[pb.BundleChunks],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> pb.UploadFilesAck:
        batch = FileBatch(held=self.held, max_file_bytes=self.max_file_bytes)
        error: tuple[grpc.StatusCode, str] | None = None
        try:
            incident_id = ""
            # Each message is let go once its chunks' data is copied out, not
            # held (parsed: a second copy) through the batch's write and syncs
            # (ingest.requests).
            while (msg := await next_request(context)) is not None:
                incident_id = await self._take_chunks(msg, batch, incident_id)
                del msg
            if batch.current is not None:
                raise Invalid(f"stream ended inside {batch.current.key.file_name}")
            acks = await self._store_batch(incident_id, batch) if batch.files else []
            self._ok("UploadFiles")
            return pb.UploadFilesAck(files=acks)
        except (Invalid, UploadError, _NotFound) as e:
            error = _refusal(e)
        except OSError as e:
            # A full or read-only data dir: the agent keeps its copy and retries.
            error = (grpc.StatusCode.UNAVAILABLE, f"cannot store the files: {e}")
        finally:
            batch.release()
        self.metrics.inc(
            "hangwatch_upload_files_total", len(batch.files) or 1, labels={"outcome": "rejected"}
        )
        await self._fail(context, "UploadFiles", *error)

    async def _take_chunks(self, msg: pb.BundleChunks, batch: FileBatch, incident_id: str) -> str:
        """One UploadFiles message's chunks into `batch`; the stream's incident."""
        for chunk in msg.chunks:
            if batch.current is None:
                ranks = await self._check_upload(chunk)
                if incident_id and chunk.incident_id != incident_id:
                    raise Invalid("one UploadFiles stream carries one incident's files")
                incident_id = chunk.incident_id
                batch.start(chunk, ranks)
            batch.add(chunk)
        return incident_id

    async def _store_batch(self, incident_id: str, batch: FileBatch) -> list[pb.UploadAck]:
        incident_dir = self.store.incident_dir(incident_id)
        written, duplicate = await asyncio.to_thread(write_parts, incident_dir, batch.files)
        try:
            # Bytes durable before the names appear, names durable before the
            # ack: a crash leaves either no file or a whole one.
            await self.group_sync.flush()
            await asyncio.to_thread(rename_in, written)
            await self.group_sync.flush()
        except BaseException:
            await asyncio.to_thread(discard, written)
            raise
        stored = sum(1 for d in duplicate if not d)
        self.metrics.inc("hangwatch_upload_files_total", stored, labels={"outcome": "stored"})
        if stored < len(duplicate):
            self.metrics.inc(
                "hangwatch_upload_files_total",
                len(duplicate) - stored,
                labels={"outcome": "duplicate"},
            )
        self.metrics.inc(
            "hangwatch_upload_bytes_total",
            sum(f.size for f, d in zip(batch.files, duplicate, strict=True) if not d),
        )
        return [
            pb.UploadAck(
                incident_id=f.key.incident_id,
                rank=f.key.rank,
                file_name=f.key.file_name,
                bytes_stored=f.size,
                complete=True,
                duplicate=d,
            )
            for f, d in zip(batch.files, duplicate, strict=True)
        ]

    async def _check_upload(self, first: pb.BundleChunk) -> frozenset[int]:
        """The first chunk of a file names a job, agent, incident and rank that
        fit; returns the incident's ranks (empty: not known)."""
        validate.sender(first)
        validate.incident_id(first.incident_id)
        validate.file_name(first.file_name)
        validate.rank(first.rank)
        if first.node_archive and first.file_name != nodearchive.archive_name(first.rank):
            raise Invalid(
                f"a node archive is named {nodearchive.archive_name(first.rank)!r} "
                f"after its lowest rank, not {first.file_name!r}"
            )
        key = await self._incident_key(first.incident_id)
        if key is None or key[0] != first.job_id:
            raise _NotFound(f"no incident {first.incident_id!r} for job {first.job_id!r}")
        if key[1] and first.rank not in key[1]:
            raise Invalid(f"rank {first.rank} is not among incident {first.incident_id}'s ranks")
        return key[1]

    async def _begin_upload(self, first: pb.BundleChunk) -> FileUpload:
        if first.node_archive:
            raise Invalid("a node archive goes up in an UploadFiles stream, not UploadBundle")
        await self._check_upload(first)
        return FileUpload(
            incident_dir=self.store.incident_dir(first.incident_id),
            incidents_root=self.store.incidents_root,
            first=first,
            max_bytes=self.max_file_bytes,
        )

    async def _incident_key(self, incident_id: str) -> tuple[str, frozenset[int]] | None:
        """(job, expected ranks) of an incident. A dump uploads three files per
        rank, thousands per incident: look the row up once, not per file.
        Both fields are fixed when the incident is created. Event-loop only."""
        hit = self._incident_keys.get(incident_id)
        if hit is None:
            row = await asyncio.to_thread(self.store.get_incident, incident_id)
            if row is None:
                return None
            hit = (row.job_id, frozenset(row.ranks_expected))
            self._incident_keys[incident_id] = hit
            while len(self._incident_keys) > INCIDENT_KEY_CACHE:
                self._incident_keys.popitem(last=False)
        return hit

    async def CompleteDump(
        self, request: pb.DumpResult, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.DumpResultAck:
        await self._check(context, "CompleteDump", lambda: validate.dump_result(request))
        if request.actions:
            accepted = self.actions is not None and self.actions.on_result(request)
        else:
            accepted = self.incidents.on_dump_result(request)
        self._ok("CompleteDump")
        return pb.DumpResultAck(accepted=accepted)

    async def Health(
        self, request: pb.HealthRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.HealthResponse:
        received = time.time_ns()
        self._ok("Health")
        return pb.HealthResponse(
            receive_ns=received,
            serving=not self.stopping.is_set(),
            version=__version__,
            agents_connected=self.registry.agents_connected(),
            dashboard_url=self.dashboard_url,
            stall_timeout_s=self.registry.stall_timeout,
            # Stamped last, so the caller's offset estimate leaves out our own time.
            send_ns=time.time_ns(),
        )


class _NotFound(Exception):
    pass


def _refusal(e: Exception) -> tuple[grpc.StatusCode, str]:
    """The status an upload refused for `e` is answered with."""
    if isinstance(e, UploadError):
        return e.code, str(e)
    if isinstance(e, _NotFound):
        return grpc.StatusCode.NOT_FOUND, str(e)
    return grpc.StatusCode.INVALID_ARGUMENT, str(e)
