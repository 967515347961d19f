"""What opens an incident: an agent's event, a stall the detector found, or a job gone quiet.

Each trigger is turned into one `Trigger`, the reason a person reads and the
structured record stored with the incident. Deciding whether it opens a new
incident or joins one is the manager's; the stored-incident lookup here is
the part of that dedupe that survives a coordinator restart.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from hangwatch.server.incidents.store import IncidentStore
from hangwatch.server.live.detector import JobQuiet
from hangwatch.server.live.registry import JobRegistry
from hangwatch.server.live.views import StalledGroup

from hangwatch import formats
from hangwatch.formats import IncidentDoc, RankMeta, StallKind, TriggerKind, nodearchive
from hangwatch.rankspec import format_ranks
from hangwatch.wire import event_kind_name, pb

# Events that open an incident at once. A rank exiting is not one of them:
# at a normal job end ranks exit while their peers' last reports still show
# the final collective in flight. The detector's rank-lost rule (peers alive
# and in flight, no progress for the stall timeout) catches a silent death;
# a rank whose hook recorded an uncaught exception before it died arrives as
# EVENT_KIND_RANK_CRASHED and opens a "crash" incident at once (crash_trigger).
EVENT_TRIGGERS: Final[dict[int, TriggerKind]] = {
    pb.EVENT_KIND_WATCHDOG_DUMP: TriggerKind.WATCHDOG,
    pb.EVENT_KIND_COLLECTIVE_TIMEOUT: TriggerKind.TIMEOUT,
    pb.EVENT_KIND_BACKEND_UNHEALTHY: TriggerKind.BACKEND_UNHEALTHY,
}
# Stall kinds that name their own trigger; the others open a "stall".
_STALL_TRIGGERS: Final = {
    StallKind.RANK_LOST: TriggerKind.RANK_LOST,
    StallKind.AGENT_LOST: TriggerKind.AGENT_LOST,
}
# How many of a job's latest stored incidents are read to dedupe a stall
# seen again after a restart.
STORED_DEDUPE_LOOKBACK: Final = 20


@dataclass(kw_only=True, frozen=True)
class Trigger:
    kind: TriggerKind  # the store's trigger column
    reason: str
    onset: float  # coordinator monotonic: best estimate of when the hang began
    keys: list[tuple[str, int]]  # the (group, seq) pairs this incident covers
    info: dict[str, Any] = field(default_factory=dict)  # incident.json's "trigger"


CRASH_MARK: Final = "uncaught exception: "


def crash_trigger(ev: pb.Event, registry: JobRegistry) -> Trigger:
    """A rank died of an uncaught exception (EVENT_KIND_RANK_CRASHED): the
    incident names the rank, how it died and the exception."""
    how, sep, exc = ev.detail.partition(CRASH_MARK)
    how = how.strip().rstrip(";").strip() or "process gone"
    exc = exc.strip() if sep else ev.detail.strip()
    key = registry.in_flight_key(ev.job_id)
    who = f"rank {ev.rank}" if ev.rank >= 0 else "a rank"
    reason = f"{who} crashed ({how}): uncaught exception {exc[:300]}"
    return Trigger(
        kind=TriggerKind.CRASH,
        reason=reason,
        onset=registry.now() - max(0.0, ev.age_s),
        keys=[key] if key else [],
        info={
            "kind": TriggerKind.CRASH,
            "event": event_kind_name(ev.kind),
            "rank": ev.rank,
            "how": how,
            "exception": exc[:2000],
            "detail": ev.detail[:2000],
        },
    )


def event_trigger(ev: pb.Event, registry: JobRegistry) -> Trigger | None:
    """The trigger an agent's event makes, or None for events that open nothing."""
    if ev.kind == pb.EVENT_KIND_RANK_CRASHED:
        return crash_trigger(ev, registry)
    kind = EVENT_TRIGGERS.get(ev.kind)
    if kind is None:
        return None
    # The event names no collective; what the job is inside now is the best
    # guess at which one it is about, and keeps later symptoms of it joined.
    key = registry.in_flight_key(ev.job_id)
    what = event_kind_name(ev.kind).removeprefix("EVENT_KIND_").lower().replace("_", " ")
    reason = f"{what} on rank {ev.rank}" if ev.rank >= 0 else what
    if ev.detail:
        reason += f": {ev.detail[:300]}"
    return Trigger(
        kind=kind,
        reason=reason,
        onset=registry.now() - max(0.0, ev.age_s),
        keys=[key] if key else [],
        info={
            "kind": kind,
            "event": event_kind_name(ev.kind),
            "rank": ev.rank,
            "detail": ev.detail[:2000],
        },
    )


def stall_trigger(stalls: list[StalledGroup], fresh: list[StalledGroup], now: float) -> Trigger:
    """The trigger for a job's stalls, named for the earliest of the `fresh` ones
    (those no incident covered yet); it covers and records all of them."""
    # The earliest stalled collective explains the rest (a subgroup hang
    # blocks the default group behind it).
    first = min(fresh, key=lambda s: (-s.stalled_for_s, s.seq, s.group))
    kind = _STALL_TRIGGERS.get(first.kind, TriggerKind.STALL)
    # A mismatch has no one op: its ops are named below, each with its ranks.
    op = f" ({first.op})" if first.op and not first.ops_entered else ""
    reason = (
        f"group {first.group} stalled at seq {first.seq}{op}: "
        f"ranks {format_ranks(first.waiting_ranks)} waiting"
    )
    if first.not_entered_ranks:
        reason += f", ranks {format_ranks(first.not_entered_ranks)} not entered"
    if first.kind == StallKind.MISMATCH:
        reason += ", but members entered different ops at that seq"
        if first.ops_entered:
            # The analyzer's op-mismatch finding words it the same way.
            ops = sorted(first.ops_entered.items())
            reason += ": " + ", ".join(f"{o} on {format_ranks(r)}" for o, r in ops)
    if first.dead_ranks:
        reason += f", ranks {format_ranks(first.dead_ranks)} stopped or gone"
    if first.unobserved_ranks:
        reason += f", ranks {format_ranks(first.unobserved_ranks)} unobserved"
    reason += f"; no progress for {first.stalled_for_s:.1f}s"
    if first.busy_ranks:
        # Deferred as work (stalls.busy_laggards): say why it took longer.
        cpu = [r for r in first.busy_ranks if r not in first.compiling_ranks]
        how = [f"ranks {format_ranks(cpu)} busy on a CPU or storage"] if cpu else []
        if first.compiling_ranks:
            how.append(f"ranks {format_ranks(first.compiling_ranks)} inside torch.compile")
        reason += (
            f", {' and '.join(how)} all along, past the {first.timeout_s:.0f}s bound for busy ranks"
        )
    return Trigger(
        kind=kind,
        reason=reason,
        onset=now - first.stalled_for_s,
        keys=[(s.group, s.seq) for s in stalls],
        info={
            "kind": kind,
            "stalled": [
                {
                    "group": s.group,
                    "seq": s.seq,
                    "op": s.op,
                    "kind": s.kind,
                    "waiting_ranks": s.waiting_ranks,
                    "not_entered_ranks": s.not_entered_ranks,
                    "dead_ranks": s.dead_ranks,
                    "unobserved_ranks": s.unobserved_ranks,
                    "stalled_for_s": round(s.stalled_for_s, 3),
                    **({"ops_entered": s.ops_entered} if s.ops_entered else {}),
                    **({"busy_ranks": s.busy_ranks} if s.busy_ranks else {}),
                    **({"compiling_ranks": s.compiling_ranks} if s.compiling_ranks else {}),
                }
                for s in stalls
            ],
        },
    )


log = logging.getLogger("hangwatch.server")

NO_PROGRESS: Final = TriggerKind.NO_PROGRESS
# The key a no-progress incident covers: one per quiet period, named by how
# many moves the job had made when it went quiet (a later quiet period is a
# new hang; the same one seen again joins the first).
QUIET_KEY: Final = "<no-progress>"


def quiet_trigger(quiet: JobQuiet, now: float) -> Trigger:
    """The job stopped with every rank alive and none in a collective: FR has
    nothing to say (gloo records no send/recv; a rank stuck in Python before
    its next collective moves no counter), so the verdict must come from the
    stacks every rank's dump carries."""
    if quiet.rule == "bound":
        busy = f", ranks {format_ranks(quiet.busy_ranks)} busy" if quiet.busy_ranks else ""
        if quiet.compiling_ranks:
            busy += f" (ranks {format_ranks(quiet.compiling_ranks)} inside torch.compile)"
        who = f"ranks {format_ranks(quiet.idle_ranks)} idle{busy}"
        reason = (
            f"no progress for {quiet.quiet_for_s:.1f}s on any rank, past the "
            f"{quiet.threshold_s:.0f}s bound ({who}, none in a collective): "
            "FR cannot see this hang; diagnosing from the stacks"
        )
    else:
        reason = (
            f"no progress for {quiet.quiet_for_s:.1f}s on any rank "
            f"(ranks {format_ranks(quiet.ranks)} alive, none in a collective): "
            "FR cannot see this hang; diagnosing from the stacks"
        )
    return Trigger(
        kind=NO_PROGRESS,
        reason=reason,
        onset=now - quiet.quiet_for_s,
        keys=[(QUIET_KEY, quiet.moves)],
        info={
            "kind": NO_PROGRESS,
            "quiet_for_s": round(quiet.quiet_for_s, 3),
            "threshold_s": round(quiet.threshold_s, 3),
            "moves_before": quiet.moves,
            "longest_gap_s": round(quiet.longest_gap_s, 3),
            "ranks": quiet.ranks,
            "rule": quiet.rule,
            "idle_ranks": quiet.idle_ranks,
            "busy_ranks": quiet.busy_ranks,
            "compiling_ranks": quiet.compiling_ranks,
            "cores": {str(r): c for r, c in quiet.cores.items()},
            "io_mib_s": {str(r): v for r, v in quiet.io_mib_s.items()},
        },
    )


def stored_incident_for(
    store: IncidentStore, registry: JobRegistry, job_id: str, keys: list[tuple[str, int]]
) -> str | None:
    """A stored incident of this job that already covers one of these stalled
    (group, seq) pairs, if any (only recent incidents are read).

    The in-memory dedupe is lost when the coordinator restarts in the middle
    of a hang; the incidents on disk still say what they covered."""
    wanted = set(keys)
    for row in store.list_incidents(job_id=job_id, limit=STORED_DEDUPE_LOOKBACK):
        path = store.incident_dir(row.id) / formats.INCIDENT_FILE
        try:
            covered = IncidentDoc.from_bytes(path.read_bytes()).stalled_keys()
        except (OSError, formats.FormatError):
            continue
        if covered & wanted and _same_processes(store, registry, job_id, row.id):
            return row.id
    return None


def _same_processes(
    store: IncidentStore, registry: JobRegistry, job_id: str, incident_id: str
) -> bool:
    """Whether the stored incident was taken from the ranks running now: a
    job restarted under the same id reaches the same seqs again, and that
    is a new hang, not the old one."""
    bundle = store.incident_dir(incident_id)
    for data in itertools.islice(_some_metas(bundle), 8):
        try:
            meta = RankMeta.from_bytes(data)
        except formats.FormatError:
            continue
        live = registry.rank_meta(job_id, meta.rank)
        if meta.pid is not None and live is not None and live.pid is not None:
            return live.pid == meta.pid
    return False


def _some_metas(bundle: Path) -> Iterator[bytes]:
    """meta.json files of a bundle, from the rank directories, then from the
    node archives (a large incident's phase one stores them there)."""
    for meta_path in sorted(bundle.glob(f"rank_*/{formats.META_FILE}")):
        try:
            yield meta_path.read_bytes()
        except OSError:
            continue
    try:
        for path in nodearchive.archives(bundle):
            try:
                for m in nodearchive.list_members(path):
                    if m.name == formats.META_FILE:
                        yield nodearchive.read(m, formats.MAX_RANKMETA_BYTES)
            except nodearchive.ArchiveError as e:
                log.debug("%s: skipped for the restart check: %s", path, e)
                continue
    finally:
        nodearchive.release()
