"""The agent's gRPC client: deadlines on every unary call, bearer token, TLS, backoff, sessions."""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypedDict, TypeVar

import grpc

from hangwatch import __version__, progress_columns
from hangwatch.config import Config
from hangwatch.tls import channel_credentials
from hangwatch.wire import message_size_options, pb, rpc

log = logging.getLogger("hangwatch.agent")

T = TypeVar("T")

UNARY_DEADLINE_S = 5.0
UPLOAD_DEADLINE_S = 60.0


class Backoff:
    """Exponential backoff with full jitter, capped so a reconnect takes < 5 s."""

    def __init__(
        self, *, base: float = 0.1, cap: float = 2.0, rng: random.Random | None = None
    ) -> None:
        self.base, self.cap = base, cap
        self._attempt = 0
        self._rng = rng or random.Random()

    def next(self) -> float:
        ceiling = min(self.cap, self.base * (2**self._attempt))
        self._attempt = min(self._attempt + 1, 16)
        return self._rng.uniform(ceiling / 2, ceiling)

    def reset(self) -> None:
        self._attempt = 0


class StaleSession(Exception):
    """The coordinator does not know this session (it restarted): register again."""


class Sender(TypedDict):
    """The fields by which every message after Register says whose it is."""

    job_id: str
    agent_id: str
    session_id: str


def build_channel(cfg: Config, relay: bool = False) -> grpc.Channel:
    """The channel to the coordinator, or with `relay` to the progress relay:
    TLS to either where a CA is configured, with the agent's certificate for
    mTLS where one is (hangwatch.tls)."""
    options: list[tuple[str, Any]] = [
        *message_size_options(cfg.auth.max_message_bytes),
        # gRPC's own reconnect backoff defaults to a 120 s ceiling; keep it short.
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 2000),
        ("grpc.keepalive_time_ms", 20_000),
        ("grpc.keepalive_timeout_ms", 5_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.enable_retries", 0),
    ]
    target = cfg.agent.progress_relay if relay else cfg.agent.coordinator
    creds = channel_credentials(cfg.auth)
    if creds is not None:
        return grpc.secure_channel(target, creds, options=options)
    return grpc.insecure_channel(target, options=options)


# After a progress stream through the relay fails, progress goes straight to
# the coordinator this long before the relay is tried again: a relay that is
# down costs each of its agents one failed stream a minute, not one a report.
RELAY_RETRY_S = 60.0

# A call the relay could not carry: the relay is gone or cannot reach the
# coordinator (UNAVAILABLE), it is older than carrying calls (UNIMPLEMENTED),
# or it did not answer in time (DEADLINE_EXCEEDED). Calls then go straight to
# the coordinator for RELAY_RETRY_S. The first two are made again at once,
# straight; a call that timed out is left to its caller's backoff, so that a
# slow coordinator is not waited on twice.
RELAY_FAULTS = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.DEADLINE_EXCEEDED}
)
RELAY_RETRY_AT_ONCE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNIMPLEMENTED})

# Reports waiting to go on the progress stream (a few KB each at 8 ranks).
# One is sent a second, so 16 waiting means gRPC itself could not write for
# 16 s (its flow-control window, about 64 KB, already full): the coordinator
# is stuck. The agent stops queueing (bounded memory) and opens a new stream,
# sending every rank again. A burst on a new stream (before its connection is
# up) stays well under it.
STREAM_BACKLOG = 16


class StreamBroken(grpc.RpcError):
    """The progress stream cannot take a report: it ended, or the coordinator
    stopped reading it. Caught where any failed call is (the agent backs off
    and sends a full report on a new stream)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class ProgressStream:
    """One StreamProgress call: `send` queues a report and never blocks; a
    reader thread waits for the coordinator's rare answers (an unknown session)
    or the stream's end. gRPC's own thread drains the queue into the call."""

    def __init__(self, stub: rpc.CoordinatorStub, metadata: tuple[tuple[str, str], ...]) -> None:
        self._q: queue.Queue[pb.ProgressReport] = queue.Queue(maxsize=STREAM_BACKLOG)
        self._ended = threading.Event()
        self.stale = False
        self.error: grpc.RpcError | None = None
        self._call = stub.StreamProgress(self._requests(), metadata=metadata)
        self._reader = threading.Thread(
            target=self._read, name="hangwatch-progress-stream", daemon=True
        )
        self._reader.start()

    def _requests(self) -> Iterator[pb.ProgressReport]:
        # Wakes every half second to notice the end: the thread gRPC runs this
        # on must not outlive the call.
        while not self._ended.is_set():
            try:
                yield self._q.get(timeout=0.5)
            except queue.Empty:
                continue

    def _read(self) -> None:
        try:
            for ack in self._call:
                if not ack.known:
                    self.stale = True
                    break
        except grpc.RpcError as e:
            self.error = e
        finally:
            self._ended.set()

    @property
    def ended(self) -> bool:
        return self._ended.is_set()

    def send(self, req: pb.ProgressReport) -> None:
        if self._ended.is_set():
            raise StreamBroken(grpc.StatusCode.UNAVAILABLE, "the progress stream ended")
        try:
            self._q.put_nowait(req)
        except queue.Full:
            raise StreamBroken(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"the coordinator read none of the last {STREAM_BACKLOG} progress reports",
            ) from None

    def close(self, timeout: float = 2.0) -> None:
        self._ended.set()
        self._call.cancel()
        if self._reader is not threading.current_thread():
            self._reader.join(timeout)


class CoordinatorClient:
    """Thread-safe wrapper around the stub that owns the session id."""

    def __init__(self, cfg: Config, *, agent_id: str, host: str) -> None:
        self.cfg = cfg
        self.agent_id = agent_id
        self.host = host
        self.channel = build_channel(cfg)
        self.stub = rpc.CoordinatorStub(self.channel)
        token = cfg.auth.resolved_token()
        self.metadata: tuple[tuple[str, str], ...] = (
            (("authorization", f"Bearer {token}"),) if token else ()
        )
        self._lock = threading.Lock()
        self._session_id = ""
        self._registered = threading.Event()
        self.poll_interval_hint = 0.0
        self.heartbeat_hint = 0.0  # RegisterResponse.heartbeat_s
        # Progress goes on a stream where the coordinator takes one
        # (RegisterResponse.progress_stream); used by the sender thread only.
        self._use_stream = False
        self._stream: ProgressStream | None = None
        # Progress through a relay where one is configured (--progress-relay):
        # its channel, whether the open stream goes through it, and until when
        # (monotonic) it is passed over after failing.
        self._relay: rpc.CoordinatorStub | None = None
        self._relay_channel: grpc.Channel | None = None
        if cfg.agent.progress_relay:
            self._relay_channel = build_channel(cfg, relay=True)
            self._relay = rpc.CoordinatorStub(self._relay_channel)
        self._via_relay = False
        self._relay_down_until = 0.0
        self._back_to_relay = False
        # The same for the commands call (the command thread's alone).
        self.commands_via_relay = False
        self._commands_relay_down_until = 0.0
        # The same for every other call (Register, events, uploads,
        # CompleteDump, the clock exchange): an agent behind a relay holds no
        # connection to the coordinator, about 20 KB of its memory each
        # (server.relay_calls). Any of the agent's threads makes these.
        self._calls_relay_down_until = 0.0
        self._said_relay_older = False
        # Progress goes as columns where the coordinator reads them
        # (RegisterResponse.progress_columns), indexed by this session's group table.
        self._use_columns = False
        self._groups: dict[str, int] = {}
        # Phase one goes up as one archive per node where the coordinator
        # stores them (RegisterResponse.node_archives).
        self.node_archives = False

    # --- session ----------------------------------------------------------

    @property
    def session_id(self) -> str:
        with self._lock:
            return self._session_id

    def invalidate(self) -> None:
        with self._lock:
            self._session_id = ""
            self._registered.clear()

    def _stale(self, what: str) -> StaleSession:
        """The coordinator does not know our session: forget it (the agent
        registers again) and say so to the caller, which raises it."""
        self.invalidate()
        return StaleSession(f"{what}: session unknown")

    def _sender(self) -> Sender:
        return Sender(
            job_id=self.cfg.job.job_id, agent_id=self.agent_id, session_id=self.session_id
        )

    def wait_registered(self, timeout: float) -> str:
        self._registered.wait(timeout)
        return self.session_id

    # --- calls through the relay ------------------------------------------

    def _call(self, method: str, make: Callable[[rpc.CoordinatorStub], T]) -> T:
        """`make(stub)` on the relay's stub where a relay is configured and has
        not failed in the last RELAY_RETRY_S, else on the coordinator's. A call
        the relay could not carry (RELAY_RETRY_AT_ONCE) is made again at once,
        straight: `make` builds its request anew each time (an upload's chunks)."""
        relay = self._relay
        if relay is not None and self.calls_via_relay:
            try:
                return make(relay)
            except grpc.RpcError as e:
                code = e.code()
                if code not in RELAY_FAULTS:
                    raise  # the coordinator's own answer
                self._calls_relay_down_until = time.monotonic() + RELAY_RETRY_S
                # A relay older than carrying calls says so every RELAY_RETRY_S
                # for as long as it runs: a warning the first time, not each minute.
                older = code == grpc.StatusCode.UNIMPLEMENTED
                level = logging.DEBUG if older and self._said_relay_older else logging.WARNING
                self._said_relay_older |= older
                log.log(
                    level,
                    "%s through relay %s failed (%s: %s); calling the coordinator for %.0f s",
                    method,
                    self.cfg.agent.progress_relay,
                    code.name,
                    e.details(),
                    RELAY_RETRY_S,
                )
                if code not in RELAY_RETRY_AT_ONCE:
                    raise
        return make(self.stub)

    @property
    def calls_via_relay(self) -> bool:
        """Whether the next call (Register, events, uploads...) goes through the relay."""
        return self._relay is not None and time.monotonic() >= self._calls_relay_down_until

    def register(self, ranks: list[pb.RankInfo]) -> str:
        req = pb.RegisterRequest(
            job_id=self.cfg.job.job_id,
            agent_id=self.agent_id,
            host=self.host,
            ranks=ranks,
            agent_version=__version__,
        )
        resp = self._call(
            "Register",
            lambda stub: stub.Register(req, timeout=UNARY_DEADLINE_S, metadata=self.metadata),
        )
        with self._lock:
            self._session_id = resp.session_id
            self.poll_interval_hint = resp.poll_interval_s
            self.heartbeat_hint = resp.heartbeat_s
            self._use_stream = resp.progress_stream
            self._use_columns = resp.progress_columns
            self.node_archives = resp.node_archives
            self._groups = progress_columns.group_table(ranks)
            self._registered.set()
        self._end_stream()  # its session is over
        log.info(
            "registered %d ranks as %s (session %s)", len(ranks), self.agent_id, resp.session_id
        )
        return str(resp.session_id)

    # --- reports ------------------------------------------------------------

    def report_progress(
        self,
        seq: int,
        ranks: list[pb.RankProgress],
        *,
        clock_offset_ns: int = 0,
        clock_error_ns: int = 0,
    ) -> None:
        columns = None
        if self._use_columns:
            columns, ranks = progress_columns.encode(ranks, self._groups)
        req = pb.ProgressReport(
            **self._sender(),
            report_seq=seq,
            ranks=ranks,
            columns=columns,
            clock_offset_ns=clock_offset_ns,
            clock_error_ns=clock_error_ns,
        )
        if not self._use_stream:
            ack = self.stub.ReportProgress(req, timeout=UNARY_DEADLINE_S, metadata=self.metadata)
            if not ack.known:
                raise self._stale("progress")
            return
        if self._back_to_relay:
            # progress_needs_full said so: this report is full, for a new stream.
            self._back_to_relay = False
            self._end_stream()
        stream = self._stream
        if stream is not None and stream.ended:
            self._stream_failed(stream, None)
        if self._stream is None:
            self._via_relay = self._relay is not None and (
                time.monotonic() >= self._relay_down_until
            )
            stub = self._relay if self._via_relay and self._relay is not None else self.stub
            self._stream = ProgressStream(stub, self.metadata)
        stream = self._stream
        try:
            stream.send(req)
        except StreamBroken as e:
            # It may have ended between the check above and now: say why it did.
            self._stream_failed(stream, e)

    def _stream_failed(self, stream: ProgressStream, broken: StreamBroken | None) -> None:
        """Drop an ended (or unwritable) stream, so the next report opens a
        new one, and raise what ended it: StaleSession, its RPC error, or
        `broken`. Returns only when it ended without either (closed here)."""
        # Read before ending it: ending cancels the call, and a reader still
        # waiting would then record that local CANCELLED as the stream's error.
        stale, error = stream.stale, stream.error or broken
        self._end_stream()
        if stale:
            raise self._stale("progress")
        if error is None:
            return
        if self._via_relay:
            self._relay_failed(error)
        elif error.code() == grpc.StatusCode.UNIMPLEMENTED:
            self._use_stream = False  # said it had one, has not: unary from now on
        raise error

    def _relay_failed(self, error: grpc.RpcError) -> None:
        """Send progress straight to the coordinator for RELAY_RETRY_S."""
        self._relay_down_until = time.monotonic() + RELAY_RETRY_S
        log.warning(
            "progress relay %s failed (%s); reporting to the coordinator for %.0f s",
            self.cfg.agent.progress_relay,
            error.code().name,
            RELAY_RETRY_S,
        )

    @property
    def progress_via_relay(self) -> bool:
        """Whether the open progress stream goes through the relay."""
        return self._stream is not None and not self._stream.ended and self._via_relay

    def progress_needs_full(self) -> bool:
        """The next report opens a new progress stream: what went on the last
        one may not have arrived, so it must carry every rank. That is also
        when a stream sent straight while the relay was passed over goes back
        to the relay (the next report_progress moves it)."""
        if not self._use_stream:
            return False
        if self._stream is None or self._stream.ended:
            return True
        self._back_to_relay = (
            self._relay is not None
            and not self._via_relay
            and time.monotonic() >= self._relay_down_until
        )
        return self._back_to_relay

    def _end_stream(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.close()

    def health(self, req: pb.HealthRequest) -> pb.HealthResponse:
        resp: pb.HealthResponse = self._call(
            "Health",
            lambda stub: stub.Health(req, timeout=UNARY_DEADLINE_S, metadata=self.metadata),
        )
        return resp

    def report_entries(self, entries: list[pb.FrEntry], dropped: int) -> None:
        req = pb.EntryBatch(**self._sender(), entries=entries, dropped=dropped)
        ack = self._call(
            "ReportEntries",
            lambda stub: stub.ReportEntries(req, timeout=UNARY_DEADLINE_S, metadata=self.metadata),
        )
        if not ack.known:
            raise self._stale("entries")

    def report_event(self, kind: int, rank: int, detail: str, age_s: float) -> str:
        req = pb.Event(
            **self._sender(),
            kind=kind,  # type: ignore[arg-type]
            rank=rank,
            detail=detail[:4000],
            age_s=age_s,
        )
        try:
            ack = self._call(
                "ReportEvent",
                lambda stub: stub.ReportEvent(
                    req, timeout=UNARY_DEADLINE_S, metadata=self.metadata
                ),
            )
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                raise self._stale("event") from e
            raise
        return str(ack.incident_id)

    def watch_commands(self) -> Any:
        """The server stream of commands (a call object: iterate it, `cancel()`
        it): through the relay where one is configured and has not failed in
        the last RELAY_RETRY_S, else from the coordinator. A call straight to
        the coordinator while the relay is passed over ends (DEADLINE_EXCEEDED)
        when the pause does, and the next goes back to the relay."""
        req = pb.WatchRequest(**self._sender())
        now = time.monotonic()
        if self._relay is not None and now >= self._commands_relay_down_until:
            self.commands_via_relay = True
            return self._relay.WatchCommands(req, metadata=self.metadata)
        self.commands_via_relay = False
        pause = None if self._relay is None else max(1.0, self._commands_relay_down_until - now)
        return self.stub.WatchCommands(req, metadata=self.metadata, timeout=pause)

    def commands_failed(self, error: grpc.RpcError) -> bool:
        """A WatchCommands call ended with `error`; True when the next is to be
        opened at once, not after a backoff: the relay failed (an older relay
        without the method, one gone, or one that lost the coordinator: the
        next call goes straight, for RELAY_RETRY_S), or a straight call's pause
        is over. A dump request waits in the coordinator's mailbox meanwhile."""
        code = error.code()
        if self.commands_via_relay and code != grpc.StatusCode.FAILED_PRECONDITION:
            self._commands_relay_down_until = time.monotonic() + RELAY_RETRY_S
            log.warning(
                "commands through relay %s failed (%s); watching the coordinator for %.0f s",
                self.cfg.agent.progress_relay,
                code.name,
                RELAY_RETRY_S,
            )
            return True
        return (
            not self.commands_via_relay
            and self._relay is not None
            and code == grpc.StatusCode.DEADLINE_EXCEEDED
        )

    def upload(self, chunks: Callable[[], Iterator[pb.BundleChunk]]) -> pb.UploadAck:
        """One file's chunks, from `chunks()`: called again for a second try."""
        return self._call(
            "UploadBundle",
            lambda stub: stub.UploadBundle(
                chunks(), timeout=UPLOAD_DEADLINE_S, metadata=self.metadata
            ),
        )

    def upload_files(
        self, chunks: Callable[[], Iterator[pb.BundleChunks]], *, compressed: bool = False
    ) -> pb.UploadFilesAck:
        # gzip: a phase-one stream of plain files is mostly JSON and member
        # lists, which shrink several-fold; the coordinator's gRPC core
        # inflates them. Not for a node archive (`compressed`): already deflated.
        # A relay inflates and carries the bytes as they are (server.relay_calls).
        return self._call(
            "UploadFiles",
            lambda stub: stub.UploadFiles(
                chunks(),
                timeout=UPLOAD_DEADLINE_S,
                metadata=self.metadata,
                compression=None if compressed else grpc.Compression.Gzip,
            ),
        )

    def complete_dump(self, result: pb.DumpResult) -> bool:
        ack = self._call(
            "CompleteDump",
            lambda stub: stub.CompleteDump(
                result, timeout=UNARY_DEADLINE_S, metadata=self.metadata
            ),
        )
        return bool(ack.accepted)

    def close(self) -> None:
        self._end_stream()
        self.channel.close()
        if self._relay_channel is not None:
            self._relay_channel.close()
