"""Node history across jobs: which hosts held the culprit of which incidents.

Operators act on a pattern no single incident shows: one host was the culprit
in 4 of the last 6 hangs, across 3 jobs. So when an incident's verdict is
stored, the store also records, per host, the culprit ranks it held
(`culprit_hosts`), and answers per host over a window (`HostHistory`). A host
with at least `threshold` such incidents in the window is a **repeat
offender**: the API, `/metrics`, a webhook event and `--exclude-only-repeat-
offenders` read that one rule (`OffenderRule`).

Only culprits count: the lagging ranks of a `hang` (a transient stall that
cleared by itself included: it was a hang while it lasted) and the first rank
to die in a `crash`. A host whose ranks only waited is never counted, nor a
`mismatch` (the program called different ops: not the host's fault), nor a
verdict that names nobody.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from hangwatch.analyzer.report import RankEvidence, Report

from hangwatch.config import Config

# Verdicts whose lagging ranks are culprits a host can be blamed for.
CULPRIT_VERDICTS: Final = ("hang", "crash")
# Incident ids a host's history carries (newest first): enough to open the
# recent ones from a page; the count is exact whatever the cap.
INCIDENTS_SHOWN: Final = 20


@dataclass(kw_only=True, frozen=True)
class CulpritHost:
    """One host's share of one incident's culprits."""

    host: str
    ranks: list[int]
    gpus: list[int] = field(default_factory=list)  # NVML indices of their GPUs, where known


@dataclass(kw_only=True, frozen=True)
class HostHistory:
    """One host over a window: the incidents whose culprits it held."""

    host: str
    incidents: int  # distinct incidents
    jobs: int  # distinct jobs among them
    first: float  # unix seconds of the oldest such incident in the window
    last: float  # ... and of the newest
    incident_ids: list[str] = field(default_factory=list)  # newest first, INCIDENTS_SHOWN at most
    job_ids: list[str] = field(default_factory=list)  # sorted
    gpus: list[int] = field(default_factory=list)  # sorted

    def to_dict(self) -> dict[str, Any]:
        return {
            "host": self.host,
            "incidents": self.incidents,
            "jobs": self.jobs,
            "first": self.first,
            "last": self.last,
            "incident_ids": list(self.incident_ids),
            "job_ids": list(self.job_ids),
            "gpus": list(self.gpus),
        }


def _gpu_index(ev: RankEvidence) -> int | None:
    """The NVML index of the GPU whose compute processes list the rank's pid."""
    gpu = ev.gpu or {}
    if ev.pid is None or not gpu.get("available"):
        return None
    for dev in gpu.get("devices") or []:
        if not isinstance(dev, Mapping):
            continue
        pids = {p.get("pid") for p in dev.get("processes") or [] if isinstance(p, Mapping)}
        if ev.pid in pids and isinstance(dev.get("index"), int):
            return int(dev["index"])
    return None


def culprit_hosts(report: Report) -> list[CulpritHost]:
    """The hosts of a verdict's culprit ranks, sorted by host; [] where the
    verdict blames no host (see the module docstring). A culprit whose host is
    unknown (its dump never came) is left out rather than guessed."""
    if report.verdict not in CULPRIT_VERDICTS:
        return []
    ranks: dict[str, list[int]] = {}
    gpus: dict[str, set[int]] = {}
    for r in sorted(set(report.lagging_ranks)):
        ev = report.evidence.get(r)
        if ev is None or not ev.host:
            continue
        ranks.setdefault(ev.host, []).append(r)
        g = _gpu_index(ev)
        gpus.setdefault(ev.host, set())
        if g is not None:
            gpus[ev.host].add(g)
    return [CulpritHost(host=h, ranks=rs, gpus=sorted(gpus[h])) for h, rs in sorted(ranks.items())]


@dataclass(frozen=True, kw_only=True)
class OffenderRule:
    """When a host is a repeat offender: `incidents` or more within `window_s`."""

    incidents: int = 3
    window_s: float = 7 * 24 * 3600.0

    @classmethod
    def from_config(cls, c: Config) -> OffenderRule:
        return cls(
            incidents=c.respond.repeat_offender_incidents,
            window_s=c.respond.repeat_offender_window,
        )

    def since(self, now: float) -> float:
        """Where the window starts, for `IncidentStore.host_history(since=...)`."""
        return now - self.window_s

    def applies(self, history: HostHistory) -> bool:
        # IncidentStore.count_hosts(min_incidents=self.incidents) counts the same.
        return history.incidents >= self.incidents

    @property
    def window_text(self) -> str:
        """The window for people: "7 days", "90 s"."""
        days = self.window_s / 86400
        return f"{days:g} days" if days >= 1 else f"{self.window_s:g} s"
