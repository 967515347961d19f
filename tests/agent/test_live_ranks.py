"""Hook, poller, collector and agent against one real hung 2-rank gloo job.

Rank 1 stops calling collectives after 5 steps; rank 0 blocks in all_reduce #6
of the default group. Tests run in file order and share the job.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hangwatch.agent import collector, endpoint
from hangwatch.agent.ranks import poll_rank
from hangwatch.agent.service import Agent
from hangwatch.analyzer import packed
from hangwatch.analyzer.parse import parse_dump_bytes

from hangwatch import formats, hook_protocol
from hangwatch.config import Config
from hangwatch.formats import RankMeta, nodearchive
from hangwatch.safepickle import safe_loads
from hangwatch.wire import pb
from tests.agent.live_ranks import PYSPY, Job, socket_of

pytestmark = pytest.mark.torch


@pytest.mark.timeout(60)
def test_rankinfo_pg_ids_match_flight_recorder(hang_job: Job) -> None:
    infos = hang_job.rankinfo()
    assert sorted(infos) == [0, 1], hang_job.output()
    for rank, info in infos.items():
        assert info["schema"] == formats.RANKINFO
        assert info["pid"] == hang_job.pid(rank)
        assert info["fr_source"] == "worker-server"
        assert info["world_size"] == 2 and info["backend"] == "gloo"
        # The truth: FR entries carry both the local pg_id and the group name.
        doc = json.loads(endpoint.call(socket_of(info), hook_protocol.FR_TRACE_JSON, timeout=5))
        from_fr = {e["pg_id"]: e["process_group"][0] for e in doc["entries"]}
        from_hook = {g["pg_id"]: g["name"] for g in info["groups"]}
        assert from_fr == {k: v for k, v in from_hook.items() if k in from_fr}, (from_fr, from_hook)
        # Rank 1 is not in the "head" group (ranks [0]): its pg_ids shift, as FR's do.
        names = [g["name"] for g in info["groups"]]
        assert ("1" in names) == (rank == 0)
        for g in info["groups"]:
            assert rank in g["ranks"]
    log0 = hang_job.logs[0].read_text()
    assert f"'TORCH_FR_DUMP_TEMP_FILE': '{hang_job.run_dir}/fr/fr_trace_rank_'" in log0


@pytest.mark.timeout(60)
def test_status_handler_is_status_only_and_pickle_is_torchs(hang_job: Job) -> None:
    info = hang_job.rankinfo()[0]
    sock = socket_of(info)
    status = endpoint.call(sock, hook_protocol.STATUS, timeout=2)
    doc = json.loads(status)
    assert "entries" not in status.decode() and len(status) < 2048, status[:300]
    # One status-only dump per recorder instance; a gloo job has one, gloo's.
    assert doc["schema"] == formats.FRSTATUS
    (gloo,) = doc["recorders"]
    assert gloo["instance"] == "gloo"
    status = gloo["dump"]["pg_status"]["0"]
    assert status["last_enqueued_collective"] == "6"
    # Rank 0 is inside #6, so at most #5 is complete. How far below that FR's
    # counter is has no bound the test can rely on: gloo records completion
    # from its own worker thread after wait() has already returned to the
    # script (measured: "3" on a loaded machine, "4" or "5" on an idle one).
    assert 0 <= int(status["last_completed_collective"]) <= 5, status
    fr = safe_loads(endpoint.call(sock, hook_protocol.FR_PICKLE, timeout=10))
    assert fr["entries"] and all("frames" in e for e in fr["entries"])
    assert endpoint.call(sock, hook_protocol.PING, timeout=2) == b"pong"


@pytest.mark.timeout(60)
def test_poll_reports_the_stall_with_agent_clock_ages(hang_job: Job) -> None:
    trackers = hang_job.trackers()
    t0 = time.monotonic()
    first = {r: poll_rank(t, t0, entries_after_s=0.3) for r, t in trackers.items()}
    assert all(not res.events for res in first.values())
    # The agent's clock is the `now` it is handed: 0.4 s later, with no sleep.
    t1 = t0 + 0.4
    second = {r: poll_rank(t, t1, entries_after_s=0.3) for r, t in trackers.items()}
    p0 = {g.group: g for g in trackers[0].progress_pb(t1).groups}
    p1 = {g.group: g for g in trackers[1].progress_pb(t1).groups}
    assert trackers[0].state == pb.PROCESS_STATE_RUNNING
    assert (p0["0"].last_enqueued, p0["0"].last_completed) == (6, 5)
    # Rank 1 finished #5; gloo may not have counted it in pg_status yet, and then
    # the retired entry (fetched because #5 looked in flight) settles it.
    assert (p1["0"].last_enqueued, p1["0"].last_completed) == (5, 5)
    assert p0["0"].HasField("oldest_in_flight") and not p1["0"].HasField("oldest_in_flight")
    assert p0["0"].oldest_in_flight.seq == 6
    # Ages are the agent's own monotonic time since it first saw #6 in flight:
    # at the first poll, or at the second when gloo's completed count lagged
    # and the fetched entries settled it.
    age1 = p0["0"].oldest_in_flight.age_s
    assert age1 == pytest.approx(t1 - t0, abs=0.05) or age1 == pytest.approx(0.0, abs=0.05)
    # The full dump was fetched once, as deltas: at the first poll (the agent's
    # first look at a rank that has entered collectives, agent/numbering.py)
    # or, in flight past the threshold, at the second.
    new = first[0].entries + second[0].entries
    assert new and new[-1].profiling_name == "gloo:all_reduce" and new[-1].group == "0"
    assert p0["0"].oldest_in_flight.op == "all_reduce"
    assert [e.record_id for e in new] == sorted(e.record_id for e in new)
    assert trackers[1].python_ok, "status handler did not answer"
    t3 = t1 + 0.25
    third = poll_rank(trackers[0], t3, entries_after_s=0.3)
    assert not third.entries  # no new records since
    age3 = {g.group: g for g in trackers[0].progress_pb(t3).groups}["0"].oldest_in_flight.age_s
    assert age3 == pytest.approx(age1 + (t3 - t1), abs=0.05)


@pytest.mark.timeout(60)
def test_collect_bundle_with_a_frozen_rank(hang_job: Job, tmp_path: Path) -> None:
    trackers = hang_job.trackers()
    hang_job.sigstop(1)
    try:
        res = poll_rank(trackers[1], time.monotonic(), entries_after_s=1.0)
        assert trackers[1].state == pb.PROCESS_STATE_STOPPED and not res.events
        gpu = collector.gpu_snapshot()
        run_dir = str(hang_job.run_dir)
        b0 = collector.collect_rank(
            trackers[0], run_dir=run_dir, incident_id="inc-1", pyspy=PYSPY, gpu=gpu
        )
        t = time.monotonic()
        b1 = collector.collect_rank(
            trackers[1], run_dir=run_dir, incident_id="inc-1", pyspy=PYSPY, gpu=gpu
        )
        frozen_s = time.monotonic() - t
    finally:
        hang_job.sigcont(1)
    assert b0.failure == "" and b0.sources["fr"] == "worker-server"
    assert b0.sources["stacks"] == "worker-server"
    d0 = Path(b0.directory)
    assert sorted(p.name for p in d0.iterdir()) == ["fr_trace_rank_0", "meta.json", "stacks.txt"]
    assert "all_reduce" in (d0 / "stacks.txt").read_text()
    # torch's own format: the pickle with call-site frames when it answers
    # within the collector's grace, else the C++ JSON dump (readers sniff).
    assert parse_dump_bytes((d0 / "fr_trace_rank_0").read_bytes())["pg_status"]
    assert b1.failure == "process stopped (SIGSTOP?)"
    meta1 = json.loads((Path(b1.directory) / "meta.json").read_text())
    assert meta1["schema"] == formats.RANKMETA and meta1["process_state"] == "stopped"
    # What a real agent wrote reads back through the format's one reader.
    typed = RankMeta.from_json(meta1)
    assert typed.reachable is False and typed.groups == trackers[1].info.groups
    assert meta1["sources"]["fr"] == "none" and not meta1["reachable"]
    # py-spy reads a stopped process without its help (with --nonblocking).
    assert meta1["sources"]["stacks"] == "py-spy", meta1["errors"]
    assert "rankjob.py" in (Path(b1.directory) / "stacks.txt").read_text()
    assert frozen_s < collector.PYSPY_TIMEOUT_S + 1
    assert meta1["gpu"]["available"] in (True, False)
    if not meta1["gpu"]["available"]:
        assert meta1["gpu"]["reason"]


@contextlib.contextmanager
def _agent_against_coordinator(
    hang_job: Job, data: Path, *, job_id: str, node_id: str, token: str | None = None, **server: Any
) -> Iterator[tuple[Any, Agent]]:
    """A real coordinator on port 0 and a real agent over the hung job; the
    agent must stop within 8 s of being asked."""
    from hangwatch.server.coordinator import Coordinator

    server_cfg = Config.of(
        data_dir=str(data),
        grpc_port=0,
        http_port=0,
        stall_timeout=1.0,
        dump_deadline=20.0,
        token=token,
        **server,
    )
    with Coordinator(server_cfg) as coord:
        agent = Agent(
            Config.of(
                coordinator=coord.grpc_address,
                run_dir=str(hang_job.run_dir),
                poll_interval=0.3,
                job_id=job_id,
                node_id=node_id,
                token=token,
                pyspy=PYSPY,
            )
        )
        th = threading.Thread(target=agent.run, daemon=True)
        th.start()
        try:
            yield coord, agent
        finally:
            agent.stop.set()
            t = time.monotonic()
            th.join(10)
            assert not th.is_alive() and time.monotonic() - t < 8


@pytest.mark.timeout(90)
def test_agent_end_to_end_with_the_real_coordinator(hang_job: Job, tmp_path: Path) -> None:
    token = "s3cret-token"
    with _agent_against_coordinator(
        hang_job, tmp_path / "data", job_id="live", node_id="node-a", token=token
    ) as (coord, agent):
        incident_dir = None
        deadline = time.monotonic() + 45
        while time.monotonic() < deadline and incident_dir is None:
            time.sleep(0.3)
            for d in (tmp_path / "data").rglob("incident.json"):
                inc = json.loads(d.read_text())
                if sorted(inc.get("ranks_dumped", [])) == [0, 1]:
                    incident_dir = d.parent
        assert incident_dir is not None, list((tmp_path / "data").rglob("*"))
        snap = coord.registry.snapshot("live")
        assert snap is not None and sorted(r.rank for r in snap.ranks) == [0, 1]
        local = hang_job.run_dir / "bundles" / incident_dir.name
        # Issue 27: a coordinator that lost a file it was sent (killed before it
        # reached the disk) asks again; the agent sends its kept copy, not a new
        # collection (the local file is the same inode, written once).
        lost = incident_dir / "rank_1" / "fr_trace_rank_1"
        lost.unlink()
        kept = (local / "rank_1" / "fr_trace_rank_1").stat()
        agent.handle_command(pb.Command(kind=pb.COMMAND_KIND_DUMP, incident_id=incident_dir.name))
        assert lost.is_file()
        again = (local / "rank_1" / "fr_trace_rank_1").stat()
        assert (again.st_ino, again.st_mtime_ns) == (kept.st_ino, kept.st_mtime_ns)
    # The coordinator's copy is byte-identical to the agent's local copy.
    for rank in (0, 1):
        for name in (f"fr_trace_rank_{rank}", "meta.json", "stacks.txt"):
            mine = (local / f"rank_{rank}" / name).read_bytes()
            theirs = (incident_dir / f"rank_{rank}" / name).read_bytes()
            assert hashlib.sha256(mine).digest() == hashlib.sha256(theirs).digest()
    assert agent.polls >= 3


@pytest.mark.timeout(90)
def test_agent_two_phase_collection_with_the_real_coordinator(
    hang_job: Job, tmp_path: Path
) -> None:
    """full_dump_max_ranks=0 forces a small job down the large-job path: tails,
    metas and stacks first in one stream, then the lagging rank's full dump."""
    with _agent_against_coordinator(
        hang_job,
        tmp_path / "data",
        job_id="live2",
        node_id="node-b",
        full_dump_max_ranks=0,
        tail_context=2,
    ) as (coord, _agent):
        incident_dir: Path | None = None
        full = None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            time.sleep(0.3)
            for d in (tmp_path / "data").rglob("incident.json"):
                incident_dir = d.parent
            if incident_dir is not None:
                full = incident_dir / "rank_1" / "fr_trace_rank_1"
                if full.is_file():
                    break
        assert incident_dir is not None, list((tmp_path / "data").rglob("*"))
        assert full is not None and full.is_file(), sorted(
            str(p.relative_to(incident_dir)) for p in incident_dir.rglob("*")
        )
        row = coord.store.get_incident(incident_dir.name)
        assert row is not None and row.report is not None
        assert row.report.lagging_ranks == [1], row.report.summary
        uploads = coord.metrics.render_prometheus()
    inc = json.loads((incident_dir / "incident.json").read_text())
    assert inc["tail_context"] == 2 and sorted(inc["ranks_dumped"]) == [0, 1]
    # Rank 0 is not lagging: its full history stayed on the node.
    assert not (incident_dir / "rank_0" / "fr_trace_rank_0").exists()
    local = hang_job.run_dir / "bundles" / incident_dir.name
    # Phase one went up as one archive for the node (BundleChunk.node_archive).
    assert [p.name for p in nodearchive.archives(incident_dir)] == ["node_0.zip"]
    # The agent decoded its tails (in a child process) and sent them along;
    # the analyzer took both ranks from them.
    cols = nodearchive.stored_file(incident_dir, 0, formats.FR_COLUMNS_FILE)
    assert cols is not None
    members = {m.member: m for m in nodearchive.list_members(incident_dir / "nodes" / "node_0.zip")}
    assert sorted(packed.unpack(cols, members)) == [
        "rank_0/fr_tail_rank_0",
        "rank_1/fr_tail_rank_1",
    ]
    assert not [e for e in row.report.errors if formats.FR_COLUMNS_FILE in e.file], (
        row.report.errors
    )
    for rank in (0, 1):
        for name in (f"fr_tail_rank_{rank}", "meta.json"):
            mine = (local / f"rank_{rank}" / name).read_bytes()
            assert mine == nodearchive.stored_file(incident_dir, rank, name), name
            assert not (incident_dir / f"rank_{rank}" / name).exists()
        # Stacks travel inside meta.json; stacks.txt stays on the node.
        assert nodearchive.stored_file(incident_dir, rank, "stacks.txt") is None
        meta = json.loads((local / f"rank_{rank}" / "meta.json").read_text())
        assert meta["stacks"] == (local / f"rank_{rank}" / "stacks.txt").read_text()
        ev = row.report.evidence[rank]
        assert ev.stacks and "Thread" in ev.stacks, ev
        tail = parse_dump_bytes((local / f"rank_{rank}" / f"fr_tail_rank_{rank}").read_bytes())
        whole = parse_dump_bytes((local / f"rank_{rank}" / f"fr_trace_rank_{rank}").read_bytes())
        assert 0 < len(tail["entries"]) < len(whole["entries"])
    assert (local / "rank_1" / "fr_trace_rank_1").read_bytes() == full.read_bytes()
    assert 'hangwatch_grpc_requests_total{code="OK",method="UploadFiles"} 1' in uploads
