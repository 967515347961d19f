"""An incident bundle's metadata: each rank's meta.json (and stacks), and incident.json.

The coordinator writes `meta.json` (schema `hangwatch.rankmeta/1`) next to a
rank's dumps with what the agent saw (host, process state, groups, stacks);
`incident.json` says an incident was triggered at all, which is what tells a
stall nobody can explain from a healthy snapshot. A bad file is one
`FileError`, never the end of the load.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from hangwatch.analyzer.report import FileError
from hangwatch.analyzer.text import one_line

from hangwatch import formats

MAX_META_BYTES = 16 * 1024**2
MAX_STACKS_BYTES = 4 * 1024**2


def read_json_file(p: Path, limit: int) -> Any:
    if p.stat().st_size > limit:
        raise ValueError(f"over the {limit}-byte limit")
    with open(p, "rb") as f:
        return json.loads(f.read())


def read_rank_meta(
    paths: Iterable[Path], base: Path, selected: set[int] | None
) -> tuple[dict[int, dict[str, Any]], list[FileError]]:
    """rank -> its meta.json, with "stacks" (text) and "_dir" (relative to `base`) added."""
    rank_meta: dict[int, dict[str, Any]] = {}
    errors: list[FileError] = []
    for mp in paths:
        rel = str(mp.relative_to(base))
        try:
            meta = read_json_file(mp, MAX_META_BYTES)
            if not isinstance(meta, dict) or meta.get("schema") != formats.RANKMETA:
                errors.append(
                    FileError(file=rel, error=f"meta.json without schema {formats.RANKMETA}")
                )
                continue
            r = meta.get("rank")
            if not isinstance(r, int) or isinstance(r, bool) or r < 0:
                errors.append(FileError(file=rel, error="meta.json has no integer rank"))
                continue
        except (OSError, ValueError, RecursionError) as e:
            errors.append(FileError(file=rel, error=f"unreadable meta.json: {one_line(str(e))}"))
            continue
        if selected is not None and r not in selected:
            continue
        embedded = meta.pop("stacks", None)
        if isinstance(embedded, str):  # tails-first bundles carry them in meta.json
            meta["stacks"] = embedded[:MAX_STACKS_BYTES]
        elif embedded is not None:
            errors.append(FileError(file=rel, error="meta.json 'stacks' is not text; ignored"))
        sp = mp.parent / formats.STACKS_FILE
        if sp.is_file():
            try:
                with open(sp, "rb") as f:
                    meta["stacks"] = f.read(MAX_STACKS_BYTES).decode("utf-8", "replace")
            except OSError as e:
                errors.append(
                    FileError(file=str(sp.relative_to(base)), error=f"cannot read: {e.strerror}")
                )
        meta["_dir"] = str(mp.parent.relative_to(base))
        rank_meta[r] = meta
    return rank_meta, errors


def read_incident(
    paths: Iterable[Path], base: Path
) -> tuple[dict[str, Any] | None, list[FileError]]:
    """The last valid incident.json, if any."""
    incident: dict[str, Any] | None = None
    errors: list[FileError] = []
    for ip in paths:
        try:
            doc = read_json_file(ip, MAX_META_BYTES)
            if isinstance(doc, dict) and doc.get("schema") == formats.INCIDENT:
                incident = doc
            else:
                errors.append(
                    FileError(
                        file=str(ip.relative_to(base)),
                        error=f"incident.json without schema {formats.INCIDENT}",
                    )
                )
        except (OSError, ValueError, RecursionError) as e:
            errors.append(
                FileError(
                    file=str(ip.relative_to(base)),
                    error=f"unreadable incident.json: {one_line(str(e))}",
                )
            )
    return incident, errors


def group_names(rank_meta: dict[int, dict[str, Any]]) -> set[str]:
    """Every group name the bundle metadata mentions."""
    return {
        str(g["name"])
        for meta in rank_meta.values()
        for g in meta.get("groups") or []
        if isinstance(g, dict) and g.get("name") is not None
    }
