"""The coordinator's own counters and histograms, in plain Python.

No prometheus_client dependency: the dashboard renders `/metrics` from
`Metrics.samples()` (or `render_prometheus()`), and tests read values directly.
Label sets are small and fixed (verdict, trigger, method, code), so memory
stays bounded.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Final

# Detection latency spans the stall timeout (seconds) plus dump and analysis.
DETECTION_BUCKETS: Final = (1.0, 2.0, 5.0, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 120.0, 300.0)
ANALYSIS_BUCKETS: Final = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)

Labels = tuple[tuple[str, str], ...]

HELP: Final = {
    "hangwatch_incidents_total": (
        "counter",
        "Incidents analysed or failed, by verdict and trigger.",
    ),
    "hangwatch_incidents_opened_total": ("counter", "Incidents opened, by trigger."),
    "hangwatch_incidents_by_state": (
        "gauge",
        "Stored incidents by state (collecting, analyzed, resolved, ended, failed).",
    ),
    "hangwatch_incidents_open": (
        "gauge",
        "Incidents still open (collecting or analyzed); resolved and ended ones do not count.",
    ),
    "hangwatch_incident_transitions_total": (
        "counter",
        "Incidents entering a state (resolved, ended, ...), by state and trigger.",
    ),
    "hangwatch_detection_seconds": ("histogram", "From stall onset to verdict stored."),
    "hangwatch_analysis_seconds": ("histogram", "Analyzer wall time per incident."),
    "hangwatch_grpc_requests_total": ("counter", "gRPC calls handled, by method and status code."),
    "hangwatch_upload_bytes_total": ("counter", "Bundle bytes stored."),
    "hangwatch_upload_files_total": (
        "counter",
        "Bundle files by outcome (stored, duplicate, rejected).",
    ),
    "hangwatch_ranks_unreachable_total": (
        "counter",
        "Ranks no dump could be taken from, summed over incidents.",
    ),
    "hangwatch_stragglers_flagged_total": (
        "counter",
        "Times a rank was named a straggler (slow, not hung), over all jobs.",
    ),
    "hangwatch_agents_lost_total": (
        "counter",
        "Agents that went silent past the agent-lost timeout.",
    ),
}


def _labels(labels: Mapping[str, str] | None) -> Labels:
    return tuple(sorted((k, str(v)) for k, v in (labels or {}).items()))


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bucket, not cumulative; last is +Inf
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.n += 1

    def cumulative(self) -> list[tuple[float, int]]:
        out, acc = [], 0
        for le, c in zip((*self.buckets, math.inf), self.counts, strict=True):
            acc += c
            out.append((le, acc))
        return out


@dataclass(frozen=True, kw_only=True)
class Sample:
    name: str  # metric name, with _bucket/_sum/_count for histograms
    labels: Labels
    value: float


class Metrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: dict[str, dict[Labels, float]] = {}
        self._hists: dict[str, dict[Labels, Histogram]] = {}
        self._buckets: dict[str, tuple[float, ...]] = {
            "hangwatch_detection_seconds": DETECTION_BUCKETS,
            "hangwatch_analysis_seconds": ANALYSIS_BUCKETS,
        }

    def inc(self, name: str, value: float = 1.0, labels: Mapping[str, str] | None = None) -> None:
        with self._lock:
            series = self._counters.setdefault(name, {})
            key = _labels(labels)
            series[key] = series.get(key, 0.0) + value

    def set(self, name: str, value: float, labels: Mapping[str, str] | None = None) -> None:
        """A gauge: the series takes `value` (HELP gives it its type)."""
        with self._lock:
            self._counters.setdefault(name, {})[_labels(labels)] = float(value)

    def observe(self, name: str, value: float, labels: Mapping[str, str] | None = None) -> None:
        with self._lock:
            series = self._hists.setdefault(name, {})
            key = _labels(labels)
            h = series.get(key)
            if h is None:
                h = series[key] = Histogram(self._buckets.get(name, DETECTION_BUCKETS))
            h.observe(value)

    def counter(self, name: str, labels: Mapping[str, str] | None = None) -> float:
        with self._lock:
            return self._counters.get(name, {}).get(_labels(labels), 0.0)

    def counter_total(self, name: str) -> float:
        with self._lock:
            return sum(self._counters.get(name, {}).values())

    def histogram(self, name: str, labels: Mapping[str, str] | None = None) -> Histogram | None:
        with self._lock:
            h = self._hists.get(name, {}).get(_labels(labels))
            return None if h is None else Histogram(h.buckets, list(h.counts), h.total, h.n)

    def samples(self) -> list[Sample]:
        out: list[Sample] = []
        with self._lock:
            for name, series in sorted(self._counters.items()):
                out.extend(Sample(name=name, labels=k, value=v) for k, v in sorted(series.items()))
            for name, hseries in sorted(self._hists.items()):
                for k, h in sorted(hseries.items()):
                    for le, acc in h.cumulative():
                        le_s = "+Inf" if math.isinf(le) else repr(le)
                        out.append(
                            Sample(name=f"{name}_bucket", labels=(*k, ("le", le_s)), value=acc)
                        )
                    out.append(Sample(name=f"{name}_sum", labels=k, value=h.total))
                    out.append(Sample(name=f"{name}_count", labels=k, value=h.n))
        return out

    def render_prometheus(self, extra: Iterable[tuple[str, str, str, float]] = ()) -> str:
        """Prometheus text format. `extra` adds gauges: (name, type, help, value)."""
        lines: list[str] = []
        seen: set[str] = set()
        for s in self.samples():
            base = s.name
            for suffix in ("_bucket", "_sum", "_count"):
                if base.endswith(suffix) and base[: -len(suffix)] in self._hists:
                    base = base[: -len(suffix)]
            if base not in seen:
                seen.add(base)
                kind, text = HELP.get(base, ("untyped", base))
                lines += [f"# HELP {base} {text}", f"# TYPE {base} {kind}"]
            lines.append(f"{s.name}{_fmt_labels(s.labels)} {_fmt_value(s.value)}")
        for name, kind, text, value in extra:
            lines += [
                f"# HELP {name} {text}",
                f"# TYPE {name} {kind}",
                f"{name} {_fmt_value(value)}",
            ]
        return "\n".join(lines) + "\n"


def _fmt_labels(labels: Labels) -> str:
    if not labels:
        return ""
    esc = [(k, v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")) for k, v in labels]
    return "{" + ",".join(f'{k}="{v}"' for k, v in esc) + "}"


def _fmt_value(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else repr(float(v))
