"""The decoder's shortcuts give exactly what per-value normalization gives.

`decode_dump` normalizes each *distinct* value once (grouping values by a
hashable key built in C) and reads entries with one itemgetter when every
key is present. These tests pin both shortcuts to the plain definitions on
arbitrary values, including the shapes where the shortcut must step aside
(tuples among lists, bools among ints, strings posing as size lists).
"""

from __future__ import annotations

import json
import math
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fr_dumps import SimJob
from hangwatch.analyzer.coded import Coded, encode, marshal_keys, only_str, str_or, tuple_keys
from hangwatch.analyzer.decode import (
    ParsedDump,
    _shape_columns,
    check_dump,
    decode_dump,
    decode_dumps,
    group_columns,
)
from hangwatch.analyzer.fields import dtypes_norm, fast_int_column, sizes_str
from hangwatch.analyzer.loader import load_dumps
from hangwatch.analyzer.parse import parse_dump_bytes
from hangwatch.analyzer.reading import _merge_coded
from hangwatch.analyzer.sniff import DumpFormatError
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

_atom = st.one_of(
    st.integers(-3, 2**40),
    st.booleans(),
    st.floats(allow_nan=False, width=32),
    st.text(max_size=3),
    st.none(),
)
_shape = st.one_of(st.lists(_atom, max_size=3), st.tuples(_atom, _atom))
_sizes = st.one_of(st.lists(_shape, max_size=3), st.none(), st.text(max_size=5), st.integers())
_dtypes = st.one_of(
    st.lists(st.sampled_from(["Float", "BFloat16", "Half", "Int"]), max_size=3),
    st.lists(st.one_of(st.text(max_size=3), st.integers(0, 9)), max_size=3),
    st.none(),
    st.text(max_size=3),
)
_size_lists = st.lists(_shape, max_size=3)
_dtype_lists = st.lists(
    st.one_of(st.sampled_from(["Float", "Half"]), st.integers(0, 2)), max_size=3
)
_strings = st.one_of(st.sampled_from(["scheduled", "started", "completed"]), st.none(), _atom)


def _check(c: Coded, expect: list[str]) -> None:
    assert c.strings() == expect
    assert c.cats == list(dict.fromkeys(expect))  # distinct, in order of first appearance
    assert [expect.index(s) for s in c.cats] == c.reps.tolist()


@FAST
@given(st.lists(_sizes, max_size=30))
def test_sizes_by_distinct_value_equal_per_value(values: list[Any]) -> None:
    c = encode(values, sizes_str, types=frozenset({list}), keys=marshal_keys)
    _check(c, [sizes_str(v) for v in values])


@FAST
@given(st.lists(_dtypes, max_size=30))
def test_dtypes_by_distinct_value_equal_per_value(values: list[Any]) -> None:
    c = encode(
        values,
        dtypes_norm,
        types=frozenset({list}),
        keys=tuple_keys,
        exact=only_str,
    )
    _check(c, [dtypes_norm(v) for v in values])


@FAST
@given(st.lists(_strings, max_size=30))
def test_strings_by_distinct_value_equal_per_value(values: list[Any]) -> None:
    norm = str_or("scheduled")
    _check(encode(values, norm, types=frozenset({str})), [norm(v) for v in values])


@FAST
@given(
    st.lists(
        st.one_of(
            st.tuples(st.sampled_from(["0", "1", "17"]), st.sampled_from(["default_pg", "TP"])),
            st.tuples(st.sampled_from(["0", "1"])),
            st.lists(st.one_of(st.sampled_from(["0", "1"]), st.integers(0, 1), st.booleans())),
        ),
        min_size=1,
        max_size=20,
    )
)
@example(pgs=[[0, 0, 0, 0, 0], [0, False, 0, 0, 0]])  # 0 == False, str() differs
def test_process_groups_by_distinct_value_equal_per_value(pgs: list[Any]) -> None:
    pg_ids = [0] * len(pgs)
    if not all(isinstance(p, list | tuple) and len(p) >= 1 for p in pgs):
        with pytest.raises(DumpFormatError, match="no usable process_group"):
            group_columns(pgs, pg_ids)
        return
    g, d = group_columns(pgs, pg_ids)
    _check(g, [str(p[0]) for p in pgs])
    _check(d, [str(p[1]) if len(p) > 1 and p[1] is not None else "" for p in pgs])


@FAST
@given(st.lists(st.one_of(st.integers(-(2**63), 2**63 - 1), st.none()), max_size=20))
def test_int_columns_fill_none(values: list[int | None]) -> None:
    got = fast_int_column(tuple(values), 7, "x")
    assert got.dtype == np.int64
    assert got.tolist() == [7 if v is None else v for v in values]


def _job() -> SimJob:
    job = SimJob(2, backend="nccl")
    job.all("0")
    job.ranks[0].p2p("0", "send", 1)
    job.ranks[1].p2p("0", "recv", 0)
    job.all("0")
    return job


def _entries(data: bytes) -> list[dict[str, Any]]:
    out = parse_dump_bytes(data)["entries"]
    for e in out:  # NaN != NaN; absent durations must still compare equal
        e["duration_ms"] = None if math.isnan(e["duration_ms"]) else e["duration_ms"]
    return out


@pytest.mark.parametrize(
    "missing", ["thread_id", "is_p2p", "retired", "state", "op_id", "p2p_seq_id"]
)
def test_one_pass_and_per_key_reads_agree(missing: str) -> None:
    """An entry without some key sends the whole file down the per-key path;
    every other entry must come out exactly as the one-pass path makes it."""
    obj = _job().ranks[0].dump_obj()
    full = _entries(pickle.dumps(obj))
    del obj["entries"][-1][missing]
    partial = _entries(pickle.dumps(obj))
    assert len(full) == len(partial) >= 3
    assert full[:-1] == partial[:-1]
    last_full, last_part = full[-1], partial[-1]
    assert {k: v for k, v in last_full.items() if k != missing} == {
        k: v for k, v in last_part.items() if k != missing
    }


def _same_dump(a: ParsedDump, b: ParsedDump) -> None:
    for k in ("version", "backend", "pg_config", "pg_status", "n_entries", "frames", "tail"):
        assert getattr(a, k) == getattr(b, k), k
    assert (a.hooked, a.completion_known) == (b.hooked, b.completion_known)
    assert list(a.columns) == list(b.columns)
    for k, x in a.columns.items():
        y = b.columns[k]
        if isinstance(x, Coded):
            assert x.cats == y.cats and x.codes.tolist() == y.codes.tolist(), k
            assert x.reps.tolist() == y.reps.tolist(), k
        else:
            assert x.dtype == y.dtype and np.array_equal(x, y, equal_nan=x.dtype.kind == "f"), k


def test_dumps_decoded_together_equal_each_decoded_alone() -> None:
    """A batch mixes shapes (JSON lists beside pickle tuples, an entry without
    a key, an empty dump): each file's share must still be what it decodes to
    alone, its string columns in its own order of first appearance."""
    job = _job()
    job.ranks[1].coll("0", "all_gather", done=False)
    objs = [
        job.ranks[0].dump_obj(),
        json.loads(job.ranks[1].dump_bytes(json_form=True)),
        {"version": "2.10", "pg_status": {}, "entries": []},
        job.ranks[1].dump_obj(),
    ]
    del objs[3]["entries"][0]["thread_id"]
    dumps = [(o, check_dump(o)) for o in objs]
    for got, o in zip(decode_dumps(dumps), objs, strict=True):
        _same_dump(got, decode_dump(o))


def test_a_bad_file_in_a_batch_is_its_own_error(tmp_path: Path) -> None:
    job = _job()
    job.write(tmp_path)
    bad = job.ranks[0].dump_obj()
    bad["entries"][0]["collective_seq_id"] = None  # passes check_dump, fails decoding
    (tmp_path / "nccl_trace_rank_0").write_bytes(pickle.dumps(bad))
    loaded = load_dumps(tmp_path)
    assert loaded.ranks_loaded == [1]
    assert [e.error for e in loaded.errors] == ["an entry has no collective_seq_id"]


_files_cats = st.lists(
    st.lists(st.sampled_from(["b", "a", "c", "0", "10", "2", "é", ""]), min_size=1, max_size=12),
    min_size=1,
    max_size=6,
)


@FAST
@given(_files_cats)
def test_merged_categories_are_ordered_by_first_file_then_string(files: list[list[str]]) -> None:
    """concat_columns merges every file's strings at once; the order must stay
    the one a table filled file by file with each file's sorted strings gives."""
    coded = [encode(v, str, types=frozenset({str})) for v in files]
    table: dict[str, int] = {}
    for c in coded:
        for s in sorted(c.cats):
            table.setdefault(s, len(table))
    got = _merge_coded(coded)
    assert list(got.categories) == list(table)
    assert list(got) == [s for v in files for s in v]


@FAST
@given(
    st.lists(
        st.one_of(
            st.tuples(_size_lists, _size_lists, _dtype_lists, _dtype_lists),
            st.tuples(_sizes, _sizes, _dtypes, _dtypes),
        ),
        max_size=30,
    )
)
def test_shapes_keyed_together_equal_per_value(rows: list[tuple[Any, Any, Any, Any]]) -> None:
    """Sizes and dtypes share one key per entry: each column must still be
    its per-value normalization (bools among ints, tuples among lists), and
    a row of anything but lists sends all four to encode's own path."""
    cols = [[r[k] for r in rows] for k in range(4)]
    got = _shape_columns(*cols)
    for c, values, norm in zip(
        got, cols, (sizes_str, sizes_str, dtypes_norm, dtypes_norm), strict=True
    ):
        _check(c, [norm(v) for v in values])
