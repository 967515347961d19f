"""The DUMP command's uploads, as `hangwatch agent` does them: per rank, files one by
one in sha256-checked chunks, or (two-phase, when the command asks for tails)
every rank's FR tail and meta.json in one compressed UploadFiles stream and,
on UPLOAD_FULL, the full dumps of the ranks named; then CompleteDump."""

from __future__ import annotations

import asyncio
import hashlib
import io
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypedDict

import grpc
from hangwatch.agent.uploader import archive_chunks, pack_chunks, read_chunks

from hangwatch import formats
from hangwatch.wire import pb, rpc
from tests.support.simagents.constants import (
    CHUNK_BYTES,
    COMPLETE_ATTEMPTS,
    TRANSIENT,
    UNARY_TIMEOUT_S,
    UPLOAD_TIMEOUT_S,
)
from tests.support.simagents.dumps import stacks_text
from tests.support.simagents.topology import RankPos, rank_pos

if TYPE_CHECKING:
    from tests.support.simagents.agent import AgentStats, FleetSpec
    from tests.support.simagents.fleet import FleetState


@dataclass
class DumpRecord:
    incident_id: str
    command_at: float  # time.time() the DUMP command arrived
    done_at: float | None = None  # CompleteDump acknowledged
    ranks_dumped: int = 0
    files: int = 0
    bytes: int = 0
    accepted: bool | None = None
    error: str = ""
    tail_context: int = 0


class IncidentIds(TypedDict):
    job_id: str
    agent_id: str
    incident_id: str


class DumpUploads:
    """What one simulated agent does on DUMP and UPLOAD_FULL; mixed into `SimAgent`,
    which sets these attributes."""

    fleet: FleetState
    spec: FleetSpec
    agent_id: str
    ranks: list[int]
    pids: dict[int, int]
    metadata: tuple[tuple[str, str], ...]
    call_stub: rpc.CoordinatorStub
    stats: AgentStats
    coordinator_stores_archives: bool

    def about(self, incident_id: str) -> IncidentIds:
        """The ids every message about an incident carries: whose, from whom, which."""
        return IncidentIds(job_id=self.spec.job_id, agent_id=self.agent_id, incident_id=incident_id)

    def bundle_files(self, rank: int, pos: RankPos) -> list[tuple[str, bytes, str]]:
        """(name, bytes, sha256 hex) of one rank's bundle."""
        fr = self.fleet.dump_with_digest(rank, pos)
        files = [(f"{formats.FR_FILE_PREFIX}{rank}", *fr)]
        files.append((formats.META_FILE, *self.fleet.meta_with_digest(rank)))
        if self.spec.stacks:
            st = stacks_text(rank, pos, self.pids[rank]).encode()
            files.append((formats.STACKS_FILE, st, hashlib.sha256(st).hexdigest()))
        return files

    def tail_files(self, rank: int, pos: RankPos, context: int) -> list[tuple[str, bytes, str]]:
        """(name, bytes, sha256 hex) of one rank's phase-one files."""
        return self.fleet.phase_one_files(rank, pos, context, self.pids[rank])

    def _with_columns(
        self, members: list[tuple[int, str, bytes]], files: list[tuple[int, str, bytes, str]]
    ) -> list[tuple[int, str, bytes]]:
        """The archive's members and, as the real agent adds it, its columns
        member (agent.uploader.node_columns; decoded in-process here, by the
        same code, mostly ahead of the dump)."""
        cols = self.fleet.node_columns([f for f in files if formats.is_tail_fr_name(f[1])])
        if not cols:
            return members
        return [*members, (min(r for r, _, _ in members), formats.FR_COLUMNS_FILE, cols)]

    async def _upload_tails(
        self, rec: DumpRecord, incident_id: str, idx: int, context: int
    ) -> tuple[list[int], list[pb.RankFailure]]:
        files: list[tuple[int, str, bytes, str]] = []
        for r in self.ranks:
            pos = rank_pos(r, idx, self.fleet.hang)
            files.extend((r, *f) for f in self.tail_files(r, pos, context))

        archive = self.coordinator_stores_archives
        sent = 1 if archive else len(files)
        built: list[pb.BundleChunk] = []
        if archive:
            # Built by the real agent's own code, on a thread as the agent
            # builds it on its upload thread: ~3 ms a node, which on the
            # fleet's event loop held up the next agents' DUMP commands.
            built = await asyncio.to_thread(
                lambda: list(
                    archive_chunks(
                        self._with_columns([(r, name, data) for r, name, data, _ in files], files),
                        size=CHUNK_BYTES,
                        **self.about(incident_id),
                    )
                )
            )

        async def chunks() -> AsyncIterator[pb.BundleChunks]:
            # Packed by the real agent's own packer.
            every: Iterator[pb.BundleChunk] = (
                iter(built)
                if archive
                else (
                    c
                    for r, name, data, digest in files
                    for c in _chunk_list(self, incident_id, r, name, data, digest)
                )
            )
            for msg in pack_chunks(every, CHUNK_BYTES):
                yield msg

        try:
            ack = await self.call_stub.UploadFiles(
                chunks(),
                timeout=UPLOAD_TIMEOUT_S,
                metadata=self.metadata,
                compression=grpc.Compression.Gzip if self.spec.compress and not archive else None,
            )
        except grpc.aio.AioRpcError as e:
            why = f"upload failed: {e.code().name}: {e.details()}"
            self.stats.error(f"UploadFiles: {why}")
            return [], [pb.RankFailure(rank=r, reason=why) for r in self.ranks]
        if len(ack.files) != sent or not all(a.complete for a in ack.files):
            why = f"coordinator acked {len(ack.files)} of {sent} files"
            self.stats.error(why)
            return [], [pb.RankFailure(rank=r, reason=why) for r in self.ranks]
        rec.files += len(files)
        rec.bytes += sum(len(f[2]) for f in files)
        return list(self.ranks), []

    async def upload_full(self, incident_id: str, ranks: list[int]) -> None:
        """Phase two: full dumps of the ranks asked for, as the real agent does."""
        idx = self.fleet.clock.index(time.time())
        for r in ranks:
            if r not in self.ranks:
                continue
            data, digest = self.fleet.dump_with_digest(r, rank_pos(r, idx, self.fleet.hang))
            try:
                await self.call_stub.UploadBundle(
                    _chunks(self, incident_id, r, f"{formats.FR_FILE_PREFIX}{r}", data, digest),
                    timeout=UPLOAD_TIMEOUT_S,
                    metadata=self.metadata,
                )
                self.stats.full_uploads.append(r)
            except grpc.aio.AioRpcError as e:
                self.stats.error(f"UploadBundle (full) rank {r}: {e.code().name}: {e.details()}")

    async def dump(self, incident_id: str, command_at: float, tail_context: int = 0) -> None:
        rec = DumpRecord(incident_id=incident_id, command_at=command_at, tail_context=tail_context)
        self.stats.dumps.append(rec)
        idx = self.fleet.clock.index(time.time())
        dumped: list[int] = []
        failures: list[pb.RankFailure] = []
        try:
            if tail_context:
                dumped, failures = await self._upload_tails(rec, incident_id, idx, tail_context)
            for r in self.ranks if not tail_context else ():
                pos = rank_pos(r, idx, self.fleet.hang)
                try:
                    # Serial, as the real agent uploads: one file stream at a time.
                    for name, data, digest in self.bundle_files(r, pos):
                        ack = await self.call_stub.UploadBundle(
                            _chunks(self, incident_id, r, name, data, digest),
                            timeout=UPLOAD_TIMEOUT_S,
                            metadata=self.metadata,
                        )
                        if not ack.complete:
                            raise RuntimeError(
                                f"{name}: stored {ack.bytes_stored} bytes, not complete"
                            )
                        rec.files += 1
                        rec.bytes += len(data)
                    dumped.append(r)
                except (grpc.aio.AioRpcError, RuntimeError) as e:
                    why = (
                        f"{e.code().name}: {e.details()}"
                        if isinstance(e, grpc.aio.AioRpcError)
                        else str(e)
                    )
                    failures.append(pb.RankFailure(rank=r, reason=f"upload failed: {why}"))
                    self.stats.error(f"UploadBundle rank {r}: {why}")
            result = pb.DumpResult(
                **self.about(incident_id), ranks_dumped=dumped, failures=failures
            )
            # Retried as the real agent retries a pending dump's answer: one
            # lost under load would leave the coordinator waiting out its
            # deadline for ranks that were in fact dumped.
            for attempt in range(COMPLETE_ATTEMPTS):
                try:
                    res = await self.call_stub.CompleteDump(
                        result, timeout=UNARY_TIMEOUT_S, metadata=self.metadata
                    )
                    break
                except grpc.aio.AioRpcError as e:
                    if e.code() not in TRANSIENT or attempt == COMPLETE_ATTEMPTS - 1:
                        raise
                    self.stats.error(f"CompleteDump: {e.code().name} (retrying)")
                    await asyncio.sleep(0.5 * 2**attempt)
            rec.accepted = res.accepted
        except grpc.aio.AioRpcError as e:
            rec.error = f"CompleteDump: {e.code().name}: {e.details()}"
            self.stats.error(rec.error)
        rec.ranks_dumped = len(dumped)
        rec.done_at = time.time()


async def _chunks(
    agent: DumpUploads, incident_id: str, rank: int, name: str, data: bytes, digest: str
) -> AsyncIterator[pb.BundleChunk]:
    for c in _chunk_list(agent, incident_id, rank, name, data, digest):
        yield c


def _chunk_list(
    agent: DumpUploads, incident_id: str, rank: int, name: str, data: bytes, digest: str
) -> Iterator[pb.BundleChunk]:
    # The real agent's chunker, reading memory instead of a file, with the
    # digest the fleet already has (hashing every upload again would cost the
    # fleet CPU the coordinator needs).
    return read_chunks(
        io.BytesIO(data).read,
        total=len(data),
        size=CHUNK_BYTES,
        file_name=name,
        rank=rank,
        sha256=digest,
        **agent.about(incident_id),
    )
