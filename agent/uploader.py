"""Upload a rank's bundle files to the coordinator in chunks, each file verified by sha256."""

from __future__ import annotations

import hashlib
import io
import logging
import os
import subprocess
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Final

import grpc
from hangwatch.agent.client import CoordinatorClient

from hangwatch import formats
from hangwatch.formats import nodearchive
from hangwatch.wire import pb

log = logging.getLogger("hangwatch.agent")

# Room for the chunk's other fields and framing under the message limit.
# The coordinator looked at the upload and will never take it as sent: log
# it against the rank and move on, retrying would not help.
REFUSED: Final = frozenset(
    {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.DATA_LOSS}
)
# A node's batched stream refused with any of these is sent again file by file:
# one bad file cannot sink the node's evidence, and a batch too big for the
# coordinator's memory right now may fit one file at a time.
BATCH_REFUSED: Final = REFUSED | {grpc.StatusCode.RESOURCE_EXHAUSTED}

_ENVELOPE_BYTES = 64 * 1024
_MAX_CHUNK = 1 << 20


def chunk_size(max_message_bytes: int) -> int:
    return max(4096, min(_MAX_CHUNK, max_message_bytes - _ENVELOPE_BYTES))


def file_chunks(
    path: str,
    *,
    job_id: str,
    agent_id: str,
    incident_id: str,
    rank: int,
    size: int,
) -> Iterator[pb.BundleChunk]:
    """The file as a stream of chunks; the digest goes on the last one."""
    total = os.path.getsize(path)
    with open(path, "rb") as f:
        yield from read_chunks(
            f.read,
            total=total,
            size=size,
            file_name=os.path.basename(path),
            job_id=job_id,
            agent_id=agent_id,
            incident_id=incident_id,
            rank=rank,
        )


def read_chunks(
    read: Callable[[int], bytes],
    *,
    total: int,
    size: int,
    file_name: str,
    job_id: str,
    agent_id: str,
    incident_id: str,
    rank: int,
    sha256: str | None = None,
) -> Iterator[pb.BundleChunk]:
    """`total` bytes from `read` as a stream of chunks, the size on the first and
    the digest on the last. `sha256`: the digest when the caller already has it
    (the simulated agents keep their dumps' digests), else it is computed from
    what is read."""
    digest = hashlib.sha256()
    offset = 0
    while True:
        data = read(size)
        if sha256 is None:
            digest.update(data)
        last = offset + len(data) >= total
        chunk = pb.BundleChunk(
            job_id=job_id,
            agent_id=agent_id,
            incident_id=incident_id,
            rank=rank,
            file_name=file_name,
            offset=offset,
            data=data,
            last=last,
        )
        if offset == 0:
            chunk.total_size = total
        if last:
            chunk.sha256 = digest.hexdigest() if sha256 is None else sha256
        yield chunk
        offset += len(data)
        if last:
            return


def upload_file(
    client: CoordinatorClient, path: str, *, incident_id: str, rank: int
) -> pb.UploadAck:
    ack = client.upload(
        lambda: file_chunks(
            path,
            job_id=client.cfg.job.job_id,
            agent_id=client.agent_id,
            incident_id=incident_id,
            rank=rank,
            size=chunk_size(client.cfg.auth.max_message_bytes),
        )
    )
    if not ack.complete:
        raise RuntimeError(
            f"{path}: coordinator stored {ack.bytes_stored} bytes but did not complete it"
        )
    return ack


def upload_files(
    client: CoordinatorClient, files: list[tuple[str, int]], *, incident_id: str
) -> pb.UploadFilesAck:
    """Several small files, (path, rank) each, in one UploadFiles stream."""
    size = chunk_size(client.cfg.auth.max_message_bytes)

    def chunks() -> Iterator[pb.BundleChunk]:
        for path, rank in files:
            yield from file_chunks(
                path,
                job_id=client.cfg.job.job_id,
                agent_id=client.agent_id,
                incident_id=incident_id,
                rank=rank,
                size=size,
            )

    ack = client.upload_files(lambda: pack_chunks(chunks(), size))
    if len(ack.files) != len(files) or not all(a.complete for a in ack.files):
        raise RuntimeError(f"coordinator acked {len(ack.files)} of {len(files)} files complete")
    return ack


def upload_node_archive(
    client: CoordinatorClient,
    files: list[tuple[str, int]],
    *,
    incident_id: str,
    decoder: subprocess.Popen[bytes] | None = None,
) -> pb.UploadFilesAck:
    """Several small files, (path, rank) each, as one node archive in one
    UploadFiles stream (BundleChunk.node_archive): the coordinator stores one
    file for the node instead of one per rank and name."""
    size = chunk_size(client.cfg.auth.max_message_bytes)
    columns = node_columns(files, decoder)  # first: it owns the decoder
    members = []
    for path, rank in files:
        with open(path, "rb") as f:
            members.append((rank, os.path.basename(path), f.read()))
    if columns:
        members.append((min(r for _, r in files), formats.FR_COLUMNS_FILE, columns))
    ack = client.upload_files(
        lambda: pack_chunks(
            archive_chunks(
                members,
                size=size,
                job_id=client.cfg.job.job_id,
                agent_id=client.agent_id,
                incident_id=incident_id,
            ),
            size,
        ),
        compressed=True,
    )
    if len(ack.files) != 1 or not ack.files[0].complete:
        raise RuntimeError(f"coordinator acked {len(ack.files)} archives, not 1 complete")
    return ack


# Decoding a node's tails in a child process (hangwatch.analyzer.packed)
# takes 0.16-0.24 s here, most of it the interpreter and numpy starting; the
# agent starts the child when a DUMP arrives (`start_decoder`), so that this
# overlaps the ranks' dumps. Past the timeout the archive goes without: the
# analyzer then decodes the tails itself.
COLUMNS_TIMEOUT_S: Final = 20.0


def start_decoder() -> subprocess.Popen[bytes] | None:
    """The decoder child, waiting on stdin for the tails (`node_columns`).
    Decoding needs numpy, which the sidecar never loads (~20 MB it would keep
    for good), and a decoder that fails or hangs costs the upload only its
    columns. The child exits when its stdin closes, the agent's exit included."""
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "hangwatch.analyzer.packed", "-"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
    except OSError as e:
        log.warning("cannot start the tail decoder (%s); tails go as they are", e)
        return None


def stop_decoder(proc: subprocess.Popen[bytes] | None) -> None:
    """A decoder child that was not needed after all."""
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.communicate()


def node_columns(
    files: list[tuple[str, int]], decoder: subprocess.Popen[bytes] | None = None
) -> bytes | None:
    """The node's FR tails among `files` ((path, rank) each), decoded into
    one archive member by a decoder child (`decoder`, else one started
    now), or None."""
    tails = [
        f"{rank}:{path}" for path, rank in files if formats.is_tail_fr_name(os.path.basename(path))
    ]
    if not tails:
        stop_decoder(decoder)
        return None
    proc = decoder if decoder is not None else start_decoder()
    if proc is None:
        return None
    try:
        out, err = proc.communicate("\n".join(tails).encode(), timeout=COLUMNS_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as e:
        stop_decoder(proc)
        log.warning(
            "decoding %d tails for the coordinator failed (%s); sending them as they are",
            len(tails),
            e,
        )
        return None
    if proc.returncode != 0:
        lines = err.decode("utf-8", "replace").strip().splitlines()
        log.warning(
            "decoding %d tails for the coordinator exited %d (%s); sending them as they are",
            len(tails),
            proc.returncode,
            lines[-1][:300] if lines else "no message",
        )
        return None
    return out or None


def archive_chunks(
    members: list[tuple[int, str, bytes]],
    *,
    size: int,
    job_id: str,
    agent_id: str,
    incident_id: str,
) -> Iterator[pb.BundleChunk]:
    """(rank, file name, bytes) each, as one node archive's chunks. Building it
    costs the agent ~5 ms for a node's ~0.5 MB of tails (deflate level 1), off
    the ranks' processes."""
    data = nodearchive.build(members)
    first = min(r for r, _, _ in members)
    for c in read_chunks(
        io.BytesIO(data).read,
        total=len(data),
        size=size,
        file_name=nodearchive.archive_name(first),
        job_id=job_id,
        agent_id=agent_id,
        incident_id=incident_id,
        rank=first,
    ):
        c.node_archive = True
        yield c


def pack_chunks(chunks: Iterable[pb.BundleChunk], limit: int) -> Iterator[pb.BundleChunks]:
    """Consecutive chunks in messages of up to ~`limit` data bytes each."""
    batch: list[pb.BundleChunk] = []
    held = 0
    for c in chunks:
        # Each chunk's envelope (~200 B of names and digest) must fit in the
        # _ENVELOPE_BYTES room that chunk_size leaves under the message cap.
        if batch and (held + len(c.data) > limit or len(batch) >= 256):
            yield pb.BundleChunks(chunks=batch)
            batch, held = [], 0
        batch.append(c)
        held += len(c.data)
    if batch:
        yield pb.BundleChunks(chunks=batch)
