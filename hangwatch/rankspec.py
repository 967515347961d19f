"""Rank lists as people read them: `[0, 1, 2, 3, 7, 9, 10]` -> `0-3,7,9-10`.

One implementation for every place that prints ranks (the analyzer's
sentences, the incident reasons, the dashboard); each keeps its own
punctuation, which its readers and tests know, through the arguments.
Incidents name hundreds of ranks, so runs collapse and long lists are capped.
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


def format_ranks(
    ranks: Iterable[int],
    *,
    sep: str = ",",
    pairs_as_ranges: bool = True,
    limit: int = 0,
    more: str = "ranges",
) -> str:
    """The ranks as runs joined by `sep`; "none" when empty.

    `pairs_as_ranges=False` writes a run of two as "9,10" rather than "9-10".
    `limit` > 0 caps the runs shown; what follows says what was left out:
    `more="ranges"` -> " (+N more)" ranks, `more="total"` -> ",... (N ranks)".
    """
    runs = spans(ranks)
    if not runs:
        return "none"

    def run(a: int, b: int) -> str:
        if a == b:
            return str(a)
        if b == a + 1 and not pairs_as_ranges:
            return f"{a}{sep}{b}"
        return f"{a}-{b}"

    parts = [run(a, b) for a, b in runs]
    if limit <= 0 or len(parts) <= limit:
        return sep.join(parts)
    if more == "total":
        return sep.join(parts[:limit]) + f"{sep}... ({sum(b - a + 1 for a, b in runs)} ranks)"
    shown = runs[:limit]
    rest = sum(b - a + 1 for a, b in runs[limit:])
    return sep.join(run(a, b) for a, b in shown) + f" (+{rest} more)"
