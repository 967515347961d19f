"""An incident's bundle directory streamed as .tar.gz, built defensively.

The bundle holds files that agents uploaded, so the archive must never reach
outside it: no symlink is followed or archived, only regular files and
directories are included, every file is opened with O_NOFOLLOW and checked
again with fstat (a file swapped for a link or a FIFO mid-walk is skipped),
and exactly the size seen at stat time is sent, so a file growing meanwhile
cannot corrupt the archive. Memory stays bounded: the tar stream is written
by hand, one chunk at a time, through one zlib compressor.
"""

from __future__ import annotations

import os
import stat
import tarfile
import zlib
from collections.abc import Iterator
from pathlib import Path

CHUNK = 1 << 20
BLOCK = tarfile.BLOCKSIZE  # 512
RECORD = tarfile.RECORDSIZE  # 10240


class BundleMissing(FileNotFoundError):
    pass


def _members(root: Path) -> Iterator[tuple[str, os.stat_result, bool]]:
    """(relative path, lstat, is_dir), sorted, never leaving root."""
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames.sort()
        base = Path(dirpath)
        rel_dir = base.relative_to(root)
        keep_dirs = []
        for d in dirnames:
            st = os.lstat(base / d)
            if stat.S_ISDIR(st.st_mode):
                keep_dirs.append(d)
                yield (rel_dir / d).as_posix(), st, True
        dirnames[:] = keep_dirs  # never descend into a symlinked directory
        for f in sorted(filenames):
            st = os.lstat(base / f)
            if stat.S_ISREG(st.st_mode):
                yield (rel_dir / f).as_posix(), st, False


def _header(name: str, st: os.stat_result, *, is_dir: bool, size: int = 0) -> bytes:
    ti = tarfile.TarInfo(name)
    ti.mtime = int(st.st_mtime)
    if is_dir:
        ti.type = tarfile.DIRTYPE
        ti.mode = 0o755
    else:
        ti.type = tarfile.REGTYPE
        ti.mode = 0o644
        ti.size = size
    return ti.tobuf(format=tarfile.PAX_FORMAT)


def stream_bundle(root: Path, prefix: str) -> Iterator[bytes]:
    """Yield gzip bytes of a tar of `root`, entries named `<prefix>/...`."""
    st_root = os.lstat(root) if os.path.lexists(root) else None
    if st_root is None or not stat.S_ISDIR(st_root.st_mode):
        raise BundleMissing(str(root))
    return _generate(root, prefix, st_root)


def _generate(root: Path, prefix: str, st_root: os.stat_result) -> Iterator[bytes]:
    gz = zlib.compressobj(6, zlib.DEFLATED, 31)  # wbits 31: gzip container
    for raw in _tar(root, prefix, st_root):
        out = gz.compress(raw)
        if out:
            yield out
    yield gz.flush()


def _tar(root: Path, prefix: str, st_root: os.stat_result) -> Iterator[bytes]:
    written = 0
    for chunk in _entries(root, prefix, st_root):
        written += len(chunk)
        yield chunk
    end = b"\0" * (2 * BLOCK)
    yield end + b"\0" * ((-(written + len(end))) % RECORD)


def _entries(root: Path, prefix: str, st_root: os.stat_result) -> Iterator[bytes]:
    yield _header(prefix, st_root, is_dir=True)
    for rel, st, is_dir in _members(root):
        name = f"{prefix}/{rel}"
        if is_dir:
            yield _header(name, st, is_dir=True)
            continue
        try:
            fd = os.open(root / rel, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0))
        except OSError:
            continue  # vanished or replaced by a symlink since the walk
        with os.fdopen(fd, "rb") as f:
            fst = os.fstat(fd)
            if not stat.S_ISREG(fst.st_mode):
                continue
            size = fst.st_size
            yield _header(name, fst, is_dir=False, size=size)
            left = size
            while left > 0:
                data = f.read(min(CHUNK, left))
                if not data:  # truncated meanwhile: keep the archive well-formed
                    data = b"\0" * min(CHUNK, left)
                left -= len(data)
                yield data
            if size % BLOCK:
                yield b"\0" * (BLOCK - size % BLOCK)
