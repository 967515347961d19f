"""The incident store at fleet size: the incident list and a host's history over 100,000 incidents.

A store holds every incident of every job that shares it. This fills a real
store (SQLite: the coordinator's, WAL on disk; or the PostgreSQL at `--store`,
or a temporary one with `--temp-postgres`) with `--incidents` analysed
incidents spread over `--jobs` jobs and `--hosts` hosts, each with a verdict
whose culprit rank sits on one host (a few hosts are culprits far more often,
as bad nodes are), then times what the dashboard and the API ask of it:

- anchor: one incident by id (`get_incident`, a primary-key read);
- the incident list's first page (`list_incidents(limit=100)`), one job's page,
  and one verdict's page;
- `/api/hosts`'s query (`host_history(since=week)`, the top 200 hosts);
- one host's history (`host_history(host=...)`), the worst host's;
- the repeat-offender gauge (`count_hosts`);
- everything the /incidents page reads (its page, the job list, the counts).

    python benchmarks/store_history.py [--incidents 100000] [--reps 30]
    python benchmarks/store_history.py --temp-postgres   # initdb + pg_ctl, as the tests do
    python benchmarks/store_history.py --store postgresql://user@host/db   # an empty database

Prints the median of `--reps` calls of each, and its ratio to the anchor.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hangwatch.analyzer.report import RankEvidence, Report
from hangwatch.server.incidents.store import IncidentStore

WEEK = 7 * 24 * 3600.0


def _fill(store: IncidentStore, n: int, jobs: int, hosts: int, now: float) -> str:
    """n analysed incidents over the last 30 days; returns the worst host's name."""
    rng = random.Random(0)
    # A few bad nodes: host i is the culprit with weight 1/(i+1).
    weights = [1.0 / (i + 1) for i in range(hosts)]
    names = [f"gpu-node-{i:05d}" for i in range(hosts)]
    db = store._db  # one transaction per 1,000 rows: filling is not what is measured
    for start in range(0, n, 1000):
        with db.transaction() as tx:
            for i in range(start, min(n, start + 1000)):
                created = now - rng.uniform(0, 30 * 86400)
                host = rng.choices(names, weights)[0]
                report = Report(
                    verdict="hang",
                    summary=f"Rank 3 never entered all_reduce #{i} in group 0",
                    lagging_ranks=[3],
                    evidence={3: RankEvidence(rank=3, host=host, pid=1000 + i)},
                )
                iid = f"inc-{i:07d}"
                job = f"job-{i % jobs}"
                tx.execute(
                    "INSERT INTO jobs (job_id, first_seen, last_seen) VALUES (?, ?, ?) "
                    "ON CONFLICT (job_id) DO NOTHING",
                    (job, created, created),
                )
                tx.execute(
                    "INSERT INTO incidents (id, job_id, created, reason, trigger, status, "
                    "verdict, summary, lagging_ranks, report, updated) "
                    "VALUES (?, ?, ?, 'stall', 'stall', 'ended', 'hang', ?, '[3]', ?, ?)",
                    (iid, job, created, report.summary, report.to_json(), created),
                )
                tx.execute(
                    "INSERT INTO culprit_hosts (incident_id, host, job_id, created, ranks, gpus) "
                    "VALUES (?, ?, ?, ?, '[3]', '[]')",
                    (iid, host, job, created),
                )
    if store.kind == "postgresql":
        # The planner's statistics, as autovacuum would have them by the time
        # a real store held 100,000 rows.
        with db.transaction() as tx:
            tx.execute("ANALYZE")
    return names[0]


def _median_ms(fn: Callable[[], Any], reps: int) -> float:
    fn()  # warm the page cache
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _measure(store: IncidentStore, a: argparse.Namespace, now: float) -> None:
    t0 = time.perf_counter()
    worst = _fill(store, a.incidents, a.jobs, a.hosts, now)
    print(f"{store.kind}: filled {a.incidents} incidents in {time.perf_counter() - t0:.1f}s")
    one = store.list_incidents(limit=1)[0].id
    since = now - WEEK
    page = store.list_incidents(limit=100)

    def incidents_page() -> None:
        # What server.web.pages.incidents_page reads for one page.
        store.list_incidents(limit=100)
        store.list_jobs()
        store.count_by_status()

    cases: list[tuple[str, Callable[[], Any]]] = [
        ("anchor: get_incident(id)", lambda: store.get_incident(one)),
        ("list_incidents(limit=100)", lambda: store.list_incidents(limit=100)),
        ("list_incidents(job, 100)", lambda: store.list_incidents(job_id="job-7", limit=100)),
        (
            "list_incidents(verdict, 100)",
            lambda: store.list_incidents(verdict="hang", limit=100),
        ),
        (
            "list_incidents(next page, 100)",
            lambda: store.list_incidents(limit=100, before=page[-1].id),
        ),
        (
            "list_incidents(host, 100)",
            lambda: store.list_incidents(host=worst, limit=100),
        ),
        ("the /incidents page's reads", incidents_page),
        ("host_history(week, 200 hosts)", lambda: store.host_history(since=since, limit=200)),
        ("host_history(worst host)", lambda: store.host_history(since=since, host=worst)),
        ("count_hosts(week, >=3)", lambda: store.count_hosts(since=since, min_incidents=3)),
    ]
    anchor = _median_ms(cases[0][1], a.reps)
    print("query | median ms | ratio to anchor")
    for name, fn in cases:
        ms = anchor if name.startswith("anchor") else _median_ms(fn, a.reps)
        print(f"{name} | {ms:.2f} | {ms / anchor:.0f}x")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--incidents", type=int, default=100_000)
    ap.add_argument("--jobs", type=int, default=500)
    ap.add_argument("--hosts", type=int, default=2_000)
    ap.add_argument("--reps", type=int, default=30)
    where = ap.add_mutually_exclusive_group()
    where.add_argument(
        "--store", help="an empty PostgreSQL database's URL (password: PGPASSWORD/PGPASSFILE)"
    )
    where.add_argument(
        "--temp-postgres",
        action="store_true",
        help="start a temporary PostgreSQL server (initdb + pg_ctl) and use it",
    )
    a = ap.parse_args()
    now = time.time()
    with tempfile.TemporaryDirectory() as d:
        server = None
        url = a.store
        if a.temp_postgres:
            # The tests' server helper; the repository root is not on sys.path for a script.
            sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
            from tests.support.pgserver import PgServer, require_postgres

            server = PgServer(require_postgres())
            url = server.new_database()
        try:
            store = IncidentStore.open(url, Path(d))
            try:
                _measure(store, a, now)
            finally:
                store.close()
        finally:
            if server is not None:
                server.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
