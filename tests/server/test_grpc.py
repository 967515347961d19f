"""The coordinator over real gRPC on loopback: protocol, detector, dumps, uploads."""

from __future__ import annotations

import contextlib
import json
import queue
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from hangwatch.server.coordinator import Coordinator
from hangwatch.server.incidents.store import IncidentRow

from hangwatch import formats
from hangwatch.wire import pb, rpc
from tests.support.clock import FakeClock

from .conftest import (
    ProtocolAgent,
    chunks,
    gloo_dump,
    hang_rank_2,
    rank_meta,
    wait_for,
    wait_status,
)

JOB = "job-1"


def _agents(stub: rpc.CoordinatorStub, world: int = 4) -> tuple[ProtocolAgent, ProtocolAgent]:
    half = world // 2
    a = ProtocolAgent(
        stub, job_id=JOB, agent_id="node-a", ranks=list(range(half)), world_size=world
    )
    b = ProtocolAgent(
        stub, job_id=JOB, agent_id="node-b", ranks=list(range(half, world)), world_size=world
    )
    for ag in (a, b):
        ag.register()
        ag.watch()
    return a, b


@pytest.mark.timeout(30)
def test_register_progress_and_unknown_session(
    coordinator: Coordinator, stub: rpc.CoordinatorStub
) -> None:
    a = ProtocolAgent(stub, job_id=JOB, agent_id="node-a", ranks=[0, 1], world_size=2)
    resp = a.register()
    assert len(resp.session_id) == 32
    # Agents that report only changes must heartbeat well inside the lost-agent timeout.
    assert resp.heartbeat_s == pytest.approx(coordinator.registry.agent_lost_timeout / 3)
    assert a.progress({0: (3, 3), 1: (3, 2)})
    snap = coordinator.registry.snapshot(JOB)
    assert snap is not None and snap.world_size == 2
    assert [(r.rank, r.groups[0].last_completed, r.lag) for r in snap.ranks] == [
        (0, 3, 0),
        (1, 2, 1),
    ]
    assert snap.ranks[1].groups[0].in_flight_seq == 3
    assert stub.Health(pb.HealthRequest(), timeout=5).agents_connected == 1

    # Re-register (agent restart): the old session is no longer known.
    old = a.session_id
    a.register()
    assert a.session_id != old
    a.session_id, fresh = old, a.session_id
    assert a.progress({0: (4, 4)}) is False
    a.session_id = fresh
    assert a.progress({0: (4, 4)}) is True
    # A coordinator that never saw the session (it restarted) says so, no exception.
    ack = stub.ReportEntries(
        pb.EntryBatch(job_id=JOB, agent_id="node-a", session_id="f" * 32), timeout=5
    )
    assert ack.known is False


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("mutate", "needle"),
    [
        (lambda r: setattr(r.ranks[0], "world_size", 10**9), "world_size"),
        (lambda r: setattr(r, "job_id", "../etc"), "job_id"),
        (lambda r: setattr(r, "agent_id", "a/b"), "agent_id"),
        (lambda r: setattr(r, "agent_id", "a\x00b"), "agent_id"),
        (lambda r: setattr(r.ranks[0], "rank", 7), "rank 7"),
        (lambda r: r.ranks[0].groups[0].ranks.__setitem__(1, 99), "rank 99"),
    ],
)
def test_register_rejects_bad_input(
    coordinator: Coordinator,
    stub: rpc.CoordinatorStub,
    mutate: Callable[[pb.RegisterRequest], None],
    needle: str,
) -> None:
    req = pb.RegisterRequest(
        job_id=JOB,
        agent_id="node-a",
        host="h",
        ranks=[
            pb.RankInfo(rank=0, world_size=2, pid=1, groups=[pb.GroupInfo(name="0", ranks=[0, 1])])
        ],
    )
    mutate(req)
    with pytest.raises(grpc.RpcError) as ei:
        stub.Register(req, timeout=5)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in (ei.value.details() or "")
    assert coordinator.registry.jobs() == []


def _bundle_rank(
    agent: ProtocolAgent, incident_id: str, rank: int, le: int, lc: int, world: int
) -> None:
    ack = agent.upload(
        incident_id,
        rank,
        f"{formats.FR_FILE_PREFIX}{rank}",
        gloo_dump(rank=rank, last_enqueued=le, last_completed=lc),
        chunk=700,
    )
    assert ack.complete and not ack.duplicate
    assert agent.upload(incident_id, rank, formats.META_FILE, rank_meta(rank, world)).complete


# A coordinator on a fake clock, its clock, and a stub on its gRPC port.
Ticked = tuple[Coordinator, FakeClock, rpc.CoordinatorStub]


@pytest.fixture
def ticked(start_coordinator: Callable[..., Coordinator]) -> Iterator[Ticked]:
    """A coordinator on a fake clock over real gRPC: it detects nothing until the
    test advances the clock and calls `tick()` (its ticker thread is not started)."""
    clock = FakeClock()
    c = start_coordinator(clock=clock)
    with grpc.insecure_channel(c.grpc_address) as ch:
        yield c, clock, rpc.CoordinatorStub(ch)


def _incidents(c: Coordinator) -> list[str]:
    return [r.id for r in c.store.list_incidents(job_id=JOB)]


def _hold(
    c: Coordinator,
    clock: FakeClock,
    reports: dict[ProtocolAgent, dict[int, tuple[int, int]]],
    *,
    times: int,
    every: float,
) -> None:
    """Each agent reports the same numbers `times` times, `every` seconds of the
    fake clock apart, the coordinator ticking after each."""
    for _ in range(times):
        for agent, seqs in reports.items():
            agent.progress(seqs)
        clock.advance(every)
        c.incidents.tick()


@pytest.mark.timeout(60)
def test_stall_dump_upload_and_verdict(ticked: Ticked) -> None:
    coordinator, clock, stub = ticked
    a, b = _agents(stub)
    # Healthy steps first: progress moves, nothing fires.
    for step in range(1, 5):
        clock.advance(0.3)
        coordinator.incidents.tick()
        assert a.progress({0: (step, step), 1: (step, step)})
        assert b.progress({2: (step, step), 3: (step, step)})
    assert _incidents(coordinator) == []
    # At the same instant rank 2 stops: it never enters collective 5; the others
    # wait in it.
    a.progress({0: (5, 4), 1: (5, 4)})
    b.progress({2: (4, 4), 3: (5, 4)})
    # Stall timeout 0.5 s after rank 2's last move: not at 0.45 s, at the next
    # scan past it (scans are one tick, 0.05 s, apart on the registry's clock).
    clock.advance(0.45)
    coordinator.incidents.tick()
    assert _incidents(coordinator) == []
    clock.advance(0.1)
    coordinator.incidents.tick()
    cmd_a = a.next_command(timeout=5)
    cmd_b = b.next_command(timeout=5)
    assert cmd_a.kind == pb.COMMAND_KIND_DUMP and cmd_a.incident_id == cmd_b.incident_id
    assert "group 0 stalled at seq 5" in cmd_a.reason and "ranks 2 not entered" in cmd_a.reason
    iid = cmd_a.incident_id
    row = coordinator.store.get_incident(iid)
    assert row is not None and row.status == "collecting" and row.trigger == "stall"
    assert row.ranks_expected == [0, 1, 2, 3]

    # The stall keeps being reported, for 8 stall timeouts (inside the 5 s dump
    # deadline, so the collection still waits for the uploads): still one incident.
    stalled = {a: {0: (5, 4), 1: (5, 4)}, b: {2: (4, 4), 3: (5, 4)}}
    _hold(coordinator, clock, stalled, times=8, every=0.5)
    assert _incidents(coordinator) == [iid]

    for r, (le, lc) in {0: (5, 4), 1: (5, 4)}.items():
        _bundle_rank(a, iid, r, le, lc, 4)
    for r, (le, lc) in {2: (4, 4), 3: (5, 4)}.items():
        _bundle_rank(b, iid, r, le, lc, 4)
    assert a.complete(iid, [0, 1])
    assert b.complete(iid, [2, 3])
    coordinator.incidents.tick()  # every rank is in: the collection is due now

    done = wait_status(coordinator, iid, "analyzed")
    assert done.verdict == "hang", done.summary
    assert done.lagging_ranks == [2]
    assert done.ranks_dumped == [0, 1, 2, 3] and done.ranks_unreachable == {}
    assert done.detection_s is not None and 0.4 < done.detection_s < 15
    assert done.report is not None and done.report.stalled_collective is not None
    assert done.report.stalled_collective.seq == 5
    doc = json.loads((coordinator.store.incident_dir(iid) / formats.INCIDENT_FILE).read_text())
    assert doc["schema"] == formats.INCIDENT and doc["ranks_dumped"] == [0, 1, 2, 3]
    assert doc["trigger"]["stalled"][0]["not_entered_ranks"] == [2]
    # Metrics are updated just after the row is stored.
    wait_for(
        lambda: coordinator.metrics.counter(
            "hangwatch_incidents_total", {"verdict": "hang", "trigger": "stall"}
        ),
        5,
        "incidents_total{verdict=hang}",
    )
    hist = coordinator.metrics.histogram("hangwatch_detection_latency_seconds")
    assert hist is not None and hist.n == 1

    # After the verdict the same stall persists: still no second incident.
    _hold(coordinator, clock, stalled, times=10, every=0.5)
    assert _incidents(coordinator) == [iid]
    a.close()
    b.close()


@pytest.mark.timeout(30)
def test_long_healthy_collective_opens_no_incident(ticked: Ticked) -> None:
    coordinator, clock, stub = ticked
    a, b = _agents(stub)
    a.progress({0: (3, 3), 1: (3, 3)})
    b.progress({2: (3, 3), 3: (3, 3)})
    # Every member is inside collective 4 and stays there 4x the stall timeout.
    inside = {a: {0: (4, 3), 1: (4, 3)}, b: {2: (4, 3), 3: (4, 3)}}
    _hold(coordinator, clock, inside, times=10, every=0.2)
    assert coordinator.store.list_incidents() == []
    snap = coordinator.registry.snapshot(JOB)
    assert snap is not None and snap.stalled == []
    # The agent's age of the collective at its last report, plus coordinator time since.
    assert (coordinator.registry.oldest_in_flight_age(JOB) or 0) >= 0.2
    a.close()
    b.close()


def _lose_node_b(stub: rpc.CoordinatorStub) -> tuple[ProtocolAgent, pb.Command]:
    """Node-b goes silent (a coordinator with a short lost-agent timeout) while
    ranks 0,1 wait in #3: node-a, and the DUMP it is handed for the incident."""
    a, b = _agents(stub)
    a.progress({0: (2, 2), 1: (2, 2)})
    b.progress({2: (2, 2), 3: (2, 2)})
    b.close()  # its ranks become unobserved
    end = time.monotonic() + 8
    cmd = None
    while cmd is None and time.monotonic() < end:
        a.progress({0: (3, 2), 1: (3, 2)})
        with contextlib.suppress(queue.Empty):
            cmd = a.next_command(timeout=0.2)
    assert cmd is not None, "no DUMP after node-b was lost"
    return a, cmd


@pytest.mark.timeout(60)
def test_lost_agent_is_unobserved_not_guilty(
    start_coordinator: Callable[..., Coordinator],
) -> None:
    c = start_coordinator(agent_lost_timeout=0.4, stall_timeout=1.0, dump_deadline=1.5)
    with grpc.insecure_channel(c.grpc_address) as ch:
        stub = rpc.CoordinatorStub(ch)
        a, cmd = _lose_node_b(stub)
        row = c.store.get_incident(cmd.incident_id)
        assert row is not None and row.trigger == "agent-lost"
        snap = c.registry.snapshot(JOB)
        assert snap is not None
        assert {r.rank: r.observed for r in snap.ranks} == {0: True, 1: True, 2: False, 3: False}
        for r in (0, 1):
            _bundle_rank(a, cmd.incident_id, r, 3, 2, 4)
        assert a.complete(cmd.incident_id, [0, 1])
        incident_id = cmd.incident_id

        # Node-a keeps reporting while the analysis runs: with a 0.4 s lost-agent
        # timeout a silent node-a would end the job, and the incident, first.
        def analyzed() -> IncidentRow | None:
            a.progress({0: (3, 2), 1: (3, 2)})
            row = c.store.get_incident(incident_id)
            return row if row is not None and row.status == "analyzed" else None

        done = wait_for(analyzed, 20, f"incident {incident_id} to be analyzed")
        assert set(done.ranks_unreachable) == {2, 3}
        assert all(v.startswith("agent unreachable") for v in done.ranks_unreachable.values())
        assert done.report is not None
        covered = {
            r for f in done.report.findings if f.kind == "agent-unreachable" for r in f.ranks
        }
        assert covered == {2, 3}, done.report.findings
        assert "Ranks 2,3 were unobserved (agent unreachable)" in (done.summary or ""), done.summary
        assert done.report.to_dict()["summary"] == done.summary
        # The coordinator wrote what it knew of the unreachable ranks.
        meta = json.loads(
            (c.store.incident_dir(cmd.incident_id) / "rank_2" / formats.META_FILE).read_text()
        )
        assert meta["reachable"] is False and meta["groups"][0]["ranks"] == [0, 1, 2, 3]
        a.close()


@pytest.mark.timeout(60)
def test_dumps_that_arrive_after_the_verdict_are_analysed_in(
    start_coordinator: Callable[..., Coordinator],
) -> None:
    """Issue 27: node-b is lost past the lost-agent timeout mid-incident, so the
    verdict calls ranks 2,3 unobserved. Back from its partition, it uploads the
    dumps it took (its meta.json replacing the coordinator's stand-in) and
    completes: the incident is analysed again with every rank, and now names
    the ranks that never entered #3, with its status and detection time kept."""
    c = start_coordinator(agent_lost_timeout=0.4, stall_timeout=1.0, dump_deadline=1.5)
    with grpc.insecure_channel(c.grpc_address) as ch:
        stub = rpc.CoordinatorStub(ch)
        a, cmd = _lose_node_b(stub)
        iid = cmd.incident_id
        for r in (0, 1):
            _bundle_rank(a, iid, r, 3, 2, 4)
        assert a.complete(iid, [0, 1])

        def status(want: Callable[[IncidentRow], bool]) -> Callable[[], IncidentRow | None]:
            def check() -> IncidentRow | None:
                a.progress({0: (3, 2), 1: (3, 2)})  # node-a alive: the job goes on
                row = c.store.get_incident(iid)
                return row if row is not None and want(row) else None

            return check

        first = wait_for(status(lambda r: r.status == "analyzed"), 20, "the first verdict")
        assert set(first.ranks_unreachable) == {2, 3}, first
        assert "Ranks 2,3 were unobserved (agent unreachable)" in (first.summary or "")
        stand_in = c.store.incident_dir(iid) / "rank_2" / formats.META_FILE
        assert json.loads(stand_in.read_text())["reachable"] is False

        # Node-b is back: the files of the dump it took, then its CompleteDump.
        back = ProtocolAgent(stub, job_id=JOB, agent_id="node-b", ranks=[2, 3], world_size=4)
        back.register()
        for r in (2, 3):
            _bundle_rank(back, iid, r, 2, 2, 4)
        assert json.loads(stand_in.read_text()).get("reachable") is not False
        assert back.complete(iid, [2, 3]), "a late dump of unreachable ranks is accepted"
        revised = wait_for(status(lambda r: r.ranks_unreachable == {}), 20, "the re-analysis")
        assert revised.ranks_dumped == [0, 1, 2, 3]
        done = wait_for(status(lambda r: r.summary != first.summary), 20, "the revised verdict")
        assert (done.status, done.verdict, done.lagging_ranks) == ("analyzed", "hang", [2, 3])
        assert done.summary == (
            "Ranks 2,3 never entered all_reduce #3 in group 0 (default_pg); ranks 0,1 are "
            "waiting in it."
        ), done.summary
        assert done.detection_s == first.detection_s
        assert done.report is not None
        assert not [f for f in done.report.findings if f.kind == "agent-unreachable"]
        doc = json.loads((c.store.incident_dir(iid) / formats.INCIDENT_FILE).read_text())
        assert sorted(doc["ranks_dumped"]) == [0, 1, 2, 3] and not doc["ranks_unreachable"]
        # Nothing new to say: a second late CompleteDump is refused.
        assert not back.complete(iid, [2, 3])
        a.close()


@pytest.mark.timeout(30)
def test_event_opens_incident_and_duplicates_join_it(
    start_coordinator: Callable[..., Coordinator],
) -> None:
    c = start_coordinator(stall_timeout=60.0, dump_deadline=1.0)
    with grpc.insecure_channel(c.grpc_address) as ch:
        stub = rpc.CoordinatorStub(ch)
        a, b = _agents(stub)
        a.progress({0: (5, 4), 1: (5, 4)})
        b.progress({2: (4, 4), 3: (5, 4)})

        def event(agent: ProtocolAgent, kind: int, rank: int) -> str:
            return str(
                stub.ReportEvent(
                    pb.Event(
                        job_id=JOB,
                        agent_id=agent.agent_id,
                        session_id=agent.session_id,
                        kind=kind,  # type: ignore[arg-type]
                        rank=rank,
                        detail="Timed out waiting 1000ms for recv operation",
                        age_s=0.5,
                    ),
                    timeout=5,
                ).incident_id
            )

        first = event(a, pb.EVENT_KIND_COLLECTIVE_TIMEOUT, 0)
        assert first
        assert event(b, pb.EVENT_KIND_COLLECTIVE_TIMEOUT, 3) == first
        assert a.next_command(timeout=5).incident_id == first
        row = c.store.get_incident(first)
        assert (
            row is not None
            and row.trigger == "timeout"
            and "collective timeout on rank 0" in row.reason
        )
        # Nobody uploads: after the deadline the incident still closes, saying why.
        done = wait_status(c, first, "analyzed", timeout=15)
        assert set(done.ranks_unreachable) == {0, 1, 2, 3}
        assert all("no answer before deadline" in v for v in done.ranks_unreachable.values())
        # A later timeout of the same hang joins the closed incident.
        assert event(a, pb.EVENT_KIND_COLLECTIVE_TIMEOUT, 1) == first
        assert len(c.store.list_incidents()) == 1
        # A rank exiting while nothing is in flight is a normal end, not an incident.
        a.progress({0: (5, 5), 1: (5, 5)})
        b.progress({2: (5, 5), 3: (5, 5)})
        assert event(b, pb.EVENT_KIND_RANK_EXITED, 3) == ""
        a.close()
        b.close()


@pytest.mark.timeout(30)
def test_frozen_rank_failure_is_recorded(
    coordinator: Coordinator, stub: rpc.CoordinatorStub
) -> None:
    a, b = _agents(stub)
    a.progress({0: (5, 4), 1: (5, 4)})
    b.progress({2: (5, 4), 3: (5, 4)}, states={2: pb.PROCESS_STATE_STOPPED})
    cmd = a.next_command(timeout=5)
    row = coordinator.store.get_incident(cmd.incident_id)
    assert (
        row is not None and row.trigger == "rank-lost" and "ranks 2 stopped or gone" in row.reason
    )
    b.next_command(timeout=5)
    for r in (0, 1):
        _bundle_rank(a, cmd.incident_id, r, 5, 4, 4)
    _bundle_rank(b, cmd.incident_id, 3, 5, 4, 4)
    assert a.complete(cmd.incident_id, [0, 1])
    assert b.complete(cmd.incident_id, [3], {2: "process stopped (SIGSTOP): no dump possible"})
    done = wait_status(coordinator, cmd.incident_id, "analyzed")
    assert done.ranks_dumped == [0, 1, 3]
    assert done.ranks_unreachable == {2: "process stopped (SIGSTOP): no dump possible"}
    # A process-level failure is evidence, not "unobserved": no agent-unreachable finding.
    assert done.report is not None
    assert not [f for f in done.report.findings if f.kind == "agent-unreachable"]
    assert a.complete(cmd.incident_id, [0, 1]) is False  # closed incidents accept no more results
    a.close()
    b.close()


def _incident(coordinator: Coordinator, ranks: list[int]) -> str:
    return coordinator.store.create_incident(
        job_id=JOB, reason="test", trigger="stall", ranks_expected=ranks
    ).id


@pytest.mark.timeout(30)
def test_upload_replay_cutoff_bad_sha_and_path_tricks(
    coordinator: Coordinator, stub: rpc.CoordinatorStub, tmp_path: Path
) -> None:
    iid = _incident(coordinator, [0, 1])
    a = ProtocolAgent(stub, job_id=JOB, agent_id="node-a", ranks=[0, 1], world_size=2)
    data = bytes(range(256)) * 1000  # 256 kB
    final = coordinator.store.incident_dir(iid) / "rank_0" / "fr_trace_rank_0"

    ack = a.upload(iid, 0, "fr_trace_rank_0", data, chunk=10_000)
    assert (ack.complete, ack.duplicate, ack.bytes_stored) == (True, False, len(data))
    assert final.read_bytes() == data
    mtime = final.stat().st_mtime_ns
    replay = a.upload(iid, 0, "fr_trace_rank_0", data, chunk=10_000)
    assert (replay.complete, replay.duplicate, replay.bytes_stored) == (True, True, len(data))
    assert final.stat().st_mtime_ns == mtime

    # Cut off: the stream ends before the last chunk. No file under the final name, no .part left.
    parts = chunks(JOB, "node-a", iid, 1, "stacks.txt", b"x" * 50_000, 10_000)[:3]
    with pytest.raises(grpc.RpcError) as ei:
        stub.UploadBundle(iter(parts), timeout=5)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    rank1 = coordinator.store.incident_dir(iid) / "rank_1"
    assert not (rank1 / "stacks.txt").exists() and not (rank1 / "stacks.txt.part").exists()

    # Wrong digest: rejected, nothing in place.
    bad = chunks(JOB, "node-a", iid, 1, "stacks.txt", b"y" * 5000, 1000)
    bad[-1].sha256 = "0" * 64
    with pytest.raises(grpc.RpcError) as ei:
        stub.UploadBundle(iter(bad), timeout=5)
    assert ei.value.code() == grpc.StatusCode.DATA_LOSS
    assert not (rank1 / "stacks.txt").exists() and not (rank1 / "stacks.txt.part").exists()

    # Offsets that skip bytes: rejected.
    gap = chunks(JOB, "node-a", iid, 1, "stacks.txt", b"z" * 5000, 1000)
    gap[2].offset += 1
    with pytest.raises(grpc.RpcError) as ei:
        stub.UploadBundle(iter(gap), timeout=5)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "offset" in (
        ei.value.details() or ""
    )

    # Path tricks: every one refused, nothing written outside the data dir.
    before = {p for p in tmp_path.rglob("*")}
    for name in (
        "../escape",
        "../../../../tmp/escape",
        "/etc/passwd",
        "a/b",
        "..",
        ".hidden",
        "x\x00y",
        "f.part",
    ):
        with pytest.raises(grpc.RpcError) as ei:
            stub.UploadBundle(iter(chunks(JOB, "node-a", iid, 0, name, b"evil", 10)), timeout=5)
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
    with pytest.raises(grpc.RpcError) as ei:
        stub.UploadBundle(iter(chunks(JOB, "node-a", "../" + iid, 0, "f", b"evil", 10)), timeout=5)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as ei:
        stub.UploadBundle(iter(chunks(JOB, "node-a", iid, 5, "f", b"evil", 10)), timeout=5)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # rank 5 is not in the incident
    with pytest.raises(grpc.RpcError) as ei:
        stub.UploadBundle(
            iter(chunks(JOB, "node-a", "20260101T000000Z-deadbeef", 0, "f", b"x", 10)), timeout=5
        )
    assert ei.value.code() == grpc.StatusCode.NOT_FOUND
    assert {p for p in tmp_path.rglob("*")} == before
    assert not (tmp_path.parent / "escape").exists()


@pytest.mark.timeout(30)
def test_upload_size_cap(start_coordinator: Callable[..., Coordinator]) -> None:
    c = start_coordinator(max_file_bytes=10_000)
    iid = _incident(c, [0])
    with grpc.insecure_channel(c.grpc_address) as ch:
        stub = rpc.CoordinatorStub(ch)
        for announced in (True, False):
            cs = chunks(JOB, "node-a", iid, 0, "big", b"b" * 20_000, 4096)
            if not announced:
                cs[0].total_size = 0  # the cap holds even when the size is not announced
            with pytest.raises(grpc.RpcError) as ei:
                stub.UploadBundle(iter(cs), timeout=5)
            assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert list((c.store.incident_dir(iid)).rglob("big*")) == []


@pytest.mark.timeout(30)
def test_command_stream_ends_cleanly(coordinator: Coordinator, stub: rpc.CoordinatorStub) -> None:
    a = ProtocolAgent(stub, job_id=JOB, agent_id="node-a", ranks=[0], world_size=1)
    a.register()
    a.watch()
    wait_for(lambda: coordinator.registry.snapshot(JOB).agents[0].watching, 5, "stream open")  # type: ignore[union-attr]
    a.close()  # client cancels: the server side must drop its waker
    wait_for(lambda: not coordinator.registry.snapshot(JOB).agents[0].watching, 5, "stream closed")  # type: ignore[union-attr]
    # A stream for a session that a re-register replaced ends on its own.
    a.watch()
    wait_for(lambda: coordinator.registry.snapshot(JOB).agents[0].watching, 5, "stream open")  # type: ignore[union-attr]
    a.register()
    assert a.watch_thread is not None
    a.watch_thread.join(5)
    assert not a.watch_thread.is_alive() and a.watch_error is None
    # A stream with an unknown session is refused with a clear status.
    a.session_id = "0" * 32
    a.watch()
    a.watch_thread.join(5)
    assert a.watch_error is not None and a.watch_error.code() == grpc.StatusCode.FAILED_PRECONDITION


def _killed_mid_collection(
    start_coordinator: Callable[..., Coordinator],
) -> tuple[ProtocolAgent, ProtocolAgent, str]:
    """A coordinator that stops mid-collection: ranks 0,1 uploaded, ranks 2,3 never."""
    c1 = start_coordinator(dump_deadline=60.0)
    with grpc.insecure_channel(c1.grpc_address) as ch:
        a, b = _agents(rpc.CoordinatorStub(ch))
        a.progress({0: (5, 4), 1: (5, 4)})
        b.progress({2: (4, 4), 3: (5, 4)})
        iid = a.next_command(timeout=5).incident_id
        _bundle_rank(a, iid, 0, 5, 4, 4)
        _bundle_rank(a, iid, 1, 5, 4, 4)
        a.close()
        b.close()
    c1.stop(grace=1.0)
    return a, b, iid


@pytest.mark.timeout(60)
def test_coordinator_restart_keeps_incidents_and_agents_reregister(
    start_coordinator: Callable[..., Coordinator],
) -> None:
    a, b, iid = _killed_mid_collection(start_coordinator)

    c2 = start_coordinator(dump_deadline=60.0)
    # Not given up on: it waits for the agents, which kept their dumps (issue 27).
    assert c2.store.get_incident(iid).status == "collecting"  # type: ignore[union-attr]
    with grpc.insecure_channel(c2.grpc_address) as ch:
        stub = rpc.CoordinatorStub(ch)
        a.stub = b.stub = stub
        assert a.progress({0: (5, 4), 1: (5, 4)}) is False  # unknown session: re-register
        for ag in (a, b):
            ag.register()
            ag.watch()
        # Each re-registered agent is asked again; node b sends what it never
        # could (node a's ranks are on disk already: every rank is then in).
        assert a.next_command(timeout=5).incident_id == iid
        assert b.next_command(timeout=5).incident_id == iid
        _bundle_rank(b, iid, 2, 4, 4, 4)
        _bundle_rank(b, iid, 3, 5, 4, 4)
        assert b.complete(iid, [2, 3])
        row = wait_status(c2, iid, "analyzed")
        assert row.ranks_dumped == [0, 1, 2, 3] and row.ranks_unreachable == {}
        # The re-collected bundle names the rank the first run could not see.
        assert (row.verdict, row.lagging_ranks) == ("hang", [2]), row.summary
        assert a.progress({0: (5, 4), 1: (5, 4)}) is True
        a.close()
        b.close()
    assert c2.registry.jobs() == [JOB]
    assert [r.id for r in c2.store.list_incidents(job_id=JOB)] == [iid]


@pytest.mark.timeout(60)
def test_a_recovered_incident_nobody_comes_back_for_is_settled_as_restarted(
    start_coordinator: Callable[..., Coordinator],
) -> None:
    _a, _b, iid = _killed_mid_collection(start_coordinator)
    # No agent comes back: after a lost-agent timeout and a dump deadline, what
    # is on disk is analysed and the rest is named as lost to the restart; the
    # job is gone as far as anyone knows, so the incident ends, not left open.
    c2 = start_coordinator(dump_deadline=0.5, agent_lost_timeout=0.5)
    row = wait_status(c2, iid, "ended")
    assert row.verdict == "hang" and row.lagging_ranks == [2, 3], row.summary
    assert row.ranks_dumped == [0, 1]
    assert set(row.ranks_unreachable) == {2, 3}
    assert all("restarted" in why for why in row.ranks_unreachable.values())


@pytest.mark.timeout(60)
def test_a_recovered_incident_finished_by_a_deferred_upload_waits_for_its_job(
    start_coordinator: Callable[..., Coordinator],
) -> None:
    """Live (tests/hardening/test_coordinator_kill.py), an agent's deferred upload
    finished a recovered collection before the agent re-registered the job, and
    the incident ended at once, as for a job nobody tracks. It waits for the
    job's agents (a lost-agent timeout plus a dump deadline, on the fake clock),
    and their return with the numbers they had is no progress either."""
    a, b, iid = _killed_mid_collection(start_coordinator)
    clock = FakeClock()
    c2 = start_coordinator(dump_deadline=2.0, agent_lost_timeout=3.0, clock=clock)
    with grpc.insecure_channel(c2.grpc_address) as ch:
        a.stub = b.stub = rpc.CoordinatorStub(ch)
        _bundle_rank(b, iid, 2, 4, 4, 4)
        _bundle_rank(b, iid, 3, 5, 4, 4)
        assert b.complete(iid, [2, 3])
        c2.incidents.tick()  # every rank is in: finalized on this tick
        wait_status(c2, iid, "analyzed")
        for _ in range(4):  # 4 s of the 5 s wait
            clock.advance(1.0)
            c2.incidents.tick()
        row = c2.store.get_incident(iid)
        assert row is not None and row.status == "analyzed" and row.is_open
        for ag in (a, b):
            ag.register()
            ag.watch()
        for _ in range(20):  # still hung: the same numbers, one report a second
            a.progress({0: (5, 4), 1: (5, 4)})
            b.progress({2: (4, 4), 3: (5, 4)})
            clock.advance(1.0)
            c2.incidents.tick()
        row = c2.store.get_incident(iid)
        assert row is not None and row.status == "analyzed" and row.is_open
        a.close()
        b.close()
    assert [r.id for r in c2.store.list_incidents(job_id=JOB)] == [iid]


@pytest.mark.timeout(60)
def test_one_incident_per_hang_until_the_job_progresses(
    start_coordinator: Callable[..., Coordinator],
) -> None:
    clock = FakeClock()
    c = start_coordinator(dump_deadline=0.3, clock=clock)
    groups = {"0": [0, 1, 2, 3], "1": [0, 1]}
    with grpc.insecure_channel(c.grpc_address) as ch:
        stub = rpc.CoordinatorStub(ch)
        a = ProtocolAgent(
            stub, job_id=JOB, agent_id="node-a", ranks=[0, 1], world_size=4, groups=groups
        )
        b = ProtocolAgent(
            stub, job_id=JOB, agent_id="node-b", ranks=[2, 3], world_size=4, groups=groups
        )
        for ag in (a, b):
            ag.register()
            ag.watch()
        # Subgroup 1 hangs: rank 1 never enters its seq 3.
        a.progress({0: (3, 2), 1: (2, 2)}, group="1")
        clock.advance(1.0)
        c.incidents.tick()
        first = a.next_command(timeout=5).incident_id
        assert b.next_command(timeout=5).incident_id == first
        # No upload comes: past the dump deadline the collection is analysed.
        clock.advance(1.0)
        c.incidents.tick()
        wait_for(lambda: not c.incidents.is_collecting(first), 10, "first incident to close")
        wait_for(lambda: c.registry.open_incident(JOB) is None, 10, "first incident analysed")
        # The hang spreads: ranks 2,3 now wait in the default group for ranks 0,1,
        # for 10 stall timeouts.
        a.progress({0: (6, 6), 1: (6, 6)}, group="0")
        b.progress({2: (7, 6), 3: (7, 6)}, group="0")
        for _ in range(10):
            clock.advance(0.5)
            c.incidents.tick()
        assert [r.id for r in c.store.list_incidents()] == [first]
        # The job recovers, then hangs anew: that is a second incident.
        for ag, rs in ((a, (0, 1)), (b, (2, 3))):
            ag.progress({r: (7, 7) for r in rs}, group="0")
        a.progress({0: (3, 3), 1: (3, 3)}, group="1")
        clock.advance(0.1)
        c.incidents.tick()
        a.progress({0: (8, 7), 1: (8, 7)}, group="0")
        b.progress({2: (7, 7), 3: (8, 7)}, group="0")
        clock.advance(1.0)
        c.incidents.tick()
        second = b.next_command(timeout=5).incident_id
        assert second != first
        assert len(c.store.list_incidents()) == 2
        a.close()
        b.close()


def _analysed_then_stopped(start_coordinator: Callable[..., Coordinator]) -> str:
    """A coordinator diagnoses rank 2's hang, then stops with the hang still on:
    the incident is stored analysed and open. Returns its id."""
    c1 = start_coordinator()
    with grpc.insecure_channel(c1.grpc_address) as ch:
        a, b = _agents(rpc.CoordinatorStub(ch))
        iid = hang_rank_2(a, b, seq=5)
        wait_status(c1, iid, "analyzed")
        a.close()
        b.close()
    c1.stop()
    return iid


@pytest.mark.timeout(60)
def test_a_restarted_coordinator_opens_no_second_incident_for_the_same_hang(
    start_coordinator: Callable[..., Coordinator],
) -> None:
    """Fault matrix, analysed x coordinator restart: the hang outlives the
    coordinator that diagnosed it. The restarted one sees the same stall past
    its timeout, tick after tick, and opens nothing; the stored incident
    resolves when the job really moves."""
    iid = _analysed_then_stopped(start_coordinator)

    clock = FakeClock()
    c2 = start_coordinator(clock=clock)
    with grpc.insecure_channel(c2.grpc_address) as ch:
        a, b = _agents(rpc.CoordinatorStub(ch))
        stalled = {a: {0: (5, 4), 1: (5, 4)}, b: {2: (4, 4), 3: (5, 4)}}
        _hold(c2, clock, stalled, times=20, every=0.5)
        assert c2.registry.stalls(JOB, over_timeout_only=True), "the restart did not see the hang"
        assert _incidents(c2) == [iid]
        # Rank 2 enters #5 and it completes everywhere: the stored incident resolves.
        _hold(c2, clock, {a: {0: (5, 5), 1: (5, 5)}, b: {2: (5, 5), 3: (5, 5)}}, times=2, every=0.5)
        row = c2.store.get_incident(iid)
        assert row is not None and row.status == "resolved", row.status if row else None
        assert _incidents(c2) == [iid]
        for agent in (a, b):
            agent.close()


@pytest.mark.timeout(60)
def test_an_open_incident_whose_job_never_comes_back_after_a_restart_ends(
    start_coordinator: Callable[..., Coordinator],
) -> None:
    """The other way out of the same cell: nobody re-registers. The restarted
    coordinator gives the agents a lost-agent timeout plus a dump deadline
    (30 s + 5 s here) to come back, then ends the incident, not left open."""
    iid = _analysed_then_stopped(start_coordinator)

    clock = FakeClock()
    c2 = start_coordinator(clock=clock)
    clock.advance(34.0)
    c2.incidents.tick()
    assert c2.store.get_incident(iid).status == "analyzed"  # type: ignore[union-attr]
    clock.advance(2.0)
    c2.incidents.tick()
    row = c2.store.get_incident(iid)
    assert row is not None and row.status == "ended", row
    assert "no longer tracks" in (row.close_reason or ""), row.close_reason
