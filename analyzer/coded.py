"""The coded-columns engine: a column of strings as int codes into its distinct values.

A file holds millions of entries but a few dozen distinct groups, ops,
states, shapes or dtypes. Normalizing each distinct value once (and each
entry only by C-level interning) is what makes decoding a dump cost about
what unpickling it does.
"""

from __future__ import annotations

import itertools
import marshal
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True, kw_only=True)
class Coded:
    """A string column of one file: codes into distinct strings.

    Workers ship these (a small int array and a short list) instead of a
    pandas Categorical per column per file; the loader merges the distinct
    strings once for all files.
    """

    codes: np.ndarray  # int32, one per entry
    cats: list[str]  # distinct values, in order of first appearance
    reps: np.ndarray  # row of each value's first appearance

    def strings(self) -> list[str]:
        return [self.cats[c] for c in self.codes.tolist()]

    def compose(self, inner: Coded) -> Coded:
        """This encodes one value per distinct value of `inner`; re-index it per row."""
        codes = self.codes[inner.codes] if len(inner.codes) else inner.codes
        return Coded(codes=codes, cats=self.cats, reps=inner.reps[self.reps])


def intern_values(values: Sequence[Any]) -> tuple[np.ndarray, list[Any]]:
    """Codes (order of first appearance) and the distinct values; values must be hashable."""
    idx = {v: i for i, v in enumerate(dict.fromkeys(values))}
    codes = np.fromiter(map(idx.__getitem__, values), dtype=np.int32, count=len(values))
    return codes, list(idx)


def first_of_each(codes: np.ndarray) -> np.ndarray:
    """Row of each code's first appearance, for codes numbered in that order."""
    if not len(codes):
        return np.zeros(0, dtype=np.int64)
    hi = np.maximum.accumulate(codes)
    new = np.ones(len(codes), dtype=bool)
    new[1:] = hi[1:] > hi[:-1]
    return np.flatnonzero(new)


def encode(
    values: Sequence[Any],
    norm: Callable[[Any], str],
    *,
    types: frozenset[type],
    keys: Callable[[Sequence[Any]], Sequence[Any]] | None = None,
    exact: Callable[[Any], bool] | None = None,
) -> Coded:
    """Encode norm(v) for every value as (codes, distinct strings, first row of each).

    When every value's type is in `types`, values are grouped by a hashable
    key per value (`keys(values)`, built by C-level calls; None: the value
    itself) and `norm` runs once per distinct key. That is exact only where
    equal keys mean equal values of the same type: marshal bytes do (they
    decode back to the value, types included); for plain hashing, `exact`
    confirms it on each distinct value (str never equals a non-str, nor do
    tuples of str/None). Otherwise every value is normalized on its own.
    """
    if set(map(type, values)) <= types:
        try:
            raw_codes, _ = intern_values(values if keys is None else keys(values))
        except (TypeError, ValueError):  # unhashable, or too deep to marshal
            raw_codes = None
        if raw_codes is not None:
            first = first_of_each(raw_codes)
            if exact is None or all(exact(values[i]) for i in first):
                return coded_by_key(raw_codes, first, (norm(values[i]) for i in first))
    strs = [norm(v) for v in values]
    codes, cats = intern_values(strs)
    return Coded(codes=codes, cats=cats, reps=first_of_each(codes))


def coded_by_key(raw_codes: np.ndarray, first: np.ndarray, strings: Iterable[str]) -> Coded:
    """The Coded of a column whose rows hold one string per key: raw_codes
    numbers each row's key in order of first appearance, first[k] is key k's
    first row and strings yields key k's string, in key order. Keys that map
    to one string merge, so the result is what encoding the strings gives."""
    seen: dict[str, int] = {}
    remap = np.fromiter(
        (seen.setdefault(s, len(seen)) for s in strings), dtype=np.int32, count=len(first)
    )
    codes = remap[raw_codes] if len(raw_codes) else raw_codes
    return Coded(codes=codes, cats=list(seen), reps=first[first_of_each(remap)])


def marshal_keys(values: Sequence[Any]) -> list[bytes]:
    # Format 2 writes no back-references, so equal values give equal bytes.
    return list(map(marshal.dumps, values, itertools.repeat(2)))


def tuple_keys(values: Sequence[Any]) -> list[tuple[Any, ...]]:
    return list(map(tuple, values))


def str_or(default: str) -> Callable[[Any], str]:
    def norm(v: Any) -> str:
        return str(v) if v is not None else default

    return norm


def only_str_or_none(v: Any) -> bool:
    return all(x is None or type(x) is str for x in v)


def only_str(v: Any) -> bool:
    return all(type(x) is str for x in v)


def is_str_or_none(v: Any) -> bool:
    return v is None or type(v) is str


def split_coded(c: Coded, bounds: np.ndarray) -> list[Coded]:
    """Cut a column of several files (file i: rows bounds[i]:bounds[i+1]) into
    one Coded per file, exactly as encoding each file alone gives it: codes
    and cats in order of first appearance in the file, reps its own rows.

    Vectorized over the batch: one sort of (file, code) keys, then a slice
    and a short list per file.
    """
    n_files = len(bounds) - 1
    n_rows = int(bounds[-1])
    if not n_rows:
        empty = np.zeros(0, dtype=np.int32)
        return [Coded(codes=empty, cats=[], reps=np.zeros(0, dtype=np.int64))] * n_files
    file_of = np.repeat(np.arange(n_files, dtype=np.int64), np.diff(bounds))
    key = file_of * len(c.cats) + c.codes
    uniq, first, inverse = np.unique(key, return_index=True, return_inverse=True)
    # Rows are grouped by file, so first appearance in the batch orders the
    # distinct (file, value) pairs by file, then by first appearance in it.
    order = np.argsort(first, kind="stable")
    pos = np.empty(len(order), dtype=np.int64)
    pos[order] = np.arange(len(order))
    files_in_order = uniq[order] // len(c.cats)
    start = np.searchsorted(files_in_order, np.arange(n_files + 1))
    local = (pos[inverse] - start[file_of]).astype(np.int32)
    values = (uniq[order] % len(c.cats)).tolist()
    reps = first[order] - bounds[files_in_order]
    out = []
    for f, (lo, hi) in enumerate(itertools.pairwise(start.tolist())):
        out.append(
            Coded(
                codes=local[bounds[f] : bounds[f + 1]],
                cats=[c.cats[v] for v in values[lo:hi]],
                reps=reps[lo:hi],
            )
        )
    return out
