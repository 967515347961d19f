"""The files the coordinator itself writes into an incident's bundle.

incident.json says what the incident is and, once collection ends, which
ranks were dumped; ranks nobody could dump get a meta.json from what
registration knew, so the analyzer can still place them in their groups.
Both are written atomically: the dashboard and the analyzer may read them
at any moment.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from hangwatch.server.incidents.collection import Collection

from hangwatch import formats
from hangwatch.formats import IncidentDoc, RankMeta, nodearchive
from hangwatch.formats.rankmeta import STAND_IN_SOURCE

KnownMeta = Callable[[str, int], RankMeta | None]  # (job, rank) -> what is known


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
    dumped = dumped if dumped is not None else inc.dumped
    unreachable = unreachable if unreachable is not None else inc.unreachable
    if reason is None and revise_outcome(bundle, dumped, unreachable):
        return
    doc = IncidentDoc(
        id=inc.incident_id,
        job_id=inc.job_id,
        reason=reason or "",
        created_unix=inc.created,
        trigger=inc.trigger_info,
        world_size=inc.world_size,
        ranks_expected=tuple(sorted(inc.expected)),
        tail_context=inc.tail_context,
    ).with_outcome(dumped, unreachable)
    formats.atomic_write(bundle / formats.INCIDENT_FILE, doc.to_bytes(), durable=True)


def revise_outcome(bundle: Path, dumped: set[int], unreachable: dict[int, str]) -> bool:
    """Rewrite the outcome of the incident.json written at open (at the verdict,
    or after a late dump); False when there is none (a full disk at open)."""
    path = bundle / formats.INCIDENT_FILE
    if not path.exists():
        return False
    doc = IncidentDoc.from_bytes(path.read_bytes()).with_outcome(dumped, unreachable)
    formats.atomic_write(path, doc.to_bytes(), durable=True)
    return True


def is_stand_in(path: str | Path) -> bool:
    """`path` is a meta.json the coordinator wrote for an undumped rank (blocking:
    reads the small file; called only where a meta.json already exists)."""
    if Path(path).name != formats.META_FILE:
        return False
    try:
        meta = RankMeta.from_bytes(Path(path).read_bytes())
    except (OSError, ValueError):
        return False
    return meta.stand_in


def write_unreachable_meta(
    inc: Collection, bundle: Path, unreachable: dict[int, str], known_meta: KnownMeta
) -> None:
    """For ranks nobody dumped, record what registration knew (host, pid,
    group memberships) so the analyzer can still place them in groups. Not
    for a rank whose own meta.json is in place, in its directory or in a
    node archive."""
    archived, _ = nodearchive.index(bundle) if unreachable else ({}, [])
    for r, why in unreachable.items():
        meta_path = bundle / f"rank_{r}" / formats.META_FILE
        if (r, formats.META_FILE) in archived or meta_path.exists():
            continue
        meta = (known_meta(inc.job_id, r) or RankMeta(rank=r, process_state="unknown")).replace(
            reachable=False,
            sources={"fr": "none", "stacks": "none", "gpu": "none", "process": STAND_IN_SOURCE},
            errors={"fr": why, "stacks": why},
        )
        meta_path.parent.mkdir(parents=True, exist_ok=True)
        formats.atomic_write(meta_path, meta.to_bytes(pretty=True), durable=True)
