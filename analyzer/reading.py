"""Read and decode dump files, in a process pool when that pays, into one frame.

Workers return compact column arrays (`ParsedDump`), not Python objects per
entry, and the main process concatenates them once. Which dump of a rank
counts when there are several is decided here too.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import multiprocessing
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import numpy as np
import pandas as pd
from hangwatch.analyzer import packed
from hangwatch.analyzer.coded import Coded, first_of_each, intern_values
from hangwatch.analyzer.decode import (
    BOOL_COLUMNS,
    DECODE_ERRORS,
    ENTRY_COLUMNS,
    FLOAT_COLUMNS,
    INT_COLUMNS,
    STR_COLUMNS,
    ParsedDump,
    check_dump,
    decode_each,
)
from hangwatch.analyzer.discovery import Candidate
from hangwatch.analyzer.report import FileError
from hangwatch.analyzer.sniff import sniff_and_decode
from hangwatch.analyzer.text import one_line

from hangwatch.formats import nodearchive

MAX_FILE_BYTES = 2 * 1024**3
# Below this much input a process pool costs more than it saves.
PARALLEL_MIN_BYTES = 24 * 1024**2
PARALLEL_MIN_FILES = 64
# Below this mean size (FR tails are ~15 KB) shipping each parsed dump back
# from a worker costs more than decoding it: 4,096 tails load in 7.1 s in one
# process and 8.2 s with two.
PARALLEL_MIN_MEAN_BYTES = 128 * 1024
# Files of up to this many entries (FR tails hold ~34) are decoded together,
# up to BATCH_ENTRIES at a time: per file, decoding costs ~25 numpy calls per
# column whatever its length (0.6 ms a tail). Bigger files amortize that alone.
BATCH_MAX_FILE_ENTRIES = 1024
BATCH_ENTRIES = 16384
# The serial reader hands files to _read_chunk in groups of about this many
# bytes (~300 tails), reporting progress after each group.
SERIAL_CHUNK_BYTES = 4 * 1024**2
# Record ids restart in every recorder instance; a rank's k-th instance is
# shifted by k strides (far above any ring buffer's ids) to stay unique.
RECORD_ID_STRIDE = 1 << 40

Result = tuple[Candidate, ParsedDump | None, str | None]  # (file, dump, or why not)
ProgressCallback = Callable[[int, int], None]  # (files read, files in all)


def _checked(cand: Candidate, max_bytes: int, max_entries: int) -> tuple[Any, list[Any]] | str:
    """One file read, decoded to objects and checked (decode.check_dump), or why not."""
    if cand.size > max_bytes:
        return f"file is {cand.size} bytes, over the {max_bytes}-byte limit"
    if cand.member is not None:
        try:
            data = nodearchive.read(cand.member, max_bytes)
        except nodearchive.ArchiveError as e:
            return str(e)
        return _checked_bytes(data, max_entries)
    try:
        with open(cand.path, "rb") as f:
            # read(n) allocates n bytes up front: ask for what stat saw (+1
            # to notice growth), then the rest only if the file did grow.
            data = f.read(cand.size + 1)
            if len(data) > cand.size:
                data += f.read(max_bytes + 1 - len(data))
    except OSError as e:
        return f"cannot read: {e.strerror or e}"
    if len(data) > max_bytes:
        return f"file grew past the {max_bytes}-byte limit"
    return _checked_bytes(data, max_entries)


def _checked_bytes(data: bytes, max_entries: int) -> tuple[Any, list[Any]] | str:
    try:
        raw = sniff_and_decode(data)
        return raw, check_dump(raw, max_entries=max_entries)
    except DECODE_ERRORS as e:
        return _why(e)


def _why(e: BaseException) -> str:
    if isinstance(e, RecursionError):
        return "structure nests too deeply"
    if isinstance(e, MemoryError):
        return "not enough memory to decode"
    return one_line(str(e))


def _decoded(cands: list[Candidate], dumps: list[tuple[Any, list[Any]]]) -> list[Result]:
    return [
        (c, p, None) if isinstance(p, ParsedDump) else (c, None, _why(p))
        for c, p in zip(cands, decode_each(dumps), strict=True)
    ]


def _read_chunk(cands: list[Candidate], max_bytes: int, max_entries: int) -> list[Result]:
    """Every candidate read and decoded, in order; small dumps in batches."""
    out: dict[int, Result] = {}
    batch: list[int] = []
    dumps: list[tuple[Any, list[Any]]] = []
    n_batched = 0

    def flush(idx: list[int], ds: list[tuple[Any, list[Any]]]) -> None:
        out.update(zip(idx, _decoded([cands[i] for i in idx], ds), strict=True))

    with gc_paused():
        try:
            for i, c in enumerate(cands):
                got = _checked(c, max_bytes, max_entries)
                if isinstance(got, str):
                    out[i] = (c, None, got)
                elif len(got[1]) > BATCH_MAX_FILE_ENTRIES:
                    flush([i], [got])
                    del got  # a big dump's objects must go before the next file is read
                else:
                    batch.append(i)
                    dumps.append(got)
                    n_batched += len(got[1])
                    if n_batched >= BATCH_ENTRIES:
                        flush(batch, dumps)
                        batch, dumps, n_batched = [], [], 0
            if batch:
                flush(batch, dumps)
        finally:
            nodearchive.release()  # the node archive read last, if any
    return [out[i] for i in range(len(cands))]


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Unpickling builds millions of containers, and each generation-0
    threshold crossing makes the collector walk the young ones: 3-4x the
    unpickling time. A dump holds no reference cycles (pickle and JSON build
    trees), so reference counting frees everything; torch's own reader does
    the same. The loader and the analysis run paused as a whole too: each
    collection walks young object columns of every entry, and pandas' few
    cycles wait for the next collection after."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _pool_context() -> Any:
    # fork shares the already-imported pandas/numpy for free; elsewhere spawn.
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context(
        "fork" if "fork" in methods and sys.platform == "linux" else "spawn"
    )


def read_all(
    cands: list[Candidate],
    *,
    workers: int | None,
    on_progress: ProgressCallback | None,
    max_bytes: int,
    max_entries: int,
) -> list[Result]:
    """Every candidate, read and decoded, in order.

    `on_progress(done, total)` is called with done=0 first, after each file,
    and last with done == total, also when reading stops early on an error,
    so that a display can always close.
    """
    total_bytes = sum(c.size for c in cands)
    n_workers = workers if workers is not None else min(os.cpu_count() or 1, 8)
    parallel = n_workers > 1 and (
        (workers is not None and len(cands) > 1)
        or (
            total_bytes >= PARALLEL_MIN_BYTES
            and len(cands) >= PARALLEL_MIN_FILES
            and total_bytes >= PARALLEL_MIN_MEAN_BYTES * len(cands)
        )
    )
    total = len(cands)
    out: list[Result] = []
    if on_progress is not None:
        on_progress(0, total)
    try:
        if not parallel:
            # Paused across chunks, not per chunk: re-enabled in between, the
            # collector walks every dump decoded so far (0.7 s of 4.1 s).
            with gc_paused():
                for group in _by_bytes(cands, SERIAL_CHUNK_BYTES):
                    out.extend(_read_chunk(group, max_bytes, max_entries))
                    if on_progress is not None:
                        on_progress(len(out), total)
            return out
        # Chunks amortize the per-task cost; several per worker keep both busy.
        n_chunks = max(n_workers * 4, 1)
        chunk = max(1, (len(cands) + n_chunks - 1) // n_chunks)
        chunks = [cands[i : i + chunk] for i in range(0, len(cands), chunk)]
        with ProcessPoolExecutor(max_workers=n_workers, mp_context=_pool_context()) as ex:
            for res in ex.map(
                _read_chunk, chunks, [max_bytes] * len(chunks), [max_entries] * len(chunks)
            ):
                out.extend(res)
                if on_progress is not None:
                    on_progress(len(out), total)
        return out
    finally:
        if on_progress is not None and len(out) < total:
            on_progress(total, total)


def read_packed(
    cands: list[Candidate],
    columns: Mapping[str, tuple[nodearchive.Member, str]],
    *,
    max_bytes: int,
    max_entries: int,
) -> tuple[dict[int, Result], list[FileError]]:
    """The candidates whose node archive carries them already decoded
    (hangwatch.analyzer.packed), by index into `cands`; the rest are read
    as files. A damaged columns member is one FileError and its tails are
    decoded instead; one from another decoder is passed over silently."""
    # archive -> member name -> (index into cands, its member)
    by_archive: dict[str, dict[str, tuple[int, nodearchive.Member]]] = {}
    for i, c in enumerate(cands):
        if c.member is not None and c.path in columns and c.size <= max_bytes:
            by_archive.setdefault(c.path, {})[c.member.member] = (i, c.member)
    out: dict[int, Result] = {}
    errors: list[FileError] = []
    try:
        for path, wanted in by_archive.items():
            m, rel = columns[path]
            try:
                got = packed.unpack(
                    nodearchive.read(m, packed.MAX_BYTES),
                    {name: member for name, (_, member) in wanted.items()},
                )
            except packed.StaleDecoder:
                continue
            except (packed.PackError, nodearchive.ArchiveError) as e:
                errors.append(
                    FileError(file=rel, error=f"{_why(e)}; its tails were decoded instead")
                )
                continue
            for name, p in got.items():
                i = wanted[name][0]
                if p.n_entries <= max_entries:
                    out[i] = (cands[i], p, None)
    finally:
        nodearchive.release()
    return out, errors


def _by_bytes(cands: list[Candidate], limit: int) -> Iterator[list[Candidate]]:
    """Consecutive groups of candidates of about `limit` bytes each."""
    group: list[Candidate] = []
    size = 0
    for c in cands:
        group.append(c)
        size += c.size
        if size >= limit:
            yield group
            group, size = [], 0
    if group:
        yield group


def concat_columns(parts: list[tuple[int, ParsedDump]]) -> pd.DataFrame:
    """One frame for all ranks; string columns become one Categorical each.
    Consumes the parts' columns.

    Categories are ordered as union_categoricals orders per-file sorted ones:
    by the first file holding a string, then the string. Every file's
    distinct strings are interned together, so the per-row work is one
    integer take per column, and the per-file work a list extend (a table
    and a remap per file and column cost 0.23 s at 4,096 ranks).
    """
    parts = [(r, p) for r, p in parts if p.n_entries]
    data: dict[str, Any] = {}
    if not parts:
        empty: dict[str, Any] = {k: np.array([], dtype=np.int64) for k in INT_COLUMNS}
        empty.update({k: pd.Categorical([]) for k in STR_COLUMNS})
        empty.update({k: np.array([], dtype=bool) for k in BOOL_COLUMNS})
        empty.update({k: np.array([], dtype=np.float64) for k in FLOAT_COLUMNS})
        empty["rank"] = np.array([], dtype=np.int64)
        return pd.DataFrame(empty)[["rank", *ENTRY_COLUMNS]]
    sizes = np.array([p.n_entries for _, p in parts], dtype=np.int64)
    data["rank"] = np.repeat(np.array([r for r, _ in parts], dtype=np.int64), sizes)
    # Column by column, dropping each file's copy once merged (the parts are
    # spent): peak memory is the merged frame plus one column, not twice all.
    for k in ENTRY_COLUMNS:
        if k not in STR_COLUMNS:
            data[k] = np.concatenate([p.columns.pop(k) for _, p in parts])
            continue
        coded: list[Coded] = [p.columns.pop(k) for _, p in parts]
        data[k] = _merge_coded(coded)
    return pd.DataFrame(data, copy=False)


def _merge_coded(coded: list[Coded]) -> pd.Categorical:
    """Files' coded columns as one Categorical, categories ordered by (first
    file holding the string, the string)."""
    n_cats = np.array([len(c.cats) for c in coded], dtype=np.int64)
    # Each file's categories, one after the other, as ids into their union.
    ids, names = intern_values(list(itertools.chain.from_iterable(c.cats for c in coded)))
    file_of_id = np.repeat(np.arange(len(coded), dtype=np.int64), n_cats)[first_of_each(ids)]
    by_name = np.empty(len(names), dtype=np.int64)
    by_name[sorted(range(len(names)), key=names.__getitem__)] = np.arange(len(names))
    order = np.lexsort((by_name, file_of_id))
    position = np.empty(len(names), dtype=np.int32)
    position[order] = np.arange(len(names), dtype=np.int32)
    offsets = np.repeat(np.cumsum(n_cats) - n_cats, [len(c.codes) for c in coded])
    codes = position[ids[np.concatenate([c.codes for c in coded]) + offsets]]
    return pd.Categorical.from_codes(codes, categories=pd.Index([names[i] for i in order]))


def shift_record_ids(p: ParsedDump, by: int) -> None:
    p.columns["record_id"] = p.columns["record_id"] + by
    p.frames = {rec + by: fr for rec, fr in p.frames.items()}


def choose_dumps(
    results: list[Result],
) -> tuple[dict[tuple[int, str], tuple[Candidate, ParsedDump]], list[FileError]]:
    """One dump per (rank, backend), and a FileError for every file that does not count.

    A rank of a job with NCCL and gloo groups has one recorder instance of
    each (hangwatch.recorders), and both count.
    """
    by_key: dict[tuple[int, str], tuple[Candidate, ParsedDump]] = {}
    errors: list[FileError] = []
    # Full dumps first: phase two of a collection brings a rank's full dump
    # next to its tail (hangwatch.frtail), and the full one holds everything
    # the tail does. Only two dumps of the same kind are a conflict.
    for cand, parsed, err in sorted(results, key=lambda x: x[1] is not None and x[1].tail):
        if parsed is None:
            errors.append(FileError(file=cand.rel, error=err or "unreadable"))
            continue
        key = (cand.rank, parsed.backend)
        prev = by_key.get(key)
        if prev is None:
            by_key[key] = (cand, parsed)
            continue
        if parsed.tail and not prev[1].tail:
            continue
        keep_new = (parsed.n_entries, cand.mtime) > (prev[1].n_entries, prev[0].mtime)
        kept, dropped = ((cand, parsed), prev) if keep_new else (prev, (cand, parsed))
        by_key[key] = kept
        errors.append(
            FileError(
                file=dropped[0].rel,
                error=f"second dump for rank {cand.rank}; kept {kept[0].rel} (more entries or newer)",
            )
        )
    return by_key, errors
