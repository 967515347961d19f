"""From loaded dumps to a verdict: who everyone is waiting for, and on what.

The model
---------
* A rank is *blocked* in group g at collective seq s when it entered s and
  has not finished it (its oldest open collective in g), or at a p2p op it
  posted and that has not finished.
* A blocked rank *waits on* each member of g whose last enqueued collective
  is below s (it never entered s), and each member with no dump at all. For
  p2p, it waits on its peer when the peer's p2p counter in g is below the
  op's p2p seq. Ranks that merely have collectives still scheduled are not
  culprits when they have enqueued *beyond* s: that is how NCCL runs.
* Roots are where the waiting ends: terminal strongly-connected components
  of the waits-for graph that someone waits on. A single rank that waits on
  nobody is a root (compute hang, frozen, crashed GPU, no dump); a cycle is
  a cross-group deadlock and all of its ranks are named.

Verdicts
--------
* ``mismatch``: ranks disagree on op, sizes or dtypes at the same (group,
  seq) that is not finished everywhere (or there is no other explanation).
* ``hang``: the waits-for graph has roots.
* ``no-culprit-visible``: nothing in FR explains a stall that *did* happen,
  i.e. an incident was triggered (the input holds `incident.json` or bundle
  `meta.json` files) but no rank is waiting on a rank that is behind.
* ``healthy``: the same situation without any sign that a stall happened:
  offline dumps in which every collective in flight has been entered by all
  of its members and nothing is unmatched. A single snapshot cannot tell a
  slow collective from a stuck one, so the summary says what FR shows.
* ``unknown``: the same, where a group's recorder does not record completion
  (torch 2.15's FlightRecorderHook on an asynchronous backend such as its
  default NCCL): every member entered every collective, and whether the last
  ones finished is not in the dumps. Never reported as healthy.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
from hangwatch.analyzer.loader import GroupMeta, LoadedDumps, build_groups
from hangwatch.analyzer.matching import Mismatch, find_mismatches
from hangwatch.analyzer.progress import Progress, compute_progress, done_mask
from hangwatch.analyzer.report import (
    CollectiveRef,
    Finding,
    Frame,
    GroupProgress,
    RankEvidence,
    Report,
    StalledCollective,
    WaitEdge,
)
from hangwatch.analyzer.text import plural, rank_list

# Evidence and wait edges are per rank; at 4,096 ranks keep the report readable.
MAX_EVIDENCE_RANKS = 64
MAX_WAIT_EDGES = 512
# Process states in which a rank with no dump is known dead, not just unseen.
_DEAD_STATES = frozenset({"stopped", "tracing-stop", "frozen", "zombie", "gone", "dead"})


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


def analyze(
    loaded: LoadedDumps, *, world_size: int | None = None, group: str | None = None
) -> Report:
    """Diagnose loaded dumps. Pure: reads `loaded`, returns a Report."""
    ws = world_size if world_size is not None else loaded.world_size
    groups = loaded.groups
    if ws != loaded.world_size:
        groups = build_groups(
            entries=loaded.entries,
            pg_status=loaded.pg_status,
            pg_config=loaded.pg_config,
            rank_meta=loaded.rank_meta,
            world_size=ws,
        )
    E = loaded.entries
    if group is not None:
        E = E.loc[(E["group"] == group).to_numpy()]  # categorical: compares codes
        groups = {group: groups[group]} if group in groups else {}
    return _Diagnosis(loaded, E, groups, ws, group).run()


class _Diagnosis:
    def __init__(
        self,
        loaded: LoadedDumps,
        entries: pd.DataFrame,
        groups: dict[str, GroupMeta],
        world_size: int | None,
        only_group: str | None,
    ) -> None:
        self.L = loaded
        self.E = entries
        self.groups = groups
        self.ws = world_size
        self.only_group = only_group
        self.dumped = set(loaded.ranks_loaded)
        universe: set[int] = set(self.dumped) | set(loaded.rank_meta)
        for g in groups.values():
            universe.update(g.ranks)
        if world_size:
            universe.update(range(world_size))
        if loaded.selected_ranks is not None:
            # Ranks left out by --selected-ranks are unknown, not missing.
            universe &= loaded.selected_ranks
        self.universe = universe
        self.missing = sorted(universe - self.dumped)
        # Ranks with no dump that nobody could observe (the coordinator wrote
        # their meta: agent unreachable), as opposed to ones known to be
        # stopped or gone. They carry no evidence either way.
        self.unobserved = {
            r
            for r in self.missing
            if (m := loaded.rank_meta.get(r)) is not None
            and not m.get("reachable", True)
            and str(m.get("process_state") or "unknown") not in _DEAD_STATES
        }
        self.findings: list[Finding] = []
        # (peer that has not posted, waiter, group, p2p seq, waiter's op name)
        self.unmatched: list[tuple[int, int, str, int, str]] = []
        self.p2p_blocked: set[int] = set()
        self._tabs: dict[str, dict[str, pd.Series]] = {}

    # ---------- progress ----------
    def run(self) -> Report:
        P = compute_progress(self.L, self.E)
        if self.only_group is not None:
            t = P.table
            P.table = t.loc[t.index.get_level_values("group") == self.only_group]
        self.P = P
        waits = self._collective_waits(P) + self._p2p_waits(P)
        self._all_waits = [w for w in waits if w.targets]
        roots, cycles = self._roots(waits)
        roots = self._blame_in_cycles(roots, cycles, waits)
        mismatches = find_mismatches(self.E, self.groups)
        return self._verdict(P, waits, roots, cycles, mismatches)

    def _tab(self, col: str) -> dict[str, pd.Series]:
        """group -> Series(rank -> value) for one progress column (computed once)."""
        if col not in self._tabs:
            t = self.P.table[col]
            self._tabs[col] = {
                str(g): s.droplevel("group") for g, s in t.groupby(level="group", observed=True)
            }
        return self._tabs[col]

    def _collective_waits(self, P: Progress) -> list[Wait]:
        blocked = P.table["coll_blocked"].dropna()
        if not len(blocked):
            return []
        enq = self._tab("coll_enq")
        first_entry = self._first_entry_info({(str(g), int(v)) for (_, g), v in blocked.items()})
        waits: list[Wait] = []
        for (g, s), sub in blocked.groupby([blocked.index.get_level_values("group"), blocked]):
            g = str(g)
            s = int(s)
            meta = self.groups.get(g)
            members = set(meta.ranks) if meta else set()
            waiters = {int(r) for r in sub.index.get_level_values("rank")}
            e = enq.get(g, pd.Series(dtype=np.float64))
            known = e.reindex(sorted(members - waiters))
            behind = {int(r) for r, v in known.items() if not np.isnan(v) and v < s}
            missing = {r for r in members if r not in self.dumped and r in self.universe}
            # Ranks outside --selected-ranks are unknown, not missing. An
            # unobserved rank is blamed only when no observed member explains
            # the wait: never beside a rank the dumps show never entered.
            targets = behind | (missing - self.unobserved if behind else missing)
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
                )
            )
        return waits

    def _first_entry_info(
        self, keys: set[tuple[str, int]]
    ) -> dict[tuple[str, int], dict[str, Any]]:
        """Op name and oldest creation time of the collectives some rank is blocked in."""
        E = self.E
        if not keys or not len(E):
            return {}
        seqs = np.fromiter((s for _, s in keys), dtype=np.int64)
        m = ~E["is_p2p"].to_numpy() & np.isin(E["collective_seq_id"].to_numpy(), seqs)
        coll = E.loc[m, ["group", "collective_seq_id", "op", "profiling_name", "time_created_ns"]]
        coll = coll.assign(group=coll["group"].astype(str))
        coll = coll.loc[
            [k in keys for k in zip(coll["group"], coll["collective_seq_id"], strict=True)]
        ]
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

    def _p2p_waits(self, P: Progress) -> list[Wait]:
        E = self.E
        p2p = E["is_p2p"].to_numpy()
        if not p2p.any():
            return []
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
            ],
        ]
        sub = sub.assign(group=sub["group"].astype(str), op=sub["op"].astype(str))
        # Known complete through pg_status (a p2p-domain counter)?
        p2p_comp = P.table["p2p_comp"]
        ck = p2p_comp.reindex(pd.MultiIndex.from_arrays([sub["rank"], sub["group"]])).to_numpy()
        sub = sub.loc[~(sub["p2p_seq_id"].to_numpy() <= np.nan_to_num(ck, nan=-1))]
        if not len(sub):
            return []
        # Group-local peer -> global rank, per group (membership must be exact).
        peer_local = np.where(
            sub["op"].to_numpy() == "recv", sub["peer_src"].to_numpy(), sub["peer_dst"].to_numpy()
        )
        peer_global = np.full(len(sub), -1, dtype=np.int64)
        gcol = sub["group"].to_numpy()
        for g in pd.unique(gcol):
            meta = self.groups.get(g)
            if meta is None or (meta.membership_source == "dumps" and g != "0"):
                continue
            ranks = np.asarray(sorted(meta.ranks) if g != "0" or meta.ranks else [], dtype=np.int64)
            m = gcol == g
            loc = peer_local[m]
            ok = (loc >= 0) & (loc < len(ranks))
            glob = np.full(len(loc), -1, dtype=np.int64)
            glob[ok] = ranks[loc[ok]]
            peer_global[m] = glob
        sub = sub.assign(peer=peer_global)
        sub = sub.loc[sub["peer"].to_numpy() >= 0]
        p2p_enq = P.table["p2p_enq"]
        pe = p2p_enq.reindex(pd.MultiIndex.from_arrays([sub["peer"], sub["group"]])).to_numpy()
        peer_dumped = sub["peer"].isin(list(self.dumped)).to_numpy()
        peer_known_missing = ~peer_dumped & sub["peer"].isin(list(self.universe)).to_numpy()
        behind = (
            peer_dumped & ~np.isnan(pe) & (np.nan_to_num(pe, nan=0) < sub["p2p_seq_id"].to_numpy())
        )
        blamed = sub.loc[behind | peer_known_missing]
        waits: list[Wait] = []
        for (g, k), grp in blamed.groupby(["group", "p2p_seq_id"]):
            w = Wait(
                group=str(g),
                seq=int(k),
                kind="p2p",
                waiters={int(r) for r in grp["rank"]},
                targets={int(p) for p in grp["peer"]},
                op=str(grp["op"].iloc[0]),
                profiling_name=str(grp["profiling_name"].iloc[0]),
                oldest_ns=int(grp["time_created_ns"].min()),
            )
            for r, p in zip(grp["rank"], grp["peer"], strict=True):
                w.detail.setdefault(int(r), set()).add(int(p))
            w.targets -= w.waiters
            waits.append(w)
            for r, p, name in zip(grp["rank"], grp["peer"], grp["profiling_name"], strict=True):
                self.unmatched.append((int(p), int(r), str(g), int(k), str(name)))
        # Every blocked p2p op also makes its rank "blocked" for the purpose
        # of telling roots from ranks stuck outside any collective.
        self.p2p_blocked = {int(r) for r in sub["rank"]}
        return waits

    # ---------- graph ----------
    def _roots(self, waits: list[Wait]) -> tuple[list[int], list[list[int]]]:
        """Terminal SCCs reached from waiters; hyper-edges go through one
        virtual node per Wait so the graph stays linear in size."""
        adj: dict[Any, set[Any]] = {}
        for i, w in enumerate(waits):
            if not w.targets:
                continue
            h = ("w", i)
            adj.setdefault(h, set()).update(w.targets)
            for r in w.waiters:
                adj.setdefault(r, set()).add(h)
            for t in w.targets:
                adj.setdefault(t, set())
        comp = _tarjan(adj)
        comp_of = {n: ci for ci, nodes in enumerate(comp) for n in nodes}
        out_edges: dict[int, bool] = {ci: False for ci in range(len(comp))}
        for n, nbrs in adj.items():
            for m in nbrs:
                if comp_of[n] != comp_of[m]:
                    out_edges[comp_of[n]] = True
        targets = set().union(*(w.targets for w in waits)) if waits else set()
        roots: list[int] = []
        cycles: list[list[int]] = []
        for ci, nodes in enumerate(comp):
            if out_edges[ci]:
                continue
            ranks = sorted(n for n in nodes if isinstance(n, int))
            if len(nodes) > 1:
                cycles.append(ranks)
                roots.extend(ranks)
            elif ranks and ranks[0] in targets:
                roots.append(ranks[0])
        return sorted(set(roots)), cycles

    @staticmethod
    def _cycle_sides(cycle: list[int], waits: list[Wait]) -> dict[tuple[str, int], set[int]]:
        """The ranks of a cycle, grouped by the (group, seq) each is blocked in."""
        cs = set(cycle)
        sides: dict[tuple[str, int], set[int]] = {}
        for w in waits:
            if w.targets & cs:
                for r in w.waiters & cs:
                    sides.setdefault((w.group, w.seq), set()).add(r)
        return sides

    def _blame_in_cycles(
        self, roots: list[int], cycles: list[list[int]], waits: list[Wait]
    ) -> list[int]:
        """In a cross-group deadlock, blame the ranks that took the odd order.

        Where most of a cycle's ranks wait in one collective and a minority in
        another, the minority entered the groups in a different order than
        everyone else: they are the odd ones out, and the majority is merely
        blocked on them. When the sides are the same size there is no odd one
        out and every rank of the cycle is named.
        """
        in_cycle = {r for c in cycles for r in c}
        blamed = set(roots) - in_cycle
        for c in cycles:
            sides = list(self._cycle_sides(c, waits).values())
            smallest = min((len(v) for v in sides), default=0)
            if len(sides) < 2 or all(len(v) == smallest for v in sides):
                blamed.update(c)
            else:
                blamed.update(r for v in sides if len(v) == smallest for r in v)
        return sorted(blamed)

    # ---------- verdict ----------
    def _verdict(
        self,
        P: Progress,
        waits: list[Wait],
        roots: list[int],
        cycles: list[list[int]],
        mismatches: list[Mismatch],
    ) -> Report:
        live_mm = [m for m in mismatches if not self._complete_everywhere(m.group, m.seq)]
        for m in mismatches:
            self.findings.append(
                Finding(kind=m.kind, ranks=m.odd_ranks, group=m.group, seq=m.seq, detail=m.detail)
            )
        stalled: StalledCollective | None = None
        lagging: list[int] = []
        incident = self.L.incident is not None or bool(self.L.rank_meta)
        blocked_any = bool(P.table["coll_blocked"].notna().any()) or bool(self.p2p_blocked)

        if live_mm or (mismatches and not roots):
            m = sorted(
                live_mm or mismatches,
                key=lambda x: (
                    ["op-mismatch", "size-mismatch", "dtype-mismatch"].index(x.kind),
                    x.seq,
                ),
            )[0]
            verdict = "mismatch"
            lagging = m.odd_ranks
            stalled = self._stalled_for(m.group, m.seq, "collective", None)
            name = self._coll_name(stalled)
            summary = (
                f"{_ranks_word(lagging)} {'disagrees' if len(lagging) == 1 else 'disagree'} with "
                f"the rest of group {self._gname(m.group)} at {name}: {m.kind.replace('-', ' ')}."
            )
        elif roots:
            verdict = "hang"
            lagging = roots
            blame = [w for w in waits if w.targets & set(roots)]
            best = sorted(blame, key=lambda w: _wait_key(w, roots))[0]
            stalled = self._stalled_for(best.group, best.seq, best.kind, best)
            self._root_findings(roots, cycles, waits)
            summary = self._hang_sentence(roots, cycles, best, stalled)
        else:
            if self.missing and self.ws:
                self.findings.append(
                    Finding(
                        kind="missing-dump",
                        ranks=self.missing,
                        detail=f"no dump from {_ranks_word(self.missing)}; nobody with a dump is waiting on them",
                    )
                )
            gloo = self.L.backend == "gloo"
            why = (
                "No collective is in flight that a member has not entered. This happens when the job "
                "hangs outside collectives (a compute hang, a data-loader or I/O stall, a deadlock "
                "between Python threads) or in point-to-point traffic"
                + (", which gloo does not record in the flight recorder at all" if gloo else "")
                + ". The per-rank stacks show where each rank is."
            )
            if not blocked_any and incident:
                self.findings.append(Finding(kind="no-collective-in-flight", ranks=[], detail=why))
            if gloo:
                self.findings.append(
                    Finding(
                        kind="gloo-p2p-blind-spot",
                        ranks=[],
                        detail="gloo records no send/recv in the flight recorder: a p2p deadlock leaves dumps that look healthy.",
                    )
                )
            if self._unknown_groups() and not incident:
                verdict = "unknown"
                summary = (
                    "FR cannot tell: every member entered every collective it recorded, and "
                    f"the recorder of group(s) {', '.join(self._unknown_groups())} does not record "
                    "completion, so a collective stuck after everyone entered it looks the same "
                    "as a finished one; see the per-rank stacks and GPU state."
                )
            elif incident:
                verdict = "no-culprit-visible"
                summary = (
                    "A stall was reported, but the flight recorder shows no rank waiting on a lagging "
                    "rank: the culprit is not visible in FR; see the per-rank stacks."
                )
                if blocked_any:
                    summary = (
                        "A stall was reported; every collective in flight has been entered by all of "
                        "its members, so FR cannot say which rank is slow inside it; see the per-rank stacks."
                    )
            else:
                verdict = "healthy"
                summary = (
                    "FR shows no stalled collective: every collective in flight has been entered by all "
                    "of its members and nothing is unmatched."
                    if blocked_any
                    else "FR shows no stalled collective: every rank has completed everything it enqueued."
                )
        self._p2p_findings(set(lagging))
        self._wrap_findings()
        if self._unknown_groups():
            self.findings.append(
                Finding(
                    kind="completion-unknown",
                    ranks=[],
                    detail=(
                        f"group(s) {', '.join(self._unknown_groups())} are recorded by torch's "
                        "FlightRecorderHook on a backend whose completion it does not record "
                        "(entries are 'retired' when the call returns): hangwatch counts a "
                        "collective as finished once every member entered it"
                    ),
                )
            )
        return Report(
            verdict=verdict,  # type: ignore[arg-type]
            summary=summary,
            stalled_collective=stalled,
            lagging_ranks=sorted(lagging),
            findings=self.findings,
            ranks_loaded=sorted(self.dumped),
            ranks_missing=self.missing,
            tail_ranks=list(self.L.tail_ranks),
            errors=list(self.L.errors),
            groups=self._group_progress(P, waits),
            waits_for=_edges(waits),
            evidence=self._evidence(sorted(lagging), waits, stalled),
        )

    def _unknown_groups(self) -> list[str]:
        """Groups in scope whose completion FR does not record, in group order."""
        unk = self.L.completion_unknown_groups & set(self.groups)
        return sorted(unk, key=lambda n: (not n.isdigit(), int(n) if n.isdigit() else 0, n))

    def _complete_everywhere(self, g: str, s: int) -> bool:
        """Every member is known to have finished (g, s): a mismatch there
        ended without a hang (NCCL can finish mismatched sizes)."""
        meta = self.groups.get(g)
        comp = self._tab("coll_comp").get(g)
        if meta is None or comp is None:
            return False
        v = comp.reindex(meta.ranks).to_numpy()
        return bool(len(v)) and not np.isnan(v).any() and bool((v >= s).all())

    def _gname(self, g: str) -> str:
        meta = self.groups.get(g)
        return f"{g} ({meta.desc})" if meta and meta.desc else g

    @staticmethod
    def _coll_name(sc: StalledCollective | None) -> str:
        if sc is None:
            return "?"
        return f"{sc.op or 'collective'} #{sc.seq}"

    def _stalled_for(self, g: str, s: int, kind: str, w: Wait | None) -> StalledCollective:
        meta = self.groups.get(g)
        members = sorted(meta.ranks) if meta else []
        E = self.E
        gm = (E["group"] == g).to_numpy()
        if kind == "collective":
            at = E.loc[gm & ~E["is_p2p"].to_numpy() & (E["collective_seq_id"] == s).to_numpy()]
            enq = self._tab("coll_enq").get(g, pd.Series(dtype=np.float64))
            comp = self._tab("coll_comp").get(g, pd.Series(dtype=np.float64))
            entered = sorted(
                {int(r) for r in at["rank"]} | {int(r) for r, v in enq.items() if v >= s}
            )
            completed = sorted(int(r) for r, v in comp.items() if v >= s)
            never = sorted(
                r
                for r in members
                if (r not in self.dumped and r in self.universe) or (r in enq.index and enq[r] < s)
            )
        else:
            at = E.loc[gm & E["is_p2p"].to_numpy() & (E["p2p_seq_id"] == s).to_numpy()]
            entered = sorted({int(r) for r in at["rank"]})
            completed = []
            never = sorted(w.targets) if w else []
        rep = at.sort_values("record_id").iloc[-1] if len(at) else None
        op = w.op if w and w.op else (str(rep["op"]) if rep is not None else "")
        sizes: list[list[int]] = []
        dtypes: list[str] = []
        if rep is not None:
            try:
                parsed = json.loads(str(rep["input_sizes"]))
                if isinstance(parsed, list):
                    sizes = [list(x) for x in parsed if isinstance(x, list)]
            except ValueError:
                sizes = []
            dtypes = [d for d in str(rep["input_dtypes"]).split(",") if d]
        return StalledCollective(
            group=g,
            group_desc=meta.desc if meta else "",
            group_ranks=members,
            seq=s,
            op=op,
            profiling_name=(
                w.profiling_name
                if w and w.profiling_name
                else (str(rep["profiling_name"]) if rep is not None else "")
            ),
            entered_ranks=[r for r in entered if r not in never],
            completed_ranks=completed,
            missing_ranks=never,
            input_sizes=sizes,
            dtypes=dtypes,
        )

    def _in_flight(self, r: int) -> bool:
        t = self.P.table
        if r in self.p2p_blocked:
            return True
        try:
            return bool(t.xs(r, level="rank")["coll_blocked"].notna().any())
        except KeyError:
            return False

    def _root_findings(self, roots: list[int], cycles: list[list[int]], waits: list[Wait]) -> None:
        in_cycle = {r for c in cycles for r in c}
        for c in cycles:
            gs = sorted({w.group for w in waits if w.waiters & set(c) and w.targets & set(c)})
            parts = [
                f"rank {r} waits in {self._gname(w.group)} #{w.seq} on {rank_list(w.targets & set(c))}"
                for w in waits
                for r in sorted(w.waiters & set(c))
                if w.targets & set(c)
            ]
            self.findings.append(
                Finding(
                    kind="cross-group-deadlock",
                    ranks=c,
                    group=gs[0] if gs else None,
                    detail=f"ranks {rank_list(c)} wait on each other across groups {', '.join(gs)} "
                    f"(collectives entered in different orders): " + "; ".join(parts[:8]),
                )
            )
        for r in roots:
            if r in in_cycle:
                continue
            blamed = [w for w in waits if r in w.targets]
            w0 = min(blamed, key=lambda w: _wait_key(w, roots))
            where = f"{w0.op or w0.kind} #{w0.seq} in group {self._gname(w0.group)}"
            n_wait = len(w0.waiters)
            meta = self.L.rank_meta.get(r)
            if r not in self.dumped:
                if meta is not None and not meta.get("reachable", True):
                    state = str(meta.get("process_state") or "unknown")
                    kind = (
                        "frozen"
                        if state in ("stopped", "tracing-stop", "frozen")
                        else "agent-unreachable"
                    )
                    self.findings.append(
                        _root_finding(
                            kind,
                            r,
                            w0,
                            f"rank {r} could not be dumped (process state: {state}); {plural(n_wait, 'rank')} wait on it at {where}",
                        )
                    )
                else:
                    self.findings.append(
                        _root_finding(
                            "missing-dump",
                            r,
                            w0,
                            f"no dump from rank {r}; {plural(n_wait, 'rank')} wait on it at {where}",
                        )
                    )
            elif not self._in_flight(r):
                self.findings.append(
                    _root_finding(
                        "stuck-outside-collective",
                        r,
                        w0,
                        (
                            f"rank {r} finished every collective it enqueued and never entered {where}; "
                            if w0.group not in self.L.completion_unknown_groups
                            # Completion is not recorded there: say only what is known.
                            else f"rank {r} is in no collective its peers have not all entered, "
                            f"and never entered {where}; "
                        )
                        + "it is stuck outside any collective (compute, I/O, Python); see its stacks",
                    )
                )
            else:
                self.findings.append(
                    _root_finding(
                        "not-entered",
                        r,
                        w0,
                        f"rank {r} never entered {where}, where {plural(n_wait, 'rank')} wait; "
                        f"its own older work has not finished although all its peers entered it",
                    )
                )

    def _hang_sentence(
        self, roots: list[int], cycles: list[list[int]], best: Wait, sc: StalledCollective
    ) -> str:
        gname = self._gname(best.group)
        if cycles:
            c = cycles[0]
            gs = sorted(
                {f.group for f in self.findings if f.kind == "cross-group-deadlock" and f.group}
            )
            odd = sorted(set(c) & set(roots))
            if gs and len(odd) < len(c):
                rest = sorted(set(c) - set(odd))
                both = sorted({g for g, _ in self._cycle_sides(c, self._all_waits)})
                return (
                    f"Cross-group deadlock: {_ranks_lower(odd)} entered groups "
                    f"{' and '.join(self._gname(g) for g in both)} in a different order than "
                    f"{_ranks_lower(rest)}, which wait in {sc.op or 'collective'} #{sc.seq} "
                    f"in group {gname} for {'it' if len(odd) == 1 else 'them'}."
                )
            return (
                f"Cross-group deadlock: ranks {rank_list(c)} wait on each other in different groups "
                f"(entered in opposite orders), e.g. {sc.op or 'collective'} #{sc.seq} in group {gname}."
                if gs
                else f"Ranks {rank_list(c)} wait on each other in a cycle."
            )
        blamed = sorted(best.targets & set(roots))
        others = sorted(set(roots) - set(blamed))
        who = _ranks_word(blamed)
        verb = "never entered" if best.kind == "collective" else "never posted the peer op for"
        what = f"{sc.op or best.op or 'collective'} #{best.seq} in group {gname}"
        tail = f"; {_ranks_lower(sorted(best.waiters))} {'is' if len(best.waiters) == 1 else 'are'} waiting in it."
        s = f"{who} {verb} {what}{tail}"
        if others:
            s = s[:-1] + f" (also lagging: {rank_list(others)})."
        behind = set().union(*(w.waiters for w in self._all_waits)) - set(best.waiters) - set(roots)
        if behind:
            s = (
                s[:-1]
                + f"; {plural(len(behind), 'other rank')} {'is' if len(behind) == 1 else 'are'} blocked behind it."
            )
        return s

    def _p2p_findings(self, lagging: set[int]) -> None:
        """One finding per peer that left p2p ops unmatched; when there are
        lagging ranks, only for them (the others are blocked behind them)."""
        by_peer: dict[int, list[tuple[int, str, int, str]]] = {}
        for peer, waiter, g, k, name in self.unmatched:
            if lagging and peer not in lagging:
                continue
            by_peer.setdefault(peer, []).append((waiter, g, k, name))
        for peer, items in sorted(by_peer.items()):
            shown = "; ".join(
                f"{name} #{k} in group {g} on rank {w}" for w, g, k, name in items[:6]
            )
            more = f" and {len(items) - 6} more" if len(items) > 6 else ""
            nodump = " (no dump from it)" if peer not in self.dumped else ""
            self.findings.append(
                Finding(
                    kind="p2p-unmatched",
                    ranks=sorted({peer, *(w for w, _, _, _ in items)}),
                    group=items[0][1],
                    seq=items[0][2],
                    detail=f"rank {peer}{nodump} has not posted the peer side of: {shown}{more}",
                )
            )

    def _wrap_findings(self) -> None:
        E = self.E
        if not len(E):
            return
        done = done_mask(E)
        g = (
            E.assign(done=done)
            .groupby("rank")
            .agg(first=("record_id", "min"), anydone=("done", "any"))
        )
        # A tail starts past record 0 by construction: that says nothing
        # about the ring buffer (tail_ranks says where the history went).
        tails = set(self.L.tail_ranks)
        wrapped = [
            int(r)
            for r, row in g.iterrows()
            if row["first"] > 0 and row["anydone"] and int(r) not in tails
        ]
        if wrapped:
            self.findings.append(
                Finding(
                    kind="buffer-wrapped",
                    ranks=wrapped,
                    detail="these ranks' FR ring buffers wrapped; entries that fell out are not evidence of anything "
                    "(progress is read from pg_status and the newest entries)",
                )
            )

    def _group_progress(self, P: Progress, waits: list[Wait]) -> list[GroupProgress]:
        comp = self._tab("coll_comp")
        enq = self._tab("coll_enq")
        lag_by_group: dict[str, set[int]] = {}
        for w in waits:
            lag_by_group.setdefault(w.group, set()).update(w.targets)
        out = []
        for name, meta in self.groups.items():
            c = comp.get(name)
            e = enq.get(name)
            out.append(
                GroupProgress(
                    group=name,
                    group_desc=meta.desc,
                    ranks=list(meta.ranks),
                    min_completed=int(np.nanmin(c.to_numpy()))
                    if c is not None and c.notna().any()
                    else -1,
                    max_enqueued=int(np.nanmax(e.to_numpy()))
                    if e is not None and e.notna().any()
                    else -1,
                    lagging=sorted(lag_by_group.get(name, set())),
                )
            )
        return out

    def _evidence(
        self, lagging: list[int], waits: list[Wait], sc: StalledCollective | None
    ) -> dict[int, RankEvidence]:
        if len(self.universe) <= MAX_EVIDENCE_RANKS:
            chosen = sorted(self.universe)
        else:
            waiters = sorted(set().union(*(w.waiters for w in waits))) if waits else []
            chosen = sorted(
                set(lagging)
                | set(self.missing[:MAX_EVIDENCE_RANKS])
                | set(waiters[: MAX_EVIDENCE_RANKS // 2])
            )
        E = self.E
        done = done_mask(E)
        rank = E["rank"].to_numpy()
        mine = np.isin(rank, chosen)
        newest = _newest_per_rank(E, mine)
        newest_done = _newest_per_rank(E, mine & done)
        comp = self._tab("coll_comp")
        out: dict[int, RankEvidence] = {}
        for r in chosen:
            meta = self.L.rank_meta.get(r) or {}
            last_c: CollectiveRef | None = None
            if r in newest_done.index:
                row = newest_done.loc[r]
                last_c = CollectiveRef(
                    group=str(row["group"]),
                    seq=_seq(row),
                    op=str(row["op"]),
                    state="retired" if row["retired"] else str(row["state"]),
                )
            elif (
                sc is not None
                and sc.group in comp
                and r in comp[sc.group].index
                and not np.isnan(comp[sc.group][r])
            ):
                last_c = CollectiveRef(
                    group=sc.group, seq=int(comp[sc.group][r]), op="", state="completed"
                )
            last_e: CollectiveRef | None = None
            frames: list[Frame] = []
            if r in newest.index:
                row = newest.loc[r]
                last_e = CollectiveRef(
                    group=str(row["group"]),
                    seq=_seq(row),
                    op=str(row["op"]),
                    state="retired" if row["retired"] else str(row["state"]),
                )
                fr = self.L.frames.get((r, int(row["record_id"])))
                if fr is None:
                    fr = self._any_frames(r)
                frames = [Frame(name=a, filename=b, line=c) for a, b, c in (fr or ())]
            sources = dict(meta.get("sources") or {})
            if r in self.dumped:
                sources.setdefault("fr", "dump-file")
            gpu = meta.get("gpu")
            out[r] = RankEvidence(
                rank=r,
                host=meta.get("host"),
                pid=meta.get("pid") if isinstance(meta.get("pid"), int) else None,
                process_state=meta.get("process_state"),
                reachable=bool(meta.get("reachable", r in self.dumped or not meta)),
                last_completed=last_c,
                last_entered=last_e,
                frames=frames,
                stacks=meta.get("stacks"),
                gpu=gpu if isinstance(gpu, dict) else None,
                sources={str(k): str(v) for k, v in sources.items()},
            )
        return out

    def _any_frames(self, r: int) -> tuple[tuple[str, str, int], ...] | None:
        best = None
        for (rr, rec), fr in self.L.frames.items():
            if rr == r and (best is None or rec > best[0]):
                best = (rec, fr)
        return best[1] if best else None


def _newest_per_rank(E: pd.DataFrame, mask: np.ndarray) -> pd.DataFrame:
    """Each rank's entry with the highest record_id among `mask`, indexed by rank."""
    rows = np.flatnonzero(mask)
    rank = E["rank"].to_numpy()[rows]
    order = np.lexsort((E["record_id"].to_numpy()[rows], rank))
    last = np.ones(len(order), dtype=bool)
    last[:-1] = rank[order][1:] != rank[order][:-1]
    return E.iloc[rows[order[last]]].set_index("rank")


def _wait_key(w: Wait, roots: list[int]) -> tuple[Any, ...]:
    """Which wait best names "the" stalled collective: a collective over a p2p
    op, blaming the most roots and only roots, the one waiting the longest
    (the first collective the roots failed to join), then the most waiters."""
    return (
        w.kind != "collective",
        -len(w.targets & set(roots)),
        len(w.targets - set(roots)),  # blame a root directly, not through a blocked rank
        w.oldest_ns or np.iinfo(np.int64).max,  # the first collective the roots failed to join
        -len(w.waiters),
        w.seq,
    )


def _seq(row: pd.Series) -> int:
    return int(row["p2p_seq_id"] if row["is_p2p"] else row["collective_seq_id"])


def _root_finding(kind: str, rank: int, w: Wait, detail: str) -> Finding:
    """A finding that blames one root rank for the wait it holds up."""
    return Finding(kind=kind, ranks=[rank], group=w.group, seq=w.seq, detail=detail)


def _ranks_word(ranks: list[int]) -> str:
    return f"Rank {ranks[0]}" if len(ranks) == 1 else f"Ranks {rank_list(ranks)}"


def _ranks_lower(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {rank_list(ranks)}"


def _edges(waits: list[Wait]) -> list[WaitEdge]:
    out: list[WaitEdge] = []
    for w in sorted(waits, key=lambda w: (w.group, w.seq)):
        for a in sorted(w.waiters):
            peers = w.detail.get(a, w.targets) if w.kind == "p2p" else w.targets
            for b in sorted(peers):
                if len(out) >= MAX_WAIT_EDGES:
                    return out
                out.append(WaitEdge(waiter=a, waits_on=b, group=w.group, seq=w.seq))
    return out


def _tarjan(adj: dict[Any, set[Any]]) -> list[list[Any]]:
    """Strongly connected components, iteratively (deep graphs must not recurse)."""
    index: dict[Any, int] = {}
    low: dict[Any, int] = {}
    on_stack: set[Any] = set()
    stack: list[Any] = []
    comps: list[list[Any]] = []
    counter = 0
    for start in adj:
        if start in index:
            continue
        work: list[tuple[Any, Iterator[Any]]] = [(start, iter(adj.get(start, ())))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, it = work[-1]
            advanced = False
            for nxt in it:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(adj.get(nxt, ()))))
                    advanced = True
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    x = stack.pop()
                    on_stack.discard(x)
                    comp.append(x)
                    if x == node:
                        break
                comps.append(comp)
    return comps


__all__ = ["analyze"]
