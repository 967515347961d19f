"""What one diagnosis looks at: the entries and groups in scope, which ranks exist, their progress.

Built once, before anything is decided, so that every later step reads the
same facts instead of state that an earlier step happened to set.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
from hangwatch.analyzer.groups import GroupMeta
from hangwatch.analyzer.loader import LoadedDumps
from hangwatch.analyzer.progress import Progress, compute_progress

# Process states in which a rank with no dump is known dead, not just unseen.
DEAD_STATES = frozenset({"stopped", "tracing-stop", "frozen", "zombie", "gone", "dead"})


@dataclass(kw_only=True)
class Scope:
    loaded: LoadedDumps
    entries: pd.DataFrame  # only the analysed group's rows when one is chosen
    groups: dict[str, GroupMeta]
    world_size: int | None
    progress: Progress  # its table restricted to the analysed group, likewise
    dumped: set[int]
    universe: set[int]  # every rank known to exist (and selected)
    missing: list[int]  # in the universe, without a dump
    # Missing ranks nobody could observe (the coordinator wrote their meta:
    # agent unreachable), as opposed to ones known to be stopped or gone.
    # They carry no evidence either way.
    unobserved: set[int]
    _tabs: dict[str, ByGroup] = field(default_factory=dict, repr=False)

    def tab(self, col: str) -> ByGroup:
        """group -> Series(rank -> value) for one progress column.

        Cached: sorting the table by group is the costly part, and several
        steps read the same columns.
        """
        if col not in self._tabs:
            self._tabs[col] = ByGroup(self.progress.table[col])
        return self._tabs[col]

    def unknown_groups(self) -> list[str]:
        """Groups in scope whose completion FR does not record, in group order."""
        unk = self.loaded.completion_unknown_groups & set(self.groups)
        return sorted(unk, key=lambda n: (not n.isdigit(), int(n) if n.isdigit() else 0, n))

    def complete_everywhere(self, g: str, s: int) -> bool:
        """Every member is known to have finished (g, s): a mismatch there
        ended without a hang (NCCL can finish mismatched sizes)."""
        meta = self.groups.get(g)
        comp = self.tab("coll_comp").get(g)
        if meta is None or comp is None:
            return False
        v = comp.reindex(meta.ranks).to_numpy()
        return bool(len(v)) and not np.isnan(v).any() and bool((v >= s).all())

    def in_collective(self, r: int) -> bool:
        """Rank r is blocked in some collective it entered."""
        try:
            return bool(self.progress.table.xs(r, level="rank")["coll_blocked"].notna().any())
        except KeyError:
            return False

    def membership_unknown(self) -> list[str]:
        """Groups some rank is blocked in whose members only the dumps name
        (no pg_config ranks, no bundle metadata, no --world-size).

        The dumps name only the ranks that dumped: a member whose dump is not
        here, or that never recorded the group, is invisible. Whether
        everyone entered is then not known (a one-member group's collective
        waits on nobody: an unfinished one proves members nobody names), and
        the verdict is never healthy.
        """
        blocked = self.progress.table["coll_blocked"].dropna()
        if not len(blocked):
            return []
        names = {str(g) for g in blocked.index.get_level_values("group")}
        unk = [
            g
            for g in names
            if (m := self.groups.get(g)) is not None and m.membership_source == "dumps"
        ]
        return sorted(unk, key=lambda n: (not n.isdigit(), int(n) if n.isdigit() else 0, n))

    def op_at(self, g: str, seq: int) -> str:
        """The op some rank recorded for collective seq in group g ("" if none)."""
        E = self.entries
        m = (
            (E["group"] == g).to_numpy()
            & ~E["is_p2p"].to_numpy()
            & (E["collective_seq_id"] == seq).to_numpy()
        )
        return str(E.loc[m, "op"].iloc[0]) if m.any() else ""

    def any_collective_blocked(self) -> bool:
        return bool(self.progress.table["coll_blocked"].notna().any())


class ByGroup(Mapping[str, pd.Series]):
    """One progress column as group -> Series(rank -> value), groups in sorted
    order, rows in table order.

    One stable sort, and each group's Series cut from it when first asked
    for: a groupby that dropped the level of every part took 0.2-0.3 s per
    column for 1,569 groups (4,096 ranks), and cutting every group's Series
    up front 0.26 s per column for 3,105 groups (8,192 ranks), where the
    analysis asks for the few groups ranks are blocked in.
    """

    def __init__(self, t: pd.Series) -> None:
        groups = t.index.get_level_values("group")
        ranks = t.index.get_level_values("rank")
        codes, names = pd.factorize(groups, sort=True)
        order = np.argsort(codes, kind="stable")
        codes = codes[order]
        self._whole = pd.Series(
            t.to_numpy()[order], index=pd.Index(ranks.to_numpy()[order], name="rank"), name=t.name
        )
        bounds = [0, *(np.flatnonzero(np.diff(codes)) + 1).tolist(), len(codes)]
        self._rows: dict[str, tuple[int, int]] = {
            str(names[codes[lo]]): (lo, hi) for lo, hi in itertools.pairwise(bounds) if lo < hi
        }
        self._cut: dict[str, pd.Series] = {}

    def known(self) -> dict[str, int]:
        """group -> how many of its rows hold a value (not NaN), in one pass
        over the sorted column, no group's Series cut."""
        if not self._rows:
            return {}
        isna = np.isnan(self._whole.to_numpy(dtype=np.float64))
        starts = np.fromiter((lo for lo, _ in self._rows.values()), np.int64, len(self._rows))
        counts = np.add.reduceat(~isna, starts).tolist()
        return dict(zip(self._rows, counts, strict=True))

    def __getitem__(self, group: str) -> pd.Series:
        s = self._cut.get(group)
        if s is None:
            lo, hi = self._rows[group]
            s = self._cut[group] = self._whole.iloc[lo:hi]
        return s

    def __contains__(self, group: object) -> bool:
        return group in self._rows

    def __iter__(self) -> Iterator[str]:
        return iter(self._rows)

    def __len__(self) -> int:
        return len(self._rows)


def build_scope(
    loaded: LoadedDumps,
    entries: pd.DataFrame,
    groups: dict[str, GroupMeta],
    world_size: int | None,
    only_group: str | None,
) -> Scope:
    progress = compute_progress(loaded, entries)
    if only_group is not None:
        t = progress.table
        progress.table = t.loc[t.index.get_level_values("group") == only_group]
    dumped = set(loaded.ranks_loaded)
    universe: set[int] = set(dumped) | set(loaded.rank_meta)
    for g in groups.values():
        universe.update(g.ranks)
    if world_size:
        universe.update(range(world_size))
    if loaded.selected_ranks is not None:
        # Ranks left out by --selected-ranks are unknown, not missing.
        universe &= loaded.selected_ranks
    missing = sorted(universe - dumped)
    unobserved = {
        r
        for r in missing
        if (m := loaded.rank_meta.get(r)) is not None
        and m.reachable is False
        and (m.process_state or "unknown") not in DEAD_STATES
    }
    return Scope(
        loaded=loaded,
        entries=entries,
        groups=groups,
        world_size=world_size,
        progress=progress,
        dumped=dumped,
        universe=universe,
        missing=missing,
        unobserved=unobserved,
    )
