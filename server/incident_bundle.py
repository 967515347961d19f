"""The files the coordinator itself writes into an incident's bundle.

incident.json says what the incident is and, once collection ends, which
ranks were dumped; ranks nobody could dump get a meta.json from what
registration knew, so the analyzer can still place them in their groups.
Both are written atomically: the dashboard and the analyzer may read them
at any moment.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hangwatch.server.incident_collection import Collection

from hangwatch import formats

RankMeta = Callable[[str, int], dict[str, object] | None]  # (job, rank) -> what is known


def write_incident_json(
    bundle: Path,
    inc: Collection,
    reason: str | None,
    *,
    dumped: set[int] | None = None,
    unreachable: dict[int, str] | None = None,
) -> None:
    """Write incident.json; with `reason` None, update the outcome of the one
    written when the incident opened (if it could be written then)."""
    bundle.mkdir(parents=True, exist_ok=True)
    path = bundle / formats.INCIDENT_FILE
    doc: dict[str, Any]
    if reason is None and path.exists():
        doc = json.loads(path.read_text(encoding="utf-8"))
    else:
        doc = {
            "schema": formats.INCIDENT,
            "id": inc.incident_id,
            "job_id": inc.job_id,
            "reason": reason or "",
            "created_unix": inc.created,
            "trigger": inc.trigger_info,
            "world_size": inc.world_size,
            "ranks_expected": sorted(inc.expected),
            # > 0: ranks' FR dumps were collected as tails (hangwatch.frtail).
            "tail_context": inc.tail_context,
        }
    doc["ranks_dumped"] = sorted(dumped if dumped is not None else inc.dumped)
    doc["ranks_unreachable"] = {
        str(r): why
        for r, why in sorted((unreachable if unreachable is not None else inc.unreachable).items())
    }
    formats.atomic_write(path, (json.dumps(doc, indent=2) + "\n").encode(), durable=True)


def write_unreachable_meta(
    inc: Collection, bundle: Path, unreachable: dict[int, str], rank_meta: RankMeta
) -> None:
    """For ranks nobody dumped, record what registration knew (host, pid,
    group memberships) so the analyzer can still place them in groups."""
    for r, why in unreachable.items():
        meta_path = bundle / f"rank_{r}" / formats.META_FILE
        if meta_path.exists():
            continue
        known = rank_meta(inc.job_id, r)
        meta: dict[str, Any] = {
            "schema": formats.RANKMETA,
            "rank": r,
            "host": None,
            "pid": None,
            "process_state": "unknown",
            "groups": [],
        }
        if known:
            meta.update(known)
        meta["reachable"] = False
        meta["sources"] = {
            "fr": "none",
            "stacks": "none",
            "gpu": "none",
            "process": "coordinator",
        }
        meta["errors"] = {"fr": why, "stacks": why}
        meta_path.parent.mkdir(parents=True, exist_ok=True)
        formats.atomic_write(meta_path, (json.dumps(meta, indent=2) + "\n").encode(), durable=True)
