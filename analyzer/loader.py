"""Find and load every rank's flight-recorder dump under a directory (or an incident bundle).

The steps, one module each: `discovery` (which files are dumps, bundle
metadata or incidents), `bundle` (meta.json, incident.json), `reading` (the
files decoded, in a process pool when that pays, into one frame) and `groups`
(local pg_ids tied to group names, membership). A bad file never stops the
load: it becomes one `FileError` and the rest are analyzed.

The loader draws nothing: a caller that wants a progress display passes
`on_progress` (the terminal's is `hangwatch.analyzer.render.load_progress_bar`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from hangwatch.analyzer.bundle import (
    group_names,
    read_incident,
    read_rank_meta,
)
from hangwatch.analyzer.coded import Coded
from hangwatch.analyzer.decode import MAX_ENTRIES_PER_FILE, ParsedDump
from hangwatch.analyzer.discovery import discover, parse_ranks
from hangwatch.analyzer.groups import GroupMeta, PgStatus, build_groups, map_pg_ids
from hangwatch.analyzer.reading import (
    MAX_FILE_BYTES,
    RECORD_ID_STRIDE,
    ProgressCallback,
    choose_dumps,
    concat_columns,
    gc_paused,
    read_all,
    read_packed,
    shift_record_ids,
)
from hangwatch.analyzer.report import FileError

from hangwatch.formats import IncidentDoc, RankMeta, nodearchive


@dataclass(kw_only=True)
class LoadedDumps:
    """Everything read from a dump directory, normalized; diagnosis reads only this."""

    root: str
    # One row per FR entry of every rank; columns are decode.ENTRY_COLUMNS + "rank".
    # Missing timestamps are 0; peer_src/peer_dst are group-local (-1 for collectives).
    entries: pd.DataFrame
    pg_status: dict[int, dict[str, PgStatus]]  # rank -> group name -> status
    groups: dict[str, GroupMeta]
    ranks_loaded: list[int]
    errors: list[FileError]
    rank_meta: dict[int, RankMeta]  # bundle meta.json per rank (stacks.txt read in)
    frames: dict[tuple[int, int], tuple[tuple[str, str, int], ...]]  # (rank, record_id)
    versions: dict[int, str]  # rank -> FR format version
    comm_lib_versions: dict[int, str] = field(default_factory=dict)
    backends: dict[int, str] = field(default_factory=dict)  # rank -> "nccl" | "gloo" | ...
    pg_config: dict[int, dict[str, dict[str, Any]]] = field(default_factory=dict)
    unmapped_pg_ids: dict[int, list[int]] = field(default_factory=dict)
    incident: IncidentDoc | None = None
    files: dict[int, str] = field(default_factory=dict)  # rank -> relative path loaded
    # rank -> the newest write time of its dump files (the filesystem's clock):
    # when torch or an agent wrote it, unless the files were copied since.
    written_unix: dict[int, float] = field(default_factory=dict)
    # Ranks whose every dump holds the whole history (record 0 on, not a
    # tail) and names every group of its pg_status (groups.build_groups).
    complete_ranks: set[int] = field(default_factory=set)
    world_size: int | None = None
    selected_ranks: set[int] | None = None  # None: every rank found was loaded
    # Ranks read from a tail (hangwatch.frtail) because no full dump of theirs
    # was there: their older history is absent by design, not lost.
    tail_ranks: list[int] = field(default_factory=list)
    # Groups recorded only by torch's FlightRecorderHook on a backend whose
    # completion is never recorded: what ranks entered is known, not what finished.
    completion_unknown_groups: set[str] = field(default_factory=set)

    @property
    def backend(self) -> str:
        vals = [b for v in self.backends.values() for b in v.split(",") if b]
        return max(set(vals), key=vals.count) if vals else ""

    def pg_status_frame(self) -> pd.DataFrame:
        rows = [
            (r, g, s.pg_id, s.last_enqueued, s.last_started, s.last_completed)
            for r, d in self.pg_status.items()
            for g, s in d.items()
        ]
        return pd.DataFrame(
            rows,
            columns=["rank", "group", "pg_id", "last_enqueued", "last_started", "last_completed"],
        ).astype(
            {
                "rank": np.int64,
                "pg_id": np.int64,
                "last_enqueued": np.int64,
                "last_started": np.int64,
                "last_completed": np.int64,
            }
        )


def whole_histories(parts: list[tuple[int, ParsedDump]]) -> set[int]:
    """Ranks whose dumps start at record 0 in every instance and are no tails:
    nothing of their history is missing. Read before the columns are merged
    (concat_columns takes them)."""
    out: set[int] = set()
    bad: set[int] = set()
    for r, p in parts:
        rec = p.columns.get("record_id")
        if p.tail or (rec is not None and len(rec) and int(rec.min()) % RECORD_ID_STRIDE != 0):
            bad.add(r)
        out.add(r)
    return out - bad


def load_dumps(
    path: str | os.PathLike[str],
    *,
    prefix: str | None = None,
    world_size: int | None = None,
    selected_ranks: Iterable[int] | str | None = None,
    progress: bool = False,
    workers: int | None = None,
    max_file_bytes: int = MAX_FILE_BYTES,
    max_entries: int = MAX_ENTRIES_PER_FILE,
    on_progress: ProgressCallback | None = None,
) -> LoadedDumps:
    """Load every dump under `path`. Raises FileNotFoundError only when `path`
    itself does not exist; every per-file problem lands in `errors`.

    `on_progress(done, total)` follows the reading of the dump files (see
    `reading.read_all`). `progress` is accepted for old callers and ignored:
    the library draws nothing itself.
    """
    del progress
    # The load builds 4,096 metas, frames and object columns: with the
    # collector on it walked them for 0.4-0.55 s at 4,096 ranks (see gc_paused).
    with gc_paused():
        return _load(
            Path(path),
            prefix=prefix,
            world_size=world_size,
            selected_ranks=selected_ranks,
            workers=workers,
            max_file_bytes=max_file_bytes,
            max_entries=max_entries,
            on_progress=on_progress,
        )


def _load(
    root: Path,
    *,
    prefix: str | None,
    world_size: int | None,
    selected_ranks: Iterable[int] | str | None,
    workers: int | None,
    max_file_bytes: int,
    max_entries: int,
    on_progress: ProgressCallback | None,
) -> LoadedDumps:

    if not root.exists():
        raise FileNotFoundError(f"no such file or directory: {root}")
    selected = parse_ranks(selected_ranks) if selected_ranks is not None else None
    found = discover(root, prefix)
    base = root.parent if root.is_file() else root
    try:
        rank_meta, meta_errors = read_rank_meta(found.metas, base, selected, found.stacks)
        incident, incident_errors = read_incident(found.incidents, base)
        errors = [*found.errors, *meta_errors, *incident_errors]

        cands = found.dumps
        if selected is not None:
            cands = [c for c in cands if c.rank in selected]
        # Tails the nodes decoded already; every other file is read here.
        done, packed_errors = read_packed(
            cands, found.columns, max_bytes=max_file_bytes, max_entries=max_entries
        )
        errors.extend(packed_errors)
        rest = iter(
            read_all(
                [c for i, c in enumerate(cands) if i not in done],
                workers=workers,
                on_progress=on_progress,
                max_bytes=max_file_bytes,
                max_entries=max_entries,
            )
        )
        results = [done[i] if i in done else next(rest) for i in range(len(cands))]
    finally:
        nodearchive.release()  # the node archive read last, if any
    by_key, read_errors = choose_dumps(results)
    errors.extend(read_errors)

    ranks = sorted({r for r, _ in by_key})
    # Ordered by rank, then backend; record ids restart in every recorder
    # instance, so a rank's second instance is shifted to keep (rank, record_id) unique.
    parts: list[tuple[int, ParsedDump]] = []
    files_of: dict[int, list[str]] = {}
    written: dict[int, float] = {}
    for (r, _b), (cand, p) in sorted(by_key.items()):
        k = len(files_of.setdefault(r, []))
        files_of[r].append(cand.rel)
        written[r] = max(written.get(r, 0.0), cand.mtime)
        if k:
            shift_record_ids(p, k * RECORD_ID_STRIDE)
        parts.append((r, p))
    entry_maps: dict[tuple[int, int], dict[int, str]] = {}
    all_names: set[str] = set()
    unknown_completion: set[str] = set()
    known_completion: set[str] = set()
    for i, (r, p) in enumerate(parts):
        all_names.update(p.pg_config)
        if p.n_entries:
            pids = p.columns["pg_id"]
            grp: Coded = p.columns["group"]
            _, first = np.unique(pids, return_index=True)
            entry_maps[(r, i)] = {int(pids[j]): grp.cats[grp.codes[j]] for j in first}
            all_names.update(entry_maps[(r, i)].values())
            done = known_completion if p.completion_known else unknown_completion
            done.update(str(c) for c in grp.cats)
    whole = whole_histories(parts)
    entries = concat_columns(parts)

    pg_status: dict[int, dict[str, PgStatus]] = {}
    unmapped: dict[int, list[int]] = {}
    frames: dict[tuple[int, int], tuple[tuple[str, str, int], ...]] = {}
    all_names.update(group_names(rank_meta))
    # Once, not per rank: 1,665 names x 4,096 ranks of isdigit() cost 2 s.
    digit_names = {n for n in all_names if n.isdigit()}
    for i, (r, p) in enumerate(parts):
        st, um = map_pg_ids(
            r, p, entry_maps.get((r, i), {}), rank_meta.get(r), digit_names, instance=p.backend
        )
        mine = pg_status.setdefault(r, {})
        for g, v in st.items():
            mine.setdefault(g, v)  # a group in two instances: its first (GPU) one
        if um:
            unmapped.setdefault(r, []).extend(um)
        for rec, fr in p.frames.items():
            frames[(r, rec)] = fr
    pg_config: dict[int, dict[str, dict[str, Any]]] = {}
    for r, p in parts:
        for name, c in p.pg_config.items():
            pg_config.setdefault(r, {}).setdefault(name, c)
    # A group such a rank never mentions is one it is not in, unless its
    # pg_status holds a group no entry of it names.
    complete = whole - set(unmapped)
    groups = build_groups(
        entries=entries,
        pg_status=pg_status,
        pg_config=pg_config,
        rank_meta=rank_meta,
        world_size=world_size,
        complete_ranks=complete,
    )
    # One pass over the parts: a comprehension per rank over every part was
    # quadratic (2.0 of 10.6 s at 4,096 ranks).
    backends: dict[int, set[str]] = {}
    for r, q in parts:
        backends.setdefault(r, set()).add(q.backend)
    return LoadedDumps(
        root=str(root),
        entries=entries,
        pg_status=pg_status,
        groups=groups,
        ranks_loaded=ranks,
        errors=errors,
        rank_meta=rank_meta,
        frames=frames,
        versions={r: p.version for r, p in reversed(parts)},
        comm_lib_versions={r: p.comm_lib_version for r, p in reversed(parts)},
        backends={r: ",".join(sorted(backends.get(r, set()) - {""})) for r in ranks},
        pg_config=pg_config,
        unmapped_pg_ids=unmapped,
        incident=incident,
        files={r: ", ".join(files_of[r]) for r in ranks},
        written_unix=written,
        complete_ranks=complete,
        world_size=world_size,
        selected_ranks=selected,
        tail_ranks=sorted({r for r, p in parts if p.tail}),
        completion_unknown_groups=unknown_completion - known_completion,
    )
