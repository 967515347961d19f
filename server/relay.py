"""`hangwatch relay`: many agents' progress on one stream to the coordinator.

gRPC's own work is per message: a server whose handler drops every message
took 0.14 of a core for 512 node agents reporting once a second (34 µs a
rank report, more than the coordinator's own ~6 µs), and 0.07 of that with
64 agents' reports a message (benchmarks/grpc_floor.py). A relay, one per
rack or per 64 nodes, serves the coordinator's own StreamProgress method (an
agent needs only `--progress-relay HOST:PORT`), gathers what arrives within
`--relay-window` and sends it as one ProgressBatch on a RelayProgress stream.

It speaks TLS as the coordinator does (hangwatch.tls): with a certificate
it serves its agents over TLS (asking for theirs where a CA is given), and it
dials the coordinator as an agent would, presenting the same certificate
where the coordinator asks for one. Health answers probes: serving while the
stream to the coordinator is up.

The relay answers an agent as the coordinator would: ProgressAck{known:
false} and the end of its stream for an unknown session, INVALID_ARGUMENT for
a refused report.

It carries its agents' WatchCommands calls too, on one RelayCommands stream
(the coordinator sends a whole incident's DUMPs to a relay's agents in one
message, not one stream each). A command stays in its agent's mailbox at the
coordinator until the agent answers, so a relay lost mid-incident delays a
DUMP (its agents' calls end, they reopen straight to the coordinator and get
it there), never loses it. A coordinator without RelayCommands answers
UNIMPLEMENTED; the relay then answers its agents' calls the same way and
they watch directly.

Every other call an agent makes on its session (Register, events, uploads,
CompleteDump, its clock exchange) passes through to the coordinator as bytes
(server.relay_calls), so an agent behind a relay holds no connection to the
coordinator: about 20 KB of the coordinator's memory each.

Failure never loses progress silently. While the relay has no stream to the
coordinator it refuses agents' streams (UNAVAILABLE); when that stream
breaks, it ends every agent's stream, since a batch in flight may not have
been applied; and when the coordinator stops reading, its backlog fills and
it ends them (RESOURCE_EXHAUSTED). An agent whose relay stream fails sends
its next report, a full one, straight to the coordinator
(agent.client.RELAY_RETRY_S).

Its HTTP port (`--http-port`, server.relay_http) serves /metrics, counting
every report it took, forwarded or turned away and why, and /healthz and
/readyz for probes.

On start it prints one machine-readable line,
    hangwatch relay: grpc=HOST:PORT http=HOST:PORT coordinator=HOST:PORT
SIGINT/SIGTERM stop it within `SHUTDOWN_BOUND_S`; a second signal exits at once;
a stop not done within `EXIT_BOUND_S` prints every thread's stack and exits 1
(ShutdownSignals.stopping, whatever began the stop).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import socket
import sys
import threading
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Final

import grpc
from hangwatch.server.ingest.auth import SERVICE, TokenAuth
from hangwatch.server.ingest.requests import next_request
from hangwatch.server.relay_calls import CarriedCalls
from hangwatch.server.relay_http import RelayHttp

from hangwatch import __version__
from hangwatch import config as cfg
from hangwatch.addresses import hostport
from hangwatch.lifecycle import ShutdownSignals, configure_logging
from hangwatch.tls import channel_credentials, server_credentials
from hangwatch.wire import (
    MAX_RELAYED_REPORTS,
    agent_server_options,
    message_size_options,
    pb,
    rpc,
)

log = logging.getLogger("hangwatch.relay")

EXIT_USAGE: Final = 2
# Reports held while the coordinator is slow to read them: 8 batches of the
# largest size, ~20 MB at 2.5 KB a report. Past it agents' streams end and
# they report to the coordinator directly: bounded memory, nothing dropped
# silently.
MAX_PENDING: Final = 8 * MAX_RELAYED_REPORTS
# The wait before reconnecting to the coordinator, doubling to the cap.
RECONNECT_S: Final = (0.2, 5.0)
SHUTDOWN_BOUND_S: Final = 5.0
# The whole stop of `hangwatch relay`, exit included: its HTTP port (up to
# 5 s) and its loop (SHUTDOWN_BOUND_S), and 2 s to exit; past it the
# process leaves its stacks and exits 1 (lifecycle.exit_if_stuck).
EXIT_BOUND_S: Final = 12.0
# The relay's own default ports: one beside a coordinator (7451, 7450) must not clash.
RELAY_PORT: Final = 7452
RELAY_HTTP_PORT: Final = 7453


# An agent's WatchCommands call at the relay: its commands, then how it ends
# (None: normally; a status and text: aborted so).
_Queue = asyncio.Queue[pb.Command | tuple[grpc.StatusCode, str] | None]


@dataclass
class _AgentStream:
    """One agent's StreamProgress call at the relay: how it is to end."""

    done: asyncio.Event
    ack: pb.ProgressAck | None = None
    abort: tuple[grpc.StatusCode, str] | None = None

    def end(
        self, *, ack: pb.ProgressAck | None = None, abort: tuple[grpc.StatusCode, str] | None = None
    ) -> bool:
        """End it this way unless it has ended already; whether it ended now."""
        if self.done.is_set():
            return False
        self.ack, self.abort = ack, abort
        self.done.set()
        return True


@dataclass(frozen=True, kw_only=True)
class RelayStats:
    """The relay's counts at one moment, read on its loop (`Relay.stats`): what
    /metrics exposes (server.relay_http)."""

    connected: bool
    agent_streams: int
    pending_reports: int
    reports_received: int
    reports_forwarded: int
    batches_forwarded: int
    upstream_failures: int
    # Agents' WatchCommands calls held, and the commands passed to them.
    command_watches: int
    commands_forwarded: int
    # Reports taken but never sent on, by why: "backlog" (refused, the
    # coordinator reading too slowly), "upstream_lost" (held when the stream
    # to the coordinator broke), "stopping".
    not_forwarded: dict[str, int]
    # Agents' streams the relay ended, by why: those three, "no_coordinator"
    # (turned away at the start), "unknown_session" and "invalid" (the
    # coordinator's answers to a report).
    streams_ended: dict[str, int]
    # Agents' other calls carried to the coordinator (server.relay_calls), by
    # method, and those that failed there, by status code.
    calls_carried: dict[str, int]
    calls_failed: dict[str, int]


class RelayService:
    """StreamProgress and WatchCommands for agents, and Health for probes. The
    agents' other calls pass through as bytes (server.relay_calls); the
    coordinator's relay methods, and unary ReportProgress, are not served
    (UNIMPLEMENTED, as for any method a server lacks)."""

    def __init__(self, relay: Relay) -> None:
        self.relay = relay

    def handlers(self) -> dict[str, grpc.RpcMethodHandler]:
        return {
            "Health": grpc.unary_unary_rpc_method_handler(
                self.Health,
                request_deserializer=pb.HealthRequest.FromString,
                response_serializer=pb.HealthResponse.SerializeToString,
            ),
            "WatchCommands": grpc.unary_stream_rpc_method_handler(
                self.WatchCommands,
                request_deserializer=pb.WatchRequest.FromString,
                response_serializer=pb.Command.SerializeToString,
            ),
            "StreamProgress": grpc.stream_stream_rpc_method_handler(
                self.StreamProgress,
                request_deserializer=pb.ProgressReport.FromString,
                response_serializer=pb.ProgressAck.SerializeToString,
            ),
        }

    async def Health(
        self, request: pb.HealthRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.HealthResponse:
        """Serving while the relay has its stream to the coordinator (without
        it agents are turned away), and the agents' streams it holds. Open
        without a token, as the coordinator's Health is (auth.TokenAuth).

        An agent's clock exchange (client_send_ns set) is the coordinator's to
        answer: its clock, not the relay's. The relay's hop lengthens the round
        trip, and the offset's error bound, half of it, grows to match."""
        relay = self.relay
        if request.client_send_ns and relay.carried is not None:
            return await relay.carried.health(request, context)
        return pb.HealthResponse(
            serving=relay.connected,
            version=__version__,
            agents_connected=relay.agents_connected(),
        )

    async def WatchCommands(
        self, request: pb.WatchRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.Command]:
        """The agent's commands as the coordinator sends them on the relay's
        RelayCommands stream; the call ends as WatchCommands would end it
        there, or UNAVAILABLE when that stream breaks (the agent then watches
        the coordinator directly)."""
        relay = self.relay
        if relay.commands_unsupported:
            await context.abort(
                grpc.StatusCode.UNIMPLEMENTED, "the coordinator takes commands directly"
            )
        if not relay.commands_connected:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the relay has no coordinator")
        watch = relay.open_watch(request)
        try:
            while True:
                item = await watch.get()
                if item is None:
                    return  # replaced at the coordinator: the agent opens a new call
                if isinstance(item, pb.Command):
                    yield item
                    continue
                await context.abort(*item)
        finally:
            relay.close_watch(request, watch)

    async def StreamProgress(
        self,
        request_iterator: AsyncIterator[pb.ProgressReport],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[pb.ProgressAck]:
        relay = self.relay
        if not relay.connected:
            relay.streams_ended["no_coordinator"] += 1
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the relay has no coordinator")
        stream = _AgentStream(done=asyncio.Event())
        sessions: set[str] = set()

        async def read() -> None:
            try:
                # The report waits in the relay's next batch, not also here
                # until the agent's next one (ingest.requests).
                while (req := await next_request(context)) is not None:
                    sessions.add(req.session_id)
                    relay.take(req, stream)
                    del req
                    if stream.done.is_set():
                        break
            finally:
                stream.end()  # the agent closed its side, or it broke

        reader = asyncio.create_task(read())
        try:
            await stream.done.wait()
            if stream.ack is not None:
                yield stream.ack
            if stream.abort is not None:
                await context.abort(*stream.abort)
        finally:
            reader.cancel()
            for s in sessions:
                relay.forget(s, stream)


class Relay:
    """The relay's gRPC server for agents and its one stream to the coordinator,
    on one event loop in a thread of its own (`start`, `stop`)."""

    def __init__(self, conf: cfg.Config) -> None:
        self.conf = conf
        self.window_s = conf.relay.relay_window
        self.coordinator = conf.agent.coordinator
        self.relay_id = ""
        self.address = ""
        self.http_address = ""
        self._http: RelayHttp | None = None
        self.carried: CarriedCalls | None = None  # made on the loop (_main)
        self.connected = False
        # Counts for /metrics (`stats`); only the loop thread changes them.
        self.batches_sent = 0
        self.reports_sent = 0
        self.reports_received = 0
        self.commands_forwarded = 0
        self.upstream_failures = 0
        self.not_forwarded: Counter[str] = Counter()
        self.streams_ended: Counter[str] = Counter()
        token = conf.auth.resolved_token()
        self._metadata: tuple[tuple[str, str], ...] = (
            (("authorization", f"Bearer {token}"),) if token else ()
        )
        self._token = token
        self._max_bytes = conf.auth.max_message_bytes
        # Only the loop thread touches these.
        self._pending: list[pb.ProgressReport] = []
        self._call_no = 0  # of the RelayProgress call now open (_batches)
        self._streams: dict[str, _AgentStream] = {}
        # Agents' WatchCommands calls held here, by session, and the changes
        # to them not yet told to the coordinator (the last per session).
        self.commands_connected = False
        self.commands_unsupported = False
        self._watches: dict[str, tuple[pb.WatchRequest, _Queue]] = {}
        self._watch_changes: dict[str, tuple[bool, pb.WatchRequest]] = {}
        self._watch_wake: asyncio.Event | None = None
        self._watch_call_no = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._stopping: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._start_error: BaseException | None = None

    @staticmethod
    def server_options(max_bytes: int) -> list[tuple[str, int]]:
        """The agent-facing server's options: the coordinator's (its agents
        ping it alike, and reconnect together when it restarts)."""
        return agent_server_options(max_bytes)

    # ---- the agents' side (on the loop) -------------------------------------

    def take(self, req: pb.ProgressReport, stream: _AgentStream) -> None:
        """Queue an agent's report for the next batch."""
        self._streams[req.session_id] = stream
        self.reports_received += 1
        if len(self._pending) >= MAX_PENDING:
            self.not_forwarded["backlog"] += 1
            if stream.end(
                abort=(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"the relay holds {MAX_PENDING} reports the coordinator has not read",
                )
            ):
                self.streams_ended["backlog"] += 1
            return
        self._pending.append(req)
        assert self._wake is not None
        self._wake.set()

    def agents_connected(self) -> int:
        """Agents' streams open here (a stream's sessions count once)."""
        return len({id(s) for s in self._streams.values()})

    def forget(self, session_id: str, stream: _AgentStream) -> None:
        if self._streams.get(session_id) is stream:
            del self._streams[session_id]

    def _route(self, ack: pb.RelayedAck) -> None:
        """Pass the coordinator's answer to the report's agent, ending its stream."""
        stream = self._streams.get(ack.session_id)
        if stream is None:
            return  # that agent's stream is already gone; its next one is full
        if ack.invalid:
            if stream.end(abort=(grpc.StatusCode.INVALID_ARGUMENT, ack.invalid)):
                self.streams_ended["invalid"] += 1
        elif not ack.known and stream.end(
            ack=pb.ProgressAck(known=False, report_seq=ack.report_seq)
        ):
            self.streams_ended["unknown_session"] += 1

    def _end_all(self, code: grpc.StatusCode, why: str, reason: str) -> None:
        """End every agent's stream and drop what they sent that is not yet
        forwarded (they send in full on their next stream), counted by `reason`."""
        # A stream carries each of its sessions: end (and count) it once.
        for stream in {id(s): s for s in self._streams.values()}.values():
            if stream.end(abort=(code, why)):
                self.streams_ended[reason] += 1
        self._streams.clear()
        if self._pending:
            self.not_forwarded[reason] += len(self._pending)
        self._pending.clear()

    # ---- commands (on the loop) ---------------------------------------------

    def open_watch(self, req: pb.WatchRequest) -> _Queue:
        """Hold an agent's WatchCommands call; a call of the same session
        still held is ended (the agent opened a new one)."""
        old = self._watches.get(req.session_id)
        if old is not None:
            old[1].put_nowait((grpc.StatusCode.UNAVAILABLE, "a newer call took its place"))
        q: _Queue = asyncio.Queue()
        self._watches[req.session_id] = (req, q)
        self._watch_changed(True, req)
        return q

    def close_watch(self, req: pb.WatchRequest, q: _Queue) -> None:
        held = self._watches.get(req.session_id)
        if held is not None and held[1] is q:
            del self._watches[req.session_id]
            self._watch_changed(False, req)

    def _watch_changed(self, opened: bool, req: pb.WatchRequest) -> None:
        self._watch_changes[req.session_id] = (opened, req)
        assert self._watch_wake is not None
        self._watch_wake.set()

    def _route_command(self, rc: pb.RelayedCommand) -> None:
        held = self._watches.get(rc.session_id)
        if held is None:
            return  # that call is gone; the mailbox sends it on the agent's next one
        q = held[1]
        if rc.end == pb.WATCH_END_UNKNOWN_SESSION:
            q.put_nowait((grpc.StatusCode.FAILED_PRECONDITION, "unknown session: re-register"))
        elif rc.end == pb.WATCH_END_REPLACED:
            q.put_nowait(None)
        else:
            self.commands_forwarded += 1
            q.put_nowait(rc.command)

    def _end_watches(self, code: grpc.StatusCode, why: str) -> None:
        for _, q in self._watches.values():
            q.put_nowait((code, why))
        self._watches.clear()
        self._watch_changes.clear()

    async def _watch_feed(self, call_no: int) -> AsyncIterator[pb.CommandWatch]:
        """Every call held, then the changes as they come, each session's last."""
        assert self._watch_wake is not None
        self._watch_changes.clear()
        yield pb.CommandWatch(relay_id=self.relay_id, opened=[r for r, _ in self._watches.values()])
        while True:
            await self._watch_wake.wait()
            if call_no != self._watch_call_no:
                return
            self._watch_wake.clear()
            changes, self._watch_changes = self._watch_changes, {}
            msg = pb.CommandWatch()
            for opened, req in changes.values():
                (msg.opened if opened else msg.closed).append(req)
            if changes:
                yield msg

    async def _commands(self, channel: grpc.aio.Channel) -> None:
        """Keep one RelayCommands stream open; end every agent's call when it breaks."""
        assert self._stopping is not None
        stub = rpc.CoordinatorStub(channel)
        delay = RECONNECT_S[0]
        while not self._stopping.is_set():
            self._watch_call_no += 1
            call = stub.RelayCommands(
                self._watch_feed(self._watch_call_no), metadata=self._metadata
            )
            try:
                await call.wait_for_connection()
                self.commands_connected = True
                delay = RECONNECT_S[0]
                log.info("carrying agents' commands from %s", self.coordinator)
                async for msg in call:
                    for rc in msg.commands:
                        self._route_command(rc)
                why = "the coordinator ended the relay's command stream"
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                    log.warning("the coordinator takes no commands through relays: agents watch it")
                    self.commands_unsupported = True
                    self.commands_connected = False
                    self._end_watches(grpc.StatusCode.UNIMPLEMENTED, "commands go directly")
                    return
                why = f"the relay's command stream failed: {e.code().name}: {e.details()}"
            finally:
                call.cancel()
            self.commands_connected = False
            self._end_watches(grpc.StatusCode.UNAVAILABLE, why)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), delay)
            delay = min(RECONNECT_S[1], delay * 2)

    async def _stats(self) -> RelayStats:
        return RelayStats(
            connected=self.connected,
            agent_streams=self.agents_connected(),
            pending_reports=len(self._pending),
            reports_received=self.reports_received,
            reports_forwarded=self.reports_sent,
            batches_forwarded=self.batches_sent,
            upstream_failures=self.upstream_failures,
            command_watches=len(self._watches),
            commands_forwarded=self.commands_forwarded,
            not_forwarded=dict(self.not_forwarded),
            streams_ended=dict(self.streams_ended),
            calls_carried=dict(self.carried.calls) if self.carried else {},
            calls_failed=dict(self.carried.failed) if self.carried else {},
        )

    def stats(self, timeout: float = 2.0) -> RelayStats:
        """The counts as the loop holds them, from any thread; RuntimeError
        when the loop does not answer (stopped, or stuck)."""
        loop = self._loop
        if loop is None or loop.is_closed() or not self.alive:
            raise RuntimeError("the relay's loop is not running")
        try:
            return asyncio.run_coroutine_threadsafe(self._stats(), loop).result(timeout)
        except (TimeoutError, RuntimeError) as e:  # RuntimeError: the loop closed meanwhile
            raise RuntimeError(f"the relay's loop did not answer: {e or 'timed out'}") from None

    # ---- the coordinator's side (on the loop) --------------------------------

    async def _batches(self, call_no: int) -> AsyncIterator[pb.ProgressBatch]:
        """What arrived in each window, split to fit a message. Ends once a newer
        call has replaced its own: gRPC may leave a broken call's request feeder
        waiting, and an old feeder that woke would take reports into a dead call."""
        assert self._wake is not None
        while True:
            await self._wake.wait()
            await asyncio.sleep(self.window_s)
            if call_no != self._call_no:
                return
            self._wake.clear()
            reports, self._pending = self._pending, []
            batch = pb.ProgressBatch(relay_id=self.relay_id)
            size = 0
            for r in reports:
                n = r.ByteSize()
                full = len(batch.reports) >= MAX_RELAYED_REPORTS
                if batch.reports and (full or size + n > self._max_bytes // 2):
                    yield self._counted(batch)
                    batch, size = pb.ProgressBatch(relay_id=self.relay_id), 0
                batch.reports.append(r)
                size += n
            if batch.reports:
                yield self._counted(batch)

    def _counted(self, batch: pb.ProgressBatch) -> pb.ProgressBatch:
        self.batches_sent += 1
        self.reports_sent += len(batch.reports)
        return batch

    async def _forward(self, channel: grpc.aio.Channel) -> None:
        """Keep one RelayProgress stream open; end every agent stream when it breaks."""
        assert self._stopping is not None
        stub = rpc.CoordinatorStub(channel)
        delay = RECONNECT_S[0]
        while not self._stopping.is_set():
            self._call_no += 1
            call = stub.RelayProgress(self._batches(self._call_no), metadata=self._metadata)
            try:
                await call.wait_for_connection()
                self.connected = True
                delay = RECONNECT_S[0]
                log.info("forwarding progress to %s", self.coordinator)
                async for ack in call:
                    for a in ack.acks:
                        self._route(a)
                why = "the coordinator ended the relay's stream"
            except grpc.aio.AioRpcError as e:
                why = (
                    f"the relay's stream to the coordinator failed: {e.code().name}: {e.details()}"
                )
            finally:
                call.cancel()
            if self.connected:
                log.warning("%s; agents report to the coordinator directly", why)
            self.connected = False
            self.upstream_failures += 1
            self._end_all(grpc.StatusCode.UNAVAILABLE, why, "upstream_lost")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), delay)
            delay = min(RECONNECT_S[1], delay * 2)

    # ---- lifecycle -------------------------------------------------------------

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wake, self._stopping = asyncio.Event(), asyncio.Event()
        options = self.server_options(self._max_bytes)
        interceptors = [TokenAuth(self._token)] if self._token else []
        server = grpc.aio.server(interceptors=interceptors, options=options)
        channel = self._channel()
        self.carried = CarriedCalls(channel)
        handlers = {**self.carried.handlers(), **RelayService(self).handlers()}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        addr = hostport(self.conf.serve.host, self.conf.serve.grpc_port)
        creds = server_credentials(self.conf.auth)
        port = server.add_secure_port(addr, creds) if creds else server.add_insecure_port(addr)
        if not port:
            await channel.close()
            raise OSError(f"cannot bind {addr}")
        host = self.conf.serve.host
        self.address = hostport(host, port)
        self.relay_id = f"{socket.gethostname()}:{port}"
        await server.start()
        self._watch_wake = asyncio.Event()
        forward = asyncio.create_task(self._forward(channel))
        forward.add_done_callback(self._upstream_ended)
        commands = asyncio.create_task(self._commands(channel))
        commands.add_done_callback(self._upstream_ended)
        self._started.set()
        try:
            await self._stopping.wait()
        finally:
            self._end_all(grpc.StatusCode.UNAVAILABLE, "the relay is stopping", "stopping")
            self._end_watches(grpc.StatusCode.UNAVAILABLE, "the relay is stopping")
            await server.stop(1.0)
            forward.cancel()
            commands.cancel()
            await asyncio.gather(forward, commands, return_exceptions=True)
            await channel.close()

    def _upstream_ended(self, task: asyncio.Task[None]) -> None:
        """`_forward` and `_commands` run until the relay stops; one ended
        otherwise (a bug), the relay would turn agents away while looking
        alive: stop it, so that `hangwatch relay` exits non-zero and its
        supervisor restarts it."""
        assert self._stopping is not None
        if self._stopping.is_set():
            return
        err = None if task.cancelled() else task.exception()
        if err is None and self.commands_unsupported:
            return  # _commands ends so on an older coordinator: agents watch it directly
        log.error("the relay's stream to the coordinator stopped for good: %r; stopping", err)
        self._stopping.set()

    def _channel(self) -> grpc.aio.Channel:
        options = [*message_size_options(self._max_bytes), ("grpc.max_reconnect_backoff_ms", 2000)]
        # As an agent dials: the coordinator verified with the CA, the relay's
        # certificate presented where the coordinator asks for one (mTLS).
        creds = channel_credentials(self.conf.auth)
        if creds is not None:
            return grpc.aio.secure_channel(self.coordinator, creds, options=options)
        return grpc.aio.insecure_channel(self.coordinator, options=options)

    def _run(self) -> None:
        try:
            # asyncio.run cancels what gRPC left running (a call's request
            # feeder) before it closes the loop.
            asyncio.run(self._main())
        except BaseException as e:
            self._start_error = e
            self._started.set()

    def start(self, timeout: float = 10.0) -> str:
        """Bind and start; returns the address agents use."""
        self._thread = threading.Thread(target=self._run, name="hangwatch-relay", daemon=True)
        self._thread.start()
        if not self._started.wait(timeout):
            raise RuntimeError("the relay did not start")
        if self._start_error is not None:
            raise RuntimeError(f"cannot start the relay: {self._start_error}")
        serve = self.conf.serve
        self._http = RelayHttp(self.stats, host=serve.host, port=serve.http_port, token=self._token)
        try:
            self.http_address = self._http.start()
        except OSError as e:
            self._http = None
            self.stop()
            raise RuntimeError(f"cannot start the relay's HTTP port: {e}") from None
        return self.address

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, bound_s: float = SHUTDOWN_BOUND_S) -> None:
        if self._http is not None:
            self._http.stop()
        loop, stopping = self._loop, self._stopping
        if loop is not None and stopping is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop already ended
                loop.call_soon_threadsafe(stopping.set)
        if self._thread is not None:
            self._thread.join(bound_s)


# ---- `hangwatch relay` ----------------------------------------------------------


def add_parser(subparsers: Any) -> None:
    cfg.add_command(
        subparsers,
        cfg.RELAY,
        help="Relay agents' progress to the coordinator, many reports a message.",
        description=(
            "Take node agents' progress streams (agents started with --progress-relay) and"
            " forward them to the coordinator in batches, one stream for all: for jobs of"
            " more than a few thousand ranks (docs/scaling.md)."
        ),
        func=run,
        defaults={"grpc_port": RELAY_PORT, "http_port": RELAY_HTTP_PORT},
    )


def run(ns: argparse.Namespace) -> int:
    try:
        own: dict[str, Any] = {}
        for name, port in (("grpc_port", RELAY_PORT), ("http_port", RELAY_HTTP_PORT)):
            if not cfg.explicitly_set(ns, name):
                own[name] = port
        conf = cfg.for_command(cfg.RELAY, ns, None, **own)
    except ValueError as e:
        print(f"hangwatch relay: bad setting: {e}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    configure_logging(conf.job.log_level)
    relay = Relay(conf)
    signals = ShutdownSignals("hangwatch relay", exit_bound_s=EXIT_BOUND_S)
    with signals as stop:
        try:
            address = relay.start()
        except RuntimeError as e:
            print(f"hangwatch relay: {e}", file=sys.stderr, flush=True)
            return EXIT_USAGE
        print(
            f"hangwatch relay: grpc={address} http={relay.http_address}"
            f" coordinator={relay.coordinator}",
            flush=True,
        )
        try:
            while not stop.wait(1.0):
                if not relay.alive:
                    log.error("the relay's loop ended")
                    return 1
            return 0
        finally:
            signals.stopping()
            relay.stop()
            if relay.alive:
                log.error("the relay's loop did not end within %.0f s", SHUTDOWN_BOUND_S)
