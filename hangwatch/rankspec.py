"""Rank lists as people read them: `[0, 1, 2, 3, 7, 9, 10]` -> `0-3,7,9,10`.

The one way every place prints ranks (the analyzer's sentences, the incident
reasons, webhooks, the dashboard, the terminal): the same ranks read the same
everywhere. Incidents name hundreds of ranks, so runs collapse and long lists
are capped.
"""

from __future__ import annotations

from collections.abc import Iterable


def spans(ranks: Iterable[int]) -> list[tuple[int, int]]:
    """Sorted distinct ranks as inclusive (first, last) runs."""
    out: list[tuple[int, int]] = []
    for r in sorted(set(ranks)):
        if out and r == out[-1][1] + 1:
            out[-1] = (out[-1][0], r)
        else:
            out.append((r, r))
    return out


def format_ranks(ranks: Iterable[int], *, limit: int = 12) -> str:
    """The ranks as runs, "none" when empty: `[0, 1, 2, 3, 7, 9, 10]` -> `0-3,7,9,10`.

    A run of three or more collapses to `a-b`; a pair stays `9,10`, which reads
    as two ranks. `limit` caps the runs shown (12, about a line of prose; 0
    for all) and ends with the total: `0,2,4,... (50 ranks)`.
    """
    runs = spans(ranks)
    if not runs:
        return "none"
    parts = [str(a) if a == b else f"{a},{b}" if b == a + 1 else f"{a}-{b}" for a, b in runs]
    if limit <= 0 or len(parts) <= limit:
        return ",".join(parts)
    return ",".join(parts[:limit]) + f",... ({sum(b - a + 1 for a, b in runs)} ranks)"
