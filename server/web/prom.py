"""`/metrics`: the server's own prometheus_client registry, in the text format.

The families are declared in `hangwatch.server.integrations.metrics`; the live gauges
(agents, ranks, per-job stall state) are computed at scrape time by
`hangwatch.server.integrations.gauges`, registered with the server's context.
"""

from __future__ import annotations

from hangwatch.server.integrations.metrics import CONTENT_TYPE, Metrics

__all__ = ["CONTENT_TYPE", "render"]


def render(metrics: Metrics) -> str:
    return metrics.render()
