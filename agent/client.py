"""The agent's gRPC client: deadlines on every unary call, bearer token, TLS, backoff, sessions."""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Iterator
from typing import Any, TypedDict

import grpc

from hangwatch import __version__
from hangwatch.config import Config
from hangwatch.wire import message_size_options, pb, rpc

log = logging.getLogger("hangwatch.agent")

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


def build_channel(cfg: Config) -> grpc.Channel:
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
    if cfg.auth.tls_ca:
        with open(cfg.auth.tls_ca, "rb") as f:
            ca = f.read()
        cert = key = None
        if cfg.auth.tls_cert and cfg.auth.tls_key:
            with open(cfg.auth.tls_cert, "rb") as f:
                cert = f.read()
            with open(cfg.auth.tls_key, "rb") as f:
                key = f.read()
        creds = grpc.ssl_channel_credentials(
            root_certificates=ca, private_key=key, certificate_chain=cert
        )
        return grpc.secure_channel(cfg.agent.coordinator, creds, options=options)
    return grpc.insecure_channel(cfg.agent.coordinator, options=options)


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

    def register(self, ranks: list[pb.RankInfo]) -> str:
        req = pb.RegisterRequest(
            job_id=self.cfg.job.job_id,
            agent_id=self.agent_id,
            host=self.host,
            ranks=ranks,
            agent_version=__version__,
        )
        resp = self.stub.Register(req, timeout=UNARY_DEADLINE_S, metadata=self.metadata)
        with self._lock:
            self._session_id = resp.session_id
            self.poll_interval_hint = resp.poll_interval_s
            self.heartbeat_hint = resp.heartbeat_s
            self._registered.set()
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
        req = pb.ProgressReport(
            **self._sender(),
            report_seq=seq,
            ranks=ranks,
            clock_offset_ns=clock_offset_ns,
            clock_error_ns=clock_error_ns,
        )
        ack = self.stub.ReportProgress(req, timeout=UNARY_DEADLINE_S, metadata=self.metadata)
        if not ack.known:
            raise self._stale("progress")

    def health(self, req: pb.HealthRequest) -> pb.HealthResponse:
        resp: pb.HealthResponse = self.stub.Health(
            req, timeout=UNARY_DEADLINE_S, metadata=self.metadata
        )
        return resp

    def report_entries(self, entries: list[pb.FrEntry], dropped: int) -> None:
        req = pb.EntryBatch(**self._sender(), entries=entries, dropped=dropped)
        ack = self.stub.ReportEntries(req, timeout=UNARY_DEADLINE_S, metadata=self.metadata)
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
            ack = self.stub.ReportEvent(req, timeout=UNARY_DEADLINE_S, metadata=self.metadata)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                raise self._stale("event") from e
            raise
        return str(ack.incident_id)

    def watch_commands(self) -> Any:
        """The server stream of commands (a call object: iterate it, `cancel()` it)."""
        req = pb.WatchRequest(**self._sender())
        return self.stub.WatchCommands(req, metadata=self.metadata)

    def upload(self, chunks: Iterator[pb.BundleChunk]) -> pb.UploadAck:
        return self.stub.UploadBundle(chunks, timeout=UPLOAD_DEADLINE_S, metadata=self.metadata)

    def upload_files(self, chunks: Iterator[pb.BundleChunks]) -> pb.UploadFilesAck:
        # gzip: a phase-one stream is mostly JSON and member lists, which
        # shrink several-fold; the coordinator's gRPC core inflates them.
        return self.stub.UploadFiles(
            chunks,
            timeout=UPLOAD_DEADLINE_S,
            metadata=self.metadata,
            compression=grpc.Compression.Gzip,
        )

    def complete_dump(self, result: pb.DumpResult) -> bool:
        ack = self.stub.CompleteDump(result, timeout=UNARY_DEADLINE_S, metadata=self.metadata)
        return bool(ack.accepted)

    def close(self) -> None:
        self.channel.close()
