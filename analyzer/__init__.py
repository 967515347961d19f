"""The cross-rank analyzer: flight-recorder dumps in, a typed verdict out.

    from hangwatch.analyzer import analyze_path
    report = analyze_path("dumps/")          # -> hangwatch.analyzer.report.Report
    print(report.summary, report.lagging_ranks)

`load_dumps` + `analyze` are the same two steps, separately (the coordinator
loads a bundle once and may analyze it per group).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hangwatch.analyzer.diagnose import analyze
    from hangwatch.analyzer.loader import LoadedDumps, load_dumps
    from hangwatch.analyzer.report import Report

# Imported on first use, not with the package: the node agent reads pickles
# through hangwatch.safepickle when it cuts FR tails, and must not
# pay for pandas and numpy (~100 MB, ~1 s) in the sidecar to do so.
_LAZY = {
    "analyze": "hangwatch.analyzer.diagnose",
    "LoadedDumps": "hangwatch.analyzer.loader",
    "load_dumps": "hangwatch.analyzer.loader",
    "Report": "hangwatch.analyzer.report",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def analyze_path(
    path: str | os.PathLike[str],
    *,
    prefix: str | None = None,
    world_size: int | None = None,
    selected_ranks: Iterable[int] | str | None = None,
    group: str | None = None,
    progress: bool = False,
    on_progress: Callable[[int, int], None] | None = None,
) -> Report:
    """Load every dump under `path` (a directory or an incident bundle) and diagnose it.

    `on_progress(done, total)` follows the reading of the dump files; the
    library draws nothing, so `progress` is accepted for old callers and ignored.
    """
    from hangwatch.analyzer.diagnose import analyze
    from hangwatch.analyzer.loader import load_dumps

    loaded = load_dumps(
        path,
        prefix=prefix,
        world_size=world_size,
        selected_ranks=selected_ranks,
        progress=progress,
        on_progress=on_progress,
    )
    return analyze(loaded, world_size=world_size, group=group)


__all__ = ["LoadedDumps", "Report", "analyze", "analyze_path", "load_dumps"]
