"""Who waits on whom: the blocked collectives and p2p ops, and the ranks they wait on.

* A rank is *blocked* in group g at collective seq s when it entered s and
  has not finished it (its oldest open collective in g), or at a p2p op it
  posted and that has not finished.
* A blocked rank *waits on* each member of g whose last enqueued collective
  is below s (it never entered s), and each member with no dump at all. For
  p2p, it waits on its peer when the peer's p2p counter in g is below the
  op's p2p seq. Ranks that merely have collectives still scheduled are not
  culprits when they have enqueued *beyond* s: that is how NCCL runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import pandas as pd
from hangwatch.analyzer.progress import done_mask
from hangwatch.analyzer.scope import Scope


@dataclass(kw_only=True)
class Wait:
    """Some ranks blocked at one (group, seq) waiting on some targets."""

    group: str
    seq: int
    kind: str  # "collective" | "p2p"
    waiters: set[int]
    targets: set[int]
    op: str = ""
    profiling_name: str = ""
    oldest_ns: int = 0  # earliest creation time of the waiters' entries (0: unknown)
    detail: dict[int, set[int]] = field(default_factory=dict)  # p2p: waiter -> peers
    # The targets entered (g, seq) too; their side is queued behind their own
    # older unfinished work (streams.stream_waits).
    queued: bool = False
    # The targets are members without a dump, taken as the targets only
    # because no member with a dump is behind: the weakest evidence.
    on_missing: bool = False


OTHER_SIDE = {"send": "recv", "recv": "send"}


def p2p_wait(
    group: Any, seq: Any, rows: pd.DataFrame, *, profiling_name: str, oldest_ns: int = 0
) -> Wait:
    """The p2p wait of `rows`: one pending entry per row, each waiter's peer in
    column "peer", all at (`group`, p2p `seq`)."""
    w = Wait(
        group=str(group),
        seq=int(seq),
        kind="p2p",
        waiters={int(r) for r in rows["rank"]},
        targets={int(p) for p in rows["peer"]},
        op=str(rows["op"].iloc[0]),
        profiling_name=profiling_name,
        oldest_ns=oldest_ns,
    )
    for r, p in zip(rows["rank"], rows["peer"], strict=True):
        w.detail.setdefault(int(r), set()).add(int(p))
    return w


class Unmatched(NamedTuple):
    """A p2p op whose peer has not posted its side."""

    peer: int
    waiter: int
    group: str
    seq: int  # p2p seq
    name: str  # the waiter's profiling name


@dataclass(kw_only=True)
class P2pWaits:
    waits: list[Wait]
    unmatched: list[Unmatched]
    # Every rank with a p2p op not known finished: "blocked", for telling
    # roots in flight from ranks stuck outside any collective.
    blocked: set[int]


def collective_waits(scope: Scope) -> list[Wait]:
    blocked = scope.progress.table["coll_blocked"].dropna()
    if not len(blocked):
        return []
    enq = scope.tab("coll_enq")
    first_entry = _first_entry_info(
        scope.entries, {(str(g), int(v)) for (_, g), v in blocked.items()}
    )
    waits: list[Wait] = []
    for (g, s), sub in blocked.groupby([blocked.index.get_level_values("group"), blocked]):
        g = str(g)
        s = int(s)
        meta = scope.groups.get(g)
        members = set(meta.ranks) if meta else set()
        waiters = {int(r) for r in sub.index.get_level_values("rank")}
        e = enq.get(g, pd.Series(dtype=np.float64))
        known = e.reindex(sorted(members - waiters))
        behind = {int(r) for r, v in known.items() if not np.isnan(v) and v < s}
        missing = {r for r in members if r not in scope.dumped and r in scope.universe}
        # Ranks outside --selected-ranks are unknown, not missing. A rank
        # with no dump (absent, unreadable, its agent unreachable) proves
        # nothing: it is blamed only when no member with a dump explains
        # the wait, never beside a rank the dumps show never entered.
        targets = behind if behind else missing
        info = first_entry.get((g, s), {})
        waits.append(
            Wait(
                group=g,
                seq=s,
                kind="collective",
                waiters=waiters,
                targets=targets - waiters,
                op=info.get("op", ""),
                profiling_name=info.get("profiling_name", ""),
                oldest_ns=info.get("oldest_ns", 0),
                on_missing=not behind and bool(targets - waiters),
            )
        )
    return waits


def _first_entry_info(
    E: pd.DataFrame, keys: set[tuple[str, int]]
) -> dict[tuple[str, int], dict[str, Any]]:
    """Op name and oldest creation time of the collectives some rank is blocked in."""
    if not keys or not len(E):
        return {}
    seqs = np.fromiter((s for _, s in keys), dtype=np.int64)
    m = ~E["is_p2p"].to_numpy() & np.isin(E["collective_seq_id"].to_numpy(), seqs)
    coll = E.loc[m, ["group", "collective_seq_id", "op", "profiling_name", "time_created_ns"]]
    coll = coll.assign(group=coll["group"].astype(str))
    coll = coll.loc[[k in keys for k in zip(coll["group"], coll["collective_seq_id"], strict=True)]]
    if not len(coll):
        return {}
    tc = coll["time_created_ns"].where(coll["time_created_ns"] > 0)
    agg = (
        coll.assign(
            tc=tc, op=coll["op"].astype(str), profiling_name=coll["profiling_name"].astype(str)
        )
        .groupby(["group", "collective_seq_id"])
        .agg(
            op=("op", "first"),
            profiling_name=("profiling_name", "first"),
            oldest_ns=("tc", "min"),
        )
    )
    out: dict[tuple[str, int], dict[str, Any]] = {}
    for g, s, op, name, t in zip(
        agg.index.get_level_values(0),
        agg.index.get_level_values(1),
        agg["op"],
        agg["profiling_name"],
        agg["oldest_ns"],
        strict=True,
    ):
        out[(str(g), int(s))] = {
            "op": op,
            "profiling_name": name,
            "oldest_ns": int(t) if not pd.isna(t) else 0,
        }
    return out


def global_peers(scope: Scope, sub: pd.DataFrame) -> np.ndarray:
    """Each p2p row's peer as a global rank (-1: a collective, or membership not exact).

    `sub` has str `group` and `op` columns; FR writes peers group-local.
    """
    op = sub["op"].to_numpy()
    peer_local = np.where(op == "recv", sub["peer_src"].to_numpy(), sub["peer_dst"].to_numpy())
    peer_global = np.full(len(sub), -1, dtype=np.int64)
    gcol = sub["group"].to_numpy()
    is_p2p = sub["is_p2p"].to_numpy() & np.isin(op, list(OTHER_SIDE))
    for g in pd.unique(gcol[is_p2p]):
        meta = scope.groups.get(g)
        if meta is None or (meta.membership_source == "dumps" and g != "0"):
            continue
        ranks = np.asarray(sorted(meta.ranks) if g != "0" or meta.ranks else [], dtype=np.int64)
        m = is_p2p & (gcol == g)
        loc = peer_local[m]
        ok = (loc >= 0) & (loc < len(ranks))
        glob = np.full(len(loc), -1, dtype=np.int64)
        glob[ok] = ranks[loc[ok]]
        peer_global[m] = glob
    return peer_global


def _pairwise(E: pd.DataFrame, scope: Scope, sub: pd.DataFrame) -> np.ndarray:
    """Per row of `sub`: the rank's p2p ops in the group (all it holds) are all
    with this peer, and the peer's with this rank only."""
    p2p = E.loc[E["is_p2p"].to_numpy(), ["rank", "group", "op", "peer_src", "peer_dst", "is_p2p"]]
    p2p = p2p.assign(group=p2p["group"].astype(str), op=p2p["op"].astype(str))
    p2p = p2p.assign(peer=global_peers(scope, p2p)).drop_duplicates(["rank", "group", "peer"])
    peers: dict[tuple[int, str], set[int]] = {}
    for r, g, q in zip(p2p["rank"], p2p["group"], p2p["peer"], strict=True):
        peers.setdefault((int(r), str(g)), set()).add(int(q))
    return np.fromiter(
        (
            peers.get((int(r), g), set()) == {int(q)} and peers.get((int(q), g), set()) <= {int(r)}
            for r, g, q in zip(sub["rank"], sub["group"], sub["peer"], strict=True)
        ),
        dtype=bool,
        count=len(sub),
    )


def p2p_waits(scope: Scope) -> P2pWaits:
    E = scope.entries
    P = scope.progress
    none = P2pWaits(waits=[], unmatched=[], blocked=set())
    p2p = E["is_p2p"].to_numpy()
    if not p2p.any():
        return none
    done = done_mask(E)
    sub = E.loc[
        p2p & ~done,
        [
            "rank",
            "group",
            "op",
            "profiling_name",
            "p2p_seq_id",
            "peer_src",
            "peer_dst",
            "time_created_ns",
            "is_p2p",
        ],
    ]
    sub = sub.assign(group=sub["group"].astype(str), op=sub["op"].astype(str))
    # Known complete through pg_status (a p2p-domain counter)?
    p2p_comp = P.table["p2p_comp"]
    ck = p2p_comp.reindex(pd.MultiIndex.from_arrays([sub["rank"], sub["group"]])).to_numpy()
    sub = sub.loc[~(sub["p2p_seq_id"].to_numpy() <= np.nan_to_num(ck, nan=-1))]
    if not len(sub):
        return none
    peer_global = global_peers(scope, sub)
    sub = sub.assign(peer=peer_global)
    sub = sub.loc[sub["peer"].to_numpy() >= 0]
    p2p_enq = P.table["p2p_enq"]
    pe = p2p_enq.reindex(pd.MultiIndex.from_arrays([sub["peer"], sub["group"]])).to_numpy()
    peer_dumped = sub["peer"].isin(list(scope.dumped)).to_numpy()
    peer_known_missing = ~peer_dumped & sub["peer"].isin(list(scope.universe)).to_numpy()
    # p2p seq ids count each rank's own ops in the group. Between two ranks
    # that talk only to each other there, they count the pair's ops and the
    # peer's counter says whether it posted its side; where either talks to
    # others too, a higher counter proves nothing, and a peer with its
    # matching op open has posted its side.
    pairwise = _pairwise(E, scope, sub)
    mine = set(zip(sub["rank"], sub["group"], sub["op"], sub["peer"], strict=True))
    posted = np.fromiter(
        (
            (p, g, OTHER_SIDE.get(o, ""), r) in mine
            for r, g, o, p in zip(sub["rank"], sub["group"], sub["op"], sub["peer"], strict=True)
        ),
        dtype=bool,
        count=len(sub),
    )
    behind = (
        peer_dumped
        & (pairwise | ~posted)
        & ~np.isnan(pe)
        & (np.nan_to_num(pe, nan=0) < sub["p2p_seq_id"].to_numpy())
    )
    # Waits on peers without a dump apart from the others: they are weaker
    # evidence (Wait.on_missing).
    blamed = sub.loc[behind | peer_known_missing].assign(
        nodump=peer_known_missing[behind | peer_known_missing]
    )
    waits: list[Wait] = []
    unmatched: list[Unmatched] = []
    for (g, k, _), grp in blamed.groupby(["group", "p2p_seq_id", "nodump"]):
        w = p2p_wait(
            g,
            k,
            grp,
            profiling_name=str(grp["profiling_name"].iloc[0]),
            oldest_ns=int(grp["time_created_ns"].min()),
        )
        w.targets -= w.waiters
        w.on_missing = bool(w.targets) and not w.targets & scope.dumped
        waits.append(w)
        for r, p, name in zip(grp["rank"], grp["peer"], grp["profiling_name"], strict=True):
            unmatched.append(Unmatched(int(p), int(r), str(g), int(k), str(name)))
    return P2pWaits(waits=waits, unmatched=unmatched, blocked={int(r) for r in sub["rank"]})
