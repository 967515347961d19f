"""A real coordinator on loopback port 0 and a protocol-level agent that talks to it.

`ProtocolAgent` is a real gRPC client sending what a node agent sends; it
lets these tests drive the detector with exact sequence numbers. Real torch
ranks behind a real agent are exercised by the end-to-end tests elsewhere.
"""

from __future__ import annotations

import copy
import hashlib
import pickle
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from hangwatch.server.coordinator import Coordinator
from hangwatch.server.incidents.store import IncidentRow
from hangwatch.server.relay import Relay

from hangwatch import formats
from hangwatch.config import Config
from hangwatch.wire import pb, rpc


def make_config(tmp_path: Path, **kw: Any) -> Config:
    base: dict[str, Any] = {
        "data_dir": str(tmp_path / "data"),
        "grpc_port": 0,
        "http_port": 0,
        "stall_timeout": 0.5,
        "dump_deadline": 5.0,
        "agent_lost_timeout": 30.0,
    }
    base.update(kw)
    return Config.of(**base)


@pytest.fixture
def start_coordinator(tmp_path: Path) -> Iterator[Callable[..., Coordinator]]:
    started: list[Coordinator] = []

    def start(**kw: Any) -> Coordinator:
        analyze = kw.pop("analyze", None)
        extra = {"analyze": analyze} if analyze else {}
        max_file_bytes = kw.pop("max_file_bytes", None)
        if max_file_bytes:
            extra["max_file_bytes"] = max_file_bytes
        if (clock := kw.pop("clock", None)) is not None:
            # On a caller's clock the coordinator starts no ticker: the test ticks.
            extra["clock"] = clock
        c = Coordinator(make_config(tmp_path, **kw), tick_s=0.05, **extra)
        c.start()
        started.append(c)
        return c

    yield start
    for c in started:
        c.stop(grace=1.0)


@pytest.fixture
def coordinator(start_coordinator: Callable[..., Coordinator]) -> Coordinator:
    return start_coordinator()


def start_relay(coordinator: str, **kw: Any) -> Relay:
    """A relay (`server.relay`) for `coordinator`, on ports 0, started; its
    window 0.1 s unless `relay_window` says otherwise."""
    kw.setdefault("relay_window", 0.1)
    r = Relay(Config.of(coordinator=coordinator, grpc_port=0, http_port=0, **kw))
    r.start()
    return r


@pytest.fixture
def relay(coordinator: Coordinator) -> Iterator[Relay]:
    """A relay for `coordinator`, with both its streams to it up."""
    r = start_relay(coordinator.grpc_address)
    wait_for(lambda: r.connected and r.commands_connected, 10, "the relay's streams")
    yield r
    r.stop()


@pytest.fixture
def stub(coordinator: Coordinator) -> Iterator[rpc.CoordinatorStub]:
    with grpc.insecure_channel(coordinator.grpc_address) as ch:
        yield rpc.CoordinatorStub(ch)


@dataclass(eq=False)
class ProtocolAgent:
    """Speaks the agent side of the wire contract for a set of ranks (`groups`: name ->
    members; empty, the default group of all `world_size` ranks)."""

    stub: rpc.CoordinatorStub
    _: KW_ONLY
    job_id: str
    agent_id: str
    ranks: list[int]
    world_size: int
    groups: dict[str, list[int]] = field(default_factory=dict)
    session_id: str = field(default="", init=False)
    seq: int = field(default=0, init=False)
    _in_flight_since: dict[tuple[int, str, int], float] = field(default_factory=dict, init=False)
    commands: queue.Queue[pb.Command] = field(default_factory=queue.Queue, init=False)
    _watch: grpc.Future | None = field(default=None, init=False)
    watch_thread: threading.Thread | None = field(default=None, init=False)
    watch_error: grpc.RpcError | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.groups = self.groups or {"0": list(range(self.world_size))}

    def register(self) -> pb.RegisterResponse:
        infos = [
            pb.RankInfo(
                rank=r,
                local_rank=i,
                world_size=self.world_size,
                pid=10_000 + r,
                backend="gloo",
                torch_version="2.13.0",
                fr_source="worker-server",
                groups=[
                    pb.GroupInfo(
                        name=g, desc="default_pg" if g == "0" else f"group_{g}", pg_id=i, ranks=m
                    )
                    for i, (g, m) in enumerate(self.groups.items())
                    if r in m
                ],
            )
            for i, r in enumerate(self.ranks)
        ]
        resp = self.stub.Register(
            pb.RegisterRequest(
                job_id=self.job_id,
                agent_id=self.agent_id,
                host=f"host-{self.agent_id}",
                ranks=infos,
            ),
            timeout=5,
        )
        self.session_id = resp.session_id
        return resp

    def progress(
        self,
        seqs: dict[int, tuple[int, int]],
        *,
        group: str = "0",
        states: dict[int, Any] | None = None,
    ) -> bool:
        """seqs: rank -> (last_enqueued, last_completed) in `group`."""
        self.seq += 1
        ranks = []
        for r, (le, lc) in seqs.items():
            gp = pb.GroupProgress(group=group, last_enqueued=le, last_completed=lc, last_started=-1)
            if le > lc:
                # Age on this agent's own clock, like a real agent measures it.
                since = self._in_flight_since.setdefault((r, group, lc + 1), time.monotonic())
                gp.oldest_in_flight.CopyFrom(
                    pb.InFlight(seq=lc + 1, op="all_reduce", age_s=time.monotonic() - since)
                )
            ranks.append(
                pb.RankProgress(
                    rank=r, state=(states or {}).get(r, pb.PROCESS_STATE_RUNNING), groups=[gp]
                )
            )
        ack = self.stub.ReportProgress(
            pb.ProgressReport(
                job_id=self.job_id,
                agent_id=self.agent_id,
                session_id=self.session_id,
                report_seq=self.seq,
                ranks=ranks,
            ),
            timeout=5,
        )
        return bool(ack.known)

    def watch(self) -> None:
        call = self.stub.WatchCommands(
            pb.WatchRequest(job_id=self.job_id, agent_id=self.agent_id, session_id=self.session_id)
        )
        self._watch = call

        def pump() -> None:
            try:
                for cmd in call:
                    self.commands.put(cmd)
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.CANCELLED:
                    self.watch_error = e

        self.watch_thread = threading.Thread(target=pump, daemon=True)
        self.watch_thread.start()

    def next_command(self, timeout: float) -> pb.Command:
        return self.commands.get(timeout=timeout)

    def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
        if self.watch_thread is not None:
            self.watch_thread.join(5)
            assert not self.watch_thread.is_alive()

    def upload(
        self, incident_id: str, rank: int, file_name: str, data: bytes, *, chunk: int = 64 * 1024
    ) -> pb.UploadAck:
        return self.stub.UploadBundle(
            iter(chunks(self.job_id, self.agent_id, incident_id, rank, file_name, data, chunk)),
            timeout=10,
        )

    def complete(
        self, incident_id: str, dumped: list[int], failures: dict[int, str] | None = None
    ) -> bool:
        ack = self.stub.CompleteDump(
            pb.DumpResult(
                job_id=self.job_id,
                agent_id=self.agent_id,
                incident_id=incident_id,
                ranks_dumped=dumped,
                failures=[
                    pb.RankFailure(rank=r, reason=why) for r, why in (failures or {}).items()
                ],
            ),
            timeout=5,
        )
        return bool(ack.accepted)


def chunks(
    job_id: str, agent_id: str, incident_id: str, rank: int, file_name: str, data: bytes, size: int
) -> list[pb.BundleChunk]:
    digest = hashlib.sha256(data).hexdigest()
    out = []
    offsets = list(range(0, len(data), size)) or [0]
    for i, off in enumerate(offsets):
        last = i == len(offsets) - 1
        out.append(
            pb.BundleChunk(
                job_id=job_id if i == 0 else "",
                agent_id=agent_id if i == 0 else "",
                incident_id=incident_id,
                rank=rank,
                file_name=file_name,
                offset=off,
                data=data[off : off + size],
                last=last,
                sha256=digest if last else "",
                total_size=len(data) if i == 0 else 0,
            )
        )
    return out


def gloo_dump(*, rank: int, last_enqueued: int, last_completed: int, group: str = "0") -> bytes:
    """An FR dump with the dict shape torch 2.13 writes for gloo (pickle, no globals)."""
    entries = []
    for seq in range(1, last_enqueued + 1):
        entries.append(
            {
                "record_id": seq - 1,
                "pg_id": 0,
                "process_group": (group, "default_pg"),
                "collective_seq_id": seq,
                "p2p_seq_id": 0,
                "op_id": seq,
                "profiling_name": "gloo:all_reduce",
                "time_created_ns": 1_700_000_000_000_000_000 + seq * 1_000_000,
                "input_sizes": [[1024]],
                "input_dtypes": ["Float"],
                "output_sizes": [[1024]],
                "output_dtypes": ["Float"],
                "state": "scheduled",
                "time_discovered_started_ns": None,
                "time_discovered_completed_ns": None,
                "retired": seq <= last_completed,
                "timeout_ms": 1_800_000,
                "is_p2p": False,
                "thread_name": "pt_main_thread",
                "thread_id": "140000000000000",
                "frames": [{"name": "train_step", "filename": "train.py", "line": 42}],
            }
        )
    doc = {
        "version": "2.10",
        "pg_config": {"": {"name": "", "desc": "", "ranks": "[]"}},
        "comm_lib_version": "gloo",
        "pg_status": {
            "0": {
                "last_enqueued_collective": last_enqueued,
                "last_started_collective": -1,
                "last_completed_collective": last_completed,
            }
        },
        "entries": entries,
    }
    return pickle.dumps(doc)


def rank_meta(rank: int, world_size: int, host: str = "host") -> bytes:
    return formats.RankMeta(
        rank=rank,
        host=host,
        pid=10_000 + rank,
        process_state="running",
        reachable=True,
        groups=(
            formats.GroupInfo(name="0", desc="default_pg", pg_id=0, ranks=list(range(world_size))),
        ),
        sources={"fr": "worker-server", "stacks": "none", "gpu": "none", "process": "procfs"},
        gpu={"available": False, "reason": "no GPU"},
    ).to_bytes()


def free_port() -> int:
    """A loopback port nothing listens on (closed again: for a peer that must be absent)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(pred: Callable[[], Any], timeout: float, what: str) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def wait_status(
    c: Coordinator, incident_id: str, status: str, timeout: float = 20.0
) -> IncidentRow:
    def done() -> IncidentRow | None:
        row = c.store.get_incident(incident_id)
        return row if row is not None and row.status == status else None

    try:
        return wait_for(done, timeout, f"incident {incident_id} to be {status}")
    except AssertionError:
        row = c.store.get_incident(incident_id)
        raise AssertionError(f"incident {incident_id}: {row}") from None


def two_nodes(
    stub: rpc.CoordinatorStub, job_id: str, names: tuple[str, str] = ("node-a", "node-b")
) -> tuple[ProtocolAgent, ProtocolAgent]:
    """Node a with ranks 0,1 and node b with ranks 2,3 of a 4-rank job, both
    registered and watching for commands."""
    a = ProtocolAgent(stub, job_id=job_id, agent_id=names[0], ranks=[0, 1], world_size=4)
    b = ProtocolAgent(stub, job_id=job_id, agent_id=names[1], ranks=[2, 3], world_size=4)
    for ag in (a, b):
        ag.register()
        ag.watch()
    return a, b


def hang_rank_2(
    a: ProtocolAgent,
    b: ProtocolAgent,
    *,
    seq: int,
    hosts: tuple[str, str] = ("host", "host"),
    on_stalled: Callable[[], None] | None = None,
    dump_timeout: float = 10.0,
    uploads_via: rpc.CoordinatorStub | None = None,
) -> str:
    """Node a (ranks 0,1) and node b (ranks 2,3), registered and watching: three
    healthy steps before `seq`, then rank 2 never enters collective `seq` while
    the others wait in it (then `on_stalled()`, if given). Waits for the DUMP
    (up to `dump_timeout`),
    uploads every rank's dump (its meta naming host hosts[0] for node a's ranks,
    hosts[1] for node b's) and completes, on `uploads_via` where given (a
    relay's stub); returns the incident id."""
    for step in range(max(1, seq - 4), max(4, seq - 1)):
        a.progress({0: (step, step), 1: (step, step)})
        b.progress({2: (step, step), 3: (step, step)})
    stalled = {0: (seq, seq - 1), 1: (seq, seq - 1)}, {2: (seq - 1, seq - 1), 3: (seq, seq - 1)}
    a.progress(stalled[0])
    b.progress(stalled[1])
    if on_stalled is not None:
        on_stalled()
    cmd = a.next_command(timeout=dump_timeout)
    assert cmd.kind == pb.COMMAND_KIND_DUMP and b.next_command(timeout=10).kind == cmd.kind
    iid = cmd.incident_id
    for node, seqs in zip((a, b), stalled, strict=True):
        ag = node
        if uploads_via is not None:
            ag = copy.copy(node)
            ag.stub = uploads_via
        for r, (le, lc) in seqs.items():
            dump = gloo_dump(rank=r, last_enqueued=le, last_completed=lc)
            assert ag.upload(iid, r, f"{formats.FR_FILE_PREFIX}{r}", dump).complete
            host = hosts[0] if node is a else hosts[1]
            assert ag.upload(iid, r, formats.META_FILE, rank_meta(r, 4, host)).complete
        assert ag.complete(iid, sorted(seqs))
    return iid


def rank_infos(ranks: list[int], world: int, pid_base: int = 20_000) -> list[pb.RankInfo]:
    """Registration of `ranks` of a `world`-rank gloo job, all in the default group "0"."""
    return [
        pb.RankInfo(
            rank=r,
            local_rank=i,
            world_size=world,
            pid=pid_base + r,
            backend="gloo",
            torch_version="2.13.0",
            fr_source="worker-server",
            groups=[pb.GroupInfo(name="0", desc="default_pg", pg_id=0, ranks=list(range(world)))],
        )
        for i, r in enumerate(ranks)
    ]


def progress_at(ranks: list[int], completed: int) -> list[pb.RankProgress]:
    """Every one of `ranks` running, through collective `completed` of group "0"."""
    return [
        pb.RankProgress(
            rank=r,
            state=pb.PROCESS_STATE_RUNNING,
            groups=[pb.GroupProgress(group="0", last_enqueued=completed, last_completed=completed)],
        )
        for r in ranks
    ]
