"""Incident states after the verdict, on the fake clock: resolved, ended, crash.

The real registry, incident manager and SQLite store, with the harness of
test_fake_clock (agents played by feeding real protobuf messages; only the
analysis is stood in for).
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from hangwatch.server.incidents.store import IncidentStore

from hangwatch import formats
from hangwatch.wire import pb

from . import test_fake_clock
from .test_fake_clock import DEADLINE, JOB, STALL, Env, stall_pattern

env = test_fake_clock.env  # its fixture: real registry, manager and store on a FakeClock

EXC = "RuntimeError: rank 1: corrupt sample in batch 10"


def _event(env: Env, node: str, kind: pb.EventKind, rank: int, detail: str) -> str:
    n = env.a if node == "a" else env.b
    ev = pb.Event(
        job_id=JOB, agent_id=n.agent_id, session_id=n.session, kind=kind, rank=rank, detail=detail
    )
    env.registry.record_event(ev)
    return env.manager.on_event(ev)


def _answer_all(env: Env, incident_id: str) -> None:
    assert env.a.answer(env.manager, incident_id)
    assert env.b.answer(env.manager, incident_id)
    env.manager.tick()
    assert env.finalized(incident_id).status == "analyzed"


def _open_stall(env: Env) -> str:
    stall_pattern(env, seq=5)  # ranks 0-2 in #5, rank 3 not entered (it is evaluating)
    env.clock.advance(STALL)
    env.manager.tick()
    row = env.only_incident()
    assert (row.status, row.trigger) == ("collecting", "stall")
    return row.id


@pytest.mark.timeout(20)
def test_a_stall_that_completes_is_resolved_with_its_duration_and_late_ranks(env: Env) -> None:
    first = _open_stall(env)
    assert env.metrics.counter("hangwatch_incidents_open") == 1
    _answer_all(env, first)
    env.manager.tick()
    assert env.only_incident().status == "analyzed"  # no progress yet: still a hang
    # Rank 3 finishes its evaluation 2 s later: #5 completes everywhere.
    env.clock.advance(2)
    env.a.report({0: (5, 5), 1: (5, 5)})
    env.b.report({2: (5, 5), 3: (5, 5)})
    env.clock.advance(0.5)
    env.manager.tick()
    row = env.only_incident()
    assert row.status == "resolved" and row.transient and not row.is_open
    assert row.stall_s == pytest.approx(STALL + 2)
    assert row.late_ranks == [3]  # the incident's lagging ranks
    assert row.verdict == "hang"  # the verdict of the moment is kept
    assert row.close_reason == "progress resumed 12.0s after the stall began; late: ranks 3"
    assert row.closed_at is not None  # unix time; the fake clock is not wall time
    # It raises no page: not counted as open; counted as resolved.
    assert env.metrics.counter("hangwatch_incidents_open") == 0
    assert env.metrics.counter("hangwatch_incidents_by_state", {"state": "resolved"}) == 1
    assert (
        env.metrics.counter(
            "hangwatch_incident_transitions_total", {"state": "resolved", "trigger": "stall"}
        )
        == 1
    )
    # The job trains on and ends normally: the resolved incident stays resolved.
    for node, ranks in ((env.a, [0, 1]), (env.b, [2, 3])):
        for r in ranks:
            _event(env, "a" if node is env.a else "b", pb.EVENT_KIND_RANK_EXITED, r, "process gone")
    env.clock.advance(STALL)
    env.manager.tick()
    assert env.only_incident().status == "resolved"


@pytest.mark.timeout(20)
def test_counters_that_move_as_the_job_dies_are_not_a_recovery(env: Env) -> None:
    """The job is stopped with the hang in place: rank 3, which never entered #5,
    exits, and its peers' all_reduce fails, which gloo counts as completed. The
    counters moved, but the rank the stall waited on never entered what it waited
    in: no "transient stall", and a peer's crash for the lost connection is the
    same hang ending, not a new incident. The incident ends with the job."""
    first = _open_stall(env)
    _answer_all(env, first)
    env.clock.advance(2)
    env.a.report({0: (5, 5), 1: (5, 5)})  # the failed collective, counted completed
    env.b.report({2: (5, 5), 3: (4, 4)})
    env.clock.advance(0.5)
    env.manager.tick()
    assert env.only_incident().status == "analyzed"
    crash = "process gone; uncaught exception: RuntimeError: Connection closed by peer"
    assert _event(env, "a", pb.EVENT_KIND_RANK_CRASHED, 0, crash) == first
    assert [r.id for r in env.store.list_incidents()] == [first]
    for node, ranks in (("a", (0, 1)), ("b", (2, 3))):
        for r in ranks:
            _event(env, node, pb.EVENT_KIND_RANK_EXITED, r, "process gone")
    env.manager.tick()
    row = env.only_incident()
    assert (row.status, row.transient) == ("ended", False), row.close_reason
    assert row.close_reason == "the job stopped: every rank of the job exited"


@pytest.mark.timeout(20)
def test_a_restarted_agent_is_not_progress(env: Env) -> None:
    """The node's agent is killed and restarted mid-incident (a DaemonSet): it
    re-registers the same rank processes and reports the numbers they still
    have. That is no progress: the hang stays open until the ranks move."""
    first = _open_stall(env)
    _answer_all(env, first)
    for _ in range(3):
        env.clock.advance(2)
        env.b.register()  # a new session: the same processes (same pids)
        env.b.report({2: (5, 4), 3: (4, 4)})  # where they were: no move
        env.a.report({0: (5, 4), 1: (5, 4)})
        env.manager.tick()
    row = env.only_incident()
    assert row.status == "analyzed" and row.is_open, row.close_reason
    # Rank 3 really resumes: #5 completes everywhere, and now it resolves.
    env.clock.advance(1)
    env.b.report({2: (5, 5), 3: (5, 5)})
    env.a.report({0: (5, 5), 1: (5, 5)})
    env.manager.tick()
    assert env.only_incident().status == "resolved"


@pytest.mark.timeout(20)
def test_agents_restarted_as_the_hang_clears_resolve_it_with_the_ranks_own_numbers(
    env: Env,
) -> None:
    """Fault matrix, resolving x agent restart: both agents are killed just as
    rank 3 resumes and come back after #5 completed everywhere. The processes
    are the same ones (pid and start time), so their counters past the stalled
    collective are observed progress, not a baseline: the incident resolves on
    those first reports, once, with rank 3 late. (Re-registered numbers that
    did not move keep it open: test_a_restarted_agent_is_not_progress; a new
    process's numbers are a baseline: test_a_restarted_job_is_a_new_baseline_not_progress_either.)"""
    first = _open_stall(env)
    _answer_all(env, first)
    env.clock.advance(2)
    for node in (env.a, env.b):
        node.register()  # killed and restarted: a new session, the same processes
    env.a.report({0: (6, 6), 1: (6, 6)})
    env.b.report({2: (6, 6), 3: (6, 6)})
    env.manager.tick()
    row = env.only_incident()
    assert row.status == "resolved" and row.late_ranks == [3], row.close_reason
    assert row.stall_s == pytest.approx(STALL + 2)
    # The job trains on: nothing more opens, the one incident stays resolved.
    for step in (7, 8):
        env.clock.advance(1)
        env.a.report({0: (step, step), 1: (step, step)})
        env.b.report({2: (step, step), 3: (step, step)})
        env.manager.tick()
    assert [r.status for r in env.store.list_incidents()] == ["resolved"]


@pytest.mark.timeout(20)
def test_an_agent_restarted_during_collection_is_asked_again(env: Env) -> None:
    """Fault matrix, collecting x agent restart: node b's agent took the DUMP
    and died before answering. The restarted agent (a new session, the same
    rank processes) is handed the same DUMP again, with what is left of its
    deadline, and its answer completes the bundle: no rank is lost to the
    restart and nothing opens a second incident."""
    first = _open_stall(env)
    assert [c.incident_id for c in env.b.commands()] == [first]
    assert env.a.answer(env.manager, first)
    env.clock.advance(3)
    env.b.register()  # killed and restarted: a new session
    env.b.report({2: (5, 4), 3: (4, 4)})  # the same processes, where they were
    env.manager.tick()
    [again] = env.b.commands()
    assert again.incident_id == first
    assert again.to_pb(env.clock.now).deadline_s == pytest.approx(DEADLINE - 3)
    assert env.manager.is_collecting(first)
    assert env.b.answer(env.manager, first)
    env.manager.tick()
    done = env.finalized(first)
    assert (done.status, done.ranks_dumped, done.ranks_unreachable) == (
        "analyzed",
        [0, 1, 2, 3],
        {},
    )
    assert [r.id for r in env.store.list_incidents()] == [first]


@pytest.mark.timeout(20)
def test_a_restarted_job_is_a_new_baseline_not_progress_either(env: Env) -> None:
    """New processes behind the same ranks (the launcher restarted the job) start
    from nothing: their first numbers are a baseline, so the old hang is not
    read as resolved by them; it ends with the old processes."""
    first = _open_stall(env)
    _answer_all(env, first)
    env.clock.advance(2)
    env.b.pid_base += 1000  # other pids: another run of the job
    env.b.register()
    env.b.report({2: (0, 0), 3: (0, 0)})
    env.manager.tick()
    assert env.store.get_incident(first).status == "analyzed"  # type: ignore[union-attr]


@pytest.mark.timeout(20)
def test_progress_while_still_collecting_resolves_once_the_verdict_is_stored(env: Env) -> None:
    first = _open_stall(env)
    env.clock.advance(1)
    env.a.report({0: (5, 5), 1: (5, 5)})
    env.b.report({2: (5, 5), 3: (5, 5)})
    env.clock.advance(3)
    env.manager.tick()  # noticed now, but the verdict is not stored yet
    assert env.only_incident().status == "collecting"
    _answer_all(env, first)
    env.manager.tick()
    row = env.only_incident()
    assert row.status == "resolved"
    assert row.stall_s == pytest.approx(STALL + 1)  # when progress resumed, not when seen


@pytest.mark.timeout(20)
def test_a_job_whose_ranks_all_exit_with_the_incident_open_ends_it(env: Env) -> None:
    first = _open_stall(env)
    _answer_all(env, first)
    env.clock.advance(5)
    for r in (0, 1):
        _event(env, "a", pb.EVENT_KIND_RANK_EXITED, r, "process gone")
    _event(env, "b", pb.EVENT_KIND_RANK_EXITED, 2, "process gone")
    env.manager.tick()
    assert env.only_incident().status == "analyzed"  # rank 3 still runs
    _event(env, "b", pb.EVENT_KIND_RANK_EXITED, 3, "process gone")
    env.manager.tick()
    row = env.only_incident()
    assert (row.status, row.is_open, row.transient) == ("ended", False, False)
    assert row.close_reason == "the job stopped: every rank of the job exited"
    assert row.stall_s is None and row.closed_at is not None
    assert env.metrics.counter("hangwatch_incidents_open") == 0
    assert env.metrics.counter("hangwatch_incidents_by_state", {"state": "ended"}) == 1


@pytest.mark.timeout(20)
def test_every_agent_gone_ends_the_incident(env: Env) -> None:
    first = _open_stall(env)
    _answer_all(env, first)
    env.clock.advance(31)  # past the lost-agent timeout, nobody reports
    env.manager.tick()
    row = env.only_incident()
    assert row.status == "ended"
    assert row.close_reason == "the job stopped: every agent of the job is gone"


@pytest.mark.timeout(20)
def test_a_crash_opens_a_crash_incident_with_the_exception_and_dumps_the_survivors(
    env: Env,
) -> None:
    env.a.report({0: (9, 9), 1: (9, 9)})
    env.b.report({2: (9, 9), 3: (9, 9)})
    env.clock.advance(1)
    first = _event(
        env, "a", pb.EVENT_KIND_RANK_CRASHED, 1, f"process gone; uncaught exception: {EXC}"
    )
    assert first
    row = env.only_incident()
    assert row.trigger == "crash" and row.status == "collecting"
    assert row.reason == f"rank 1 crashed (process gone): uncaught exception {EXC}"
    # Every agent is asked to dump, as for any incident.
    assert [c.incident_id for c in env.a.commands()] == [first]
    assert [c.incident_id for c in env.b.commands()] == [first]
    # The survivors then hang in #10 without rank 1: the same incident.
    env.a.report({0: (10, 9)})
    env.b.report({2: (10, 9), 3: (10, 9)})
    env.clock.advance(STALL)
    env.manager.tick()
    assert env.a.answer(env.manager, first, dumped=[0], failures={1: "process gone"})
    assert env.b.answer(env.manager, first)
    env.manager.tick()
    done = env.finalized(first)
    assert done.status == "analyzed" and done.ranks_unreachable == {1: "process gone"}
    # The analyzer words the crash (tests/analyzer/test_crash_wording.py) from
    # what incident.json records of it.
    path = env.store.incident_dir(first) / formats.INCIDENT_FILE
    doc = formats.IncidentDoc.from_bytes(path.read_bytes())
    assert (doc.trigger["kind"], doc.trigger["rank"], doc.trigger["how"]) == (
        "crash", 1, "process gone",
    )  # fmt: skip
    assert doc.trigger["exception"] == EXC
    env.clock.advance(STALL)
    env.manager.tick()
    assert len(env.store.list_incidents(job_id=JOB)) == 1
    # Other ranks crashing too, with no progress since: the same incident.
    assert (
        _event(env, "b", pb.EVENT_KIND_RANK_CRASHED, 2, f"process gone; uncaught exception: {EXC}")
        == first
    )
    # The launcher kills the survivors: the incident ends, it never resolves.
    for r in (0,):
        _event(env, "a", pb.EVENT_KIND_RANK_EXITED, r, "process gone")
    _event(env, "b", pb.EVENT_KIND_RANK_EXITED, 3, "process gone")
    env.manager.tick()
    row = env.only_incident()
    assert (row.status, row.trigger) == ("ended", "crash")
    assert env.store.incident_dir(first).joinpath("incident.json").read_text().count(EXC) >= 1


@pytest.mark.timeout(20)
def test_survivors_that_fail_their_collective_and_crash_are_the_same_crash(env: Env) -> None:
    """Rank 1 dies; gloo fails the survivors' all_reduce #10 when its socket
    closes and counts it completed, so their numbers move; then they crash of
    "connection closed by peer". The job did not move on: a rank it waits on
    is dead. One incident, not two (seen live in a full test run)."""
    env.a.report({0: (9, 9), 1: (9, 9)})
    env.b.report({2: (9, 9), 3: (9, 9)})
    env.clock.advance(1)
    first = _event(
        env, "a", pb.EVENT_KIND_RANK_CRASHED, 1, f"process gone; uncaught exception: {EXC}"
    )
    env.a.report({0: (10, 9)})
    env.b.report({2: (10, 9), 3: (10, 9)})
    _answer_all(env, first)
    env.clock.advance(0.5)
    env.a.report({0: (10, 10)})
    env.b.report({2: (10, 10), 3: (10, 10)})
    env.manager.tick()
    closed = "RuntimeError: Connection closed by peer [127.0.0.1]:37608"
    assert (
        _event(
            env, "a", pb.EVENT_KIND_RANK_CRASHED, 0, f"process gone; uncaught exception: {closed}"
        )
        == first
    )
    assert [r.id for r in env.store.list_incidents(job_id=JOB)] == [first]


@pytest.mark.timeout(20)
def test_a_normal_exit_of_every_rank_opens_no_incident(env: Env) -> None:
    env.a.report({0: (20, 20), 1: (20, 20)})
    env.b.report({2: (20, 20), 3: (20, 19)})  # rank 3's last report still in flight
    env.clock.advance(0.5)
    for r in (0, 1):
        assert _event(env, "a", pb.EVENT_KIND_RANK_EXITED, r, "process gone") == ""
    for r in (2, 3):
        assert _event(env, "b", pb.EVENT_KIND_RANK_EXITED, r, "process gone") == ""
    for _ in range(4):
        env.clock.advance(STALL)
        env.manager.tick()
    assert env.store.list_incidents(job_id=JOB) == []
    assert env.metrics.counter("hangwatch_incidents_open") == 0


@pytest.mark.timeout(20)
def test_an_old_database_opens_and_gains_the_lifecycle_columns(tmp_path: Path) -> None:
    db = tmp_path / "hangwatch.db"
    old = sqlite3.connect(db)
    old.executescript(
        """
        CREATE TABLE jobs (job_id TEXT PRIMARY KEY, first_seen REAL NOT NULL,
                           last_seen REAL NOT NULL);
        CREATE TABLE incidents (
            id TEXT PRIMARY KEY, job_id TEXT NOT NULL, created REAL NOT NULL,
            reason TEXT NOT NULL, trigger TEXT NOT NULL, status TEXT NOT NULL,
            verdict TEXT, summary TEXT, lagging_ranks TEXT NOT NULL DEFAULT '[]',
            ranks_expected TEXT NOT NULL DEFAULT '[]', ranks_dumped TEXT NOT NULL DEFAULT '[]',
            ranks_unreachable TEXT NOT NULL DEFAULT '{}', detection_s REAL, report TEXT,
            error TEXT, updated REAL NOT NULL);
        INSERT INTO incidents (id, job_id, created, reason, trigger, status, updated)
            VALUES ('20240101T000000Z-abcd0123', 'j', 1.0, 'old', 'stall', 'analyzed', 1.0);
        PRAGMA user_version=1;
        """
    )
    old.close()
    store = IncidentStore(db)
    try:
        [row] = store.list_incidents()
        assert (row.status, row.late_ranks, row.closed_at, row.stall_s) == (
            "analyzed",
            [],
            None,
            None,
        )
        done = store.resolve_incident(row.id, stall_s=3.0, late_ranks=[2], reason="r")
        assert (done.status, done.late_ranks, done.stall_s) == ("resolved", [2], 3.0)
        assert store.count_by_status()["resolved"] == 1
    finally:
        store.close()


@pytest.mark.timeout(30)
def test_the_api_and_dashboard_show_a_resolved_incident_as_transient_not_open(
    tmp_path: Path,
) -> None:
    import httpx
    from hangwatch.server.web.app import create_app

    from tests.web import harness

    ctx = harness.make_context(tmp_path)
    try:
        report = harness.hang_report(world=4, stuck=3)
        resolved = harness.insert_incident(ctx, job="j", report=report)
        ended = harness.insert_incident(ctx, job="j", report=report)
        ctx.store.resolve_incident(
            resolved, stall_s=12.0, late_ranks=[3], reason="progress resumed 12.0s after"
        )
        ctx.store.end_incident(ended, reason="the job stopped: every rank of the job exited")
        with harness.serve(create_app(ctx)) as base, httpx.Client(base_url=base, timeout=10) as c:
            body = c.get(f"/api/incidents/{resolved}").json()
            assert (body["status"], body["open"], body["transient"]) == ("resolved", False, True)
            assert (body["stall_s"], body["late_ranks"]) == (12.0, [3])
            assert c.get(f"/api/incidents/{ended}").json()["status"] == "ended"
            assert [i["id"] for i in c.get("/api/incidents?status=resolved").json()] == [resolved]
            page = c.get("/incidents").text
            assert "<strong>0</strong> open" in page and "1 resolved" in page
            assert "transient, 12.0 s" in page
            one = c.get(f"/incidents/{resolved}").text
            assert "transient stall: it cleared by itself" in one and "12.0 s" in one
            assert "the job stopped with it unresolved" in c.get(f"/incidents/{ended}").text
    finally:
        ctx.store.close()


@pytest.mark.timeout(20)
def test_a_restarted_job_that_hangs_before_its_first_report_opens_its_own_incident(
    env: Env,
) -> None:
    """The job is restarted under the same id (new processes) and hangs at the same
    collective before its agents' first report: those numbers are a baseline, not
    progress, yet it is a new run and a new hang, not the last incident's."""
    first = _open_stall(env)
    _answer_all(env, first)
    env.clock.advance(2)
    for node in (env.a, env.b):
        node.pid_base += 1000
        node.register()
    stall_pattern(env, seq=5)  # their first numbers: already stuck
    env.clock.advance(STALL)
    env.manager.tick()
    ids = [r.id for r in env.store.list_incidents()]
    assert len(ids) == 2 and first in ids, ids
