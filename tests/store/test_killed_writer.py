"""Two writers share one PostgreSQL store and one is killed -9 in the middle of
its writes: nothing it committed is lost, nothing is duplicated, and nothing
is half-written (an incident's verdict and its node history are one
transaction: a verdict without its culprit rows, or rows without a verdict,
would be a half-written incident)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hangwatch.server.incidents.store import IncidentStore

from tests.support.pgserver import PgServer

# Each writer stores incidents as a coordinator does (open, then the verdict
# with its culprit hosts), printing each id once its verdict is committed.
_WRITER = """
import sys
from pathlib import Path
from hangwatch.analyzer.report import RankEvidence, Report
from hangwatch.server.incidents.store import IncidentStore

url, job, root = sys.argv[1:4]
store = IncidentStore.open(url, Path(root))
report = Report(
    verdict="hang", summary="rank 2 never entered all_reduce #5", lagging_ranks=[2, 3],
    evidence={2: RankEvidence(rank=2, host="node-b", pid=2), 3: RankEvidence(rank=3, host="node-c", pid=3)},
)
print("ready", flush=True)
for i in range(100_000):
    row = store.create_incident(job_id=job, reason="stall", trigger="stall", ranks_expected=[0, 1, 2, 3])
    store.finish_incident(row.id, report=report, detection_s=1.0)
    print(row.id, flush=True)
"""


def _writer(url: str, job: str, root: Path) -> subprocess.Popen[str]:
    err = root / f"{job}.stderr"
    with open(err, "w") as stderr:
        p = subprocess.Popen(
            [sys.executable, "-c", _WRITER, url, job, str(root)],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
    assert p.stdout is not None
    line = p.stdout.readline()
    assert line == "ready\n", (line, err.read_text())
    return p


@pytest.mark.realtime
@pytest.mark.timeout(120)
def test_a_writer_killed_mid_write_loses_duplicates_and_half_writes_nothing(
    pg: PgServer, tmp_path: Path
) -> None:
    url = pg.new_database()
    IncidentStore.open(url, tmp_path).close()  # the schema, before two writers race for it
    survivor = _writer(url, "job-survivor", tmp_path)
    victim = _writer(url, "job-victim", tmp_path)
    db = url.rsplit("/", 1)[1]
    try:
        # Let both write for a while, then kill the victim at no chosen point:
        # most of a writer's time is spent inside its transactions.
        # Each of them: a wait on the total once passed with every row the
        # survivor's (a loaded full run), the victim having committed nothing.
        deadline = time.monotonic() + 30
        while True:
            counts = pg.sql(
                "SELECT COUNT(*) FROM incidents WHERE status = 'analyzed' GROUP BY job_id", db
            ).split()
            if len(counts) == 2 and min(map(int, counts)) >= 50:
                break
            assert time.monotonic() < deadline, f"analysed incidents per writer in 30 s: {counts}"
            time.sleep(0.05)
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait(10)
        assert victim.returncode == -signal.SIGKILL
        # The survivor goes on writing after the kill.
        after = int(pg.sql("SELECT COUNT(*) FROM incidents WHERE job_id = 'job-survivor'", db))
        deadline = time.monotonic() + 30
        while int(pg.sql("SELECT COUNT(*) FROM incidents WHERE job_id = 'job-survivor'", db)) < (
            after + 20
        ):
            assert time.monotonic() < deadline, "the survivor stopped writing"
            time.sleep(0.05)
    finally:
        for p in (survivor, victim):
            p.kill()
            p.wait(10)
    committed = {
        job: [ln.strip() for ln in p.communicate(timeout=10)[0].splitlines() if ln.strip()]
        for job, p in (("job-victim", victim), ("job-survivor", survivor))
    }
    assert len(committed["job-victim"]) > 0 and len(committed["job-survivor"]) > 0

    store = IncidentStore.open(url, tmp_path)
    rows = store.list_incidents(limit=1_000_000)
    by_id = {r.id: r for r in rows}
    assert len(by_id) == len(rows)  # no id twice
    for job, ids in committed.items():
        # Every verdict a writer saw committed is there, analysed.
        missing = [i for i in ids if i not in by_id or by_id[i].status != "analyzed"]
        assert missing == [], (job, missing[:5])
    # The victim's last incident may have been opened and not yet analysed (a
    # coordinator finalizes it again, or ends it, after its restart): it is
    # whole, a collecting row with nothing else. Beyond that one, none.
    unfinished = [r for r in rows if r.status != "analyzed"]
    assert len([r for r in unfinished if r.job_id == "job-victim"]) <= 1
    for r in unfinished:
        assert (r.status, r.verdict, r.report) == ("collecting", None, None)
    # Never half a verdict: each analysed incident has exactly its two culprit
    # hosts, and no culprit row belongs to an incident without a verdict.
    culprits = json.loads(
        pg.sql(
            "SELECT COALESCE(json_agg(json_build_array(incident_id, host)), '[]')::text "
            "FROM culprit_hosts",
            db,
        )
    )
    hosts: dict[str, list[str]] = {}
    for iid, host in culprits:
        hosts.setdefault(iid, []).append(host)
    assert all(by_id[i].status == "analyzed" for i in hosts)
    assert {i for i, r in by_id.items() if r.status == "analyzed"} == set(hosts)
    assert all(sorted(h) == ["node-b", "node-c"] for h in hosts.values())
    [b] = store.host_history(host="node-b")
    assert (b.incidents, b.jobs) == (len(hosts), 2)
    store.close()
