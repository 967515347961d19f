"""Per (rank, group) progress, reconciled from FR entries and pg_status.

Two sequence spaces live in one group: collectives count `collective_seq_id`,
point-to-point ops count `p2p_seq_id`, and torch's `pg_status` reports the
seq of whichever *work* was enqueued/completed last, so in a group that
carries p2p traffic (Megatron's pipeline groups, the default group) its
numbers can be either kind. Measured on real NCCL dumps: a PIPELINE group
with `collective_seq_id` 29 reports `last_enqueued_collective` 14000 (its
p2p counter). Hence:

* in a group where no dump records a p2p op ("clean"), pg_status is a
  collective counter and is trusted as such;
* in a "mixed" group, a pg_status value above every collective seq seen in
  that group is a p2p counter; anything else is ambiguous and unused.

Entries add exact knowledge: the newest entry a rank holds for a group
carries that rank's collective counter at the time (p2p entries carry it
too), and a ring buffer evicts oldest first, so "the newest entry I hold
for g has collective seq c" proves the rank never enqueued a collective
above c in g, however much of its history fell out of the buffer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
from hangwatch.analyzer.loader import LoadedDumps


@dataclass(kw_only=True)
class Progress:
    # index (rank, group); columns: coll_enq, coll_comp, p2p_enq, p2p_comp,
    # coll_blocked (first collective seq entered and not completed, NaN if none).
    # NaN = unknown.
    table: pd.DataFrame
    mixed_groups: set[str]
    coll_max: dict[str, int]  # highest collective seq any dump shows per group


def done_mask(entries: pd.DataFrame) -> np.ndarray:
    """An entry is known finished when torch retired it or saw it complete."""
    return np.asarray(entries["retired"].to_numpy() | (entries["state"] == "completed").to_numpy())


def _group_codes(E: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """Integer group codes per row and the group name of each code.

    Grouping by (rank, categorical group) breaks once the categorical's codes
    widen past int8 (about 127 group names: pandas then mixes int8 and int16
    codes across partial results), so aggregation keys are plain integers.
    """
    g = E["group"]
    cat = g.array if isinstance(g.dtype, pd.CategoricalDtype) else pd.Categorical(g.astype(str))
    codes = np.asarray(cat.codes, dtype=np.int64)
    names = np.asarray([str(c) for c in cat.categories], dtype=object)
    return codes, names


def compute_progress(loaded: LoadedDumps, entries: pd.DataFrame) -> Progress:
    E = entries
    done = done_mask(E)
    keys = ["rank", "group"]
    p2p = E["is_p2p"].to_numpy()
    gcode, gnames = _group_codes(E)
    n_groups = max(len(gnames), 1)
    mixed = {str(gnames[c]) for c in np.unique(gcode[p2p])} if p2p.any() else set()
    cseq = E["collective_seq_id"].to_numpy()
    coll_max: dict[str, int] = {}
    if len(E):
        hi = np.full(n_groups, np.iinfo(np.int64).min, dtype=np.int64)
        np.maximum.at(hi, gcode, cseq)
        coll_max = {str(gnames[c]): int(hi[c]) for c in np.unique(gcode)}

    # One integer key per (rank, group) and one group-by for all five
    # aggregates; rows outside an aggregate's mask are NaN, which max/min skip.
    key = E["rank"].to_numpy().astype(np.int64) * n_groups + gcode
    cs = cseq.astype(np.float64)
    ps = E["p2p_seq_id"].to_numpy().astype(np.float64)
    nan = np.float64(np.nan)
    A = pd.DataFrame(
        {
            "ent_coll_hi": cs,
            "ent_coll_done": np.where(~p2p & done, cs, nan),
            "ent_coll_open": np.where(~p2p & ~done, cs, nan),
            "ent_p2p_hi": np.where(p2p, ps, nan),
            "ent_p2p_done": np.where(p2p & done, ps, nan),
        }
    )
    T = A.groupby(key, sort=True).agg(
        {
            "ent_coll_hi": "max",
            "ent_coll_done": "max",
            "ent_coll_open": "min",
            "ent_p2p_hi": "max",
            "ent_p2p_done": "max",
        }
    )
    k = T.index.to_numpy().astype(np.int64)
    T.index = pd.MultiIndex.from_arrays([k // n_groups, gnames[k % n_groups]], names=keys)
    S = loaded.pg_status_frame()
    if len(S):
        S["group"] = S["group"].astype(str)
        S = S.set_index(keys)[["last_enqueued", "last_completed"]].astype(np.float64)
    else:
        S = pd.DataFrame(
            {"last_enqueued": [], "last_completed": []},
            index=pd.MultiIndex.from_tuples([], names=keys),
        )
    T = T.join(S, how="outer") if len(T) or len(S) else T.reindex(columns=[*T.columns, *S.columns])
    for c in (
        "ent_coll_hi",
        "ent_coll_done",
        "ent_coll_open",
        "ent_p2p_hi",
        "ent_p2p_done",
        "last_enqueued",
        "last_completed",
    ):
        if c not in T.columns:
            T[c] = np.nan

    groups = T.index.get_level_values("group")
    is_mixed = np.asarray(groups.isin(list(mixed)))
    gmax = np.asarray(groups.map(lambda g: coll_max.get(g, -1)), dtype=np.float64)
    enq = T["last_enqueued"].to_numpy()
    comp = T["last_completed"].to_numpy()
    # pg_status counters: collective counters in clean groups; in mixed groups
    # only values above every collective seq seen are (unambiguously) p2p.
    st_coll_enq = np.where(~is_mixed, enq, np.nan)
    st_coll_comp = np.where(~is_mixed, comp, np.nan)
    st_p2p_enq = np.where(is_mixed & (enq > gmax + 1), enq, np.nan)
    st_p2p_comp = np.where(is_mixed & (comp > gmax + 1), comp, np.nan)

    out = pd.DataFrame(index=T.index)
    out["coll_enq"] = np.fmax(np.fmax(T["ent_coll_hi"].to_numpy(), st_coll_enq), st_coll_comp)
    out["coll_comp"] = np.fmax(T["ent_coll_done"].to_numpy(), st_coll_comp)
    out["p2p_enq"] = np.fmax(T["ent_p2p_hi"].to_numpy(), st_p2p_enq)
    out["p2p_comp"] = np.fmax(T["ent_p2p_done"].to_numpy(), st_p2p_comp)

    # First collective this rank entered and has not finished: the oldest open
    # entry above what is known complete; with no entry (status-only dumps),
    # the one after pg_status's last completed when more was enqueued.
    comp_known = np.nan_to_num(out["coll_comp"].to_numpy(), nan=-1.0)
    open_min = _open_after(E, p2p, done, T.index, comp_known)
    from_status = np.where(
        ~is_mixed & (np.nan_to_num(enq, nan=-1.0) > np.nan_to_num(comp, nan=-1.0)),
        np.nan_to_num(comp, nan=-1.0) + 1,
        np.nan,
    )
    out["coll_blocked"] = np.where(np.isnan(open_min), from_status, open_min)
    _assume_entered_means_done(out, loaded.completion_unknown_groups)
    return Progress(table=out, mixed_groups=mixed, coll_max=coll_max)


def _assume_entered_means_done(out: pd.DataFrame, groups: set[str]) -> None:
    """Groups whose recorder records no completion (torch's FlightRecorderHook on
    an asynchronous backend): only what each rank entered is known.

    A collective every member with a dump entered is taken as finished, except
    the newest one they all entered when nobody went further: that may be the
    one they are all stuck in. A rank behind the rest is then "not entered" in
    the collective the others wait in, exactly as in a gloo dump; a hang
    inside a collective everyone entered stays undecided (the verdict says so).
    """
    if not groups or not len(out):
        return
    gidx = np.asarray(out.index.get_level_values("group").astype(str))
    for g in groups:
        m = gidx == g
        enq = out.loc[m, "coll_enq"].to_numpy()
        if not m.any() or np.isnan(enq).all():
            continue
        lo, hi = np.nanmin(enq), np.nanmax(enq)
        if hi > lo:
            out.loc[m, "coll_comp"] = lo
            out.loc[m, "coll_blocked"] = np.where(enq > lo, lo + 1, np.nan)
        else:
            out.loc[m, "coll_comp"] = lo - 1
            out.loc[m, "coll_blocked"] = np.where(np.isnan(enq), np.nan, lo)


def _open_after(
    E: pd.DataFrame, p2p: np.ndarray, done: np.ndarray, index: pd.MultiIndex, comp_known: np.ndarray
) -> np.ndarray:
    """Lowest collective seq per (rank, group) that is not done and above comp_known."""
    mask = ~p2p & ~done
    if not mask.any():
        return np.full(len(index), np.nan)
    sub = E.loc[mask, ["rank", "group", "collective_seq_id"]].copy()
    sub["group"] = sub["group"].astype(str)
    ck = pd.Series(comp_known, index=index, name="ck")
    sub = sub.join(ck, on=["rank", "group"])
    sub = sub[sub["collective_seq_id"] > sub["ck"].fillna(-1)]
    s = sub.groupby(["rank", "group"])["collective_seq_id"].min().astype(np.float64)
    return s.reindex(index).to_numpy()
