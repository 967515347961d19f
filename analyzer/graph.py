"""The waits-for graph: its terminal components (roots and cycles), and who is blamed in a cycle.

Roots are where the waiting ends: terminal strongly-connected components
that someone waits on. A single rank that waits on nobody is a root (compute
hang, frozen, crashed GPU, no dump); a cycle is a cross-group deadlock.

The dashboard draws what is computed here (`Report.roots`, `Report.cycles`);
`rank_terminals` is the same classification for bare edges, which is all an
old report carries.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator
from typing import Any

from hangwatch.analyzer.report import WaitEdge
from hangwatch.analyzer.waits import Wait

# Evidence of the graph, not the graph: at 4,096 ranks keep the report readable.
MAX_WAIT_EDGES = 512


def wait_terminals(waits: list[Wait]) -> tuple[list[int], list[list[int]]]:
    """(single-rank roots, cycles) of the graph the waits make.

    Hyper-edges go through one virtual node per Wait, so the graph stays
    linear in size when a thousand ranks wait on the same few.
    """
    adj: dict[Hashable, set[Hashable]] = {}
    for i, w in enumerate(waits):
        if not w.targets:
            continue
        h = ("w", i)
        adj.setdefault(h, set()).update(w.targets)
        for r in w.waiters:
            adj.setdefault(r, set()).add(h)
        for t in w.targets:
            adj.setdefault(t, set())
    targets: set[int] = set().union(*(w.targets for w in waits)) if waits else set()
    return _terminals(adj, targets)


def rank_terminals(pairs: Iterable[tuple[int, int]]) -> tuple[list[int], list[list[int]]]:
    """(single-rank roots, cycles) of a graph given as (waiter, waits_on) pairs."""
    adj: dict[Hashable, set[Hashable]] = {}
    targets: set[int] = set()
    for a, b in pairs:
        if a == b:
            continue  # waiting on oneself is no wait on anyone
        adj.setdefault(a, set()).add(b)
        adj.setdefault(b, set())
        targets.add(b)
    return _terminals(adj, targets)


def _terminals(
    adj: dict[Hashable, set[Hashable]], targets: set[int]
) -> tuple[list[int], list[list[int]]]:
    comp = tarjan(adj)
    comp_of = {n: ci for ci, nodes in enumerate(comp) for n in nodes}
    out_edges: dict[int, bool] = {ci: False for ci in range(len(comp))}
    for n, nbrs in adj.items():
        for m in nbrs:
            if comp_of[n] != comp_of[m]:
                out_edges[comp_of[n]] = True
    singles: list[int] = []
    cycles: list[list[int]] = []
    for ci, nodes in enumerate(comp):
        if out_edges[ci]:
            continue
        ranks = sorted(n for n in nodes if isinstance(n, int))
        if len(nodes) > 1:
            cycles.append(ranks)
        elif ranks and ranks[0] in targets:
            singles.append(ranks[0])
    return sorted(set(singles)), cycles


def cycle_sides(cycle: list[int], waits: list[Wait]) -> dict[tuple[str, int], set[int]]:
    """The ranks of a cycle, grouped by the (group, seq) each is blocked in."""
    cs = set(cycle)
    sides: dict[tuple[str, int], set[int]] = {}
    for w in waits:
        if w.targets & cs:
            for r in w.waiters & cs:
                sides.setdefault((w.group, w.seq), set()).add(r)
    return sides


def blame_in_cycles(roots: list[int], cycles: list[list[int]], waits: list[Wait]) -> list[int]:
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
        sides = list(cycle_sides(c, waits).values())
        smallest = min((len(v) for v in sides), default=0)
        if len(sides) < 2 or all(len(v) == smallest for v in sides):
            blamed.update(c)
        else:
            blamed.update(r for v in sides if len(v) == smallest for r in v)
    return sorted(blamed)


def edges(waits: list[Wait]) -> list[WaitEdge]:
    """The rank-to-rank edges, capped at MAX_WAIT_EDGES, in (group, seq) order."""
    out: list[WaitEdge] = []
    for w in sorted(waits, key=lambda w: (w.group, w.seq)):
        for a in sorted(w.waiters):
            peers = w.detail.get(a, w.targets) if w.kind == "p2p" else w.targets
            for b in sorted(peers):
                if len(out) >= MAX_WAIT_EDGES:
                    return out
                out.append(WaitEdge(waiter=a, waits_on=b, group=w.group, seq=w.seq))
    return out


def tarjan(adj: dict[Any, set[Any]]) -> list[list[Any]]:
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
