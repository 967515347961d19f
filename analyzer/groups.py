"""Process groups: which group each rank's local pg_id is, and who the members are.

A rank's pg_status is keyed by its local pg_id, a counter of the groups that
rank belongs to; entries, bundle metadata and creation order tie those ids to
the global group names. Membership comes from the best source there is, and
each group says which one (`GroupMeta.membership_source`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
from hangwatch.analyzer.decode import ParsedDump

from hangwatch import formats
from hangwatch.formats import RankMeta


@dataclass(frozen=True, kw_only=True)
class PgStatus:
    last_enqueued: int
    last_started: int
    last_completed: int
    pg_id: int
    # How the local pg_id was tied to a group name: "entries", "bundle",
    # "creation-order" (see map_pg_ids) or "default" (pg 0 is group "0").
    mapped_by: str


@dataclass(frozen=True, kw_only=True)
class GroupMeta:
    name: str
    desc: str
    ranks: list[int]
    # "pg_config" | "bundle" | "world_size" | "inferred" (every rank of the
    # world left its complete history: a rank that never mentions the group
    # is not in it) | "dumps" (only who was seen: other members may exist)
    membership_source: str


def map_pg_ids(
    rank: int,
    parsed: ParsedDump,
    entry_map: dict[int, str],
    meta: RankMeta | None,
    digit_names: set[str],
    *,
    instance: str = "",
) -> tuple[dict[str, PgStatus], list[int]]:
    """Tie each local pg_id in pg_status to a group name.

    Evidence, strongest first: the rank's own entries (pg_id next to
    process_group), the agent's bundle metadata, then creation order. Every
    rank calls new_group for every group, so default group names ("0", "1",
    ...) are a global creation counter, while a rank's local pg_ids count only
    the groups it is a member of: the map is order-preserving. Between two
    known (pg_id, name) anchors, unmapped pg_ids are assigned only when
    exactly as many candidate names fall in between: first the rank's own
    pg_config names (NCCL lists the groups it belongs to), then every group
    name any dump mentions (gloo's pg_config is empty).
    """
    mapping: dict[int, tuple[str, str]] = {pid: (g, "entries") for pid, g in entry_map.items()}
    recs = meta.recorders if meta is not None else ()
    rec = next((x for x in recs if x.instance == instance), None) if instance else None
    if rec is not None:
        # The agent recorded this instance's own numbering: pg_id == index.
        for pid, name in enumerate(rec.groups):
            mapping.setdefault(pid, (name, "bundle"))
    elif meta is not None and (not instance or instance == formats.GENERIC_INSTANCE or not recs):
        for gi in meta.groups:
            if gi.pg_id is not None:
                mapping.setdefault(gi.pg_id, (gi.name, "bundle"))
    ids = sorted(int(k) for k in parsed.pg_status)
    if 0 in ids and 0 not in mapping and "0" not in {g for g, _ in mapping.values()}:
        mapping[0] = ("0", "default")  # the default group is always local pg 0, named "0"
    own = {n for n in parsed.pg_config if n.isdigit()}
    for names in (own, digit_names):
        if any(pid not in mapping for pid in ids) and names:
            _order_fill(ids, mapping, names)
    out: dict[str, PgStatus] = {}
    unmapped: list[int] = []
    for pid in ids:
        enq, started, comp = parsed.pg_status[str(pid)]
        if pid not in mapping:
            unmapped.append(pid)
            continue
        g, how = mapping[pid]
        out[g] = PgStatus(
            last_enqueued=enq, last_started=started, last_completed=comp, pg_id=pid, mapped_by=how
        )
    return out, unmapped


def _order_fill(ids: list[int], mapping: dict[int, tuple[str, str]], names: set[str]) -> None:
    anchors = sorted((pid, int(g)) for pid, (g, _) in mapping.items() if g.isdigit())
    if any(b[1] <= a[1] for a, b in itertools.pairwise(anchors)):
        return  # names not in creation order: the assumption does not hold here
    used = {int(g) for g, _ in mapping.values() if g.isdigit()}
    cand = sorted(int(n) for n in names if int(n) not in used)
    bounds = [(-1, -1), *anchors, (1 << 62, 1 << 62)]
    for (p_lo, n_lo), (p_hi, n_hi) in itertools.pairwise(bounds):
        todo = [pid for pid in ids if p_lo < pid < p_hi and pid not in mapping]
        fit = [n for n in cand if n_lo < n < n_hi]
        if todo and len(todo) == len(fit):
            for pid, n in zip(todo, fit, strict=True):
                mapping[pid] = (str(n), "creation-order")


def build_groups(
    *,
    entries: pd.DataFrame,
    pg_status: dict[int, dict[str, PgStatus]],
    pg_config: dict[int, dict[str, dict[str, Any]]],
    rank_meta: dict[int, RankMeta],
    world_size: int | None,
    complete_ranks: set[int] | None = None,
) -> dict[str, GroupMeta]:
    """Group membership by name: pg_config, else bundle metadata, else the
    dumps that mention the group, else (default group only) --world-size.

    `complete_ranks`: ranks whose dumps hold their whole history (from the
    first record, nothing wrapped or cut) and name every group of their
    pg_status. When those are the whole world, the dumps that mention a
    group are all its members: "inferred", not just "seen".
    """
    desc: dict[str, str] = {}
    from_cfg: dict[str, list[int]] = {}
    for r, cfg in pg_config.items():
        for name, c in cfg.items():
            if c.get("desc"):
                desc.setdefault(name, c["desc"])
            # A member's own config must list it: torch 2.15's gloo writes a
            # subgroup's group-local ranks ('[0, 1]' for a group {2, 3}).
            if c.get("ranks") and r in c["ranks"]:
                from_cfg.setdefault(name, c["ranks"])
    from_meta: dict[str, set[int]] = {}
    # The same member list arrives from every member's meta.json: fold each
    # distinct list in once (list == list runs in C; set.update per int does not).
    seen_lists: dict[str, Sequence[int]] = {}
    for r, meta in rank_meta.items():
        for gi in meta.groups:
            name = gi.name
            if gi.desc:
                desc.setdefault(name, gi.desc)
            s = from_meta.setdefault(name, set())
            s.add(r)
            # A range (the compact form) compares in O(1), a list in C.
            if seen_lists.get(name) != gi.ranks:
                seen_lists[name] = gi.ranks
                s.update(gi.ranks)
    from_dumps: dict[str, set[int]] = {}
    if len(entries):
        pairs = entries[["group", "rank"]].drop_duplicates()
        # One sort and slices of one array: a sub-frame per group cost 0.08 s
        # for 1,569 groups at 4,096 ranks.
        codes, names = pd.factorize(pairs["group"])
        order = np.argsort(codes, kind="stable")
        codes, ranks = codes[order], pairs["rank"].to_numpy()[order]
        starts = np.flatnonzero(np.r_[True, codes[1:] != codes[:-1]]) if len(codes) else codes
        for lo, hi in itertools.pairwise([*starts.tolist(), len(codes)]):
            if codes[lo] >= 0:  # -1: no group (groupby drops it too)
                from_dumps.setdefault(str(names[codes[lo]]), set()).update(ranks[lo:hi].tolist())
        dpairs = entries[["group", "group_desc"]].drop_duplicates()
        for g, d in zip(dpairs["group"], dpairs["group_desc"], strict=True):
            if d:
                desc.setdefault(str(g), str(d))
    for r, d in pg_status.items():
        for g in d:
            from_dumps.setdefault(g, set()).add(r)
    out: dict[str, GroupMeta] = {}
    world_complete = bool(world_size) and set(range(world_size or 0)) <= (complete_ranks or set())
    names = set(from_cfg) | set(from_meta) | set(from_dumps)
    if world_size:
        names.add("0")
    for name in sorted(names, key=lambda n: (not n.isdigit(), int(n) if n.isdigit() else 0, n)):
        if name in from_cfg:
            ranks, src = from_cfg[name], "pg_config"
        elif name in from_meta:
            ranks, src = sorted(from_meta[name]), "bundle"
        elif name == "0" and world_size:
            ranks, src = list(range(world_size)), "world_size"
        else:
            ranks, src = sorted(from_dumps.get(name, set())), "dumps"
        if name == "0" and world_size and src == "dumps":
            ranks, src = list(range(world_size)), "world_size"
        if src == "dumps" and world_complete:
            src = "inferred"
        out[name] = GroupMeta(
            name=name,
            desc=desc.get(name, "default_pg" if name == "0" else ""),
            ranks=list(ranks),
            membership_source=src,
        )
    return out
