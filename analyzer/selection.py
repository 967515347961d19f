"""What `--selected-ranks` leaves out: selected ranks whose unfinished work involves ranks not selected.

Ranks outside the selection are unknown, not missing: they are never blamed
and never waited on in the graph. But a selected rank in an unfinished
collective with unselected members, or in a send/recv with an unselected
peer, may be waiting on them, and nothing in the selection can say whether
it is: the verdict is then `unknown`, never `healthy`, and says whose dumps
would settle it.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from hangwatch.analyzer.scope import Scope
from hangwatch.analyzer.streams import HeadOp
from hangwatch.analyzer.waits import Wait, p2p_wait


def outside_waits(scope: Scope, pending: pd.DataFrame) -> list[Wait]:
    """Unfinished work of selected ranks that involves known ranks outside the selection.

    `pending` is `streams.pending_ops(scope)`. Only groups whose membership
    comes from more than the dumps count: the dumps of a selection name only
    selected ranks.
    """
    sel = scope.loaded.selected_ranks
    if sel is None:
        return []
    out: list[Wait] = []
    blocked = scope.progress.table["coll_blocked"].dropna()
    if len(blocked):
        gl = blocked.index.get_level_values("group").astype(str)
        for (g, s), sub in blocked.groupby([gl, blocked.to_numpy()]):
            meta = scope.groups.get(str(g))
            if meta is None or meta.membership_source == "dumps":
                continue
            outside = set(meta.ranks) - sel - scope.dumped
            if outside:
                out.append(
                    Wait(
                        group=str(g),
                        seq=int(s),
                        kind="collective",
                        waiters={int(r) for r in sub.index.get_level_values("rank")},
                        targets=outside,
                        op=scope.op_at(str(g), int(s)),
                    )
                )
    if len(pending):
        peer = pending["peer"].to_numpy()
        p2p = pending.loc[
            pending["is_p2p"].to_numpy() & (peer >= 0) & ~np.isin(peer, list(sel | scope.dumped))
        ]
        for (g, k), sub in p2p.groupby(["group", "p2p_seq_id"]):
            name = str(scope.entries.at[sub.index[0], "profiling_name"])
            out.append(p2p_wait(g, k, sub, profiling_name=name))
    return out


def known_roots(
    roots: list[int], waits: list[Wait], outside: list[Wait], heads: dict[int, HeadOp]
) -> list[int]:
    """The roots that do not rest on ranks outside the selection.

    A rank that others wait on only through work queued behind its own
    oldest op is a root because that op's other sides are at their heads;
    when that op is shared with unselected ranks, that is not known.
    """
    if not outside:
        return roots
    unsure = {
        r
        for w in outside
        for r in w.waiters
        if (h := heads.get(r)) is not None and (h.group, h.seq, h.kind) == (w.group, w.seq, w.kind)
    }
    return [
        r for r in roots if r not in unsure or not all(w.queued for w in waits if r in w.targets)
    ]
