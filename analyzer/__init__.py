"""The cross-rank analyzer: flight-recorder dumps in, a typed verdict out.

    from hangwatch.analyzer import analyze_path
    report = analyze_path("dumps/")          # -> hangwatch.analyzer.report.Report
    print(report.summary, report.lagging_ranks)

`load_dumps` + `analyze` are the same two steps, separately (the coordinator
loads a bundle once and may analyze it per group).
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from hangwatch.analyzer.diagnose import analyze
from hangwatch.analyzer.loader import LoadedDumps, load_dumps
from hangwatch.analyzer.report import Report


def analyze_path(
    path: str | os.PathLike[str],
    *,
    prefix: str | None = None,
    world_size: int | None = None,
    selected_ranks: Iterable[int] | str | None = None,
    group: str | None = None,
    progress: bool = False,
) -> Report:
    """Load every dump under `path` (a directory or an incident bundle) and diagnose it."""
    loaded = load_dumps(
        path,
        prefix=prefix,
        world_size=world_size,
        selected_ranks=selected_ranks,
        progress=progress,
    )
    return analyze(loaded, world_size=world_size, group=group)


__all__ = ["LoadedDumps", "Report", "analyze", "analyze_path", "load_dumps"]
