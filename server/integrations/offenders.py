"""The webhook event for a host that becomes a repeat offender.

    {"schema": "hangwatch.notification/1", "event": "host.repeat-offender",
     "incident": {<the incident that made it one, as GET /api/incidents lists it>,
                  "url": ..., "host": {<its history: GET /api/hosts's item>}},
     "text": "host node-7 held the culprit of 3 incidents in 2 jobs within 7 days: ..."}

Published when a verdict is stored (the store's status listener, status
`analyzed`) and one of its culprit hosts reaches the threshold exactly
(`OffenderRule`): once per crossing, not with every later incident; a host
whose old incidents leave the window and that reaches it again is announced
again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from hangwatch.server.incidents.hosts import HostHistory, OffenderRule, culprit_hosts
from hangwatch.server.incidents.store import IncidentRow, IncidentStatus, IncidentStore

log = logging.getLogger(__name__)

EVENT = "host.repeat-offender"

Publish = Callable[..., None]  # Notifier.publish(event, item, text=...)


def offender_line(h: HostHistory, rule: OffenderRule, link: str) -> str:
    return (
        f"host {h.host} held the culprit of {h.incidents} incidents in {h.jobs} jobs within"
        f" {rule.window_text} ({', '.join(h.job_ids)}): a repeat offender; newest {link}"
    )


@dataclass(frozen=True, kw_only=True)
class OffenderWatch:
    """The store's status listener that publishes EVENT (`link`: an incident's page)."""

    store: IncidentStore
    rule: OffenderRule
    publish: Publish
    link: Callable[[str], str]
    clock: Callable[[], float] = time.time

    def on_status_change(self, row: IncidentRow) -> None:
        if row.status != IncidentStatus.ANALYZED or row.report is None:
            return
        since = self.rule.since(self.clock())
        for c in culprit_hosts(row.report):
            [h] = self.store.host_history(since=since, host=c.host) or [None]
            if h is None or h.incidents != self.rule.incidents:
                continue
            item: Mapping[str, Any] = {**row.summary_fields(), "host": h.to_dict()}
            line = offender_line(h, self.rule, self.link(row.id))
            log.warning("repeat offender: %s", line)
            self.publish(EVENT, item, text=line)
