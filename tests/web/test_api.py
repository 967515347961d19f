"""The JSON API, /metrics and the bundle download against the real app over real HTTP."""

from __future__ import annotations

import io
import math
import os
import re
import tarfile
import time
from pathlib import Path

import httpx
import pytest
from hangwatch.analyzer.report import Report
from hangwatch.server.web.app import create_app

from hangwatch.wire import pb
from tests.support.clock import FakeClock
from tests.web import harness
from tests.web.conftest import JOB, STUCK, WORLD, Served

pytestmark = pytest.mark.timeout(30)


def test_jobs_lists_the_live_job(served: Served) -> None:
    jobs = served.client.get("/api/jobs").json()
    assert [j["job"] for j in jobs] == [JOB]
    j = jobs[0]
    assert j["live"] is True
    assert j["world_size"] == WORLD
    assert j["ranks_registered"] == j["ranks_observed"] == WORLD
    assert j["agents_connected"] == j["agents_total"] == WORLD // 8
    # Its ranks say 12 s in flight, but the coordinator has known the job for
    # less than its 5 s stall timeout: not stalled yet, as the detector counts
    # (the next test counts one past it).
    assert j["stalled_groups"] == 0
    assert j["incidents"] == 1
    assert j["oldest_inflight_age_s"] >= 12.0
    # Analysed and not closed: still the job's open incident (collection is over).
    assert j["open_incident"] == served.incident


def test_a_closed_incident_is_no_longer_the_jobs_open_one(tmp_path: Path) -> None:
    ctx = harness.make_context(tmp_path)
    try:
        harness.feed_job(ctx.registry, job="j", world=8, stuck=3)
        first = harness.insert_incident(ctx, job="j", report=harness.hang_report(world=8, stuck=3))
        newer = harness.insert_incident(
            ctx, job="j", report=harness.hang_report(world=8, stuck=3), created=time.time() + 1
        )
        with harness.serve(create_app(ctx)) as base:

            def shown() -> tuple[object, object]:
                (summary,) = httpx.get(base + "/api/jobs", timeout=10).json()
                ranks = httpx.get(base + "/api/jobs/j/ranks", timeout=10).json()
                return summary["open_incident"], ranks["open_incident"]

            assert shown() == (newer, newer)
            ctx.store.end_incident(newer, reason="the job stopped")
            assert shown() == (first, first)
            ctx.store.resolve_incident(first, stall_s=3.0, late_ranks=[3], reason="it moved")
            assert shown() == (None, None)
    finally:
        ctx.store.close()


def test_job_ranks_reports_progress_lag_and_the_stall(served: Served) -> None:
    body = served.client.get(f"/api/jobs/{JOB}/ranks").json()
    ranks = {r["rank"]: r for r in body["ranks"]}
    assert sorted(ranks) == list(range(WORLD))
    stuck = ranks[STUCK]
    # The culprit never enqueued #42: one behind the others, and named by the stall.
    assert stuck["lag"] == 1 and stuck["lag_bucket"] == "lag1" and stuck["suspect"] is True
    assert stuck["in_flight_op"] == "" and stuck["in_flight_age_s"] is None
    other = ranks[0]
    assert other["lag"] == 0 and other["lag_bucket"] == "lag0" and other["suspect"] is False
    assert other["in_flight_op"] == "all_reduce" and other["in_flight_seq"] == 42
    assert other["in_flight_age_s"] >= 12.0
    assert other["last_completed"] == 41
    assert other["connected"] and other["observed"]
    [st] = body["stalled"]
    assert st["group"] == "0" and st["seq"] == 42 and st["op"] == "all_reduce"
    assert st["not_entered_ranks"] == [STUCK]
    assert len(st["waiting_ranks"]) == WORLD - 1
    assert [g["name"] for g in body["groups"]] == ["0"]
    assert len(body["agents"]) == WORLD // 8
    assert body["missing_ranks"] == []


def test_ranks_follow_new_progress_reports(served: Served) -> None:
    harness.report_rank(
        served.ctx.registry,
        job=JOB,
        sessions=served.sessions,
        rank=STUCK,
        last_enqueued=42,
        last_completed=41,
        report_seq=2,
    )
    body = served.client.get(f"/api/jobs/{JOB}/ranks").json()
    stuck = next(r for r in body["ranks"] if r["rank"] == STUCK)
    assert stuck["lag"] == 0 and stuck["suspect"] is False
    assert stuck["in_flight_seq"] == 42


def test_unknown_job_and_incident_are_404(served: Served) -> None:
    assert served.client.get("/api/jobs/nope/ranks").status_code == 404
    assert served.client.get("/api/incidents/nope").status_code == 404
    assert served.client.get("/api/incidents/nope/bundle").status_code == 404
    assert served.client.get("/jobs/nope").status_code == 404
    assert served.client.get("/incidents/nope").status_code == 404


def test_incident_detail_carries_the_full_report(served: Served) -> None:
    body = served.client.get(f"/api/incidents/{served.incident}").json()
    assert body["id"] == served.incident and body["job"] == JOB
    assert body["status"] == "analyzed" and body["verdict"] == "hang"
    assert body["lagging_ranks"] == [STUCK]
    assert body["detection_s"] == 13.5
    assert body["ranks_unreachable"] == {}
    report = Report.from_dict(body["report"])  # the stable schema round-trips
    expected = harness.hang_report(world=WORLD, stuck=STUCK)
    assert report == expected
    ev = body["report"]["evidence"][str(STUCK)]
    assert ev["sources"]["stacks"] == "py-spy"
    assert "slow_data_loader" in ev["stacks"]
    assert ev["process_state"] == "running"
    assert ev["gpu"] == {"available": False, "reason": "no NVML on this host"}


def test_incident_filters(served: Served) -> None:
    ctx = served.ctx
    old = time.time() - 7200
    older_id = harness.insert_incident(
        ctx, job="other-job", report=harness.hang_report(world=8, stuck=3), created=old
    )
    healthy = harness.hang_report(world=8, stuck=3)
    healthy.verdict = "healthy"
    healthy_id = harness.insert_incident(ctx, job="other-job", report=healthy)
    c = served.client

    def ids(**params: str | float) -> list[str]:
        r = c.get("/api/incidents", params=params)
        assert r.status_code == 200, r.text
        return [i["id"] for i in r.json()]

    assert set(ids()) == {served.incident, older_id, healthy_id}
    assert ids()[0] in (served.incident, healthy_id)  # newest first
    assert set(ids(job=JOB)) == {served.incident}
    assert set(ids(verdict="healthy")) == {healthy_id}
    assert set(ids(since=time.time() - 600)) == {served.incident, healthy_id}
    assert ids(until=old + 1) == [older_id]
    iso = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(old + 1))
    assert ids(until=iso) == [older_id]
    assert len(ids(limit=1)) == 1
    # The culprit's host (rank 3 of 8 ran on node0); a healthy verdict blames none.
    assert ids(host="node0") == [older_id]
    # Pages: each after the last id of the one before, together the whole list.
    first, second = ids(limit=2), ids(limit=2, before=ids(limit=2)[-1])
    assert first + second == ids() and len(second) == 1
    bad = c.get("/api/incidents", params={"before": "nope"})
    assert bad.status_code == 400 and "before" in bad.json()["detail"]
    page = c.get("/incidents", params={"limit": 2}).text
    assert 'id="older-page"' in page and f"before={first[-1]}" in page
    last = c.get("/incidents", params={"limit": 2, "before": first[-1]}).text
    assert second[0] in last and 'id="older-page"' not in last and 'id="newest-page"' in last
    item = c.get("/api/incidents", params={"job": JOB}).json()[0]
    assert set(item) >= {"id", "job", "created", "verdict", "summary", "lagging_ranks", "status"}
    bad = c.get("/api/incidents", params={"since": "yesterday-ish"})
    assert bad.status_code == 422 and "since" in bad.json()["detail"]
    assert c.get("/api/incidents", params={"limit": 0}).status_code == 422


def test_bundle_is_a_safe_tar_gz(served: Served, tmp_path_factory: pytest.TempPathFactory) -> None:
    root = served.ctx.store.incident_dir(served.incident)
    outside = tmp_path_factory.mktemp("outside")
    (outside / "secret.txt").write_text("must not leak")
    (outside / "dir").mkdir()
    (outside / "dir" / "also-secret").write_text("nor this")
    os.symlink(outside / "secret.txt", root / "rank_0" / "link-to-secret")
    os.symlink(outside / "dir", root / "linked-dir")
    os.symlink("/etc/passwd", root / "passwd")
    os.mkfifo(root / "rank_0" / "a-fifo")  # would block a naive reader forever
    big = os.urandom(3 * 1024 * 1024 + 17)  # several read chunks, odd size
    (root / "rank_0" / "big.bin").write_bytes(big)

    r = served.client.get(f"/api/incidents/{served.incident}/bundle")
    assert r.status_code == 200
    assert r.headers["content-type"] == "application/gzip"
    assert f'filename="{served.incident}.tar.gz"' in r.headers["content-disposition"]
    with tarfile.open(fileobj=io.BytesIO(r.content), mode="r:gz") as tar:
        members = {m.name: m for m in tar.getmembers()}
        p = served.incident
        assert set(members) == {
            p,
            f"{p}/incident.json",
            f"{p}/rank_0",
            f"{p}/rank_0/big.bin",
            f"{p}/rank_0/fr_trace_rank_0",
            f"{p}/rank_0/stacks.txt",
        }
        assert all(m.isfile() or m.isdir() for m in members.values())
        got = tar.extractfile(f"{p}/rank_0/big.bin")
        assert got is not None and got.read() == big
        stacks = tar.extractfile(f"{p}/rank_0/stacks.txt")
        assert stacks is not None and b"all_reduce" in stacks.read()
    assert b"must not leak" not in r.content  # compressed, but a cheap extra guard


def test_bundle_of_incident_without_files_is_404(served: Served) -> None:
    row = served.ctx.store.create_incident(
        job_id=JOB, reason="test", trigger="stall", ranks_expected=[0]
    )
    r = served.client.get(f"/api/incidents/{row.id}/bundle")
    assert r.status_code == 404


_SAMPLE = re.compile(
    r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?:[a-zA-Z_]\w*="(?:[^"\\\n]|\\.)*",?)*\})? (\S+)$'
)


def _parse_metrics(text: str) -> dict[str, list[tuple[str, float]]]:
    out: dict[str, list[tuple[str, float]]] = {}
    types: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            types[name] = kind
            continue
        if line.startswith("#") or not line:
            continue
        m = _SAMPLE.match(line)
        assert m, f"not a valid sample line: {line!r}"
        out.setdefault(m.group(1), []).append((m.group(2) or "", float(m.group(3))))
    out["__types__"] = [(k, 0.0) for k in types.items()]  # type: ignore[misc]
    return out


def test_metrics_prometheus_text(served: Served) -> None:
    # A hostile job name must not break the exposition format.
    evil = 'evil"job\\with\nnewline'
    harness.feed_job(served.ctx.registry, job=evil, world=2, stuck=1, ranks_per_agent=2)
    r = served.client.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    text = r.text
    samples = _parse_metrics(text)
    assert samples["hangwatch_agents_connected"] == [("", WORLD // 8 + 1)]
    assert samples["hangwatch_ranks_connected"] == [("", WORLD + 2)]
    ages = dict(samples["hangwatch_oldest_inflight_age_seconds"])
    assert ages['{job="llama-70b"}'] >= 12.0
    assert '{job="evil\\"job\\\\with\\nnewline"}' in ages
    assert samples["hangwatch_incidents_total"] == [('{trigger="stall",verdict="hang"}', 1.0)]
    buckets = samples["hangwatch_detection_latency_seconds_bucket"]
    counts = [v for _, v in buckets]
    assert counts == sorted(counts), "histogram buckets must be cumulative"
    assert buckets[-1][0] == '{le="+Inf"}' and counts[-1] == 1
    assert samples["hangwatch_detection_latency_seconds_count"] == [("", 1.0)]
    assert math.isclose(samples["hangwatch_detection_latency_seconds_sum"][0][1], 13.5)
    assert "# TYPE hangwatch_detection_latency_seconds histogram" in text
    assert "# TYPE hangwatch_incidents_total counter" in text
    assert text.count("# TYPE hangwatch_incidents_total ") == 1


def test_metrics_before_any_incident(tmp_path: Path) -> None:
    ctx = harness.make_context(tmp_path)
    try:
        with harness.serve(create_app(ctx)) as base:
            text = httpx.get(base + "/metrics", timeout=10).text
    finally:
        ctx.store.close()
    samples = _parse_metrics(text)
    assert samples["hangwatch_agents_connected"] == [("", 0.0)]
    assert samples["hangwatch_detection_latency_seconds_count"] == [("", 0.0)]
    assert "# TYPE hangwatch_incidents_total counter" in text


def test_probes_and_headers(served: Served) -> None:
    c = served.client
    assert c.get("/healthz").json() == {"ok": True}
    assert c.get("/readyz").json() == {"ready": True, "detail": ""}
    for path in ("/", f"/incidents/{served.incident}", "/api/jobs", "/static/app.js"):
        h = c.get(path).headers
        assert "default-src 'self'" in h["content-security-policy"]
        assert "script-src 'self'" in h["content-security-policy"]
        assert h["x-content-type-options"] == "nosniff"
        assert h["x-frame-options"] == "DENY"
    served.ctx.store.close()  # the store stops answering: not ready
    r = c.get("/readyz")
    assert r.status_code == 503 and r.json() == {
        "ready": False,
        "detail": "incident store unavailable",
    }


def test_openapi_and_self_hosted_docs(served: Served) -> None:
    spec = served.client.get("/openapi.json").json()
    for path in (
        "/api/jobs",
        "/api/jobs/{job}/ranks",
        "/api/incidents",
        "/api/incidents/{incident_id}",
        "/api/incidents/{incident_id}/bundle",
        "/healthz",
        "/readyz",
        "/metrics",
    ):
        assert path in spec["paths"], path
    schemas = spec["components"]["schemas"]
    assert {"JobSummary", "JobRanks", "IncidentSummary", "IncidentDetail", "Report"} <= set(schemas)
    assert "/" not in spec["paths"]  # pages are not API
    docs = served.client.get("/docs")
    assert docs.status_code == 200
    assert "/api/incidents/{incident_id}/bundle" in docs.text
    assert "IncidentDetail" in docs.text
    assert "cdn" not in docs.text.lower() and "https://" not in docs.text


def test_pages_render_server_side(served: Served) -> None:
    c = served.client
    home = c.get("/").text
    assert f'href="/jobs/{JOB}"' in home and served.incident in home
    job = c.get(f"/jobs/{JOB}").text
    assert job.count('class="cell ') == WORLD
    assert f'class="cell lag1 stalled" role="listitem" data-rank="{STUCK}"' in job
    assert "Nothing stalled." not in job
    listing = c.get("/incidents", params={"verdict": "hang"}).text
    assert served.incident in listing
    assert served.incident not in c.get("/incidents", params={"verdict": "healthy"}).text
    page = c.get(f"/incidents/{served.incident}").text
    assert f"Rank {STUCK} never entered all_reduce #42" in page
    assert 'id="rank-37"' in page and "slow_data_loader" in page
    assert "source: py-spy" in page
    assert '<svg xmlns="http://www.w3.org/2000/svg" class="waitgraph"' in page
    offline = c.get(f"/incidents/{served.incident}/report.html")
    assert offline.status_code == 200
    assert "attachment" in offline.headers["content-disposition"]
    assert "<style>" in offline.text


def test_heat_map_renders_1024_cells(tmp_path: Path) -> None:
    ctx = harness.make_context(tmp_path)
    harness.feed_job(ctx.registry, job="big", world=1024, stuck=700, ranks_per_agent=64)
    try:
        with harness.serve(create_app(ctx)) as base:
            t0 = time.perf_counter()
            html = httpx.get(base + "/jobs/big", timeout=10).text
            elapsed = time.perf_counter() - t0
    finally:
        ctx.store.close()
    cells = re.findall(r'<div class="cell ([a-z0-9 ]+)" role="listitem" data-rank="(\d+)"', html)
    assert [int(r) for _, r in cells] == list(range(1024))
    assert dict((int(r), c) for c, r in cells)[700] == "lag1 stalled"
    assert 'class="heatmap large"' in html
    assert elapsed < 5.0, f"1,024-rank job page took {elapsed:.2f} s"


def test_real_analyzer_incident_end_to_end(tmp_path: Path) -> None:
    """Real gloo dumps -> real analyzer -> store -> API, page and bundle -> analyzer again."""
    if not (harness.GOLDEN_SKIP / "manifest.json").is_file():
        pytest.skip(f"golden dumps absent: {harness.GOLDEN_SKIP} not in this tree")
    from hangwatch.analyzer import analyze_path

    inc = harness.real_incident()
    ctx = harness.make_context(tmp_path / "data")
    incident_id = harness.insert_incident(
        ctx, job="zoo-skip", report=inc.report, bundle_from=inc.dumps
    )
    try:
        with harness.serve(create_app(ctx)) as base, httpx.Client(base_url=base) as c:
            body = c.get(f"/api/incidents/{incident_id}").json()
            assert body["lagging_ranks"] == inc.lagging_ranks
            assert Report.from_dict(body["report"]) == inc.report
            sc = body["report"]["stalled_collective"]
            assert (sc["group"], sc["seq"], sc["op"]) == (inc.group, inc.seq, inc.op)
            page = c.get(f"/incidents/{incident_id}").text
            for r in inc.lagging_ranks:
                assert f'id="rank-{r}"' in page
            tgz = c.get(f"/api/incidents/{incident_id}/bundle").content
    finally:
        ctx.store.close()
    out = tmp_path / "downloaded"
    with tarfile.open(fileobj=io.BytesIO(tgz), mode="r:gz") as tar:
        tar.extractall(out, filter="data")
    again = analyze_path(out / incident_id)
    assert again.verdict == inc.report.verdict
    assert again.lagging_ranks == inc.lagging_ranks


def test_incident_page_says_which_ranks_were_seen_through_tails(served: Served) -> None:
    report = harness.hang_report(world=WORLD, stuck=STUCK)
    plain = served.client.get(f"/incidents/{served.incident}").text
    assert "From FR tails only" not in plain
    report.tail_ranks = [r for r in range(WORLD) if r != STUCK]
    iid = harness.insert_incident(served.ctx, job=JOB, report=report)
    page = served.client.get(f"/incidents/{iid}").text
    assert "From FR tails only" in page
    api = served.client.get(f"/api/incidents/{iid}").json()
    assert api["report"]["tail_ranks"] == report.tail_ranks


def test_a_job_whose_ranks_are_gone_is_ended_not_live(served: Served) -> None:
    for r in range(WORLD):
        harness.report_rank(
            served.ctx.registry,
            job=JOB,
            sessions=served.sessions,
            rank=r,
            last_enqueued=42 if r != STUCK else 41,
            last_completed=41,
            report_seq=2 + r,
            state=pb.PROCESS_STATE_GONE,
        )
    (j,) = served.client.get("/api/jobs").json()
    assert (j["state"], j["live"]) == ("ended", False)
    assert j["ended_reason"] == "every rank of the job exited"
    # A dead job has nothing in flight, however old its last reports are.
    assert j["oldest_inflight_age_s"] is None
    body = served.client.get(f"/api/jobs/{JOB}/ranks").json()
    assert (body["state"], body["live"], body["oldest_inflight_age_s"]) == ("ended", False, None)
    for path in ("/", f"/jobs/{JOB}"):
        page = served.client.get(path).text
        assert 'class="badge badge-ended job-state"' in page, path
        assert "badge badge-healthy job-state" not in page, path


def test_job_page_says_none_and_unnamed_not_raw_sentinels(served: Served) -> None:
    # A group torch left unnamed ("undefined") where one rank has entered nothing
    # yet: FR's -1 and torch's placeholder must not reach the page or the API.
    harness.feed_job(
        served.ctx.registry, job="fresh", world=2, stuck=1, seq=0, group_desc="undefined"
    )
    body = served.client.get("/api/jobs/fresh/ranks").json()
    assert [g["desc"] for g in body["groups"]] == [""]
    assert body["groups"][0]["min_completed"] == -1  # the API keeps FR's value
    html = served.client.get("/jobs/fresh").text
    assert "undefined" not in html
    assert not re.search(r"#-1\b", html)
    assert re.search(r'<td class="num">none</td>', html)


def test_the_jobs_list_counts_only_groups_stalled_past_the_timeout(tmp_path: Path) -> None:
    """A healthy job's members are caught between collectives at any instant
    (one has entered the next all_reduce, another is still on its way): the
    job page shows that pattern with its age, but the jobs list counts a group
    as stalled only past the stall timeout, as the detector and the
    hangwatch_job_stalled_groups gauge do. The full scan it ran before flagged
    healthy jobs, and held the registry's lock ~0.1 s a 4,096-rank job."""
    clock = FakeClock()
    ctx = harness.make_context(tmp_path, clock=clock)
    sessions = harness.feed_job(ctx.registry, job="healthy", world=16, stuck=3)
    # Every rank finishes all_reduce #42; all but rank 3 enter #43 (0.5 s ago).
    for r in range(16):
        done = 43 if r != 3 else 42
        harness.report_rank(
            ctx.registry, job="healthy", sessions=sessions, rank=r,
            last_enqueued=done, last_completed=42, report_seq=2 + r,
        )  # fmt: skip
    with harness.serve(create_app(ctx)) as base, httpx.Client(base_url=base, timeout=20) as c:
        [job] = c.get("/api/jobs").json()
        assert job["stalled_groups"] == 0, job
        ranks = c.get("/api/jobs/healthy/ranks").json()
        assert [s["group"] for s in ranks["stalled"]] == ["0"], ranks["stalled"]
        clock.advance(6.0)  # past the 5 s stall timeout, within the agent-lost one
        [job] = c.get("/api/jobs").json()
        assert job["stalled_groups"] == 1, job
