"""Collectives every member entered and none finished: who entered last, and how long it stayed so.

Dumps are not one snapshot. torch's abort-hook dumps (2.15's default NCCL),
dump-on-timeout files and hangwatch's own are each written at their rank's
own moment. What the entries do say, whenever the dump was written:

* a collective cannot finish on any member before every member entered it;
  so when every member entered collective s and none finished it, the early
  ranks waited in it at least until the last one arrived;
* each entry's `time_created_ns` is when its rank entered. A rank that
  entered seconds after its peers (measured: 8.0 s, after its peers had
  timed out of it and NCCL's communicator was gone) is the one they waited
  for, even though its own dump shows it "in" the collective like everyone;
* when everyone entered together and it still never finished, FR holds no
  culprit: the fault is below it (network, GPU).

Clocks: `time_created_ns` is each host's wall clock. Ranks of one host share
it. Across hosts, the offsets the agents measured against the coordinator
(bundle metadata: `clock_offset_ns`, `clock_error_ns`) put every entry on the
coordinator's clock, within the sum of the two largest errors; without them,
the error bound is what NTP-synchronised clusters keep
(`UNMEASURED_CLOCK_ERROR_S`), and the finding says that clocks were not measured.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from hangwatch.analyzer.scope import Scope

# A rank counts as late when it entered this much after the last of the
# others, beyond the clock error: ranks leave the previous collective within
# milliseconds of each other, and step-to-step jitter on a loaded 2-core
# machine stays well under 0.1 s, so 1 s is a real delay, not noise.
LATE_MIN_S = 1.0
# Ranks on different hosts without measured offsets: NTP keeps a cluster's
# clocks within milliseconds; half a second is a wide margin.
UNMEASURED_CLOCK_ERROR_S = 0.5
# How long a collective every member entered may stay unfinished before the
# dumps count as showing it stuck, when its own timeout says less: CPU
# issue runs ahead of the GPU by a step or two, seconds, not a minute.
STUCK_AFTER_S = 60.0
# A file's write time this long after its newest entry is a copy's, not the dump's.
COPY_AFTER_S = 86400.0

CLOCKS_ONE_HOST = "one host"
CLOCKS_MEASURED = "measured offsets"
CLOCKS_UNMEASURED = "unmeasured"


@dataclass(frozen=True, kw_only=True)
class Arrival:
    """One collective that every member entered and none finished."""

    group: str
    seq: int
    op: str
    entered_ns: dict[int, int]  # member -> when it entered (its host's clock)
    late: list[int]  # members that entered conspicuously after the others
    lateness_s: float  # how long after the last on-time member the first late one entered
    clock_error_s: float  # the bound `late` had to exceed (besides LATE_MIN_S)
    clocks: str  # CLOCKS_ONE_HOST | CLOCKS_MEASURED | CLOCKS_UNMEASURED
    timeout_s: float | None  # the collective's own timeout, as FR recorded it
    # How long after the last member entered it was still unfinished on some
    # member, as the dumps' times show (None: no dump time is known).
    unfinished_s: float | None

    @property
    def stuck(self) -> bool:
        """The dumps show it unfinished long after everyone entered, or the
        late ones came after the others' own timeout had expired."""
        limit = min(STUCK_AFTER_S, self.timeout_s) if self.timeout_s else STUCK_AFTER_S
        if self.unfinished_s is not None and self.unfinished_s >= limit:
            return True
        return bool(self.late) and self.timeout_s is not None and self.lateness_s >= self.timeout_s


def entered_none_finished(scope: Scope) -> list[Arrival]:
    """Each group's collective that all members entered and none finished, oldest first.

    Only groups whose recorder records completion (a hook-recorded backend
    without completion hooks cannot tell finished from not) and whose every
    member left a dump.
    """
    E = scope.entries
    if not len(E):
        return []
    # Rows with a collective they are blocked in, per group: a group with
    # fewer than it has members cannot qualify, and is passed over without
    # a look at its members (3,105 groups at 8,192 ranks, most blocked in
    # nothing, cost 0.4 s one by one).
    blocked = scope.tab("coll_blocked")
    known = blocked.known()
    newest: dict[int, int] | None = None  # read once some group qualifies
    out: list[Arrival] = []
    for g, meta in scope.groups.items():
        if g in scope.loaded.completion_unknown_groups or g not in known:
            continue
        members = sorted(meta.ranks)
        if not members or known[g] < len(set(members)) or not set(members) <= scope.dumped:
            continue
        if newest is None:
            newest = _newest_ns(scope)
        # Arrays, not reindex: a reindex per group cost 0.1 s over 1,569 groups.
        col = blocked[g]
        mine = np.isin(col.index.to_numpy(), members)
        b = col.to_numpy()[mine]
        if len(b) != len(set(members)) or np.isnan(b).any() or len(set(b.tolist())) != 1:
            continue
        s = int(b[0])
        at = E.loc[
            (E["group"] == g).to_numpy()
            & ~E["is_p2p"].to_numpy()
            & (E["collective_seq_id"] == s).to_numpy()
        ]
        created = {int(r): int(t) for r, t in zip(at["rank"], at["time_created_ns"], strict=True)}
        if set(created) != set(members) or min(created.values()) <= 0:
            continue  # a member's entry is gone (wrapped) or carries no time
        out.append(_arrival(scope, g, s, at, created, newest))
    return sorted(out, key=lambda a: min(a.entered_ns.values()))


def _arrival(
    scope: Scope, g: str, s: int, at: object, created: dict[int, int], newest: dict[int, int]
) -> Arrival:
    import pandas as pd

    assert isinstance(at, pd.DataFrame)
    shifted, err, clocks = _on_one_clock(scope, created)
    # The dumps' own times, on the same clock as the entries.
    seen = [newest[r] + shifted[r] - t for r, t in created.items() if r in newest]
    created = shifted
    order = sorted(created, key=lambda r: created[r])
    times = [created[r] for r in order]
    gaps = np.diff(np.array(times, dtype=np.int64)) / 1e9
    late: list[int] = []
    lateness = 0.0
    if len(gaps):
        i = int(np.argmax(gaps))
        lateness = float(gaps[i])
        if lateness > LATE_MIN_S + err:
            late = sorted(order[i + 1 :])
    timeouts = at["timeout_ms"].to_numpy()
    timeouts = timeouts[timeouts > 0]
    last_in = max(times)
    return Arrival(
        group=g,
        seq=s,
        op=str(at.sort_values("record_id")["op"].iloc[-1]),
        entered_ns=created,
        late=late,
        lateness_s=lateness,
        clock_error_s=err,
        clocks=clocks,
        timeout_s=float(timeouts.min()) / 1000 if len(timeouts) else None,
        unfinished_s=(max(seen) - last_in) / 1e9 if seen else None,
    )


def _on_one_clock(scope: Scope, created: dict[int, int]) -> tuple[dict[int, int], float, str]:
    """Entry times made comparable: (times, error bound in s, how)."""
    meta = scope.loaded.rank_meta
    hosts = {meta[r].host if r in meta else None for r in created}
    if len(hosts) == 1 and None not in hosts:
        return created, 0.0, CLOCKS_ONE_HOST
    offsets = {r: meta[r].clock_offset_ns for r in created if r in meta}
    errors = {r: meta[r].clock_error_ns or 0 for r in created if r in meta}
    if len(offsets) == len(created) and all(v is not None for v in offsets.values()):
        shifted = {r: t + int(offsets[r] or 0) for r, t in created.items()}
        # Two ranks compared: each is off by at most its own error.
        worst = sorted(errors.values(), reverse=True)[:2]
        return shifted, sum(worst) / 1e9, CLOCKS_MEASURED
    return created, UNMEASURED_CLOCK_ERROR_S, CLOCKS_UNMEASURED


def _newest_ns(scope: Scope) -> dict[int, int]:
    """rank -> the latest moment its dump is known to have been taken after.

    Its newest timestamp of any kind, or the file's write time when that is
    later and plausible (not a copy made a day later).
    """
    E = scope.loaded.entries
    out: dict[int, int] = {}
    if len(E):
        ts = np.maximum(
            E["time_created_ns"].to_numpy(),
            np.maximum(
                E["time_discovered_started_ns"].to_numpy(),
                E["time_discovered_completed_ns"].to_numpy(),
            ),
        )
        # One sort, then a max per run of equal ranks: a mask over every row
        # per rank was 4,096 passes over 140,000 rows (0.27 s).
        ranks = E["rank"].to_numpy()
        order = np.argsort(ranks, kind="stable")
        uniq, start = np.unique(ranks[order], return_index=True)
        hi = np.maximum.reduceat(ts[order], start)
        out = dict(zip(uniq.tolist(), hi.tolist(), strict=True))
    for r, unix in scope.loaded.written_unix.items():
        w = int(unix * 1e9)
        if r in out and out[r] < w <= out[r] + int(COPY_AFTER_S * 1e9):
            out[r] = w
    return out
