"""One node's phase-one files in one zip archive: `<bundle>/nodes/node_<R>.zip`.

Phase one of a large incident used to store two or three small files per rank
(its FR tail, meta.json, sometimes stacks.txt): 8,192 files at 4,096 ranks, each
created, written and renamed on the coordinator, 0.1 ms of filesystem work
apiece here before any sync. One archive per node (8 ranks) stores 16 times
fewer files and the analyzer opens 16 times fewer.

Inside, a member is named as the file would be in the bundle,
`rank_<R>/<name>`, so an archive unpacked in place gives the per-rank layout.
Written by the agent (`build`), checked by the coordinator before it is stored
(`check`: every member's rank one of the incident's, every name a plain file
name, sizes capped), read by the analyzer and the coordinator (`index`,
`read`). Deflate per member: the tails are pickles of repeated strings and
shrink 3-5x, and a member is read without the others.

A damaged archive or member is one `ArchiveError` (a ValueError) with a
one-line message: the readers turn it into a file error, never a crash, and
the other archives still load.
"""

from __future__ import annotations

import io
import os
import re
import struct
import threading
import zipfile
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

NODES_DIR: Final = "nodes"
SUFFIX: Final = ".zip"
# A node holds 8 ranks, 16 at the most seen; each sends at most a few files.
MAX_MEMBERS: Final = 1024
# Per member, as its header declares it; reads stop there (zipfile enforces
# the declared size), so a small archive cannot inflate past it.
MAX_MEMBER_BYTES: Final = 512 * 1024 * 1024
MAX_TOTAL_BYTES: Final = 4 * 1024 * 1024 * 1024
# Level 1: a node's tails (~0.5 MB) deflate in ~5 ms on the agent, half the
# time of the default level for a few percent more bytes.
LEVEL: Final = 1

_MEMBER_RE: Final = re.compile(r"^rank_(\d{1,8})/([A-Za-z0-9_.\-]{1,200})$")
_NAME_RE: Final = re.compile(r"^node_(\d{1,8})\.zip$")


class ArchiveError(ValueError):
    """A node archive that cannot be used; the message is one line."""


def archive_name(first_rank: int) -> str:
    """The archive's file name: after the lowest rank it holds (unique per node)."""
    return f"node_{first_rank}{SUFFIX}"


def is_archive_name(name: str) -> bool:
    return _NAME_RE.match(name) is not None


@dataclass(frozen=True)
class Member:
    archive: str  # path of the archive on disk
    rank: int
    name: str  # the file's name in its rank's directory
    size: int  # uncompressed, as declared
    crc: int = 0  # CRC-32 of the uncompressed bytes, as declared (checked on read)
    # Where its local header starts, its compressed size and method, from the
    # central directory: `read` goes there directly. offset -1: through zipfile.
    offset: int = -1
    csize: int = 0
    method: int = zipfile.ZIP_STORED

    @property
    def member(self) -> str:
        return f"rank_{self.rank}/{self.name}"


def build(files: Iterable[tuple[int, str, bytes]]) -> bytes:
    """(rank, file name, bytes) each, as one archive."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=LEVEL) as z:
        for rank, name, data in files:
            # A fixed timestamp: the same files make the same bytes (replays
            # of an upload are recognized by their digest).
            info = zipfile.ZipInfo(f"rank_{rank}/{name}", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(info, data, compresslevel=LEVEL)
    return buf.getvalue()


def members_of(z: zipfile.ZipFile, archive: str) -> list[Member]:
    """The archive's members, checked: names, count, declared sizes."""
    infos = z.infolist()
    if len(infos) > MAX_MEMBERS:
        raise ArchiveError(f"{len(infos)} members, over the limit of {MAX_MEMBERS}")
    out: list[Member] = []
    seen: set[str] = set()
    total = 0
    for info in infos:
        m = _MEMBER_RE.match(info.filename)
        if m is None or info.is_dir():
            raise ArchiveError(f"member {info.filename[:80]!r} is not rank_<R>/<file name>")
        if info.filename in seen:
            raise ArchiveError(f"member {info.filename!r} appears twice")
        seen.add(info.filename)
        if info.file_size > MAX_MEMBER_BYTES:
            raise ArchiveError(f"member {info.filename!r} declares {info.file_size} bytes")
        total += info.file_size
        if total > MAX_TOTAL_BYTES:
            raise ArchiveError(f"members declare more than {MAX_TOTAL_BYTES} bytes in all")
        direct = info.compress_type in _DIRECT and not info.flag_bits & _ENCRYPTED
        out.append(
            Member(
                archive,
                int(m.group(1)),
                m.group(2),
                info.file_size,
                info.CRC,
                info.header_offset if direct else -1,
                info.compress_size,
                info.compress_type,
            )
        )
    return out


def check(data: bytes, ranks: Iterable[int] | None) -> list[Member]:
    """An archive as uploaded: readable, and every member of one of `ranks`
    (None: any rank). Reads the central directory only; a member's CRC is
    checked when it is read."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            members = members_of(z, "")
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError) as e:
        raise ArchiveError(f"not a readable zip archive: {e}") from None
    if ranks is not None:
        allowed = set(ranks)
        stray = sorted({m.rank for m in members} - allowed)
        if stray:
            raise ArchiveError(f"members of rank {stray[0]}, not one of the incident's ranks")
    return members


def archives(bundle: Path) -> list[Path]:
    """The node archives of a bundle, in name order."""
    d = bundle / NODES_DIR
    try:
        names = sorted(n for n in os.listdir(d) if is_archive_name(n))
    except OSError:
        return []
    return [d / n for n in names]


def list_members(path: Path) -> list[Member]:
    """The members of the archive at `path`; ArchiveError when it is unreadable."""
    try:
        with zipfile.ZipFile(path) as z:
            return members_of(z, str(path))
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError) as e:
        raise ArchiveError(f"not a readable zip archive: {e}") from None


def index(bundle: Path) -> tuple[dict[tuple[int, str], Member], list[tuple[Path, str]]]:
    """(rank, file name) -> member over every node archive of a bundle, and
    (archive, why) for each one that could not be read. A file in two
    archives keeps the first (name order)."""
    found: dict[tuple[int, str], Member] = {}
    errors: list[tuple[Path, str]] = []
    for path in archives(bundle):
        try:
            members = list_members(path)
        except ArchiveError as e:
            errors.append((path, str(e)))
            continue
        for m in members:
            found.setdefault((m.rank, m.name), m)
    return found, errors


_DIRECT: Final = frozenset({zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED})
_ENCRYPTED: Final = 0x1
_LOCAL = struct.Struct("<4s22xHH")  # signature ... file name length, extra length
_LOCAL_MAGIC: Final = b"PK\x03\x04"

# The archive last read from, per thread, kept open: a reader takes a node's
# members one after another. Opening it through zipfile for each member (its
# central directory parsed again) cost 0.34 ms a member, 2.8 s for 8,192 at
# 4,096 ranks; kept open through zipfile, each archive was still parsed
# three times (discovery, metas, columns: 1.4 s of 16,384 ranks' analysis).
# A member the directory already described is now read at its offset from a
# plain descriptor. `release` closes it.
_open = threading.local()


def _fd(path: str) -> int:
    cached: tuple[str, int] | None = getattr(_open, "fd", None)
    if cached is not None and cached[0] == path:
        return cached[1]
    release()
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    _open.fd = (path, fd)
    return fd


def release() -> None:
    """Close the archive this thread kept open for reading, if any."""
    cached: tuple[str, int] | None = getattr(_open, "fd", None)
    _open.fd = None
    if cached is not None:
        os.close(cached[1])


def read(member: Member, limit: int) -> bytes:
    """A member's bytes, at most `limit` (ArchiveError past it, on a bad CRC,
    a damaged header or deflate stream). Keeps the archive open for the next
    member read on this thread (`release` closes it)."""

    def through_zipfile() -> bytes:
        with zipfile.ZipFile(member.archive) as z, z.open(member.member) as f:
            return f.read(limit + 1)

    def direct() -> bytes:
        return _read_direct(member)

    return _limited(member, limit, through_zipfile if member.offset < 0 else direct)


def _limited(member: Member, limit: int, fetch: Callable[[], bytes]) -> bytes:
    """`fetch`'s bytes of `member`, with the size limit and every way a
    member can be unreadable turned into one ArchiveError."""
    if member.size > limit:
        raise ArchiveError(f"{member.member} is {member.size} bytes, over the {limit}-byte limit")
    try:
        data = fetch()
    except (zipfile.BadZipFile, zlib.error, KeyError, OSError, EOFError, RuntimeError) as e:
        # BadZipFile: a bad CRC or header; zlib.error: a corrupt deflate
        # stream; RuntimeError: an encrypted member.
        raise ArchiveError(f"{member.member}: cannot read: {e}") from None
    if len(data) > limit:
        raise ArchiveError(f"{member.member} is over the {limit}-byte limit")
    return data


def _read_direct(member: Member) -> bytes:
    """What zipfile reads for a stored or deflated member, from its offset:
    the local header's own name and extra lengths, then exactly the declared
    compressed bytes, inflated to at most the declared size, and the CRC."""
    fd = _fd(member.archive)
    head = os.pread(fd, _LOCAL.size, member.offset)
    if len(head) != _LOCAL.size:
        raise EOFError("archive ends inside a member's header")
    magic, name_len, extra_len = _LOCAL.unpack(head)
    if magic != _LOCAL_MAGIC:
        raise zipfile.BadZipFile("bad magic number for a member's header")
    raw = os.pread(fd, member.csize, member.offset + _LOCAL.size + name_len + extra_len)
    if len(raw) != member.csize:
        raise EOFError("archive ends inside a member's data")
    if member.method == zipfile.ZIP_DEFLATED:
        d = zlib.decompressobj(-15)
        data = d.decompress(raw, member.size + 1)
        if len(data) > member.size or not d.eof:
            raise zipfile.BadZipFile("deflate stream does not end at the declared size")
    else:
        data = raw
    if len(data) != member.size or crc32(data) != member.crc:
        raise zipfile.BadZipFile(f"bad CRC-32 for file {member.member!r}")
    return data


def read_bytes(data: bytes, member: Member, limit: int = MAX_MEMBER_BYTES) -> bytes:
    """A member of an archive held in memory (`check` listed it)."""

    def from_memory() -> bytes:
        with zipfile.ZipFile(io.BytesIO(data)) as z, z.open(member.member) as f:
            return f.read(limit + 1)

    return _limited(member, limit, from_memory)


def crc32(data: bytes) -> int:
    """The CRC-32 a zip member of these bytes declares."""
    return zlib.crc32(data) & 0xFFFFFFFF


def stored_file(bundle: Path, rank: int, name: str, limit: int = MAX_MEMBER_BYTES) -> bytes | None:
    """A rank's file as the bundle holds it, in the rank's directory or in a
    node archive; None when neither has it. For one file: a reader of many
    uses `index` once."""
    try:
        with open(bundle / f"rank_{rank}" / name, "rb") as f:
            return f.read(limit)
    except FileNotFoundError:
        pass
    for path in archives(bundle):
        for m in list_members(path):
            if m.rank == rank and m.name == name:
                try:
                    return read(m, limit)
                finally:
                    release()
    return None
