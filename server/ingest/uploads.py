"""Receiving one bundle file in chunks: verified, fsynced, renamed into place.

A file is written to `<incident>/rank_<R>/<name>.part` and only renamed to
its final name after its offsets, size and sha256 all check out, so a reader
(the analyzer) never sees a half-written file and a cut-off stream leaves no
file under the final name. Uploads are idempotent by (incident, rank, name):
a replay of a finished file is acknowledged as a duplicate without rewriting.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, ClassVar, Final

import grpc
from hangwatch.server.incidents.bundle import is_stand_in
from hangwatch.server.ingest import validate
from hangwatch.server.ingest.validate import Invalid

from hangwatch.wire import pb

MAX_FILE_BYTES: Final = 512 * 1024 * 1024  # a 20k-entry NCCL pickle with stacks is ~50 MB
MAX_FILES_PER_RANK: Final = 64


class UploadError(Exception):
    """Base of upload failures; `code` is the gRPC status to answer with."""

    code: ClassVar[grpc.StatusCode] = grpc.StatusCode.INVALID_ARGUMENT


class IntegrityError(UploadError):
    code = grpc.StatusCode.DATA_LOSS


class Busy(UploadError):
    code = grpc.StatusCode.ABORTED


class TooLarge(UploadError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


@dataclass(frozen=True, kw_only=True)
class FileKey:
    incident_id: str
    rank: int
    file_name: str


class UploadTracker:
    """Which files are being written right now, so two streams never share a .part."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active: set[FileKey] = set()

    def claim(self, key: FileKey) -> None:
        with self._lock:
            if key in self._active:
                raise Busy(
                    f"{key.incident_id}/rank_{key.rank}/{key.file_name} is being uploaded by another stream"
                )
            self._active.add(key)

    def release(self, key: FileKey) -> None:
        with self._lock:
            self._active.discard(key)


class FileUpload:
    """State of one UploadBundle stream. Feed chunks with `add`, then `finish` or `abort`."""

    def __init__(
        self,
        *,
        incident_dir: Path,
        incidents_root: Path,
        first: pb.BundleChunk,
        max_bytes: int = MAX_FILE_BYTES,
        world_size: int | None = None,
    ) -> None:
        self.key = FileKey(
            incident_id=validate.incident_id(first.incident_id),
            rank=validate.rank(first.rank, world_size=world_size),
            file_name=validate.file_name(first.file_name),
        )
        rank_dir = incident_dir / f"rank_{first.rank}"
        self.final = rank_dir / first.file_name
        self.part = rank_dir / (first.file_name + ".part")
        root = incidents_root.resolve()
        # Belt and braces after the name checks: the target must stay inside.
        if not self.final.resolve().is_relative_to(root):
            raise Invalid(f"{first.file_name!r} resolves outside the incident directory")
        self.rank_dir = rank_dir
        self.max_bytes = max_bytes
        self.total_size: int | None = first.total_size if first.total_size or first.last else None
        if self.total_size is not None and self.total_size > max_bytes:
            raise TooLarge(f"file of {self.total_size} bytes exceeds the {max_bytes}-byte cap")
        self.written = 0
        self.sha = hashlib.sha256()
        self._fh: BinaryIO | None = None

    def already_complete(self) -> bool:
        # A stand-in meta.json (the coordinator's, for a rank nobody dumped) is
        # replaced by the rank's own when it arrives late, not acked over.
        return self.final.is_file() and not is_stand_in(self.final)

    def open(self) -> None:
        self.rank_dir.mkdir(parents=True, exist_ok=True)
        existing = sum(1 for p in self.rank_dir.iterdir() if not p.name.endswith(".part"))
        if existing >= MAX_FILES_PER_RANK:
            raise TooLarge(
                f"rank_{self.key.rank} already holds {existing} files (limit {MAX_FILES_PER_RANK})"
            )
        # A .part from an earlier cut-off stream is stale: start over.
        self._fh = open(self.part, "wb")  # noqa: SIM115 - closed in finish/abort

    def add(self, chunk: pb.BundleChunk) -> None:
        assert self._fh is not None
        for name, got, want in (
            ("incident_id", chunk.incident_id, self.key.incident_id),
            ("file_name", chunk.file_name, self.key.file_name),
        ):
            if got and got != want:
                raise Invalid(f"chunk {name} {got!r} differs from the stream's {want!r}")
        if chunk.rank != self.key.rank:
            raise Invalid(f"chunk rank {chunk.rank} differs from the stream's {self.key.rank}")
        if chunk.offset != self.written:
            raise Invalid(f"chunk offset {chunk.offset} but {self.written} bytes received so far")
        # Read once: every read of a bytes field copies it (a MiB a chunk).
        data = chunk.data
        if self.written + len(data) > self.max_bytes:
            raise TooLarge(f"file exceeds the {self.max_bytes}-byte cap")
        if self.total_size is not None and self.written + len(data) > self.total_size:
            raise Invalid(f"more data than the announced total_size {self.total_size}")
        self._fh.write(data)
        self.sha.update(data)
        self.written += len(data)

    def finish(self, sha256: str) -> None:
        """Verify against the last chunk's `sha256` and move into place;
        blocking (fsync), run it off the event loop."""
        assert self._fh is not None
        if self.total_size is not None and self.written != self.total_size:
            raise IntegrityError(f"received {self.written} bytes, announced {self.total_size}")
        want = sha256.strip().lower()
        if not want:
            raise Invalid("final chunk carries no sha256")
        got = self.sha.hexdigest()
        if got != want:
            raise IntegrityError(
                f"sha256 mismatch: received data hashes to {got}, sender says {want}"
            )
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()
        self._fh = None
        os.replace(self.part, self.final)
        dir_fd = os.open(self.rank_dir, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def abort(self) -> None:
        """Never raises: it runs in the handler's cleanup, where an error (the
        buffered tail of a .part failing to flush on a full disk) would skip
        releasing the file's claim and make every retry of it ABORTED."""
        fh, self._fh = self._fh, None
        with contextlib.suppress(OSError):
            if fh is not None:
                fh.close()
        with contextlib.suppress(OSError):
            self.part.unlink(missing_ok=True)
