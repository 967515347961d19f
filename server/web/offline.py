"""One incident as a single self-contained HTML file (`hangwatch analyze DIR --html`).

Same view as the dashboard's incident page, rendered from the same template,
with the stylesheet inlined and no script: the file makes no request of any
kind, so it can be mailed, attached to a ticket or opened on an air-gapped box.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from hangwatch.analyzer.report import Report
from hangwatch.server.web import incident_view
from hangwatch.server.web.templating import environment, static_text
from markupsafe import Markup

if TYPE_CHECKING:
    from hangwatch.server.incidents.store import IncidentRow


def info_from_row(row: IncidentRow) -> incident_view.IncidentInfo:
    return incident_view.IncidentInfo(
        id=row.id,
        job=row.job_id,
        created_unix=row.created,
        status=row.status,
        reason=f"{row.trigger}: {row.reason}" if row.reason else row.trigger,
        ranks_unreachable=dict(row.ranks_unreachable),
        detection_latency_s=row.detection_s,
    )


def render_incident_html(report: Report, *, title: str, incident: IncidentRow | None = None) -> str:
    view = incident_view.build(report, info_from_row(incident) if incident is not None else None)
    css = static_text("app.css")
    if "</style" in css.lower():  # our own file; guard against a future edit breaking out
        raise ValueError("app.css must not contain '</style'")
    return (
        environment()
        .get_template("offline.html")
        .render(view=view, title=title, css=Markup(css), generated=time.time())
    )
