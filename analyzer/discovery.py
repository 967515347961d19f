"""Which files under a directory (or one file) are dumps, bundle metadata, or incidents.

A file is a dump candidate when its name ends in a rank number
(`nccl_trace_rank_3`, `rank_7.json`, `_dump_5`, `<prefix>host-a_3`); its
content, read later, decides pickle vs JSON. Nothing is opened here: a
candidate is a path, its rank and what stat saw.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from hangwatch.analyzer.report import FileError

from hangwatch import formats
from hangwatch.formats import nodearchive

RANK_RE = re.compile(r"^(?P<stem>.*?)(?P<rank>\d+)(?:\.(?:json|pkl|pickle|bin|dump))?$")
SKIP_NAMES = frozenset({formats.META_FILE, formats.INCIDENT_FILE, formats.STACKS_FILE})


def parse_ranks(spec: str | Iterable[int] | None) -> set[int] | None:
    """'0,3,5-7' -> {0,3,5,6,7}; None stays None.

    Ranks are 0 <= r < formats.MAX_RANKS, and a spec names at most that many:
    a bad spec is a ValueError with a one-line message, raised before
    anything is allocated.
    """
    if spec is None:
        return None
    if not isinstance(spec, str):
        given = {int(r) for r in spec}
        bad = [r for r in given if not 0 <= r < formats.MAX_RANKS]
        if bad:
            raise ValueError(f"rank {bad[0]} is out of range (0 to {formats.MAX_RANKS - 1})")
        return given
    spans: list[tuple[int, int]] = []
    total = 0
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        a, sep, b = part.partition("-")
        try:
            lo = _rank(a)
            hi = _rank(b) if sep else lo
        except ValueError as e:
            raise ValueError(f"bad rank {part!r}: {e} (want e.g. 0,3,5-7)") from None
        if hi < lo:
            raise ValueError(f"bad rank range {part!r}")
        total += hi - lo + 1
        if total > formats.MAX_RANKS:
            raise ValueError(f"{part!r}: more than {formats.MAX_RANKS} ranks")
        spans.append((lo, hi))
    out: set[int] = set()
    for lo, hi in spans:
        out.update(range(lo, hi + 1))
    return out


def _rank(text: str) -> int:
    text = text.strip()
    if not text.isdigit():
        raise ValueError(f"{text[:40]!r} is not a rank number")
    if len(text) > 8 or int(text) >= formats.MAX_RANKS:
        raise ValueError(f"{text[:40]} is over the maximum rank {formats.MAX_RANKS - 1}")
    return int(text)


@dataclass(frozen=True)
class Candidate:
    path: str
    rel: str  # relative to the loaded root: what errors and LoadedDumps.files name
    rank: int
    size: int
    mtime: float
    # A file inside a node archive at `path` (formats.nodearchive); rel then
    # reads "nodes/node_8.zip!rank_9/fr_tail_rank_9".
    member: nodearchive.Member | None = None


@dataclass(kw_only=True)
class Found:
    dumps: list[Candidate] = field(default_factory=list)
    # Bundle meta.json files, in rank directories or node archives.
    metas: list[Path | nodearchive.Member] = field(default_factory=list)
    stacks: dict[int, nodearchive.Member] = field(default_factory=dict)  # archived stacks.txt
    # Archive path -> its fr_columns member (hangwatch.analyzer.packed) and that member's rel.
    columns: dict[str, tuple[nodearchive.Member, str]] = field(default_factory=dict)
    incidents: list[Path] = field(default_factory=list)  # incident.json files
    errors: list[FileError] = field(default_factory=list)


def discover(root: Path, prefix: str | None) -> Found:
    """Walk `root` in name order (hidden entries skipped, symlinked dirs not followed)."""
    found = Found()
    if root.is_file():
        walk: Iterator[tuple[str, list[str], list[str]]] = iter(
            [(str(root.parent), [], [root.name])]
        )
        base = root.parent
    else:
        walk = os.walk(root, followlinks=False)
        base = root
    for dirpath, dirnames, filenames in walk:
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in sorted(filenames):
            p = Path(dirpath) / name
            rel = str(p.relative_to(base))
            if name == formats.META_FILE:
                found.metas.append(p)
                continue
            if nodearchive.is_archive_name(name) and Path(dirpath).name == nodearchive.NODES_DIR:
                _add_archive(found, p, rel, prefix)
                continue
            if name == formats.INCIDENT_FILE:
                found.incidents.append(p)
                continue
            if name in SKIP_NAMES or name.startswith("."):
                continue
            if prefix is not None and not name.startswith(prefix):
                continue
            m = RANK_RE.match(name)
            if not m:
                continue
            try:
                st = p.stat()
            except OSError as e:
                found.errors.append(FileError(file=rel, error=f"cannot stat: {e.strerror}"))
                continue
            if not p.is_file():
                continue
            found.dumps.append(
                Candidate(str(p), rel, int(m.group("rank")), st.st_size, st.st_mtime)
            )
    return found


def _add_archive(found: Found, path: Path, rel: str, prefix: str | None) -> None:
    """A node archive's members, as if each were its file in the bundle."""
    try:
        members = nodearchive.list_members(path)
        mtime = path.stat().st_mtime
    except nodearchive.ArchiveError as e:
        found.errors.append(FileError(file=rel, error=str(e)))
        return
    except OSError as e:
        found.errors.append(FileError(file=rel, error=f"cannot stat: {e.strerror}"))
        return
    for m in members:
        if m.name == formats.META_FILE:
            found.metas.append(m)
            continue
        if m.name == formats.STACKS_FILE:
            found.stacks[m.rank] = m
            continue
        if m.name == formats.FR_COLUMNS_FILE:
            found.columns[str(path)] = (m, f"{rel}!{m.member}")
            continue
        if m.name in SKIP_NAMES or m.name.startswith("."):
            continue
        if prefix is not None and not m.name.startswith(prefix):
            continue
        match = RANK_RE.match(m.name)
        if match:
            found.dumps.append(
                Candidate(
                    str(path),
                    f"{rel}!{m.member}",
                    int(match.group("rank")),
                    m.size,
                    mtime,
                    member=m,
                )
            )
