"""`/metrics` in the Prometheus text exposition format (0.0.4), written by hand.

Gauges are read from the live registry at scrape time; counters and
histograms come from the coordinator's `Metrics`. The detection histogram is
exposed as `hangwatch_detection_latency_seconds`, the dashboard's public name.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from hangwatch.server.metrics import DETECTION_BUCKETS, HELP, Metrics
from hangwatch.server.state import JobRegistry
from hangwatch.server.stragglers import StragglerMonitor

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Internal metric name -> public name.
RENAMES = {"hangwatch_detection_seconds": "hangwatch_detection_latency_seconds"}
PUBLIC_HELP = {
    "hangwatch_detection_latency_seconds": (
        "histogram",
        "Seconds from the onset of a stall to its verdict being stored.",
    ),
}


def escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _labels(pairs: Iterable[tuple[str, str]]) -> str:
    items = [f'{k}="{escape_label(v)}"' for k, v in pairs]
    return "{" + ",".join(items) + "}" if items else ""


def _value(v: float) -> str:
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return str(int(v)) if float(v).is_integer() else repr(float(v))


def _family(lines: list[str], name: str, kind: str, text: str) -> None:
    lines.append(f"# HELP {name} {_escape_help(text)}")
    lines.append(f"# TYPE {name} {kind}")


def render(metrics: Metrics, registry: JobRegistry) -> str:
    lines: list[str] = []
    _family(lines, "hangwatch_agents_connected", "gauge", "Agents with a live session.")
    lines.append(f"hangwatch_agents_connected {registry.agents_connected()}")
    _family(lines, "hangwatch_ranks_connected", "gauge", "Ranks whose agent has a live session.")
    lines.append(f"hangwatch_ranks_connected {registry.ranks_connected()}")
    _family(
        lines,
        "hangwatch_oldest_inflight_age_seconds",
        "gauge",
        "Age of the oldest in-flight collective on any observed rank of the job.",
    )
    for job in registry.jobs():
        oldest = registry.oldest_in_flight_age(job)
        lines.append(
            f"hangwatch_oldest_inflight_age_seconds{_labels([('job', job)])} "
            f"{_value(oldest if oldest is not None else 0.0)}"
        )

    # Counters and histograms, one family header per base name.
    families: dict[str, list[str]] = {}
    kinds: dict[str, tuple[str, str]] = {}
    for s in metrics.samples():
        base = s.name
        for suffix in ("_bucket", "_sum", "_count"):
            stem = s.name[: -len(suffix)]
            if s.name.endswith(suffix) and HELP.get(stem, ("",))[0] == "histogram":
                base = stem
        public = RENAMES.get(base, base)
        kinds[public] = PUBLIC_HELP.get(public) or HELP.get(base, ("untyped", base))
        sample_name = public + s.name[len(base) :]
        families.setdefault(public, []).append(
            f"{sample_name}{_labels(s.labels)} {_value(s.value)}"
        )
    # Families the dashboard promises exist even before their first sample.
    for name in ("hangwatch_incidents_total", "hangwatch_detection_latency_seconds"):
        if name not in families:
            families[name] = []
            kinds[name] = PUBLIC_HELP.get(name) or HELP.get(
                {v: k for k, v in RENAMES.items()}.get(name, name), ("untyped", name)
            )
    if not families["hangwatch_detection_latency_seconds"]:
        # An empty histogram is still a valid one: zero counts in every bucket.
        for le in (*DETECTION_BUCKETS, math.inf):
            le_s = "+Inf" if math.isinf(le) else repr(le)
            families["hangwatch_detection_latency_seconds"].append(
                f'hangwatch_detection_latency_seconds_bucket{{le="{le_s}"}} 0'
            )
        families["hangwatch_detection_latency_seconds"] += [
            "hangwatch_detection_latency_seconds_sum 0",
            "hangwatch_detection_latency_seconds_count 0",
        ]
    for name in sorted(families):
        kind, text = kinds[name]
        _family(lines, name, kind, text)
        lines.extend(families[name])
    return "\n".join(lines) + "\n"


def render_stragglers(monitor: StragglerMonitor | None) -> str:
    """Per job, two series: its worst lateness score and how many stragglers it has
    (one series per rank would grow with the job)."""
    if monitor is None:
        return ""
    lines: list[str] = []
    views = [v for j in monitor.jobs() if (v := monitor.view(j)) is not None]
    _family(
        lines,
        "hangwatch_job_lateness_worst",
        "gauge",
        "Largest share of the job's time its peers spent waiting for one rank (sliding window).",
    )
    for v in views:
        lines.append(
            f"hangwatch_job_lateness_worst{_labels([('job', v.job)])} {_value(v.worst_score)}"
        )
    _family(lines, "hangwatch_job_stragglers", "gauge", "Ranks of the job named as stragglers.")
    for v in views:
        lines.append(f"hangwatch_job_stragglers{_labels([('job', v.job)])} {len(v.stragglers)}")
    return "\n".join(lines) + "\n"
