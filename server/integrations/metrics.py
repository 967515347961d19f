"""The coordinator's metrics: one `prometheus_client` registry per server.

Every family is declared once, in `FAMILIES`, with its type, help and label
names; code records by family name (`metrics.inc("hangwatch_incidents_total",
labels={...})`) and tests read values back the same way. A registry of its
own, never the process-global default, lets servers (and tests) run side by
side. Gauges read from live state at scrape time (agents, ranks, per-job
stall state) come from collectors added with `add_collector`
(`server/integrations/gauges.py`). The families, what they mean and the alert rules
built on them are in docs/operations.md, "Monitoring".
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

# `_created` series double every counter and histogram and no rule reads them.
prometheus_client.disable_created_metrics()

# What `generate_latest` writes: the text format every Prometheus since 2.0 scrapes.
CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"

# Detection latency spans the stall timeout (seconds) plus dump and analysis.
DETECTION_BUCKETS: Final = (1.0, 2.0, 5.0, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 120.0, 300.0)
# Collection ends at the dump deadline (15 s by default) or when every rank answered.
COLLECTION_BUCKETS: Final = (0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0)
ANALYSIS_BUCKETS: Final = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# From an incident changing state to the receiver's 2xx, retries included.
DELIVERY_BUCKETS: Final = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


@dataclass(frozen=True, kw_only=True)
class Family:
    name: str  # as exposed; counters end in _total
    kind: str  # counter | gauge | histogram
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()


FAMILIES: Final = (
    Family(
        name="hangwatch_incidents_total",
        kind="counter",
        help="Incidents analysed or failed, by verdict and trigger.",
        labels=("verdict", "trigger"),
    ),
    Family(
        name="hangwatch_incident_writes_deferred_total",
        kind="counter",
        help="Incidents and verdicts the full data directory refused; each is tried again.",
    ),
    Family(
        name="hangwatch_incidents_opened_total",
        kind="counter",
        help="Incidents opened, by trigger.",
        labels=("trigger",),
    ),
    Family(
        name="hangwatch_incidents_by_state",
        kind="gauge",
        help="Stored incidents by state (collecting, analyzed, resolved, ended, failed).",
        labels=("state",),
    ),
    Family(
        name="hangwatch_incidents_open",
        kind="gauge",
        help="Incidents still open (collecting or analyzed); resolved and ended ones do not count.",
    ),
    Family(
        name="hangwatch_incident_transitions_total",
        kind="counter",
        help="Incidents entering a state (resolved, ended, ...), by state and trigger.",
        labels=("state", "trigger"),
    ),
    Family(
        name="hangwatch_detection_latency_seconds",
        kind="histogram",
        help="Seconds from the onset of a stall to its verdict being stored.",
        buckets=DETECTION_BUCKETS,
    ),
    Family(
        name="hangwatch_collection_seconds",
        kind="histogram",
        help="Seconds from an incident opening to its dumps being settled (every rank answered"
        " for, or the dump deadline).",
        buckets=COLLECTION_BUCKETS,
    ),
    Family(
        name="hangwatch_analysis_seconds",
        kind="histogram",
        help="Analyzer wall time per incident.",
        buckets=ANALYSIS_BUCKETS,
    ),
    Family(
        name="hangwatch_progress_ranks_total",
        kind="counter",
        help="Rank reports applied, by wire form: columns, or messages (ProgressReport.ranks:"
        " agents older than the columns, and ranks in groups made after registering).",
        labels=("form",),
    ),
    Family(
        name="hangwatch_grpc_requests_total",
        kind="counter",
        help="gRPC calls handled, by method and status code.",
        labels=("method", "code"),
    ),
    Family(
        name="hangwatch_relay_reports_total",
        kind="counter",
        help="Progress reports that came through each relay (ProgressBatch.relay_id, its"
        " host:port).",
        labels=("relay",),
    ),
    Family(
        name="hangwatch_relay_streams",
        kind="gauge",
        help="RelayProgress streams open from each relay: 0 once a relay that was connected"
        " is gone (its agents then report straight to the coordinator).",
        labels=("relay",),
    ),
    Family(name="hangwatch_upload_bytes_total", kind="counter", help="Bundle bytes stored."),
    Family(
        name="hangwatch_upload_files_total",
        kind="counter",
        help="Bundle files by outcome (stored, duplicate, rejected).",
        labels=("outcome",),
    ),
    Family(
        name="hangwatch_ranks_unreachable_total",
        kind="counter",
        help="Ranks no dump could be taken from, summed over incidents.",
    ),
    Family(
        name="hangwatch_agents_lost_total",
        kind="counter",
        help="Agents that went silent past the agent-lost timeout.",
    ),
    Family(
        name="hangwatch_notifications_total",
        kind="counter",
        help="Webhook notifications by event and outcome: delivered, failed (a permanent"
        " error, or retries used up) or dropped (queue full, or still queued at shutdown).",
        labels=("event", "outcome"),
    ),
    Family(
        name="hangwatch_notification_retries_total",
        kind="counter",
        help="Webhook deliveries tried again after a transient failure.",
    ),
    Family(
        name="hangwatch_notification_queue",
        kind="gauge",
        help="Notifications waiting to be delivered, over every webhook.",
    ),
    Family(
        name="hangwatch_notification_delivery_seconds",
        kind="histogram",
        help="Seconds from an incident changing state to its webhook answering 2xx.",
        buckets=DELIVERY_BUCKETS,
    ),
    Family(
        name="hangwatch_actions_total",
        kind="counter",
        help="Actions on incidents (--on-hang abort, --exclude-command), by kind and status.",
        labels=("kind", "status"),
    ),
    Family(
        name="hangwatch_stragglers_flagged_total",
        kind="counter",
        help="Times a rank was named a straggler (slow, not hung), over all jobs.",
    ),
)

_BY_NAME: Final = {f.name: f for f in FAMILIES}

Labels = Mapping[str, str]


@dataclass(frozen=True, kw_only=True)
class HistogramValue:
    """A histogram read back: cumulative (upper bound, count) pairs, +Inf last."""

    buckets: list[tuple[float, float]]
    total: float
    n: int


class Metrics:
    """One server's registry and its families, addressed by name."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._families: dict[str, Counter | Gauge | Histogram] = {}
        for f in FAMILIES:
            self._families[f.name] = _make(f, self.registry)
        # (name, kind, labels) -> its child. prometheus_client's labels()
        # checks and sorts the names and takes a lock on every call: 4-5 µs,
        # twice per progress report on the ingest path. Children live as long
        # as their family does, so keeping them changes nothing exported.
        self._children: dict[tuple[str, str, tuple[tuple[str, str], ...]], Any] = {}

    def inc(self, name: str, value: float = 1.0, labels: Labels | None = None) -> None:
        m = self._child(name, "counter", labels)
        assert isinstance(m, Counter)
        m.inc(value)

    def set(self, name: str, value: float, labels: Labels | None = None) -> None:
        m = self._child(name, "gauge", labels)
        assert isinstance(m, Gauge)
        m.set(value)

    def observe(self, name: str, value: float, labels: Labels | None = None) -> None:
        m = self._child(name, "histogram", labels)
        assert isinstance(m, Histogram)
        m.observe(value)

    def value(self, name: str, labels: Labels | None = None) -> float:
        """A counter's or gauge's current value (0 before the first sample)."""
        v = self.registry.get_sample_value(name, dict(labels or {}))
        return 0.0 if v is None else v

    # The name tests have always read counters and gauges with.
    counter = value

    def counter_total(self, name: str) -> float:
        """The sum over every label set of a counter or gauge."""
        return sum(s.value for s in self._samples(name) if s.name == name)

    def histogram(self, name: str, labels: Labels | None = None) -> HistogramValue | None:
        want = dict(labels or {})
        rows = [
            s
            for s in self._samples(name)
            if {k: v for k, v in s.labels.items() if k != "le"} == want
        ]
        count = next((s.value for s in rows if s.name == f"{name}_count"), None)
        if count is None:
            return None
        buckets = [(float(s.labels["le"]), s.value) for s in rows if s.name == f"{name}_bucket"]
        total = next(s.value for s in rows if s.name == f"{name}_sum")
        return HistogramValue(buckets=buckets, total=total, n=int(count))

    def add_collector(self, collector: Collector) -> None:
        """Families computed at scrape time (live state), in this server's registry."""
        self.registry.register(collector)

    def render(self) -> str:
        """The Prometheus text exposition (`CONTENT_TYPE`)."""
        return prometheus_client.generate_latest(self.registry).decode("utf-8")

    # The name callers used before the registry existed.
    render_prometheus = render

    def _child(self, name: str, kind: str, labels: Labels | None) -> Counter | Gauge | Histogram:
        key = (name, kind, tuple(labels.items()) if labels else ())
        m = self._children.get(key)
        if m is None:
            m = self._children[key] = self._resolve(name, kind, labels)
        return m  # type: ignore[no-any-return]

    def _resolve(self, name: str, kind: str, labels: Labels | None) -> Counter | Gauge | Histogram:
        f = _BY_NAME.get(name)
        if f is None or f.kind != kind:
            raise ValueError(
                f"no {kind} named {name!r} in hangwatch.server.integrations.metrics.FAMILIES"
            )
        m = self._families[name]
        return m.labels(**{k: str(v) for k, v in labels.items()}) if labels else m

    def _samples(self, name: str) -> Iterable[Sample]:
        for fam in self.registry.collect():
            if fam.name == name or fam.name == name.removesuffix("_total"):
                yield from fam.samples


def _make(f: Family, registry: CollectorRegistry) -> Counter | Gauge | Histogram:
    if f.kind == "counter":
        return Counter(f.name, f.help, f.labels, registry=registry)
    if f.kind == "gauge":
        return Gauge(f.name, f.help, f.labels, registry=registry)
    return Histogram(f.name, f.help, f.labels, registry=registry, buckets=f.buckets)
