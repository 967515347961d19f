"""An incident bundle's metadata: each rank's meta.json (and stacks), and incident.json.

The agent writes `meta.json` (`formats.RankMeta`) next to a rank's dumps
with what it saw (host, process state, groups, stacks), the coordinator one
for each rank nobody could dump; `incident.json` (`formats.IncidentDoc`)
says an incident was triggered at all, which is what tells a stall nobody
can explain from a healthy snapshot. A bad file is one `FileError`, never
the end of the load.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

from hangwatch.analyzer.report import FileError
from hangwatch.analyzer.text import one_line

from hangwatch import formats
from hangwatch.formats import IncidentDoc, RankMeta, nodearchive
from hangwatch.formats.checks import loads, read_file

MAX_META_BYTES = formats.MAX_RANKMETA_BYTES
MAX_STACKS_BYTES = 4 * 1024**2


def read_rank_meta(
    paths: Iterable[Path | nodearchive.Member],
    base: Path,
    selected: set[int] | None,
    archived_stacks: Mapping[int, nodearchive.Member] | None = None,
) -> tuple[dict[int, RankMeta], list[FileError]]:
    """rank -> its meta.json, with the stacks text from stacks.txt where there
    is one. A meta.json is a file or a node archive's member (`archived_stacks`:
    the archives' stacks.txt by rank). A rank with two keeps its own over the
    coordinator's stand-in (the rank's arrived after all)."""
    rank_meta: dict[int, RankMeta] = {}
    errors: list[FileError] = []
    for mp in paths:
        try:
            if isinstance(mp, nodearchive.Member):
                raw = loads(nodearchive.read(mp, MAX_META_BYTES), formats.RANKMETA, MAX_META_BYTES)
            else:
                raw = read_file(mp, formats.RANKMETA, MAX_META_BYTES)
            # Stacks of the wrong type lose only the stacks, not the rank's metadata.
            bad_stacks = isinstance(raw, dict) and not isinstance(raw.get("stacks"), str | None)
            if bad_stacks:
                del raw["stacks"]
            meta = RankMeta.from_json(raw)
        except (OSError, ValueError) as e:
            errors.append(
                FileError(file=_rel(mp, base), error=f"unreadable meta.json: {one_line(str(e))}")
            )
            continue
        if selected is not None and meta.rank not in selected:
            continue
        prev = rank_meta.get(meta.rank)
        if prev is not None and meta.stand_in and not prev.stand_in:
            continue
        # Tails-first bundles carry the stacks in meta.json.
        stacks = None if meta.stacks is None else meta.stacks[:MAX_STACKS_BYTES]
        if bad_stacks:
            errors.append(
                FileError(file=_rel(mp, base), error="meta.json 'stacks' is not text; ignored")
            )
        if isinstance(mp, nodearchive.Member):
            sm = (archived_stacks or {}).get(mp.rank)
            if sm is not None:
                try:
                    stacks = nodearchive.read(sm, MAX_STACKS_BYTES).decode("utf-8", "replace")
                except nodearchive.ArchiveError as e:
                    errors.append(FileError(file=_rel(sm, base), error=str(e)))
        else:
            sp = mp.parent / formats.STACKS_FILE
            if sp.is_file():
                try:
                    with open(sp, "rb") as f:
                        stacks = f.read(MAX_STACKS_BYTES).decode("utf-8", "replace")
                except OSError as e:
                    errors.append(
                        FileError(
                            file=str(sp.relative_to(base)), error=f"cannot read: {e.strerror}"
                        )
                    )
        # Most metas keep what they say; replace() costs microseconds a rank.
        rank_meta[meta.rank] = meta if stacks is meta.stacks else meta.replace(stacks=stacks)
    return rank_meta, errors


def _rel(p: Path | nodearchive.Member, base: Path) -> str:
    if isinstance(p, nodearchive.Member):
        return f"{Path(p.archive).relative_to(base)}!{p.member}"
    return str(p.relative_to(base))


def read_incident(paths: Iterable[Path], base: Path) -> tuple[IncidentDoc | None, list[FileError]]:
    """The last valid incident.json, if any."""
    incident: IncidentDoc | None = None
    errors: list[FileError] = []
    for ip in paths:
        try:
            raw = read_file(ip, formats.INCIDENT, formats.MAX_INCIDENT_BYTES)
            incident = IncidentDoc.from_json(raw)
        except (OSError, ValueError) as e:
            errors.append(
                FileError(
                    file=str(ip.relative_to(base)),
                    error=f"unreadable incident.json: {one_line(str(e))}",
                )
            )
    return incident, errors


def group_names(rank_meta: dict[int, RankMeta]) -> set[str]:
    """Every group name the bundle metadata mentions."""
    return {g.name for meta in rank_meta.values() for g in meta.groups}
