"""A rank's own snapshot of its flight recorder, written from a background thread.

This is what a hung job leaves behind when each rank that can still run
Python dumps its own FR buffer: the raw dump, plus (in the bundle layout of
`hangwatch.formats`) the Python stacks of every thread and a `meta.json`.
Ranks that are stopped or hold the GIL write nothing, as in real life.

Runs inside a training rank; imports torch.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import re
import socket
import sysconfig
import tempfile
from pathlib import Path
from typing import Any, Literal

from hangwatch import formats
from hangwatch.formats import GroupInfo, RankMeta
from hangwatch.safepickle import safe_loads

SnapshotFormat = Literal["pickle", "json"]
SnapshotLayout = Literal["bundle", "plain"]
FORMATS: tuple[SnapshotFormat, ...] = ("pickle", "json")
LAYOUTS: tuple[SnapshotLayout, ...] = ("bundle", "plain")


def _path_roots() -> list[tuple[str, str]]:
    """Prefixes to strip from file names so golden files carry no machine paths.

    Longest first, so site-packages (inside the venv) wins over the stdlib.
    """
    import hangwatch

    repo = str(Path(hangwatch.__file__).resolve().parent.parent)
    paths = sysconfig.get_paths()
    roots = {
        paths["purelib"]: "<site-packages>",
        paths["platlib"]: "<site-packages>",
        paths["stdlib"]: "<stdlib>",
        paths["platstdlib"]: "<stdlib>",
        repo: "<repo>",
    }
    return sorted(roots.items(), key=lambda kv: len(kv[0]), reverse=True)


def portable_path(path: str, roots: list[tuple[str, str]]) -> str:
    for prefix, label in roots:
        if path == prefix or path.startswith(prefix + os.sep):
            return label + path[len(prefix) :]
    # Anything else (a temp dir, a home dir) keeps only its base name.
    return path if path.startswith("<") else f"<other>/{os.path.basename(path)}"


_FILE_RE = re.compile(r'File "([^"]+)"')


def _portable_stacks(text: str, roots: list[tuple[str, str]]) -> str:
    return _FILE_RE.sub(lambda m: f'File "{portable_path(m.group(1), roots)}"', text)


def _portable_entries(trace: dict[str, Any], roots: list[tuple[str, str]]) -> None:
    for entry in trace.get("entries") or []:
        for frame in entry.get("frames") or []:
            if isinstance(frame.get("filename"), str):
                frame["filename"] = portable_path(frame["filename"], roots)


def _stacks_text() -> str:
    # faulthandler needs a real file descriptor; it walks every thread's frames
    # without running Python code in them.
    with tempfile.TemporaryFile() as f:
        faulthandler.dump_traceback(f, all_threads=True)
        f.seek(0)
        return f.read().decode("utf-8", "replace")


def in_flight(trace: dict[str, Any]) -> list[dict[str, Any]]:
    """Collectives not yet retired: under gloo, the only sign of an unfinished one.

    p2p entries are left out: the plan's in-flight map names collectives
    (gloo records no p2p at all); a scenario's p2p fault is checked by its verdict.
    """
    out = []
    for e in trace.get("entries") or []:
        if e.get("retired") or e.get("is_p2p"):
            continue
        name = str(e.get("profiling_name") or "")
        out.append(
            {
                "group": str(e["process_group"][0]),
                "seq": int(e["collective_seq_id"]),
                "op": name.split(":", 1)[-1],
            }
        )
    return out


def _pg_ids(trace: dict[str, Any]) -> dict[str, int]:
    """Group name -> this rank's local pg_id, as FR recorded it."""
    return {str(e["process_group"][0]): int(e["pg_id"]) for e in trace.get("entries") or []}


def write_snapshot(
    out_dir: Path,
    *,
    rank: int,
    groups: list[GroupInfo],
    fmt: SnapshotFormat,
    layout: SnapshotLayout,
    portable: bool,
    frames: bool = True,
) -> tuple[Path, list[dict[str, Any]]]:
    """Dump this rank's FR buffer (and stacks + meta in the bundle layout).

    Returns the FR file written and the collectives it shows in flight.
    `frames=False` leaves out the entries' Python call sites: torch 2.13's
    first dump with them imports torch._inductor (about 800 modules, seconds
    of CPU), which a test suite on two cores cannot pay per rank.
    """
    from hangwatch import recorders
    from hangwatch.testing import storebackend

    recs = recorders.discover() or [
        recorders.Recorder(
            instance=formats.GENERIC_INSTANCE,
            kind=recorders.KIND_GENERIC,
            completion=recorders.COMPLETION_TRACKED,
        )
    ]
    roots = _path_roots()
    dumps: list[tuple[recorders.Recorder, bytes]] = []
    flights: list[dict[str, Any]] = []
    pg_ids: dict[str, int] = {}
    for rec in recs:
        raw = recorders.dump(rec, pickle=True, stacks=frames)
        # Our own process's bytes, but the project reads every FR pickle one way.
        trace: dict[str, Any] = safe_loads(raw)  # type: ignore[assignment]
        if fmt == "pickle":
            if portable:
                _portable_entries(trace, roots)
                raw = pickle.dumps(trace)
            data = raw
        else:
            # The JSON dump has no frames, so there are no paths in it to rewrite.
            data = recorders.dump(rec, pickle=False, stacks=False)
        if rec.completion == recorders.COMPLETION_TRACKED:
            flights += in_flight(trace)
        for name, pid in _pg_ids(trace).items():
            pg_ids.setdefault(name, pid)
        dumps.append((rec, data))
    # Where FR does not record completion, the backend itself knows what is pending.
    flights += storebackend.pending_collectives()

    rank_dir = out_dir / f"rank_{rank}" if layout == "bundle" else out_dir
    if layout == "bundle":
        stacks = _stacks_text()
        if portable:
            stacks = _portable_stacks(stacks, roots)
        formats.atomic_write(rank_dir / formats.STACKS_FILE, stacks.encode())
        meta = RankMeta(
            rank=rank,
            host="localhost" if portable else socket.gethostname(),
            pid=os.getpid(),
            # A rank cannot observe its own scheduler state while it runs this.
            process_state="unknown",
            reachable=True,
            groups=tuple(
                GroupInfo(name=g.name, desc=g.desc, pg_id=pg_ids.get(g.name), ranks=g.ranks)
                for g in groups
                if rank in g.ranks
            ),
            recorders=tuple(recs),
            sources={"fr": "thread", "stacks": "thread", "gpu": "none", "process": "none"},
            gpu={"available": False, "reason": "CPU-only test job"},
        )
        formats.atomic_write(rank_dir / formats.META_FILE, meta.to_bytes(pretty=True))
    # The generic instance's file last: its presence means the rank's snapshot is complete.
    fr_path = rank_dir / f"{formats.FR_FILE_PREFIX}{rank}"
    for rec, data in sorted(dumps, key=lambda d: d[0].file_stem == formats.FR_FILE_PREFIX):
        formats.atomic_write(rank_dir / f"{rec.file_stem}{rank}", data)
        fr_path = rank_dir / f"{rec.file_stem}{rank}"
    return fr_path, flights
