"""What a run directory's hook events say (`<run_dir>/hook/<pid>.events.jsonl`)."""

from __future__ import annotations

import json
from pathlib import Path

from hangwatch.formats import HookEventKind


def first_abort_unix(run_dir: Path) -> float:
    """When torch first called the hook's abort hook on any rank of the run."""
    times = [
        float(doc["unix"])
        for f in (run_dir / "hook").glob("*.events.jsonl")
        for doc in map(json.loads, f.read_text().splitlines())
        if doc.get("kind") == HookEventKind.BACKEND_ABORT
    ]
    if not times:
        raise AssertionError(f"no backend-abort event under {run_dir / 'hook'}")
    return min(times)
