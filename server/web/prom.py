"""`/metrics`: the server's own prometheus_client registry, in the text format.

The families are declared in `hangwatch.server.metrics`; the live gauges
(agents, ranks, per-job stall state) are computed at scrape time by
`hangwatch.server.live_metrics`, registered with the server's context.
"""

from __future__ import annotations

from hangwatch.server.metrics import CONTENT_TYPE, Metrics

__all__ = ["CONTENT_TYPE", "render"]


def render(metrics: Metrics) -> str:
    return metrics.render()
