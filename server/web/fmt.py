"""Small display helpers shared by the served pages and the offline report."""

from __future__ import annotations

import datetime as _dt


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
