"""Response models of the JSON API; they are what /docs and /openapi.json describe.

The incident report itself is the analyzer's `Report` dataclass (schema
`hangwatch.report/1`), embedded as is, so a client can feed `report` straight
to `Report.from_dict`.
"""

from __future__ import annotations

from typing import Any, TypeVar

from hangwatch.analyzer.report import Report
from hangwatch.server.incidents.action_records import ActionRecord
from hangwatch.server.live.detector import (
    MOVE_SPACING_S,
    QUIET_BOUND_FACTOR,
    QUIET_GAP_FACTOR,
    STEADY_MOVES,
)
from pydantic import BaseModel, Field

M = TypeVar("M", bound=BaseModel)


def from_record(model: type[M], record: object, **given: Any) -> M:
    """`model` with every field that `given` does not name read from `record`'s
    attribute of the same name: most views are their record's own fields, and
    naming each one twice let a field added to both be left out of the view.
    `given`: what the view computes or renames. A field the record lacks is an
    AttributeError, never a silent default. (A view that computes nothing is
    pydantic's own `model_validate(record, from_attributes=True)`, faster.)"""
    fields = {name: getattr(record, name) for name in model.model_fields if name not in given}
    return model.model_validate({**fields, **given})


JOB_STATE = (
    "live: its agents report and its ranks may run; ended: the coordinator still holds its"
    " state but every agent is gone or every rank exited (ended_reason says which);"
    " history: known only from stored incidents"
)


class JobSummary(BaseModel):
    job: str
    live: bool = Field(description="state is live: the job is running as far as anyone knows.")
    state: str = Field("history", description=JOB_STATE)
    ended_reason: str | None = Field(None, description="Ended: why the job is over.")
    world_size: int | None = None
    ranks_registered: int = 0
    ranks_observed: int = Field(0, description="Ranks whose agent is connected.")
    agents_connected: int = 0
    agents_total: int = 0
    stalled_groups: int = 0
    oldest_inflight_age_s: float | None = Field(
        None, description="Largest in-flight collective age over observed ranks, seconds."
    )
    open_incident: str | None = None
    progress_moves: int | None = Field(
        None,
        description=f"Reports that moved a counter, at most one per {MOVE_SPACING_S:g} s"
        " (live jobs only).",
    )
    quiet_rule: str | None = Field(
        None,
        description="The no-progress rule that would page a quiet period now (live jobs"
        f" only): rhythm once the job moved {STEADY_MOVES} times (quiet past the stall"
        f" timeout and {QUIET_GAP_FACTOR:g}x its longest gap), else bound (quiet past the"
        f" start-up grace or {QUIET_BOUND_FACTOR:g} stall timeouts).",
    )
    incidents: int = Field(0, description="Incidents stored for this job.")
    first_seen: float | None = Field(None, description="Unix seconds (store).")
    last_seen: float | None = Field(None, description="Unix seconds (store).")


class RankGroupState(BaseModel):
    group: str
    last_enqueued: int
    last_completed: int
    in_flight_seq: int | None = None
    in_flight_op: str = ""
    in_flight_age_s: float | None = None
    counts_p2p: bool = Field(
        False, description="The group's FR counters also count this rank's p2p ops."
    )
    collectives_enqueued: int | None = Field(
        None, description="last_enqueued in collective numbering; null: not known now."
    )
    collectives_completed: int | None = Field(
        None, description="last_completed in collective numbering; null: not known now."
    )


class RankState(BaseModel):
    rank: int
    host: str
    pid: int
    agent_id: str
    connected: bool = Field(description="Its agent's session is live.")
    observed: bool = Field(description="False when its agent is lost: unobserved, not guilty.")
    process_state: str
    lag: int = Field(
        description="Collectives behind the furthest member of any of its groups, counting "
        "both completed and enqueued collectives; p2p ops never count, and a group whose "
        "collective count is not known now (p2p since its FR entries were read) is left out."
    )
    p2p: bool = Field(False, description="Some group's FR counters also count its p2p ops.")
    lag_bucket: str = Field(description="Heat-map colour class: lag0..lag4, dead or unobserved.")
    last_completed: int | None = Field(
        None,
        description="Last completed collective in the rank's first (default) group; "
        "null when not known now.",
    )
    in_flight_op: str = ""
    in_flight_seq: int | None = None
    in_flight_age_s: float | None = Field(None, description="Oldest in-flight collective age.")
    last_report_age_s: float | None = None
    suspect: bool = Field(False, description="Named by a stalled group as not having entered.")
    groups: list[RankGroupState] = Field(default_factory=list)


class GroupState(BaseModel):
    name: str
    desc: str
    ranks: list[int]
    max_completed: int
    min_completed: int
    max_enqueued: int
    no_progress_for_s: float


class StalledState(BaseModel):
    group: str
    group_desc: str = ""
    seq: int
    op: str
    kind: str = Field(description="stall | rank-lost | agent-lost")
    waiting_ranks: list[int]
    not_entered_ranks: list[int]
    dead_ranks: list[int] = Field(default_factory=list)
    unobserved_ranks: list[int] = Field(default_factory=list)
    stalled_for_s: float
    over_timeout: bool
    busy_ranks: list[int] = Field(
        default_factory=list,
        description="The not-entered ranks, when every one is working: busy on a CPU or on "
        "storage (an evaluation, a checkpoint on one rank), or inside torch.compile while some "
        "rank of the job is busy. The stall opens an incident only at timeout_s, three stall "
        "timeouts.",
    )
    compiling_ranks: list[int] = Field(
        default_factory=list,
        description="Those of busy_ranks counted as working for being inside torch.compile "
        "(their agent's stack sample): waiting on a compile cache's lock, not on a peer.",
    )
    unheard_ranks: list[int] = Field(
        default_factory=list,
        description="Not-entered ranks whose numbers last arrived before the group last "
        "progressed: they may have entered since, so the stall opens no incident until their "
        "agent reports them again (at least once a heartbeat).",
    )
    timeout_s: float = Field(
        0.0, description="What stalled_for_s must reach for the stall to open an incident."
    )


class AgentState(BaseModel):
    agent_id: str
    host: str
    ranks: list[int]
    connected: bool
    watching: bool = Field(description="Has its command stream open.")
    last_report_age_s: float | None = None


class JobRanks(BaseModel):
    job: str
    live: bool
    state: str = Field("history", description=JOB_STATE)
    ended_reason: str | None = None
    world_size: int | None = None
    ranks: list[RankState]
    missing_ranks: list[int] = Field(
        default_factory=list, description="Ranks below world_size that no agent registered."
    )
    groups: list[GroupState] = Field(default_factory=list)
    stalled: list[StalledState] = Field(default_factory=list)
    agents: list[AgentState] = Field(default_factory=list)
    open_incident: str | None = None
    oldest_inflight_age_s: float | None = None


class IncidentSummary(BaseModel):
    id: str
    job: str
    created: float = Field(description="Unix seconds.")
    status: str = Field(
        description=(
            "collecting | analyzed | resolved | ended | failed. resolved: the stall cleared"
            " by itself (a transient stall); ended: the job stopped with it unresolved"
        )
    )
    open: bool = Field(
        False,
        description="Still needs someone: collecting or analyzed (not resolved/ended/failed).",
    )
    transient: bool = Field(False, description="Resolved: a stall that cleared by itself.")
    trigger: str
    verdict: str | None = None
    summary: str | None = None
    lagging_ranks: list[int] = Field(default_factory=list)
    detection_s: float | None = None
    closed_at: float | None = Field(None, description="Unix seconds it was resolved or ended.")
    stall_s: float | None = Field(
        None, description="Resolved: seconds from the stall's onset to progress resuming."
    )
    late_ranks: list[int] = Field(
        default_factory=list, description="Resolved: the ranks that were late."
    )
    close_reason: str | None = Field(None, description="Resolved/ended: what closed it.")


class IncidentDetail(IncidentSummary):
    reason: str
    updated: float
    ranks_expected: list[int] = Field(default_factory=list)
    ranks_dumped: list[int] = Field(default_factory=list)
    ranks_unreachable: dict[int, str] = Field(
        default_factory=dict, description="Rank -> why no dump could be taken from it."
    )
    error: str | None = None
    report: Report | None = Field(
        None,
        description="The analyzer's report, schema hangwatch.report/1 (null until analysed).",
    )
    actions: list[ActionRecord] = Field(
        default_factory=list,
        description="What the coordinator did about it (--exclude-command, --on-hang abort).",
    )


class Health(BaseModel):
    ok: bool


class Ready(BaseModel):
    ready: bool
    detail: str = ""


class ErrorBody(BaseModel):
    detail: str


class RankLatenessOut(BaseModel):
    rank: int
    host: str
    score: float = Field(
        description="Share of the window's instants at which the rank was behind its group's "
        "median member: the share of the job's time its peers spend waiting for it."
    )
    late_ms: float = Field(description="Mean lateness entering a collective, ms.")
    group: str = Field(description="The group its score is measured in (its worst).")
    ticks: int = Field(description="Instants observed in the window.")
    started_score: float | None = Field(
        None,
        description="The same share for starting collectives, where the backend records starts.",
    )
    straggler: bool
    long_run: bool = Field(
        False,
        description="Late 25%+ of the window but not a straggler: in one long run (a pause, "
        "or the start of a hang), not in repeated episodes.",
    )


class StragglerOut(BaseModel):
    rank: int
    host: str
    score: float
    late_ms: float
    since: float = Field(description="Unix seconds when it was named.")
    kind: str = Field(description="host: enqueues late; device: enqueues on time, starts late.")
    group: str


class JobStragglersOut(BaseModel):
    job: str
    window_s: float = Field(description="Length of the sliding window the scores cover.")
    tick_s: float = Field(description="Interval between the instants compared.")
    ranks: list[RankLatenessOut]
    stragglers: list[StragglerOut]
    none_named: str = Field(
        "No stragglers.",
        description="What to say when `stragglers` is empty: why a rank that scores high is not one.",
    )


class HostHistoryOut(BaseModel):
    """One host's history as culprit across every job in this store (server.incidents.hosts)."""

    host: str
    incidents: int = Field(description="Incidents whose culprit ranks it held, in the window.")
    jobs: int = Field(description="Distinct jobs among them.")
    first: float = Field(description="Unix seconds of the oldest of them.")
    last: float = Field(description="Unix seconds of the newest.")
    incident_ids: list[str] = Field(description="Newest first, 20 at most.")
    job_ids: list[str]
    gpus: list[int] = Field(description="NVML indices of the culprit ranks' GPUs, where known.")
    repeat_offender: bool = Field(
        description="At least --repeat-offender-incidents incidents within the window."
    )


class HostsOut(BaseModel):
    window_s: float = Field(description="--repeat-offender-window: how far back this counts.")
    threshold: int = Field(description="--repeat-offender-incidents.")
    hosts: list[HostHistoryOut] = Field(description="Most incidents first, then the newest.")
