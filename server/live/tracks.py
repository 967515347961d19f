"""The straggler monitor's state over arrays: one job's (group, rank) tracks,
its groups' recent ticks, and a tick's readings as the reports left them.

Why arrays: at 4,096 ranks in 4-6 groups a tick is 16-25 thousand (group,
rank) tracks. Kept as one Python object each, scoring cost 19.5 µs a rank a
tick and filing 11 µs a rank report (benchmarks/ingest_path.py), the largest
part of a healthy coordinator's CPU. Here a report is filed as it came (a few
µs), a tick's readings are unpacked together, and every group is scored in
one pass of numpy over all of them. The decision rules are in stragglers.py;
this module keeps the counts they read.
"""

from __future__ import annotations

import math
import mmap
from array import array
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np

from hangwatch import progress_columns
from hangwatch.wire import pb

WINDOW_TICKS: Final = 300  # the sliding window: 5 minutes at 1 Hz
# The sequential test's two hypotheses, as shares of instants behind / ahead
# of the median member. Healthy: noise, as often behind as ahead. Straggler:
# behind a tenth of the time, almost never ahead (it is the one waited for).
P0: Final = 0.02
P1_BEHIND: Final = 0.06
P1_AHEAD: Final = 0.005
LLR_BEHIND: Final = math.log(P1_BEHIND / P0)
LLR_AHEAD: Final = math.log(P1_AHEAD / P0)
LLR_LEVEL: Final = math.log((1 - P1_BEHIND - P1_AHEAD) / (1 - 2 * P0))
CUSUM_H: Final = 6.0  # decision threshold on the summed log-likelihood ratio
CLEAR_TICKS: Final = 150  # a flagged rank is cleared on the last this many pushes
LATE_TICKS: Final = 60  # late_ms follows about the last minute
RATE_TICKS: Final = 30  # baseline for the group's collectives-per-second rate
IDLE_TICKS: Final = 5  # a group whose median counter is unchanged this long is idle (or hung)
# A gap, in collectives, that counts as behind (or ahead). Below a half: with an
# even number of members the median sits halfway, and a two-rank group's
# straggler is exactly 0.5 behind, less the instant correction's rounding.
GAP: Final = 0.4

# A push's code, a nibble: the low two bits its gap to the median member on
# the enqueued counter, the high two on the started one (0: not measured).
_LEVEL, _BEHIND, _AHEAD = 0, 1, 2
_S_NONE, _S_LEVEL, _S_BEHIND, _S_AHEAD = 0, 1, 2, 3
# A track's pushes over the window. A healthy row pushes one code over and
# over (level; level with started unmeasured), so a row keeps that code (its
# base) and, oldest first, the pushes that differ from it: up to _ODD, each a
# uint16 (its slot in the window << 4 | its code) in a small ring of its own.
# Pushes leave the window oldest first, so the push leaving is the oldest odd
# one or none, and each push reads a fixed few entries (numpy over one value
# a row, not over _ODD: the window's slots searched were 2.4x the push's
# cost). A row with more odd pushes is given a ring of nibbles (150 bytes,
# two pushes a byte) from the pool until a recount finds _ODD or fewer
# again. 56 bytes a row for 150: the rings were 0.6 KB of a 4,096-rank
# job's 4.0 KB a rank. A simulated 256-rank job's windows (400 s, compute
# jitter 2% and 5%) held a median of 8 and 11 odd pushes, at most 17 and 20:
# none in the pool. At 16 kept, 1-4% of rows were; at 20% jitter, 94% are.
_ODD: Final = 24
_RECOUNT_TICKS: Final = 30  # a pooled row is recounted every this many pushes
_RECOUNT_CHUNK: Final = 1024  # rows unpacked at once
_HIST: Final = RATE_TICKS + 1
_NO_TICK: Final = -(1 << 62)
_FIRST_CELLS: Final = 64
_FIRST_GROUPS: Final = 8
# A counter or an instant (ns from its tick) sorted under its group in one
# int64: values spanning less than 2^40 (collectives, or 18 minutes of ns),
# groups fewer than 2^23.
_VALUE_BITS: Final = 40


# Arrays this large or larger are mapped by `_zeros` itself, not calloc'd.
_MAPPED_BYTES: Final = 1 << 16


def _zeros(shape: tuple[int, ...], dtype: np.dtype[Any] | type) -> np.ndarray:
    """np.zeros, but an array of _MAPPED_BYTES or more is its own anonymous
    mapping: zero pages that cost nothing until written, given back whole
    when the array goes. calloc promises that only while glibc maps the
    block itself, and glibc stops mapping a size once a mapped block that
    large was freed (its threshold follows frees up to 32 MiB): after the
    first doubling freed one, the next ones came from the heap, zeroed by
    memset (their spare rows resident) and leaving holes as they were
    freed in turn. At 4,096 ranks in 5 groups, rows added 8 ranks at a
    time, the tracks took 2.92 KB a rank of RSS that way and 2.50 mapped
    (benchmarks/tracks_memory.py --pushes 3 --odd-share 0)."""
    dt = np.dtype(dtype)
    nbytes = math.prod(shape) * dt.itemsize
    if nbytes < _MAPPED_BYTES:
        return np.zeros(shape, dt)
    return np.frombuffer(mmap.mmap(-1, nbytes), dt).reshape(shape)


def _grown(a: np.ndarray, n: int, used: int | None = None) -> np.ndarray:
    """`a` with room for at least `n` rows (doubling), its first `used` rows
    (all by default) kept. The room is `_zeros`, and only the kept rows are
    copied, so the rows not yet used cost no memory until they are written.
    Filled as np.full fills, the doubling's spare rows were resident: at
    4,096 ranks in 5 groups (32,768 rows held for 20,480) the tracks' RSS was
    3.48 KB a rank, 2.95-3.09 with zeros (benchmarks/tracks_memory.py)."""
    if len(a) >= n:
        return a
    keep = len(a) if used is None else used
    out = _zeros((max(n, 2 * len(a)), *a.shape[1:]), a.dtype)
    out[:keep] = a[:keep]
    return out


class Tracks:
    """Every (group, rank) of one job as a row of arrays: its last reading
    (for the ticks it is not reported), and its track over the window. Rows are
    never removed (a job's groups and ranks are fixed; MAX_JOBS bounds jobs)."""

    def __init__(self) -> None:
        self.n_rows = 0
        c = _FIRST_CELLS
        self.gid = np.zeros(c, np.int32)
        self.rank = np.zeros(c, np.int32)  # ranks are < MAX_WORLD_SIZE (2**20)
        self.last_tick = np.zeros(c, np.int64)  # _FILLS: set as rows are added
        self.last_enq = np.zeros(c, np.int64)
        self.last_started = np.zeros(c, np.int64)
        self.last_err = np.zeros(c, np.int64)
        self.n = np.zeros(c, np.int32)  # pushes so far: one a second, 68 years to overflow
        self.cusum = np.zeros(c, np.float64)
        self.late_s = np.zeros(c, np.float64)  # exponential mean over ~LATE_TICKS
        self.err_s = np.zeros(c, np.float64)  # its agent's latest clock error bound
        self.flagged_at = np.zeros(c, np.float64)
        # Counts over the window (WINDOW_TICKS pushes), kept as pushes enter and leave it.
        self.behind = np.zeros(c, np.int16)
        self.ahead = np.zeros(c, np.int16)
        self.s_seen = np.zeros(c, np.int16)
        self.s_behind = np.zeros(c, np.int16)
        self.s_ahead = np.zeros(c, np.int16)
        self.episodes = np.zeros(c, np.int16)  # runs of behind (either counter)
        # ... and over the last CLEAR_TICKS pushes, for clearing a flagged rank.
        self.behind_clear = np.zeros(c, np.int16)
        self.ahead_clear = np.zeros(c, np.int16)
        self.base = np.zeros(c, np.uint8)  # level on the counters it measured
        self.odd = np.zeros((c, _ODD), np.uint16)  # its odd pushes, a ring from odd_head
        self.odd_head = np.zeros(c, np.uint8)
        self.odd_count = np.zeros(c, np.uint8)
        self.odd_clear = np.zeros(c, np.uint8)  # of them, older than the last CLEAR_TICKS
        self.ring = np.zeros(c, np.int32)  # its row of the pool; -1: none (_FILLS)
        self.pool = np.zeros((0, WINDOW_TICKS // 2), np.uint8)
        self.pool_free: list[int] = []
        self.pool_used = 0
        # Lookup: keys (gid << 32 | rank) sorted, and the row of each.
        self.keys = np.zeros(0, np.int64)
        self.rows = np.zeros(0, np.int32)

    _FILLS: Final = {"last_tick": _NO_TICK, "flagged_at": np.nan, "ring": -1}
    _NOT_ROWS: Final = ("keys", "rows", "pool")

    def find(self, gid: np.ndarray, rank: np.ndarray) -> np.ndarray:
        """Row of each (gid, rank), new rows made for those not seen before."""
        keys = (gid.astype(np.int64) << 32) | rank
        at = np.searchsorted(self.keys, keys)
        at_c = np.minimum(at, len(self.keys) - 1)
        if len(self.keys) and bool((self.keys[at_c] == keys).all()):
            # As intp: a tick indexes some forty columns with them, and an
            # int32 index is converted on each (a push of 16,384 rows took
            # 2.83 ms returned as stored, 2.42 so: benchmarks/tracks_memory.py).
            out: np.ndarray = self.rows[at_c].astype(np.intp)
            return out
        new, first = np.unique(keys, return_index=True)
        missing = ~np.isin(new, self.keys)
        new = new[missing][np.argsort(first[missing])]  # rows in order of first appearance
        if len(new):
            self._add(new)
        at = np.searchsorted(self.keys, keys)
        found: np.ndarray = self.rows[at].astype(np.intp)
        return found

    def _add(self, keys: np.ndarray) -> None:
        start, end = self.n_rows, self.n_rows + len(keys)
        for name, value in vars(self).items():
            if isinstance(value, np.ndarray) and name not in self._NOT_ROWS:
                grown = _grown(value, end, start)
                if name in self._FILLS:
                    grown[start:end] = self._FILLS[name]
                setattr(self, name, grown)
        self.gid[start:end] = keys >> 32
        self.rank[start:end] = keys & 0xFFFFFFFF
        self.n_rows = end
        all_keys = np.concatenate([self.keys, keys])
        rows = np.concatenate([self.rows, np.arange(start, end, dtype=np.int32)])
        order = np.argsort(all_keys, kind="stable")
        self.keys, self.rows = all_keys[order], rows[order]

    def push(
        self,
        rows: np.ndarray,
        gap: np.ndarray,
        late_s: np.ndarray,
        started_gap: np.ndarray,
        err_ns: np.ndarray,
    ) -> None:
        """One tick for `rows` (each once): the gap to the median member, in
        collectives (> 0: behind), and on the started counter (NaN: not measured)."""
        behind, ahead = gap >= GAP, gap <= -GAP
        s_seen = ~np.isnan(started_gap)
        s_behind = s_seen & (started_gap >= GAP)
        s_ahead = s_seen & (started_gap <= -GAP)
        code = (
            np.where(behind, _BEHIND, np.where(ahead, _AHEAD, _LEVEL))
            | np.where(
                s_seen, np.where(s_behind, _S_BEHIND, np.where(s_ahead, _S_AHEAD, _S_LEVEL)), 0
            )
            << 2
        ).astype(np.uint8)
        hit = behind | s_behind
        n = self.n[rows]
        full = n >= WINDOW_TICKS
        # A new row's base: level, on the started counter too where it is measured.
        base = np.where(n == 0, _level(code), self.base[rows])
        self.base[rows] = base
        ring = self.ring[rows]
        pooled = ring >= 0
        # Narrow types: a tick's working set is a few dozen arrays of a row
        # each (int64 here took it from 552 to 945 bytes a rank at 4,096).
        slot = _slot(n)
        # The pushes read, of those in the window before this one: the one
        # leaving it (n - WINDOW_TICKS, at this push's slot), the one after
        # it (the window's oldest next), the one leaving the last CLEAR_TICKS
        # and the one before this.
        head = self.odd_head[rows].astype(np.int16)
        count = self.odd_count[rows].astype(np.int16)
        clear = self.odd_clear[rows].astype(np.int16)
        first = self._odd_at(rows, head, count, 0)
        out_odd = full & (first >> 4 == slot)
        out = np.where(out_odd, first & 15, np.where(full, base, 0)).astype(np.uint8)
        after = np.where(out_odd, self._odd_at(rows, head, count, 1), first)
        del first
        oldest = np.where(after >> 4 == _slot(n + 1), after & 15, base).astype(np.uint8)
        del after
        e = self._odd_at(rows, head, count, clear)
        clear_odd = (n >= CLEAR_TICKS) & (e >> 4 == _slot(n - CLEAR_TICKS))
        out_clear = np.where(clear_odd, e & 15, np.where(n >= CLEAR_TICKS, base, 0))
        out_clear = out_clear.astype(np.uint8)
        e = self._odd_at(rows, head, count, count - 1)
        prev = np.where(e >> 4 == _slot(n - 1), e & 15, base).astype(np.uint8)
        del e
        if pooled.any():
            p, pr = np.flatnonzero(pooled), ring[pooled]
            out[p] = np.where(full[p], self._nibble(pr, slot[p]), 0)
            oldest[p] = self._nibble(pr, _slot(n[p] + 1))
            out_clear[p] = np.where(
                n[p] >= CLEAR_TICKS, self._nibble(pr, _slot(n[p] - CLEAR_TICKS)), 0
            )
            prev[p] = self._nibble(pr, _slot(n[p] - 1))
            self._set_nibble(pr, slot[p], code[p])
        out_hit = _hit(out)
        prev_hit = (n >= 1) & _hit(prev)
        oldest_hit = full & _hit(oldest)
        del prev, oldest
        # The odd pushes: the leaving one goes, this one comes if odd.
        head = (head + out_odd) % _ODD
        count -= out_odd
        clear += clear_odd.astype(np.int16) - out_odd
        odd = ~pooled & (code != base)
        room = odd & (count < _ODD)
        r = np.flatnonzero(room)
        self.odd[rows[r], (head[r] + count[r]) % _ODD] = (slot[r].astype(np.uint16) << 4) | code[r]
        count += room
        self.odd_head[rows], self.odd_count[rows], self.odd_clear[rows] = head, count, clear
        del head, count, clear
        over = np.flatnonzero(odd & ~room)
        if len(over):
            self._to_pool(rows[over], slot[over], code[over], base[over])
        self.behind[rows] += behind.astype(np.int16) - ((out & 3) == _BEHIND)
        self.ahead[rows] += ahead.astype(np.int16) - ((out & 3) == _AHEAD)
        self.s_seen[rows] += s_seen.astype(np.int16) - ((out >> 2) != _S_NONE)
        self.s_behind[rows] += s_behind.astype(np.int16) - ((out >> 2) == _S_BEHIND)
        self.s_ahead[rows] += s_ahead.astype(np.int16) - ((out >> 2) == _S_AHEAD)
        self.behind_clear[rows] += behind.astype(np.int16) - ((out_clear & 3) == _BEHIND)
        self.ahead_clear[rows] += ahead.astype(np.int16) - ((out_clear & 3) == _AHEAD)
        # A run starts at a hit whose predecessor is not one; the window's
        # oldest push has no predecessor in it.
        self.episodes[rows] += (hit & ~prev_hit).astype(np.int16) - out_hit + (oldest_hit & out_hit)
        n = n + 1
        self.n[rows] = n
        recount = (ring >= 0) & (n % _RECOUNT_TICKS == 0)
        if recount.any():
            self._recount(rows[recount], n[recount], code[recount])
        late = self.late_s[rows]
        self.late_s[rows] = late + (late_s - late) / np.minimum(n, LATE_TICKS)
        step = np.where(hit, LLR_BEHIND, np.where(ahead, LLR_AHEAD, LLR_LEVEL))
        self.cusum[rows] = np.minimum(2 * CUSUM_H, np.maximum(0.0, self.cusum[rows] + step))
        self.err_s[rows] = err_ns / 1e9

    # The window's pushes: a row's base and odd pushes, or its ring in the pool.

    def _odd_at(
        self, rows: np.ndarray, head: np.ndarray, count: np.ndarray, i: np.ndarray | int
    ) -> np.ndarray:
        """Each row's `i`-th odd push, oldest first (slot << 4 | code); where it
        has none, slot 4095: no slot of a window."""
        has = (i >= 0) & (i < count)
        out: np.ndarray = self.odd[rows, (head + np.where(has, i, 0)) % _ODD]
        out[~has] = 0xFFFF
        return out

    def _to_pool(
        self, rows: np.ndarray, slot: np.ndarray, code: np.ndarray, base: np.ndarray
    ) -> None:
        """Rings for rows with one odd push too many: every slot their base,
        then their odd pushes, then this one."""
        free = [self.pool_free.pop() for _ in range(min(len(rows), len(self.pool_free)))]
        new = len(rows) - len(free)
        self.pool = _grown(self.pool, self.pool_used + new, self.pool_used)
        ring = np.array(free + list(range(self.pool_used, self.pool_used + new)), np.int64)
        self.pool_used += new
        window = np.repeat(base.astype(np.uint8)[:, None], WINDOW_TICKS, axis=1)
        r, e = self._odd_entries(rows)
        window[r, e >> 4] = e & 15
        window[np.arange(len(rows)), slot] = code
        self.pool[ring] = window[:, 0::2] | (window[:, 1::2] << 4)
        self.odd_head[rows] = self.odd_count[rows] = self.odd_clear[rows] = 0
        self.ring[rows] = ring

    def _odd_entries(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Every odd push of `rows`: (index into rows, entry), oldest first."""
        k = np.arange(_ODD)[None, :]
        held = k < self.odd_count[rows][:, None]
        cols = (self.odd_head[rows][:, None].astype(np.int64) + k) % _ODD
        r, i = np.nonzero(held)
        return r, self.odd[rows[r], cols[r, i]].astype(np.int64)

    def _recount(self, rows: np.ndarray, n: np.ndarray, code: np.ndarray) -> None:
        """Pooled rows (`n` pushes each, the last `code`) whose window again
        holds _ODD or fewer pushes off level leave the pool, level their
        base (on the started counter too where the last push measured it).
        In chunks: a window unpacked is 300 bytes a row and its masks as
        much again, and every pooled row of a job recounts at the same tick."""
        for at in range(0, len(rows), _RECOUNT_CHUNK):
            part = slice(at, at + _RECOUNT_CHUNK)
            self._recount_part(rows[part], n[part], _level(code[part]).astype(np.uint8))

    def _recount_part(self, rows: np.ndarray, n: np.ndarray, base: np.ndarray) -> None:
        packed = self.pool[self.ring[rows]]
        window = np.empty((len(rows), WINDOW_TICKS), np.uint8)
        window[:, 0::2], window[:, 1::2] = packed & 15, packed >> 4
        odd = window != base[:, None]
        # Before the window fills, slot i is push i: the slots past n are unused.
        odd &= np.arange(WINDOW_TICKS, dtype=np.int16)[None, :] < n[:, None]
        leave = np.flatnonzero(np.count_nonzero(odd, axis=1) <= _ODD)
        if not len(leave):
            return
        rows, odd, window, n = rows[leave], odd[leave], window[leave], n[leave]
        # Oldest first: a slot's age, in pushes before the last, is (n - 1 - slot) mod WINDOW_TICKS.
        r, pos = np.nonzero(odd)
        age = (n[r] - 1 - pos) % WINDOW_TICKS
        order = np.lexsort((-age, r))
        r, pos, age = r[order], pos[order], age[order]
        k = np.arange(len(r)) - np.searchsorted(r, r)  # the k-th odd push of its row
        self.odd[rows[r], k] = (pos << 4) | window[r, pos]
        self.odd_head[rows] = 0
        self.odd_count[rows] = np.bincount(r, minlength=len(rows))
        self.odd_clear[rows] = np.bincount(r, age >= CLEAR_TICKS, minlength=len(rows))
        self.base[rows] = base[leave]
        self.pool_free.extend(self.ring[rows].tolist())
        self.ring[rows] = -1

    def window(self, row: int) -> list[int]:
        """Row `row`'s pushes in the window, oldest first, as codes."""
        n = int(self.n[row])
        slots = [k % WINDOW_TICKS for k in range(max(0, n - WINDOW_TICKS), n)]
        ring = int(self.ring[row])
        if ring >= 0:
            at = np.array(slots, np.int64)
            return [int(c) for c in self._nibble(np.full(len(at), ring), at)]
        codes = dict.fromkeys(slots, int(self.base[row]))
        _, entries = self._odd_entries(np.array([row]))
        for e in entries.tolist():
            codes[e >> 4] = e & 15
        return [codes[k] for k in slots]

    def _nibble(self, ring: np.ndarray, pos: np.ndarray) -> np.ndarray:
        at = ring * (WINDOW_TICKS // 2) + (pos >> 1)  # flat: 2-D fancy indexing is 3x slower
        out: np.ndarray = (self.pool.reshape(-1)[at] >> ((pos & 1) << 2)) & 15
        return out

    def _set_nibble(self, ring: np.ndarray, pos: np.ndarray, code: np.ndarray) -> None:
        flat = self.pool.reshape(-1)
        at = ring * (WINDOW_TICKS // 2) + (pos >> 1)
        shift = ((pos & 1) << 2).astype(np.uint8)
        flat[at] = (flat[at] & ~(np.uint8(15) << shift)) | (code.astype(np.uint8) << shift)

    # What the page and the decision read, per row.

    def seen(self, rows: np.ndarray, last: int = WINDOW_TICKS) -> np.ndarray:
        out: np.ndarray = np.minimum(self.n[rows], last)
        return out

    def score(self, rows: np.ndarray) -> np.ndarray:
        """Share of instants behind the median member less the share ahead of it:
        about 0 for a healthy rank whatever the noise, lateness / step for a straggler."""
        return _share(self.behind[rows], self.ahead[rows], self.seen(rows))

    def score_clear(self, rows: np.ndarray) -> np.ndarray:
        return _share(self.behind_clear[rows], self.ahead_clear[rows], self.seen(rows, CLEAR_TICKS))

    def started_score(self, rows: np.ndarray) -> np.ndarray:
        """The score on the started counter; NaN where it was never measured."""
        seen = self.s_seen[rows]
        share = _share(self.s_behind[rows], self.s_ahead[rows], seen)
        return np.where(seen > 0, share, np.nan)

    def noise(self, rows: np.ndarray) -> np.ndarray:
        """Per-tick variance of behind-less-ahead for a rank like this with no lateness."""
        seen = self.seen(rows)
        both = self.behind[rows].astype(np.int64) + self.ahead[rows]
        out: np.ndarray = np.where(seen > 0, both / np.maximum(seen, 1), 0.0)
        return out


def _level(code: np.ndarray) -> np.ndarray:
    """The level push on the counters `code` measured."""
    out: np.ndarray = np.where((code >> 2) != _S_NONE, np.uint8(_S_LEVEL << 2), np.uint8(_LEVEL))
    return out


def _slot(push: np.ndarray) -> np.ndarray:
    """The window slot of push number `push` (an int16, as `slot`)."""
    out: np.ndarray = (push % WINDOW_TICKS).astype(np.int16)
    return out


def _hit(code: np.ndarray) -> np.ndarray:
    """Behind on either counter."""
    out: np.ndarray = ((code & 3) == _BEHIND) | ((code >> 2) == _S_BEHIND)
    return out


def _share(behind: np.ndarray, ahead: np.ndarray, seen: np.ndarray) -> np.ndarray:
    diff = behind.astype(np.int64) - ahead
    out: np.ndarray = np.where(seen > 0, np.maximum(0.0, diff / np.maximum(seen, 1)), 0.0)
    return out


class GroupHistory:
    """Per group of one job: its recent scored ticks (a ring of RATE_TICKS + 1
    (median instant, median enqueued counter)) and its rate."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.ids: dict[str, int] = {}
        g = _FIRST_GROUPS
        self.hist_at = np.zeros((g, _HIST), np.float64)  # ns since the job's epoch
        self.hist_med = np.zeros((g, _HIST), np.float64)
        self.hist_len = np.zeros(g, np.int64)
        self.hist_head = np.zeros(g, np.int64)
        self.rate = np.zeros(g, np.float64)  # collectives per second, as last measured

    def gid(self, name: str) -> int:
        gid = self.ids.get(name)
        if gid is None:
            gid = self.ids[name] = len(self.names)
            self.names.append(name)
            n = len(self.names)
            self.hist_at = _grown(self.hist_at, n)
            self.hist_med = _grown(self.hist_med, n)
            self.hist_len = _grown(self.hist_len, n)
            self.hist_head = _grown(self.hist_head, n)
            self.rate = _grown(self.rate, n)
        return gid

    def step(
        self, gids: np.ndarray, at: np.ndarray, med: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """A scored tick for groups `gids`: their median instant (ns since the
        job's epoch) and median enqueued counter. Returns each one's rate
        over its recent ticks (0 where none moved it: steps longer than a
        tick still give a rate, not a run of zeros) and whether it is idle
        (its median unchanged over IDLE_TICKS)."""
        hl, head = self.hist_len[gids], self.hist_head[gids]
        oldest = (head - hl) % _HIST
        at0 = self.hist_at[gids, oldest]
        e0 = self.hist_med[gids, oldest]
        moving = (hl > 0) & (at > at0)
        rate = np.where(moving, (med - e0) / np.where(moving, (at - at0) / 1e9, 1.0), 0.0)
        idle = (hl >= IDLE_TICKS) & (self.hist_med[gids, (head - IDLE_TICKS) % _HIST] == med)
        self.hist_at[gids, head] = at
        self.hist_med[gids, head] = med
        self.hist_head[gids] = (head + 1) % _HIST
        self.hist_len[gids] = np.minimum(hl + 1, _HIST)
        return rate, idle


# A reading's instant for a rank not read at this tick (another tick, or not filed).
NOT_THIS_TICK: Final = 1 << 62


@dataclass
class TickReadings:
    """One tick's readings as they arrived: a report is filed in a few µs,
    and all of a tick's are unpacked together by the scorer (numpy's cost per
    call is per report otherwise: 41 µs a rank report measured, against 11
    for the Python objects it replaced).

    A columns report is filed as what scoring reads of it, copied out (the
    report is a part of its relay's ProgressBatch, and a part keeps the whole
    batch's parse alive, protobuf's arena that tracemalloc does not see),
    onto the tick's own columns: its counts appended to one buffer, its few
    numbers to arrays, its agent's layout and group table by reference. As a
    tuple and bytes objects a report, three ticks of filed reports were 298
    bytes a rank at 4,096 ranks; so, 211 (benchmarks/ingest_path.py)."""

    seq: int = 0  # arrival order: a (group, rank) given twice, the later stands
    # Per columns report: its seq, the tick's instant on its agent's clock,
    # its clock error bound, whether its started counts were its enqueued
    # ones (read between collectives: not stored twice), its agent's group
    # table as gids, and its rank, cell_rank and cell_group bytes
    # (Columns.packed_layout: the same objects report after report).
    c_seq: array[int] = field(default_factory=lambda: array("q"))
    c_base: array[int] = field(default_factory=lambda: array("q"))
    c_err: array[int] = field(default_factory=lambda: array("q"))
    c_same: array[int] = field(default_factory=lambda: array("B"))
    c_tables: list[np.ndarray] = field(default_factory=list)
    c_layouts: list[tuple[bytes, bytes, bytes]] = field(default_factory=list)
    # Their cells' last_enqueued and (where not the same) last_started, and
    # their ranks' status_at_ns, int64, report after report.
    c_enqueued: bytearray = field(default_factory=bytearray)
    c_started: bytearray = field(default_factory=bytearray)
    c_status_at: bytearray = field(default_factory=bytearray)
    # Report index -> each rank's status_at_ns, 0 for those not read at this
    # tick: where a report's ranks were read at more than one.
    c_only: dict[int, list[int]] = field(default_factory=dict)
    # Per-rank reports: seq, gid, rank, instant less the tick's, enqueued, started, error.
    messages: list[tuple[int, int, int, int, int, int, int]] = field(default_factory=list)

    def add(
        self,
        table: np.ndarray,
        base: int,
        req: pb.ProgressReport,
        layout: tuple[bytes, bytes, bytes],
        status_at: list[int] | None = None,
    ) -> None:
        """A report whose columns were checked (progress_columns.decode),
        `layout` its rank, cell_rank and cell_group bytes as decode read them
        (`Columns.packed_layout`), or equal bytes the caller already holds."""
        cells, ranks = len(layout[1]) // 2, len(layout[0]) // 4
        c = req.columns
        counts = c.cell_counts  # read once: each read of a bytes field is a copy of it all
        enqueued = progress_columns.count_column(counts, progress_columns.LAST_ENQUEUED, cells)
        started = progress_columns.count_column(counts, progress_columns.LAST_STARTED, cells)
        same = started == enqueued
        if status_at is not None:
            self.c_only[len(self.c_seq)] = status_at
        self.c_seq.append(self.seq)
        self.c_base.append(base)
        self.c_err.append(req.clock_error_ns)
        self.c_same.append(same)
        self.c_tables.append(table)
        self.c_layouts.append(layout)
        self.c_enqueued += enqueued
        if not same:
            self.c_started += started
        self.c_status_at += progress_columns.count_column(
            c.rank_counts, progress_columns.STATUS_AT, ranks
        )
        self.seq += 1

    def add_message(
        self, gid: int, rank: int, at: int, enqueued: int, started: int, err_ns: int
    ) -> None:
        """One (group, rank) of a per-rank report; `at` less the tick's instant."""
        self.messages.append((self.seq, gid, rank, at, enqueued, started, err_ns))
        self.seq += 1

    def readings(self) -> tuple[np.ndarray, ...]:
        """(seq, gid, rank, at, enqueued, started, err) of every reading, as arrays."""
        parts = [self._from_columns()] if self.c_seq else []
        if self.messages:
            parts.append(tuple(np.array(col, np.int64) for col in zip(*self.messages, strict=True)))
        if not parts:
            return tuple(np.zeros(0, np.int64) for _ in range(7))
        return tuple(np.concatenate(col) for col in zip(*parts, strict=True))

    def _from_columns(self) -> tuple[np.ndarray, ...]:
        layouts, tables = self.c_layouts, self.c_tables
        n_cells = np.array([len(lay[1]) // 2 for lay in layouts], np.int64)
        n_ranks = np.array([len(lay[0]) // 4 for lay in layouts], np.int64)
        n_groups = np.array([len(t) for t in tables], np.int64)
        first_rank = np.cumsum(n_ranks) - n_ranks
        # Each cell's rank, as an index into all the reports' ranks.
        rank_i = np.frombuffer(b"".join(lay[1] for lay in layouts), "<u2").astype(np.int64)
        rank_i += np.repeat(first_rank, n_cells)
        group_i = np.frombuffer(b"".join(lay[2] for lay in layouts), "<u4").astype(np.int64)
        known = group_i < np.repeat(n_groups, n_cells)
        group_i = np.where(known, group_i, 0) + np.repeat(np.cumsum(n_groups) - n_groups, n_cells)
        table = np.concatenate([*tables, np.zeros(1, np.int64)])
        ranks = np.frombuffer(b"".join(lay[0] for lay in layouts), "<i4").astype(np.int64)
        at = np.frombuffer(self.c_status_at, "<i8").copy()
        for k, only in self.c_only.items():  # some of its ranks belong to another tick
            at[first_rank[k] : first_rank[k] + n_ranks[k]] = only
        instant = np.repeat(np.frombuffer(self.c_base, np.int64), n_ranks)
        at = np.where(at != 0, at - instant, NOT_THIS_TICK)
        enqueued = np.frombuffer(self.c_enqueued, "<i8")
        started = enqueued
        if self.c_started:
            started = enqueued.copy()
            differ = np.repeat(np.frombuffer(self.c_same, np.uint8) == 0, n_cells)
            started[differ] = np.frombuffer(self.c_started, "<i8")
        return (
            np.repeat(np.frombuffer(self.c_seq, np.int64), n_cells),
            np.where(known, table[group_i], -1),
            ranks[rank_i],
            at[rank_i],
            enqueued,
            started,
            np.repeat(np.frombuffer(self.c_err, np.int64), n_cells),
        )


def group_medians_int(gid: np.ndarray, values: np.ndarray, count: np.ndarray) -> np.ndarray:
    """`group_medians` of integers, sorted as one int64 key (group above the
    value): a plain sort, 9x faster than the lexsort at 24,576 readings."""
    if not len(values):
        return np.full(len(count), np.nan)
    lo = int(values.min())
    if int(values.max()) - lo >= 1 << _VALUE_BITS or len(count) >= 1 << (63 - _VALUE_BITS):
        return group_medians(gid, values.astype(np.float64), count)
    key = np.sort((gid.astype(np.int64) << _VALUE_BITS) | (values - lo))
    return _medians_of_sorted(((key & ((1 << _VALUE_BITS) - 1)) + lo).astype(np.float64), count)


def group_medians(gid: np.ndarray, values: np.ndarray, count: np.ndarray) -> np.ndarray:
    """Per group (index = gid), the median of its `values` (statistics.median's:
    the mean of the two middle ones for an even count); NaN for a group with none."""
    return _medians_of_sorted(values[np.lexsort((values, gid))], count)


def _medians_of_sorted(v: np.ndarray, count: np.ndarray) -> np.ndarray:
    """Per group, the median of `v`: sorted by group, then value; `count` a group."""
    starts = np.cumsum(count) - count
    has = count > 0
    lo = starts + np.maximum(count - 1, 0) // 2
    hi = starts + count // 2
    out = np.full(len(count), np.nan)
    out[has] = (v[lo[has]] + v[hi[has]]) / 2
    return out


def medians_without(group: np.ndarray, values: np.ndarray, pick: np.ndarray) -> np.ndarray:
    """For each member `pick` (indices into `values`), the median of its group's
    values with its own left out: statistics.median of the rest, for every
    group at once (each group with two members or more)."""
    order = np.lexsort((values, group))
    v, g = values[order], group[order]
    n = len(v)
    idx = np.arange(n)
    where = np.empty(n, np.int64)
    where[order] = idx  # each member's place in the sorted order
    new_group = np.ones(n, bool)
    new_group[1:] = g[1:] != g[:-1]
    # The first of a run of equal values: where bisect_left would put the value.
    new_run = new_group.copy()
    new_run[1:] |= v[1:] != v[:-1]
    group_start = np.maximum.accumulate(np.where(new_group, idx, 0))
    run_start = np.maximum.accumulate(np.where(new_run, idx, 0))
    at = where[pick]
    start = group_start[at]
    k = run_start[at] - start
    m = np.bincount(g)[g[at]] - 1  # the others
    hi = m // 2
    lo = np.maximum(hi - 1, 0)
    v_hi = v[start + hi + (hi >= k)]
    v_lo = v[start + lo + (lo >= k)]
    out: np.ndarray = np.where(m % 2 == 1, v_hi, (v_lo + v_hi) / 2)
    return out
