"""Server-rendered pages. Each shows its content in the HTML it sends; the small
script in /static/app.js only keeps the live parts fresh."""

from __future__ import annotations

import datetime as _dt
from typing import Any
from urllib.parse import parse_qs, urlencode

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from hangwatch.analyzer.report import VERDICTS
from hangwatch.server.incidents.hosts import OffenderRule
from hangwatch.server.incidents.store import OPEN_STATUSES, STATUSES, IncidentRow
from hangwatch.server.web import api, incident_view, live, security
from hangwatch.server.web.offline import info_from_row, render_incident_html
from hangwatch.server.web.templating import environment

router = APIRouter(include_in_schema=False)

MAX_FORM_BYTES = 8192


def render(request: Request, name: str, status_code: int = 200, **values: Any) -> HTMLResponse:
    state = request.scope.get("state", {})
    html = (
        environment()
        .get_template(name)
        .render(authenticated_by_cookie=bool(state.get("hangwatch_cookie_auth")), **values)
    )
    return HTMLResponse(html, status_code=status_code, headers={"cache-control": "no-store"})


def login_html(next_path: str, message: str) -> str:
    return (
        environment()
        .get_template("login.html")
        .render(next=security.safe_next(next_path), message=message, authenticated_by_cookie=False)
    )


@router.get("/", response_class=HTMLResponse)
def jobs_page(request: Request) -> HTMLResponse:
    ctx = api.ctx_of(request)
    jobs = live.job_summaries(ctx.registry, ctx.store)
    none: list[IncidentRow] = []
    recent = live.without_store(lambda: ctx.store.list_incidents(limit=10), none)
    return render(request, "jobs.html", jobs=jobs, recent=recent)


@router.get("/hosts", response_class=HTMLResponse)
def hosts_page(request: Request) -> HTMLResponse:
    ctx = api.ctx_of(request)
    out = api.host_histories(ctx)
    window = OffenderRule.from_config(ctx.config).window_text
    return render(request, "hosts.html", out=out, window=window)


@router.get("/jobs/{job}", response_class=HTMLResponse)
def job_page(job: str, request: Request) -> HTMLResponse:
    ctx = api.ctx_of(request)
    try:
        ranks = api.job_ranks_or_404(ctx, job)
    except HTTPException:
        return render(request, "error.html", status_code=404, message=f"Unknown job {job!r}.")
    cells = [
        (
            i,
            r.lag_bucket if r else "unobserved",
            bool(r and r.suspect),
            live.tooltip(r) if r else f"rank {i} | not registered by any agent",
        )
        for i, r in live.ranks_or_missing(ranks)
    ]
    none: list[IncidentRow] = []
    incidents = live.without_store(lambda: ctx.store.list_incidents(job_id=job, limit=20), none)
    return render(
        request,
        "job.html",
        job=ranks,
        cells=cells,
        heat_class=live.heat_columns(len(cells)),
        incidents=incidents,
        stragglers=api.job_stragglers_or_404(ctx, job),
    )


def _local_input(unix: float | None) -> str:
    if unix is None:
        return ""
    return _dt.datetime.fromtimestamp(unix, tz=_dt.UTC).strftime("%Y-%m-%dT%H:%M")


def _state_counts(by_status: dict[str, int]) -> dict[str, int]:
    """Per state, plus "open": only collecting and analyzed ones need someone."""
    return {**by_status, "open": sum(by_status.get(s, 0) for s in OPEN_STATUSES)}


@router.get("/incidents", response_class=HTMLResponse)
def incidents_page(
    request: Request,
    job: str | None = None,
    since: str | None = None,
    until: str | None = None,
    verdict: str | None = None,
    status: str | None = None,
    host: str | None = None,
    before: str | None = None,
    limit: int = 100,
) -> HTMLResponse:
    ctx = api.ctx_of(request)
    limit = max(1, min(limit, api.MAX_LIMIT))
    try:
        rows = api.list_incident_rows(
            ctx,
            job=job,
            since=since,
            until=until,
            verdict=verdict,
            status=status,
            host=host,
            before=before,
            limit=limit,
        )
        error = ""
    except HTTPException as e:
        rows, error = [], str(e.detail)
    jobs = sorted({j.job_id for j in ctx.store.list_jobs()} | set(ctx.registry.jobs()))
    filters = {
        "job": job or "",
        "since": since or "",
        "until": until or "",
        "verdict": verdict or "",
        "status": status or "",
        "host": host or "",
        "limit": limit,
    }
    # A full page may have older incidents after it: the same filters, after its last row.
    older = ""
    if len(rows) == limit:
        older = "/incidents?" + urlencode(
            {**{k: v for k, v in filters.items() if v}, "before": rows[-1].id}
        )
    return render(
        request,
        "incidents.html",
        rows=rows,
        filters=filters,
        jobs=jobs,
        verdicts=tuple(VERDICTS),
        statuses=STATUSES,
        counts=_state_counts(ctx.store.count_by_status()),
        error=error,
        older=older,
        paged=bool(before),
    )


@router.get("/incidents/{incident_id}", response_class=HTMLResponse)
def incident_page(incident_id: str, request: Request) -> HTMLResponse:
    ctx = api.ctx_of(request)
    row = ctx.store.get_incident(incident_id)
    if row is None:
        return render(
            request, "error.html", status_code=404, message=f"Unknown incident {incident_id!r}."
        )
    info = incident_view.with_lifecycle(info_from_row(row), row)
    if row.report is None:
        return render(request, "incident_pending.html", row=row, info=info)
    view = incident_view.build(row.report, info)
    return render(request, "incident.html", view=view)


@router.get("/incidents/{incident_id}/report.html")
def incident_offline(incident_id: str, request: Request) -> Response:
    row = api.incident_or_404(api.ctx_of(request), incident_id)
    if row.report is None:
        raise HTTPException(409, "incident not analysed yet")
    html = render_incident_html(row.report, title=f"hangwatch incident {row.id}", incident=row)
    return HTMLResponse(
        html,
        headers={"content-disposition": f'attachment; filename="hangwatch-{row.id}.html"'},
    )


@router.get("/login", response_class=HTMLResponse)
def login_form(request: Request, next: str = "/") -> HTMLResponse:
    return HTMLResponse(login_html(next, ""), headers={"cache-control": "no-store"})


@router.post("/login")
async def login_submit(request: Request) -> Response:
    check: security.TokenCheck = request.app.state.token_check
    body = await request.body()
    if len(body) > MAX_FORM_BYTES:
        return HTMLResponse(login_html("/", "Form too large."), status_code=413)
    form = parse_qs(body.decode("utf-8", "replace"), keep_blank_values=True)
    token = (form.get("token") or [""])[0].strip()
    next_path = security.safe_next((form.get("next") or ["/"])[0])
    if not check.enabled:
        return RedirectResponse(next_path, status_code=303)
    if not check.bearer_ok(token):
        return HTMLResponse(
            login_html(next_path, "That token is not valid."),
            status_code=401,
            headers={"cache-control": "no-store"},
        )
    resp = RedirectResponse(next_path, status_code=303)
    resp.set_cookie(
        security.COOKIE,
        security.session_value(token),
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
        path="/",
    )
    return resp


@router.post("/logout")
def logout() -> Response:
    resp = RedirectResponse("/login", status_code=303)
    resp.delete_cookie(security.COOKIE, path="/", httponly=True, samesite="strict")
    return resp


@router.get("/docs", response_class=HTMLResponse)
def api_docs(request: Request) -> HTMLResponse:
    """A self-hosted API reference built from the OpenAPI document (no CDN assets)."""
    spec = request.app.openapi()
    ops = []
    for path, methods in spec.get("paths", {}).items():
        for method, op in methods.items():
            params = [
                {
                    "name": p.get("name", ""),
                    "in": p.get("in", ""),
                    "required": p.get("required", False),
                    "description": p.get("description")
                    or p.get("schema", {}).get("description", ""),
                }
                for p in op.get("parameters", [])
            ]
            responses = []
            for code, r in sorted(op.get("responses", {}).items()):
                content = r.get("content", {})
                ref = ""
                for media in content.values():
                    schema = media.get("schema", {})
                    ref = schema.get("$ref") or schema.get("items", {}).get("$ref", "")
                    if schema.get("type") == "array" and ref:
                        ref = f"list of {ref.rsplit('/', 1)[-1]}"
                    elif ref:
                        ref = ref.rsplit("/", 1)[-1]
                responses.append(
                    {"code": code, "description": r.get("description", ""), "schema": ref}
                )
            ops.append(
                {
                    "method": method.upper(),
                    "path": path,
                    "summary": op.get("summary", ""),
                    "description": op.get("description", ""),
                    "params": params,
                    "responses": responses,
                }
            )
    schemas_ = spec.get("components", {}).get("schemas", {})
    models = [
        {
            "name": name,
            "fields": [
                {
                    "name": f,
                    "type": _type_of(p),
                    "required": f in s.get("required", []),
                    "description": p.get("description", ""),
                }
                for f, p in s.get("properties", {}).items()
            ],
        }
        for name, s in sorted(schemas_.items())
    ]
    return render(request, "docs.html", ops=ops, models=models)


def _type_of(p: dict[str, Any]) -> str:
    if "$ref" in p:
        return str(p["$ref"]).rsplit("/", 1)[-1]
    if "anyOf" in p:
        return " | ".join(_type_of(x) for x in p["anyOf"])
    t = p.get("type", "any")
    if t == "array":
        return f"list[{_type_of(p.get('items', {}))}]"
    if t == "object" and "additionalProperties" in p:
        ap = p["additionalProperties"]
        return f"dict[str, {_type_of(ap) if isinstance(ap, dict) else 'any'}]"
    if "enum" in p or "const" in p:
        return " | ".join(repr(v) for v in p.get("enum", [p.get("const")]))
    return str(t)
