"""Storing the many small files of one UploadFiles stream together.

Phase one of a large incident sends ~3 small files per rank: 12,288 files at
4,096 ranks. Stored one stream and one fsync each, they cost the coordinator
~6 ms apiece (docs/scaling.md); stored here, a stream is held in memory, its
files are written in one worker-thread hop, made durable by one filesystem
sync shared with every other stream that is waiting at the same time (group
commit), renamed into place, and synced again before the ack. A reader never
sees a half-written file: each is renamed in only once its bytes are durable
and its size and sha256 check out.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import hashlib
import itertools
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from hangwatch.server.incidents.bundle import is_stand_in
from hangwatch.server.ingest import validate
from hangwatch.server.ingest.uploads import (
    MAX_FILES_PER_RANK,
    FileKey,
    IntegrityError,
    TooLarge,
)
from hangwatch.server.ingest.validate import Invalid

from hangwatch.formats import nodearchive
from hangwatch.wire import pb

# A stream is for small files: an agent's phase-one tails, metas and stacks
# are ~0.5 MB per 8-rank node. Big files go through UploadBundle, which
# streams to disk.
MAX_STREAM_BYTES: Final = 32 * 1024 * 1024
# All streams together: beyond this a stream is refused (RESOURCE_EXHAUSTED)
# and its agent retries, so a flood cannot hold the coordinator's memory.
MAX_HELD_BYTES: Final = 1024 * 1024 * 1024
MAX_FILES_PER_STREAM: Final = 1024
_batch_ids = itertools.count()  # next() is atomic under the GIL


@dataclass
class PendingFile:
    key: FileKey
    total_size: int | None
    parts: list[bytes] = field(default_factory=list)
    size: int = 0
    sha256: str = ""
    # A node archive (BundleChunk.node_archive), its members to be of these
    # ranks (empty: the incident's ranks are not known); None: a rank's file.
    archive_of: frozenset[int] | None = None


class HeldBytes:
    """Bytes held in memory by all open streams, with a cap."""

    def __init__(self, limit: int = MAX_HELD_BYTES) -> None:
        self.limit = limit
        self.held = 0
        self._lock = threading.Lock()

    def take(self, n: int) -> None:
        with self._lock:
            if self.held + n > self.limit:
                raise TooLarge(
                    f"coordinator is holding {self.held} bytes of uploads (limit {self.limit}); retry"
                )
            self.held += n

    def give(self, n: int) -> None:
        with self._lock:
            self.held -= n


class FileBatch:
    """The files of one UploadFiles stream, checked chunk by chunk as they arrive."""

    def __init__(
        self, *, held: HeldBytes, max_file_bytes: int, max_stream_bytes: int = MAX_STREAM_BYTES
    ) -> None:
        self.files: list[PendingFile] = []
        self.current: PendingFile | None = None
        self.bytes = 0
        self._held = held
        self._max_file = max_file_bytes
        self._max_stream = max_stream_bytes

    def start(self, first: pb.BundleChunk, ranks: frozenset[int] = frozenset()) -> PendingFile:
        """The first chunk of a new file; the caller has checked its incident and rank."""
        if self.current is not None:
            raise Invalid(f"{self.current.key.file_name}: next file began before its last chunk")
        if first.offset != 0:
            raise Invalid(f"a file's first chunk has offset {first.offset}, expected 0")
        if len(self.files) >= MAX_FILES_PER_STREAM:
            raise TooLarge(f"more than {MAX_FILES_PER_STREAM} files in one stream")
        total = first.total_size if first.total_size or first.last else None
        if total is not None and total > self._max_file:
            raise TooLarge(f"file of {total} bytes exceeds the {self._max_file}-byte cap")
        key = FileKey(
            incident_id=validate.incident_id(first.incident_id),
            rank=first.rank,
            file_name=validate.file_name(first.file_name),
        )
        self.current = PendingFile(
            key=key, total_size=total, archive_of=ranks if first.node_archive else None
        )
        return self.current

    def add(self, chunk: pb.BundleChunk) -> None:
        f = self.current
        assert f is not None
        if chunk.incident_id and chunk.incident_id != f.key.incident_id:
            raise Invalid(f"chunk incident_id {chunk.incident_id!r} differs from its file's")
        if chunk.file_name and chunk.file_name != f.key.file_name:
            raise Invalid(f"chunk file_name {chunk.file_name!r} differs from its file's")
        if chunk.rank != f.key.rank:
            raise Invalid(f"chunk rank {chunk.rank} differs from its file's {f.key.rank}")
        if chunk.offset != f.size:
            raise Invalid(f"chunk offset {chunk.offset} but {f.size} bytes received so far")
        data = chunk.data  # read once: every read of a bytes field copies it
        n = len(data)
        if f.size + n > self._max_file:
            raise TooLarge(f"file exceeds the {self._max_file}-byte cap")
        if f.total_size is not None and f.size + n > f.total_size:
            raise Invalid(f"more data than the announced total_size {f.total_size}")
        if self.bytes + n > self._max_stream:
            raise TooLarge(
                f"stream exceeds {self._max_stream} bytes: send big files with UploadBundle"
            )
        self._held.take(n)
        self.bytes += n
        f.parts.append(data)
        f.size += n
        if chunk.last:
            if f.total_size is not None and f.size != f.total_size:
                raise IntegrityError(f"received {f.size} bytes, announced {f.total_size}")
            f.sha256 = chunk.sha256.strip().lower()
            if not f.sha256:
                raise Invalid("final chunk carries no sha256")
            self.files.append(f)
            self.current = None

    def release(self) -> None:
        """Give the held bytes back (the stream is over, stored or not)."""
        self._held.give(self.bytes)
        self.bytes = 0
        for f in self.files:
            f.parts.clear()
        if self.current is not None:
            self.current.parts.clear()


@dataclass(frozen=True)
class Written:
    """A file written under a temporary name, waiting to be renamed in."""

    part: str
    final: str


def write_parts(incident_dir: Path, files: list[PendingFile]) -> tuple[list[Written], list[bool]]:
    """Verify and write each file under a unique temporary name (blocking).

    Returns what to rename and, per file, whether it was already complete (a
    replay: acked as a duplicate, not rewritten). On any error nothing of
    this batch is left behind. Plain os calls, not pathlib: at 12,288 files
    an incident, the wrappers' cost shows.
    """
    written: list[Written] = []
    duplicate: list[bool] = []
    # rank dir -> files in it, counted once per batch
    counted: dict[str, int] = {}
    suffix = f".{os.getpid()}.{next(_batch_ids)}.part"
    try:
        for f in files:
            if f.archive_of is not None:
                w = _write_archive(incident_dir, f, suffix)
                duplicate.append(w is None)
                if w is not None:
                    written.append(w)
                continue
            rank_dir = os.path.join(incident_dir, f"rank_{f.key.rank}")
            final = os.path.join(rank_dir, f.key.file_name)
            n = counted.get(rank_dir)
            if n is None:
                try:
                    os.mkdir(rank_dir)
                    n = 0
                except FileNotFoundError:  # incident.json could not be written
                    os.makedirs(rank_dir, exist_ok=True)
                    n = 0
                except FileExistsError:
                    n = sum(1 for e in os.scandir(rank_dir) if not e.name.endswith(".part"))
            if n and os.path.isfile(final) and not is_stand_in(final):
                duplicate.append(True)
                counted[rank_dir] = n
                continue
            duplicate.append(False)
            _check_digest(f)
            counted[rank_dir] = n + 1
            if n + 1 > MAX_FILES_PER_RANK:
                raise TooLarge(f"rank_{f.key.rank} would hold more than {MAX_FILES_PER_RANK} files")
            written.append(_write_part(f, final, suffix))
    except BaseException:
        discard(written)
        raise
    return written, duplicate


def _check_digest(f: PendingFile) -> None:
    h = hashlib.sha256()
    for p in f.parts:
        h.update(p)
    got = h.hexdigest()
    if got != f.sha256:
        raise IntegrityError(
            f"{f.key.file_name} of rank {f.key.rank}: sha256 mismatch: received data "
            f"hashes to {got}, sender says {f.sha256}"
        )


def _write_part(f: PendingFile, final: str, suffix: str) -> Written:
    # Unique per stream: two streams replaying one file never share it.
    part = final + suffix
    fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    w = Written(part, final)
    try:
        for p in f.parts:
            view = memoryview(p)
            while view:
                view = view[os.write(fd, view) :]
    except BaseException:
        os.close(fd)
        discard([w])
        raise
    os.close(fd)
    return w


def _write_archive(incident_dir: Path, f: PendingFile, suffix: str) -> Written | None:
    """A node archive, checked whole (digest, then its members' names, ranks
    and declared sizes) before it is written; None: already stored (a replay)."""
    nodes = os.path.join(incident_dir, nodearchive.NODES_DIR)
    final = os.path.join(nodes, f.key.file_name)
    if os.path.isfile(final):
        return None
    _check_digest(f)
    try:
        nodearchive.check(b"".join(f.parts), f.archive_of or None)
    except nodearchive.ArchiveError as e:
        raise Invalid(f"{f.key.file_name}: {e}") from None
    os.makedirs(nodes, exist_ok=True)
    return _write_part(f, final, suffix)


def rename_in(written: list[Written]) -> None:
    for w in written:
        os.replace(w.part, w.final)


def discard(written: list[Written]) -> None:
    """Never raises: runs in cleanup."""
    for w in written:
        with contextlib.suppress(OSError):
            os.unlink(w.part)


def _syncfs_fn() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name, use_errno=True)
        fn = libc.syncfs
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


class GroupSync:
    """Make every write done before `flush()` was awaited durable, sharing syncs.

    One sync covers all the streams that asked while the previous one ran, so
    512 agents finishing together cost a handful of filesystem syncs, not
    thousands of fsyncs. Event-loop only. syncfs(2) flushes just the data
    directory's filesystem; where it is missing, sync(2) flushes them all.
    """

    def __init__(self, root: Path) -> None:
        self._root = root
        self._syncfs = _syncfs_fn()
        self._next: asyncio.Future[None] | None = None
        self._task: asyncio.Task[None] | None = None
        self.syncs = 0

    def _sync(self) -> None:
        if self._syncfs is None:
            os.sync()
            return
        fd = os.open(self._root, os.O_RDONLY)
        try:
            if self._syncfs(fd) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"syncfs: {os.strerror(err)}")
        finally:
            os.close(fd)

    async def flush(self) -> None:
        if self._next is None:
            self._next = asyncio.get_running_loop().create_future()
            # Retrieved here so a sync failure nobody waits for any more is
            # not reported as "never retrieved".
            self._next.add_done_callback(lambda f: f.cancelled() or f.exception())
            if self._task is None:
                self._task = asyncio.create_task(self._run())
        await asyncio.shield(self._next)

    async def _run(self) -> None:
        try:
            while self._next is not None:
                fut, self._next = self._next, None
                try:
                    await asyncio.to_thread(self._sync)
                    self.syncs += 1
                    fut.set_result(None)
                except Exception as e:
                    fut.set_exception(e)
        finally:
            self._task = None
