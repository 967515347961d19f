"""One simulated node agent: 8 ranks on its own gRPC channel, the real protocol:
Register (with retries), ReportProgress at 1 Hz (changed ranks only), FR entry
deltas once something is in flight too long, and a WatchCommands stream whose
DUMP and UPLOAD_FULL commands run the uploads (`upload.DumpUploads`)."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc
from hangwatch.agent.delta import DeltaReporter

from hangwatch import pollgrid, progress_columns
from hangwatch.wire import group_info, pb, rpc
from tests.support.simagents.constants import (
    KINDS,
    POLL_TICK_S,
    RANKS_PER_AGENT,
    SIM_CLOCK_ERROR_NS,
    TORCH_VERSION,
    TRANSIENT,
    UNARY_TIMEOUT_S,
)
from tests.support.simagents.topology import index_of, last_seq, op_at, rank_pos
from tests.support.simagents.upload import DumpRecord, DumpUploads

if TYPE_CHECKING:
    from tests.support.simagents.fleet import FleetState


def _group_info(*, name: str, desc: str, pg_id: int, ranks: list[int]) -> pb.GroupInfo:
    """The wire's GroupInfo as the agent writes it: runs where shorter."""
    return group_info(name=name, desc=desc, pg_id=pg_id, members=ranks)


@dataclass(frozen=True, kw_only=True)
class SimJobSpec:
    """The coordinator to talk to and the simulated job's shape (see `Topology`)."""

    target: str
    job_id: str
    ranks: int
    pp: int = 4
    token: str | None = None
    # How progress travels: "stream" (StreamProgress, as the agent sends it
    # since the coordinator offers it) or "unary" (one ReportProgress call per
    # report, as older agents do).
    transport: str = "stream"
    # How ranks are written: "columns" (ProgressReport.columns, as the agent
    # writes them for a coordinator that reads them) or "messages" (one
    # RankProgress per rank, as older agents do).
    form: str = "columns"
    # Relays (`hangwatch relay`) progress streams go through, node i's through
    # relays[i % len]; empty, straight to the coordinator.
    progress_relays: tuple[str, ...] = ()
    # With relays: the agent's other calls (Register, uploads, CompleteDump)
    # through its relay too, as the agent makes them (server.relay_calls), so
    # that it holds no connection to the coordinator. False: straight, as
    # agents did before relays carried them (benchmarks compare the two).
    calls_via_relay: bool = True


@dataclass(frozen=True, kw_only=True)
class FleetSpec(SimJobSpec):
    """What a fleet process needs to know; plain data, so it crosses `spawn`."""

    entries: int = 2000
    epoch: float
    op_s: float = 0.05
    report_interval_s: float = 1.0
    stacks: bool = True
    entries_after_s: float = 2.0  # in flight this long: send the FR entry delta
    nodes: tuple[int, ...] = ()  # node indices this process simulates (empty: all)
    # Hash the full dumps ahead while the stall timeout runs. Off when the
    # coordinator will ask for tails: then it is CPU the fan-out needs.
    prehash_full: bool = True
    compress: bool = True  # gzip phase-one streams, as the real agent does
    # The fleet stands for hundreds of other machines. On a small benchmark
    # box a positive nice keeps it from taking the coordinator's core.
    nice: int = 0


@dataclass
class AgentStats:
    registered: int = 0
    register_retries: int = 0
    reports_sent: int = 0
    rank_reports_sent: int = 0
    reports_failed: int = 0
    reports_unknown: int = 0
    entry_batches: int = 0
    dumps: list[DumpRecord] = field(default_factory=list)
    full_uploads: list[int] = field(default_factory=list)  # ranks sent on UPLOAD_FULL
    errors: list[str] = field(default_factory=list)

    def error(self, text: str) -> None:
        if len(self.errors) < 50:
            self.errors.append(text)


class SimAgent(DumpUploads):
    """One node: 8 ranks, one channel, the real protocol."""

    def __init__(self, fleet: FleetState, node: int) -> None:
        self.fleet = fleet
        self.spec = fleet.spec
        self.node = node
        self.agent_id = f"sim-node-{node:05d}"
        self.host = f"sim-host-{node:05d}"
        self.ranks = list(range(node * RANKS_PER_AGENT, (node + 1) * RANKS_PER_AGENT))
        self.pids = {r: 10_000 + r for r in self.ranks}
        self.metadata: tuple[tuple[str, str], ...] = (
            (("authorization", f"Bearer {self.spec.token}"),) if self.spec.token else ()
        )
        options = [
            ("grpc.max_send_message_length", 8 * 1024 * 1024),
            ("grpc.max_receive_message_length", 8 * 1024 * 1024),
            # Each agent is its own node: its own TCP connection, not one
            # shared subchannel for the whole process.
            ("grpc.use_local_subchannel_pool", 1),
            ("grpc.keepalive_time_ms", 20_000),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.enable_retries", 0),
        ]
        self.channel = grpc.aio.insecure_channel(self.spec.target, options=options)
        self.stub = rpc.CoordinatorStub(self.channel)
        # Progress and commands go through a relay where the spec names some
        # (as the agent's --progress-relay), and its other calls too unless
        # the spec says `calls_via_relay=False`.
        relays = self.spec.progress_relays
        self.relay_channel = (
            grpc.aio.insecure_channel(relays[node % len(relays)], options=options)
            if relays
            else None
        )
        self.progress_stub = (
            rpc.CoordinatorStub(self.relay_channel) if self.relay_channel is not None else self.stub
        )
        self.call_stub = self.progress_stub if self.spec.calls_via_relay else self.stub
        self.session_id = ""
        self.report_seq = 0
        self.stats = AgentStats()
        self.sent_entries: dict[int, int] = {}  # rank -> last record_id sent
        self._handled: set[tuple[str, int]] = set()
        self.delta = DeltaReporter()
        self._stream: Any = None  # the open StreamProgress call, if any
        if self.spec.form not in ("columns", "messages"):
            raise ValueError(f"unknown form {self.spec.form!r}")
        self.groups = progress_columns.group_table(self.register_request().ranks)
        self.coordinator_reads_columns = False  # RegisterResponse.progress_columns
        self.coordinator_stores_archives = False  # RegisterResponse.node_archives

    def register_request(self) -> pb.RegisterRequest:
        topo = self.fleet.topo
        return pb.RegisterRequest(
            job_id=self.spec.job_id,
            agent_id=self.agent_id,
            host=self.host,
            agent_version="sim",
            ranks=[
                pb.RankInfo(
                    rank=r,
                    local_rank=r % RANKS_PER_AGENT,
                    world_size=topo.ranks,
                    pid=self.pids[r],
                    backend="nccl",
                    torch_version=TORCH_VERSION,
                    fr_source="worker-server",
                    groups=topo.rank_groups(r, _group_info),
                )
                for r in self.ranks
            ],
        )

    async def register(self, attempts: int = 5) -> None:
        """Register, retrying transient failures with backoff as the real agent does."""
        for attempt in range(attempts):
            try:
                resp = await self.call_stub.Register(
                    self.register_request(), timeout=UNARY_TIMEOUT_S, metadata=self.metadata
                )
                break
            except grpc.aio.AioRpcError as e:
                if e.code() not in TRANSIENT or attempt == attempts - 1:
                    raise
                self.stats.register_retries += 1
                self.stats.error(f"Register: {e.code().name}: {e.details()} (retrying)")
                await asyncio.sleep(0.2 * 2**attempt)
        self.session_id = resp.session_id
        self.coordinator_reads_columns = resp.progress_columns
        self.coordinator_stores_archives = resp.node_archives
        self.stats.registered += 1
        self.delta.reset(resp.heartbeat_s)
        self._end_stream()  # its session is over

    def progress_report(self, now: float, *, status_at_ns: int = 0) -> pb.ProgressReport:
        """Every rank's numbers at `now`; `status_at_ns` (the grid instant they
        were read at) also says so to the straggler monitor, with a synced clock."""
        clock, hang = self.fleet.clock, self.fleet.hang
        idx = clock.index(now)
        self.report_seq += 1
        ranks = []
        for r in self.ranks:
            pos = rank_pos(r, idx, hang)
            groups = []
            for k in KINDS:
                comp, enq = last_seq(k, pos.completed), last_seq(k, pos.enqueued)
                started = last_seq(k, pos.started) if pos.started is not None else comp
                comp_idx = index_of(k, comp) if comp > 0 else -1
                gp = pb.GroupProgress(
                    group=self.fleet.names[k][r],
                    last_enqueued=enq,
                    last_completed=comp,
                    last_started=started,
                    completed_unchanged_s=max(0.0, now - clock.time_of(comp_idx + 1)),
                )
                if enq > comp:
                    in_idx = index_of(k, comp + 1)
                    gp.oldest_in_flight.CopyFrom(
                        pb.InFlight(
                            seq=comp + 1,
                            op=op_at(in_idx)[1],
                            age_s=max(0.0, now - clock.time_of(in_idx)),
                        )
                    )
                groups.append(gp)
            ranks.append(
                pb.RankProgress(
                    rank=r,
                    state=pb.PROCESS_STATE_RUNNING,
                    groups=groups,
                    fr_age_s=0.0,
                    status_at_ns=status_at_ns,
                )
            )
        return pb.ProgressReport(
            job_id=self.spec.job_id,
            agent_id=self.agent_id,
            session_id=self.session_id,
            report_seq=self.report_seq,
            ranks=ranks,
            clock_offset_ns=0,
            clock_error_ns=SIM_CLOCK_ERROR_NS if status_at_ns else 0,
        )

    def as_sent(self, report: pb.ProgressReport) -> pb.ProgressReport:
        """The report in the spec's form (in place): columns only to a
        coordinator that said it reads them, as the agent does."""
        if self.spec.form == "columns" and self.coordinator_reads_columns:
            columns, rest = progress_columns.encode(report.ranks, self.groups)
            del report.ranks[:]
            report.ranks.extend(rest)
            if columns is not None:
                report.columns.CopyFrom(columns)
        return report

    def _next_read_ns(self, after_ns: int) -> int:
        """The next instant of the shared poll grid this agent reads at: every
        tick at 1 Hz, every 4th with a 4 s report interval."""
        tick_ns = int(POLL_TICK_S * 1e9)
        every = max(1, round(self.spec.report_interval_s / POLL_TICK_S))
        k, _ = pollgrid.nearest(pollgrid.next_after(after_ns, tick_ns), tick_ns)
        while k % every:
            k += 1
        return pollgrid.instant_ns(k, tick_ns)

    async def progress_loop(self, delay: float) -> None:
        """Read every rank on the poll grid all agents share and report, as the
        real agent does (agent.lateness): the nodes read together, and each
        report reaches the coordinator `delay` after the instant (a node's
        poll and encoding time), so a job's reports arrive in one burst a tick."""
        while True:
            at_ns = self._next_read_ns(time.time_ns())
            await asyncio.sleep(max(0.0, (at_ns - time.time_ns()) / 1e9) + delay)
            now = at_ns / 1e9
            try:
                report = self.progress_report(now, status_at_ns=at_ns)
                streaming = self.spec.transport == "stream"
                if streaming and self._stream is None:
                    self.delta.reset()  # a new stream carries every rank
                # Changed ranks only, all of them every few seconds: as the real agent.
                pick = self.delta.select(report.ranks, time.monotonic())
                if pick is not None:
                    del report.ranks[:]
                    report.ranks.extend(pick[0])
                    self.as_sent(report)
                    # On a stream an unknown session is answered later (_read_acks).
                    known = True
                    if streaming:
                        await self._stream_report(report)
                    else:
                        ack = await self.stub.ReportProgress(
                            report, timeout=UNARY_TIMEOUT_S, metadata=self.metadata
                        )
                        known = ack.known
                    self.stats.reports_sent += 1
                    self.stats.rank_reports_sent += len(pick[0])
                    if known:
                        self.delta.commit(pick[0], pick[1], time.monotonic())
                    else:
                        self.stats.reports_unknown += 1
                        await self.register()
                await self._maybe_entries(now)
            except grpc.aio.AioRpcError as e:
                self._end_stream()
                self.stats.reports_failed += 1
                self.stats.error(f"ReportProgress: {e.code().name}: {e.details()}")

    async def _stream_report(self, report: pb.ProgressReport) -> None:
        if self._stream is None:
            self._stream = self.progress_stub.StreamProgress(metadata=self.metadata)
            self.fleet.spawn(self._read_acks(self._stream))
        await self._stream.write(report)

    async def _read_acks(self, call: Any) -> None:
        """The coordinator answers a stream only to say the session is unknown."""
        try:
            async for ack in call:
                if not ack.known and self._stream is call:
                    self.stats.reports_unknown += 1
                    await self.register()
                    return
        except grpc.aio.AioRpcError as e:
            if self._stream is call:
                self._stream = None
                if e.code() != grpc.StatusCode.CANCELLED:
                    self.stats.error(f"StreamProgress: {e.code().name}: {e.details()}")

    def _end_stream(self) -> None:
        call, self._stream = self._stream, None
        if call is not None:
            call.cancel()

    async def _maybe_entries(self, now: float) -> None:
        """Like the real agent: once something has been in flight too long, send
        the FR entries not sent before (the newest few per rank)."""
        hang = self.fleet.hang
        if hang is None:
            return
        idx = self.fleet.clock.index(now)
        entries = []
        for r in self.ranks:
            pos = rank_pos(r, idx, hang)
            oldest = pos.started if pos.started is not None else pos.completed + 1
            if now - self.fleet.clock.time_of(oldest) < self.spec.entries_after_s:
                continue
            first = max(self.sent_entries.get(r, -1) + 1, pos.enqueued - 15)
            for i in range(first, pos.enqueued + 1):
                kind, op = op_at(i)
                state = (
                    "completed"
                    if i <= pos.completed
                    else "started"
                    if i == pos.started
                    else "scheduled"
                )
                ins, _, dtype = self.fleet.dumps.sizes[(kind, op)]
                entries.append(
                    pb.FrEntry(
                        rank=r,
                        record_id=i,
                        group=self.fleet.names[kind][r],
                        collective_seq=last_seq(kind, i),
                        profiling_name="nccl:" + op,
                        state=state,
                        retired=i <= pos.completed,
                        age_s=max(0.0, now - self.fleet.clock.time_of(i)),
                        input_sizes_json=json.dumps(ins),
                        input_dtypes_json=json.dumps([dtype]),
                    )
                )
            self.sent_entries[r] = max(self.sent_entries.get(r, -1), pos.enqueued)
        if not entries:
            return
        ack = await self.call_stub.ReportEntries(
            pb.EntryBatch(
                job_id=self.spec.job_id,
                agent_id=self.agent_id,
                session_id=self.session_id,
                entries=entries,
            ),
            timeout=UNARY_TIMEOUT_S,
            metadata=self.metadata,
        )
        self.stats.entry_batches += 1
        if not ack.known:
            await self.register()

    async def watch_loop(self) -> None:
        relay_down_until = 0.0  # as the agent: after a relay fails, straight for a minute
        while True:
            via_relay = self.relay_channel is not None and time.monotonic() >= relay_down_until
            call = (self.progress_stub if via_relay else self.stub).WatchCommands(
                pb.WatchRequest(
                    job_id=self.spec.job_id, agent_id=self.agent_id, session_id=self.session_id
                ),
                metadata=self.metadata,
            )
            try:
                async for cmd in call:
                    key = (cmd.incident_id, cmd.kind)
                    if key in self._handled:
                        continue
                    self._handled.add(key)
                    if cmd.kind == pb.COMMAND_KIND_DUMP:
                        self.fleet.spawn(self.dump(cmd.incident_id, time.time(), cmd.tail_context))
                    elif cmd.kind == pb.COMMAND_KIND_UPLOAD_FULL:
                        self.fleet.spawn(self.upload_full(cmd.incident_id, list(cmd.ranks)))
            except grpc.aio.AioRpcError as e:
                # The fleet's own shutdown cancels this task (CancelledError),
                # never the call: a CANCELLED call came from the other end or
                # the transport, and the real agent reopens its stream then.
                # Raised, it ended this agent for good: at 16,384 simulated
                # ranks one agent never saw its DUMP and the incident waited
                # out its deadline.
                self.stats.error(f"WatchCommands: {e.code().name}: {e.details()}")
                if via_relay and e.code() != grpc.StatusCode.FAILED_PRECONDITION:
                    relay_down_until = time.monotonic() + 60.0
                    continue  # the relay failed: straight to the coordinator now
            await asyncio.sleep(0.2)  # the stream ended (re-register or restart): reopen
