"""Small display helpers shared by the served pages and the offline report."""

from __future__ import annotations

import datetime as _dt
from collections.abc import Iterable

from hangwatch.rankspec import format_ranks


def rank_ranges(ranks: Iterable[int], *, limit: int = 0) -> str:
    """`[0, 1, 2, 3, 7, 9, 10]` -> `"0-3, 7, 9-10"`; readable at thousands of ranks.

    `limit` > 0 caps the number of ranges shown and says how many ranks were left out.
    """
    return format_ranks(ranks, sep=", ", limit=limit)


def when(unix: float | None) -> str:
    """UTC timestamp; UTC so that incidents from several clusters read alike."""
    if unix is None:
        return "unknown"
    return _dt.datetime.fromtimestamp(unix, tz=_dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"
