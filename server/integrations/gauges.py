"""Gauges read from the live registry and the store at scrape time.

Nothing here is kept between scrapes: each one counts the registry's agents
and ranks in one pass under its lock (`JobRegistry.census`), asks the stall
scan only for groups past the stall timeout (what the detector itself asks,
cheap when nothing is stuck) and runs two indexed GROUP BYs on the store.
The settings the alert rules compare against are exposed too, so a rule
such as "collecting for longer than twice the dump deadline" follows the
coordinator's configuration instead of repeating it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator

from hangwatch.server.incidents.hosts import OffenderRule
from hangwatch.server.incidents.store import IncidentStatus, IncidentStore, disk_full, refusal
from hangwatch.server.live.registry import JobRegistry
from hangwatch.server.live.stragglers import StragglerMonitor
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hangwatch.config import Config

log = logging.getLogger(__name__)

# Families this collector exposes, for `describe` (and the tests of deploy/).
NAMES = (
    "hangwatch_agents_connected",
    "hangwatch_ranks_connected",
    "hangwatch_agents",
    "hangwatch_ranks",
    "hangwatch_oldest_inflight_age_seconds",
    "hangwatch_job_stalled",
    "hangwatch_job_stalled_seconds",
    "hangwatch_job_collecting",
    "hangwatch_open_incidents",
    "hangwatch_oldest_collecting_incident_seconds",
    "hangwatch_incidents_stored",
    "hangwatch_stall_timeout_seconds",
    "hangwatch_dump_deadline_seconds",
    "hangwatch_agent_lost_timeout_seconds",
    "hangwatch_job_lateness_worst",
    "hangwatch_job_stragglers",
    "hangwatch_repeat_offender_hosts",
)


class LiveGauges(Collector):
    def __init__(
        self,
        registry: JobRegistry,
        store: IncidentStore,
        config: Config,
        *,
        stragglers: Callable[[], StragglerMonitor | None] = lambda: None,
    ) -> None:
        self.registry = registry
        self.store = store
        self.config = config
        self.stragglers = stragglers  # read per scrape: the context may gain one later

    def describe(self) -> Iterator[Metric]:
        # Registration must not scan live state; names are all it needs.
        for name in NAMES:
            yield GaugeMetricFamily(name, name)

    def collect(self) -> Iterator[Metric]:
        yield from self._jobs()
        try:
            incidents = list(self._incidents())
        except Exception as e:
            # The store out of reach (a PostgreSQL restart): the live series are
            # still scraped, the stored ones go missing until it is back, and the
            # coordinator does not look down to Prometheus (a failed scrape).
            if not disk_full(e):
                raise
            log.warning("/metrics without the incident store's series: %s: %s", refusal(e), e)
            incidents = []
        yield from incidents
        yield from self._stragglers()
        yield from self._settings()

    def _jobs(self) -> Iterator[Metric]:
        reg = self.registry
        agents_connected = GaugeMetricFamily(
            "hangwatch_agents_connected", "Agents with a live session."
        )
        agents_connected.add_metric([], reg.agents_connected())
        ranks_connected = GaugeMetricFamily(
            "hangwatch_ranks_connected", "Ranks whose agent has a live session."
        )
        ranks_connected.add_metric([], reg.ranks_connected())
        agents = GaugeMetricFamily(
            "hangwatch_agents",
            "A job's agents by state: connected, or lost (silent past the agent-lost timeout;"
            " the agents of a job that finished end up lost too).",
            labels=["job", "state"],
        )
        ranks = GaugeMetricFamily(
            "hangwatch_ranks",
            "A job's ranks by process state (running, stopped, zombie, gone, unresponsive,"
            " unknown), or unobserved while their agent is lost.",
            labels=["job", "state"],
        )
        oldest = GaugeMetricFamily(
            "hangwatch_oldest_inflight_age_seconds",
            "Age of the oldest in-flight collective on any observed rank of the job.",
            labels=["job"],
        )
        stalled = GaugeMetricFamily(
            "hangwatch_job_stalled",
            "1 while some group of the job has members in a collective others never entered,"
            " with no progress for the stall timeout; else 0.",
            labels=["job"],
        )
        stalled_s = GaugeMetricFamily(
            "hangwatch_job_stalled_seconds",
            "How long the job's longest such stall has lasted (0 when none is past the timeout).",
            labels=["job"],
        )
        collecting = GaugeMetricFamily(
            "hangwatch_job_collecting",
            "1 while an incident of the job is collecting its ranks' dumps; else 0.",
            labels=["job"],
        )
        for c in reg.census():
            job = c.job_id
            for state, n in sorted(c.agents.items()):
                agents.add_metric([job, state], n)
            for state, n in sorted(c.ranks.items()):
                ranks.add_metric([job, state], n)
            age = reg.oldest_in_flight_age(job)
            oldest.add_metric([job], age if age is not None else 0.0)
            stalls = reg.stalls(job, over_timeout_only=True)
            stalled.add_metric([job], 1.0 if stalls else 0.0)
            stalled_s.add_metric([job], max((s.stalled_for_s for s in stalls), default=0.0))
            collecting.add_metric([job], 1.0 if c.collecting else 0.0)
        yield from (agents_connected, ranks_connected, agents, ranks, oldest)
        yield from (stalled, stalled_s, collecting)

    def _incidents(self) -> Iterator[Metric]:
        open_ = GaugeMetricFamily(
            "hangwatch_open_incidents",
            "Open incidents (collecting or analyzed) by job, verdict (pending while collecting)"
            " and state.",
            labels=["job", "verdict", "state"],
        )
        oldest = GaugeMetricFamily(
            "hangwatch_oldest_collecting_incident_seconds",
            "Seconds the oldest incident still collecting has been open (0 when none is).",
        )
        now = time.time()
        oldest_created: float | None = None
        for job, verdict, state, n, created in self.store.open_by_job():
            open_.add_metric([job, verdict, state], n)
            if state == IncidentStatus.COLLECTING:
                oldest_created = created if oldest_created is None else min(oldest_created, created)
        oldest.add_metric([], 0.0 if oldest_created is None else max(0.0, now - oldest_created))
        stored = GaugeMetricFamily(
            "hangwatch_incidents_stored",
            "Every stored incident by verdict (pending until one is stored) and state.",
            labels=["verdict", "state"],
        )
        for (verdict, state), n in sorted(self.store.count_by_verdict_status().items()):
            stored.add_metric([verdict, state], n)
        # A count, not a series per host: the label set must not grow with every
        # host ever blamed. Which hosts: /api/hosts, and the webhook event.
        rule = OffenderRule.from_config(self.config)
        offenders = GaugeMetricFamily(
            "hangwatch_repeat_offender_hosts",
            "Hosts that held the culprit of at least --repeat-offender-incidents incidents"
            " within --repeat-offender-window, over every job in this store.",
        )
        offenders.add_metric(
            [], self.store.count_hosts(since=rule.since(now), min_incidents=rule.incidents)
        )
        yield from (open_, oldest, stored, offenders)

    def _stragglers(self) -> Iterator[Metric]:
        """Per job, its worst lateness score and how many stragglers it has (one
        series per rank would grow with the job)."""
        worst = GaugeMetricFamily(
            "hangwatch_job_lateness_worst",
            "Largest share of the job's time its peers spent waiting for one rank (sliding"
            " window).",
            labels=["job"],
        )
        count = GaugeMetricFamily(
            "hangwatch_job_stragglers", "Ranks of the job named as stragglers.", labels=["job"]
        )
        monitor = self.stragglers()
        if monitor is not None:
            for job in monitor.jobs():
                v = monitor.view(job)
                if v is not None:
                    worst.add_metric([v.job], v.worst_score)
                    count.add_metric([v.job], len(v.stragglers))
        yield from (worst, count)

    def _settings(self) -> Iterator[Metric]:
        conf = self.config
        for name, value, text in (
            (
                "hangwatch_stall_timeout_seconds",
                conf.detect.stall_timeout,
                "--stall-timeout in force.",
            ),
            (
                "hangwatch_dump_deadline_seconds",
                conf.detect.dump_deadline,
                "--dump-deadline in force.",
            ),
            (
                "hangwatch_agent_lost_timeout_seconds",
                conf.detect.agent_lost_timeout,
                "--agent-lost-timeout in force.",
            ),
        ):
            g = GaugeMetricFamily(name, text)
            g.add_metric([], value)
            yield g
