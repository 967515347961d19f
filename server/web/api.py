"""The JSON API. Every response model is in `schemas`, so /docs describes it."""

from __future__ import annotations

import dataclasses
import datetime as _dt
import time
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Query, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from hangwatch.server.app_state import ServerContext
from hangwatch.server.incidents.hosts import OffenderRule
from hangwatch.server.incidents.store import IncidentRow, UnknownIncident
from hangwatch.server.web import bundle, live, prom, schemas

router = APIRouter()

MAX_LIMIT = 1000


def ctx_of(request: Request) -> ServerContext:
    ctx: ServerContext = request.app.state.ctx
    return ctx


def parse_time(value: str | None, name: str) -> float | None:
    """Unix seconds, or ISO 8601 (naive means UTC); a clear 422 otherwise."""
    if value is None or value.strip() == "":
        return None
    v = value.strip()
    try:
        return float(v)
    except ValueError:
        pass
    try:
        t = _dt.datetime.fromisoformat(v.replace("Z", "+00:00"))
    except ValueError:
        raise HTTPException(
            422, f"{name}={value!r}: expected unix seconds or an ISO 8601 time"
        ) from None
    if t.tzinfo is None:
        t = t.replace(tzinfo=_dt.UTC)
    return t.timestamp()


def incident_summary(row: IncidentRow) -> schemas.IncidentSummary:
    return schemas.IncidentSummary(**row.summary_fields())


def incident_detail(row: IncidentRow) -> schemas.IncidentDetail:
    return schemas.from_record(schemas.IncidentDetail, row, **incident_summary(row).model_dump())


def list_incident_rows(
    ctx: ServerContext,
    *,
    job: str | None,
    since: str | None,
    until: str | None,
    verdict: str | None,
    status: str | None = None,
    host: str | None = None,
    before: str | None = None,
    limit: int,
) -> list[IncidentRow]:
    try:
        return ctx.store.list_incidents(
            job_id=job or None,
            since=parse_time(since, "since"),
            until=parse_time(until, "until"),
            verdict=verdict or None,
            status=status or None,
            host=host or None,
            before=before or None,
            limit=limit,
        )
    except UnknownIncident:
        raise HTTPException(400, f"before: no incident {before!r} to page after") from None


def job_ranks_or_404(ctx: ServerContext, job: str) -> schemas.JobRanks:
    snap = ctx.registry.snapshot(job)
    if snap is not None:
        stored = live.without_store(lambda: ctx.store.newest_open(job), {})
        return live.job_ranks(snap, ctx.registry.oldest_in_flight_age(job), stored.get(job))
    if any(j.job_id == job for j in ctx.store.list_jobs()):
        return schemas.JobRanks(job=job, live=False, ranks=[])
    raise HTTPException(404, f"unknown job {job!r}")


def job_stragglers_or_404(ctx: ServerContext, job: str) -> schemas.JobStragglersOut:
    view = ctx.stragglers.view(job) if ctx.stragglers is not None else None
    if view is None:
        job_ranks_or_404(ctx, job)  # 404 for a job nobody knows
        window = ctx.stragglers.window_s if ctx.stragglers is not None else 0.0
        return schemas.JobStragglersOut(
            job=job, window_s=window, tick_s=0.0, ranks=[], stragglers=[]
        )
    doc = dataclasses.asdict(view)
    for out, r in zip(doc["ranks"], view.ranks, strict=True):
        out["long_run"] = r.long_run
    return schemas.JobStragglersOut.model_validate({**doc, "none_named": view.none_named})


def incident_or_404(ctx: ServerContext, incident_id: str) -> IncidentRow:
    row = ctx.store.get_incident(incident_id)
    if row is None:
        raise HTTPException(404, f"unknown incident {incident_id!r}")
    return row


NOT_FOUND: dict[int | str, dict[str, Any]] = {
    404: {"model": schemas.ErrorBody, "description": "No such job or incident."}
}
UNAUTHORIZED: dict[int | str, dict[str, Any]] = {
    401: {"model": schemas.ErrorBody, "description": "Token missing or wrong."}
}


@router.get("/api/jobs", response_model=list[schemas.JobSummary], responses=UNAUTHORIZED)
def api_jobs(request: Request) -> list[schemas.JobSummary]:
    """Jobs with live state, then jobs known only from stored incidents."""
    ctx = ctx_of(request)
    return live.job_summaries(ctx.registry, ctx.store)


@router.get(
    "/api/jobs/{job}/ranks",
    response_model=schemas.JobRanks,
    responses={**NOT_FOUND, **UNAUTHORIZED},
)
def api_job_ranks(job: str, request: Request) -> schemas.JobRanks:
    """Live progress per rank and group, stalled groups and agents of one job."""
    return job_ranks_or_404(ctx_of(request), job)


@router.get(
    "/api/jobs/{job}/stragglers",
    response_model=schemas.JobStragglersOut,
    responses={**NOT_FOUND, **UNAUTHORIZED},
)
def api_job_stragglers(job: str, request: Request) -> schemas.JobStragglersOut:
    """How late each rank enters collectives against its group's median member, over a
    sliding window, and the ranks named as stragglers (slow, not hung)."""
    return job_stragglers_or_404(ctx_of(request), job)


@router.get("/api/incidents", response_model=list[schemas.IncidentSummary], responses=UNAUTHORIZED)
def api_incidents(
    request: Request,
    job: Annotated[str | None, Query(description="Only this job.")] = None,
    since: Annotated[
        str | None, Query(description="Created at or after: unix seconds or ISO 8601 (UTC).")
    ] = None,
    until: Annotated[
        str | None, Query(description="Created at or before: unix seconds or ISO 8601 (UTC).")
    ] = None,
    verdict: Annotated[
        str | None,
        Query(description="hang, mismatch, crash, healthy, no-culprit-visible or unknown."),
    ] = None,
    status: Annotated[
        str | None, Query(description="collecting, analyzed, resolved, ended or failed.")
    ] = None,
    host: Annotated[
        str | None, Query(description="Only incidents whose culprit ranks ran on this host.")
    ] = None,
    before: Annotated[
        str | None,
        Query(
            description="The next page: the incidents after this one (the last id of the"
            " previous page), same filters."
        ),
    ] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_LIMIT)] = 100,
) -> list[schemas.IncidentSummary]:
    """Incidents, newest first. With a shared store (`--store postgresql://...`)
    every job's that writes to it, whichever coordinator stored them."""
    rows = list_incident_rows(
        ctx_of(request),
        job=job,
        since=since,
        until=until,
        verdict=verdict,
        status=status,
        host=host,
        before=before,
        limit=limit,
    )
    return [incident_summary(r) for r in rows]


@router.get(
    "/api/incidents/{incident_id}",
    response_model=schemas.IncidentDetail,
    responses={**NOT_FOUND, **UNAUTHORIZED},
)
def api_incident(incident_id: str, request: Request) -> schemas.IncidentDetail:
    """One incident: store facts plus the analyzer's full report and per-rank evidence."""
    return incident_detail(incident_or_404(ctx_of(request), incident_id))


@router.get(
    "/api/incidents/{incident_id}/bundle",
    response_class=StreamingResponse,
    responses={
        200: {"content": {"application/gzip": {}}, "description": "The bundle as .tar.gz."},
        **NOT_FOUND,
        **UNAUTHORIZED,
    },
)
def api_incident_bundle(incident_id: str, request: Request) -> StreamingResponse:
    """The incident's bundle directory as a .tar.gz (regular files only; links skipped)."""
    ctx = ctx_of(request)
    row = incident_or_404(ctx, incident_id)
    try:
        root = ctx.store.incident_dir(row.id)
        chunks = bundle.stream_bundle(root, row.id)
    except (ValueError, bundle.BundleMissing):
        raise HTTPException(404, f"incident {incident_id!r} has no bundle on this server") from None
    return StreamingResponse(
        chunks,
        media_type="application/gzip",
        headers={"content-disposition": f'attachment; filename="{row.id}.tar.gz"'},
    )


@router.get(
    "/api/incidents/{incident_id}/trace.json",
    responses={
        200: {"content": {"application/json": {}}, "description": "Chrome/Perfetto trace events."},
        **NOT_FOUND,
        **UNAUTHORIZED,
    },
)
def api_incident_trace(incident_id: str, request: Request) -> JSONResponse:
    """The incident's ranks as timelines ({"traceEvents": [...]}, opens in Perfetto):
    one track per rank, the stalled collective and the lagging ranks marked."""
    ctx = ctx_of(request)
    row = incident_or_404(ctx, incident_id)
    try:
        root = ctx.store.incident_dir(row.id)
    except ValueError:
        raise HTTPException(404, f"incident {incident_id!r} has no bundle") from None
    if not root.is_dir():
        raise HTTPException(404, f"incident {incident_id!r} has no bundle on this server")
    build = ctx.trace
    if build is None:
        from hangwatch.analyzer.trace import trace_path

        build = trace_path
    try:
        doc = build(root, row.report)
    except RuntimeError as e:
        raise HTTPException(503, f"cannot build the trace: {e}") from None
    return JSONResponse(
        doc, headers={"content-disposition": f'attachment; filename="{row.id}.trace.json"'}
    )


def host_histories(
    ctx: ServerContext, host: str | None = None, limit: int = 200
) -> schemas.HostsOut:
    rule = OffenderRule.from_config(ctx.config)
    rows = ctx.store.host_history(since=rule.since(time.time()), host=host, limit=limit)
    return schemas.HostsOut(
        window_s=rule.window_s,
        threshold=rule.incidents,
        hosts=[
            schemas.HostHistoryOut(**h.to_dict(), repeat_offender=rule.applies(h)) for h in rows
        ],
    )


@router.get("/api/hosts", response_model=schemas.HostsOut, responses=UNAUTHORIZED)
def api_hosts(
    request: Request,
    offenders: Annotated[bool, Query(description="Only repeat offenders.")] = False,
    limit: Annotated[int, Query(ge=1, le=MAX_LIMIT)] = 200,
) -> schemas.HostsOut:
    """Hosts that held the culprit of an incident within --repeat-offender-window,
    over every job in this store: node history across jobs."""
    out = host_histories(ctx_of(request), limit=limit)
    if offenders:
        out.hosts = [h for h in out.hosts if h.repeat_offender]
    return out


@router.get(
    "/api/hosts/{host}",
    response_model=schemas.HostHistoryOut,
    responses={**UNAUTHORIZED, 404: {"description": "Not a culprit within the window."}},
)
def api_host(host: str, request: Request) -> schemas.HostHistoryOut:
    """One host's history as culprit within the window."""
    out = host_histories(ctx_of(request), host=host, limit=1)
    if not out.hosts:
        raise HTTPException(404, f"host {host!r} held no culprit within the window")
    return out.hosts[0]


@router.get("/healthz", response_model=schemas.Health, tags=["probes"])
def healthz() -> schemas.Health:
    """Liveness: the HTTP server answers. Never needs a token."""
    return schemas.Health(ok=True)


@router.get(
    "/readyz",
    response_model=schemas.Ready,
    tags=["probes"],
    responses={503: {"model": schemas.Ready, "description": "Not ready."}},
)
def readyz(request: Request) -> JSONResponse:
    """Readiness: the incident store answers. (The app is built once gRPC is
    bound, so the endpoint is always there by the time this can be asked.)"""
    ctx = ctx_of(request)
    try:
        ctx.store.ping()
    except Exception:
        return _ready(False, "incident store unavailable")
    return _ready(True, "")


def _ready(ok: bool, detail: str) -> JSONResponse:
    body = schemas.Ready(ready=ok, detail=detail).model_dump()
    return JSONResponse(body, status_code=200 if ok else 503)


@router.get(
    "/metrics",
    response_class=PlainTextResponse,
    responses={200: {"content": {prom.CONTENT_TYPE: {}}}, **UNAUTHORIZED},
)
def metrics(request: Request) -> PlainTextResponse:
    """Prometheus text format."""
    ctx = ctx_of(request)
    return PlainTextResponse(prom.render(ctx.metrics), media_type=prom.CONTENT_TYPE)
