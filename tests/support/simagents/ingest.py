"""Ingest probe: progress reports as fast as the coordinator acks them, from its own
process."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import multiprocessing.connection
import time
import traceback
from dataclasses import dataclass
from typing import Any

import grpc

from hangwatch.wire import pb
from tests.support.simagents.agent import FleetSpec, SimAgent, SimJobSpec
from tests.support.simagents.constants import KINDS, OPS_PER_STEP, RANKS_PER_AGENT, UNARY_TIMEOUT_S
from tests.support.simagents.fleet import FleetError, FleetState


@dataclass(frozen=True, kw_only=True)
class IngestSpec(SimJobSpec):
    seconds: float = 5.0
    in_flight: int = 128  # concurrent ReportProgress calls (or stream writes)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


async def _ingest(spec: IngestSpec) -> dict[str, Any]:
    fspec = FleetSpec(
        target=spec.target,
        job_id=spec.job_id,
        ranks=spec.ranks,
        pp=spec.pp,
        epoch=time.time(),
        token=spec.token,
        form=spec.form,
    )
    fleet = FleetState(fspec)
    sem = asyncio.Semaphore(64)

    async def reg(a: SimAgent) -> None:
        async with sem:
            await a.register()

    await asyncio.gather(*(reg(a) for a in fleet.agents))
    # Two serialized reports per agent, one step apart, so every report moves
    # last_completed (the coordinator's full update path); report_seq goes at
    # the end (field 4, varint): protobuf takes fields in any order.
    now = time.time()
    bases: list[tuple[bytes, bytes]] = []
    for a in fleet.agents:
        r0 = a.as_sent(a.progress_report(now))
        r1 = a.as_sent(a.progress_report(now + OPS_PER_STEP * fspec.op_s))
        r0.ClearField("report_seq")
        r1.ClearField("report_seq")
        bases.append((r0.SerializeToString(), r1.SerializeToString()))
    call = {
        a.agent_id: a.channel.unary_unary(
            "/hangwatch.v1.Coordinator/ReportProgress",
            request_serializer=None,
            response_deserializer=pb.ProgressAck.FromString,
        )
        for a in fleet.agents
    }
    streams: dict[str, Any] = {}
    if spec.transport == "stream":
        for a in fleet.agents:
            open_stream = a.channel.stream_stream(
                "/hangwatch.v1.Coordinator/StreamProgress",
                request_serializer=None,
                response_deserializer=pb.ProgressAck.FromString,
            )
            streams[a.agent_id] = open_stream(metadata=a.metadata)
    elif spec.transport != "unary":
        raise ValueError(f"unknown transport {spec.transport!r}")
    acks = unknown = failed = 0
    deadline = time.monotonic() + spec.seconds
    agents = fleet.agents
    lanes = max(1, min(spec.in_flight, len(agents)))

    async def lane(i: int) -> None:
        nonlocal acks, unknown, failed
        mine = agents[i::lanes]
        seqs = [0] * len(mine)
        j = 0
        while time.monotonic() < deadline:
            k = j % len(mine)
            a = mine[k]
            seqs[k] += 1
            body = bases[a.node - agents[0].node][seqs[k] % 2] + b"\x20" + _varint(seqs[k])
            try:
                if streams:
                    # Written, not yet applied: the drain below waits for that.
                    await streams[a.agent_id].write(body)
                    acks += 1
                else:
                    ack = await call[a.agent_id](body, timeout=UNARY_TIMEOUT_S, metadata=a.metadata)
                    if ack.known:
                        acks += 1
                    else:
                        unknown += 1
            except grpc.aio.AioRpcError:
                failed += 1
            j += 1

    async def drain(stream: Any) -> None:
        # The coordinator ends a stream once it has applied every report on it:
        # the flood is over when the last one ends, not when the last write left.
        nonlocal unknown, acks
        await stream.done_writing()
        async for ack in stream:
            if not ack.known:
                unknown += 1
                acks -= 1

    t0, wall0 = time.monotonic(), time.time()
    await asyncio.gather(*(lane(i) for i in range(lanes)))
    await asyncio.gather(*(drain(st) for st in streams.values()))
    elapsed = time.monotonic() - t0
    wall1 = time.time()
    await asyncio.gather(*(a.channel.close() for a in agents), return_exceptions=True)
    fleet.close()
    return {
        "agent_reports": acks,
        "rank_reports": acks * RANKS_PER_AGENT,
        "groups_per_rank": len(KINDS),
        "unknown": unknown,
        "failed": failed,
        "seconds": elapsed,
        "agent_reports_per_s": acks / elapsed,
        "rank_reports_per_s": acks * RANKS_PER_AGENT / elapsed,
        "in_flight": lanes,
        "transport": spec.transport,
        "form": spec.form,
        "report_bytes": len(bases[0][0]),
        "flood_start": wall0,
        "flood_end": wall1,
    }


def _ingest_main(spec: IngestSpec, conn: multiprocessing.connection.Connection) -> None:
    try:
        conn.send({"op": "result", "result": asyncio.run(_ingest(spec))})
    except BaseException:
        with contextlib.suppress(OSError):
            conn.send({"op": "error", "traceback": traceback.format_exc()})
        raise


class IngestProbe:
    """Run the ingest probe in its own process; `wait()` returns its numbers."""

    def __init__(self, spec: IngestSpec) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_ingest_main, args=(spec, child), daemon=True)
        self._proc.start()
        child.close()
        self.spec = spec

    def wait(self, timeout: float) -> dict[str, Any]:
        if not self._conn.poll(timeout):
            self._proc.kill()
            self._proc.join(5)
            raise FleetError(f"ingest probe did not finish in {timeout:.0f}s")
        try:
            msg = self._conn.recv()
        except EOFError as e:
            self._proc.join(5)
            raise FleetError(f"ingest probe exited with code {self._proc.exitcode}") from e
        self._proc.join(10)
        if msg["op"] == "error":
            raise FleetError(f"ingest probe failed:\n{msg['traceback']}")
        if self._proc.exitcode not in (0, None):
            raise FleetError(f"ingest probe exited with code {self._proc.exitcode}")
        result: dict[str, Any] = msg["result"]
        return result
