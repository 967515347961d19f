"""Small text helpers shared by the diagnosis sentences and the terminal report."""

from __future__ import annotations

from collections.abc import Iterable


def rank_list(ranks: Iterable[int], *, limit: int = 12) -> str:
    """[0,1,2,3,7,9,10] -> '0-3,7,9,10'; long lists end with '... (N ranks)'."""
    rs = sorted(set(ranks))
    if not rs:
        return "none"
    spans: list[tuple[int, int]] = []
    for r in rs:
        if spans and r == spans[-1][1] + 1:
            spans[-1] = (spans[-1][0], r)
        else:
            spans.append((r, r))
    parts = [str(a) if a == b else (f"{a},{b}" if b == a + 1 else f"{a}-{b}") for a, b in spans]
    if len(parts) > limit:
        return ",".join(parts[:limit]) + f",... ({len(rs)} ranks)"
    return ",".join(parts)


def plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"
