"""The coordinator's state machines on a fake clock, in milliseconds.

The real registry and the real incident manager, driven through their clock
seam (`JobRegistry(clock=...)`, which the manager tells time by) with a
monotonic clock that moves only when a test advances it. Agents are played by
feeding real protobuf messages into the methods the gRPC handlers call; the
manager's ticker thread is not started, each test calls `tick()` itself.
Only the analysis is stood in for (its own tests cover it): finalize runs on
the manager's real worker thread against a real SQLite store under tmp_path.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path

import pytest
from hangwatch.analyzer.report import Report
from hangwatch.server.incidents.collection import NO_ANSWER
from hangwatch.server.incidents.manager import IncidentManager
from hangwatch.server.incidents.store import IncidentRow, IncidentStore
from hangwatch.server.integrations.metrics import Metrics
from hangwatch.server.live.commands import Command
from hangwatch.server.live.registry import JobRegistry, StaleSession
from hangwatch.server.live.views import StalledGroup

from hangwatch import formats
from hangwatch.wire import pb
from tests.support.clock import FakeClock

JOB = "fake-clock-job"
STALL = 10.0
LOST = 30.0
DEADLINE = 20.0
TICK = 1.0


@dataclass(eq=False)
class Node:
    """One node agent's side of the wire contract, sent straight to the registry
    (`groups`: name -> members; empty, the default group of all `world_size` ranks)."""

    registry: JobRegistry
    agent_id: str
    ranks: list[int]
    _: KW_ONLY
    world_size: int = 4
    groups: dict[str, list[int]] = field(default_factory=dict)
    session: str = field(default="", init=False)
    seq: int = field(default=0, init=False)
    pid_base: int = field(default=20_000, init=False)

    def __post_init__(self) -> None:
        self.groups = self.groups or {"0": list(range(self.world_size))}

    def register(self, ranks: list[int] | None = None) -> str:
        self.ranks = ranks if ranks is not None else self.ranks
        infos = [
            pb.RankInfo(
                rank=r,
                local_rank=i,
                world_size=self.world_size,
                pid=self.pid_base + r,
                backend="gloo",
                torch_version="2.13.0",
                fr_source="worker-server",
                groups=[
                    pb.GroupInfo(name=g, desc=f"group_{g}", pg_id=j, ranks=members)
                    for j, (g, members) in enumerate(self.groups.items())
                    if r in members
                ],
            )
            for i, r in enumerate(self.ranks)
        ]
        req = pb.RegisterRequest(
            job_id=JOB, agent_id=self.agent_id, host=f"host-{self.agent_id}", ranks=infos
        )
        self.session = self.registry.register(req)
        self.seq = 0
        return self.session

    def report(
        self,
        seqs: dict[int, tuple[int, int]],
        *,
        group: str = "0",
        cpu_ns: dict[int, int] | None = None,
        in_compile: frozenset[int] = frozenset(),
        wait_ns: dict[int, int] | None = None,
        compiler_running: frozenset[int] = frozenset(),
        io_bytes: dict[int, int] | None = None,
    ) -> None:
        """seqs: rank -> (last_enqueued, last_completed) in `group`; cpu_ns: rank ->
        its process's CPU time so far (absent: unknown, as from an older agent);
        in_compile: ranks the agent's last stack sample found inside torch.compile;
        wait_ns: rank -> its time runnable but waiting for a CPU so far;
        io_bytes: rank -> storage bytes read and written so far."""
        ranks = []
        for r, (enq, comp) in seqs.items():
            gp = pb.GroupProgress(group=group, last_enqueued=enq, last_completed=comp)
            if enq > comp:
                gp.oldest_in_flight.CopyFrom(pb.InFlight(seq=comp + 1, op="all_reduce"))
            rp = pb.RankProgress(rank=r, state=pb.PROCESS_STATE_RUNNING, groups=[gp])
            rp.cpu_time_ns = (cpu_ns or {}).get(r, 0)
            rp.in_compile = r in in_compile
            rp.compiler_running = r in compiler_running
            rp.runqueue_wait_ns = (wait_ns or {}).get(r, 0)
            rp.io_bytes = (io_bytes or {}).get(r, 0)
            ranks.append(rp)
        self.send(ranks)

    def enter(
        self,
        enqueued: dict[int, int],
        *,
        group: str = "0",
        gone: frozenset[int] = frozenset(),
        finished: frozenset[int] = frozenset(),
    ) -> None:
        """A recorder that does not record completion: only what each rank entered.
        Ranks in `gone` have exited; those also in `finished` left through
        Python's exit with these as their final numbers."""
        ranks = []
        for r, enq in enqueued.items():
            gp = pb.GroupProgress(
                group=group, last_enqueued=enq, last_completed=-1, completion_unknown=True
            )
            # Such agents name the op of the newest collective entered.
            gp.oldest_in_flight.CopyFrom(pb.InFlight(seq=enq, op="all_reduce"))
            state = pb.PROCESS_STATE_GONE if r in gone else pb.PROCESS_STATE_RUNNING
            ranks.append(pb.RankProgress(rank=r, state=state, groups=[gp], finished=r in finished))
        self.send(ranks)

    def send(self, ranks: list[pb.RankProgress]) -> None:
        self.seq += 1
        self.registry.report_progress(
            pb.ProgressReport(
                job_id=JOB,
                agent_id=self.agent_id,
                session_id=self.session,
                report_seq=self.seq,
                ranks=ranks,
            )
        )

    def commands(self) -> list[Command]:
        return self.registry.pending_commands(self.session, JOB, self.agent_id)

    def answer(
        self,
        manager: IncidentManager,
        incident_id: str,
        dumped: list[int] | None = None,
        failures: dict[int, str] | None = None,
    ) -> bool:
        return manager.on_dump_result(
            pb.DumpResult(
                job_id=JOB,
                agent_id=self.agent_id,
                incident_id=incident_id,
                ranks_dumped=self.ranks if dumped is None else dumped,
                failures=[
                    pb.RankFailure(rank=r, reason=why) for r, why in (failures or {}).items()
                ],
            )
        )


@dataclass
class StandInAnalysis:
    """Takes the analyzer's place: blames `lagging` and records what it was asked."""

    lagging: list[int]
    calls: list[tuple[Path, int | None]]

    def __call__(self, bundle: Path, world_size: int | None) -> Report:
        self.calls.append((bundle, world_size))
        return Report(
            verdict="hang",
            summary=f"rank(s) {self.lagging} never entered.",
            lagging_ranks=list(self.lagging),
        )


@dataclass
class Env:
    clock: FakeClock
    registry: JobRegistry
    store: IncidentStore
    metrics: Metrics
    analysis: StandInAnalysis
    manager: IncidentManager
    a: Node  # ranks 0, 1
    b: Node  # ranks 2, 3

    def only_incident(self) -> IncidentRow:
        [row] = self.store.list_incidents(job_id=JOB)
        return row

    def finalized(self, incident_id: str) -> IncidentRow:
        assert self.manager.wait_idle(5.0), "finalize did not finish"
        row = self.store.get_incident(incident_id)
        assert row is not None
        return row


def _registry(clock: FakeClock) -> JobRegistry:
    return JobRegistry(agent_lost_timeout=LOST, stall_timeout=STALL, clock=clock)


def stall_pattern(env: Env, seq: int = 5) -> None:
    """Ranks 0-2 inside collective `seq`; rank 3 has not entered it."""
    env.a.report({0: (seq, seq - 1), 1: (seq, seq - 1)})
    env.b.report({2: (seq, seq - 1), 3: (seq - 1, seq - 1)})


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Env]:
    clock = FakeClock()
    registry = _registry(clock)
    store = IncidentStore.in_dir(tmp_path)
    metrics = Metrics()
    analysis = StandInAnalysis(lagging=[3], calls=[])
    manager = IncidentManager(
        store=store,
        registry=registry,
        metrics=metrics,
        stall_timeout=STALL,
        dump_deadline=DEADLINE,
        analyze=analysis,
        tick_s=TICK,
        full_dump_max_ranks=2,
        tail_context=8,
    )
    a, b = Node(registry, "a", [0, 1]), Node(registry, "b", [2, 3])
    a.register()
    b.register()
    yield Env(clock, registry, store, metrics, analysis, manager, a, b)
    manager.stop(timeout=5.0)
    store.close()


def _over(registry: JobRegistry) -> list[StalledGroup]:
    return registry.stalls(JOB, over_timeout_only=True)


# ---- the stall detector, through the registry ---------------------------------


@pytest.mark.timeout(10)
def test_a_group_stalls_only_once_the_stall_timeout_passes(env: Env) -> None:
    stall_pattern(env)
    [st] = env.registry.stalls(JOB)
    assert (st.group, st.seq, st.op, st.kind) == ("0", 5, "all_reduce", "stall")
    assert (st.waiting_ranks, st.not_entered_ranks) == ([0, 1, 2], [3])
    assert (st.stalled_for_s, st.over_timeout) == (0.0, False)
    assert _over(env.registry) == []
    env.clock.advance(STALL / 2)
    stall_pattern(env)  # a heartbeat repeating the same numbers is no progress
    env.clock.advance(STALL / 2 - 0.25)
    assert _over(env.registry) == []
    env.clock.advance(0.25)
    [st] = _over(env.registry)
    assert st.over_timeout and st.stalled_for_s == pytest.approx(STALL)
    snap = env.registry.snapshot(JOB)
    assert snap is not None and snap.stalled == [st]
    assert snap.groups[0].no_progress_for_s == pytest.approx(STALL)


@pytest.mark.timeout(10)
def test_a_first_collective_waits_out_the_startup_grace(env: Env) -> None:
    """Ranks start at their own pace: a member that has entered nothing yet is
    not a stall until the grace passes, while a later collective stalls on
    the plain timeout and a mismatch at #1 is not made to wait at all."""
    env.registry.startup_grace = 3 * STALL
    stall_pattern(env, seq=1)
    env.clock.advance(STALL)
    [st] = env.registry.stalls(JOB)
    assert (st.seq, st.kind, st.not_entered_ranks, st.over_timeout) == (1, "stall", [3], False)
    assert _over(env.registry) == []
    env.clock.advance(2 * STALL - 0.25)
    assert _over(env.registry) == []
    env.clock.advance(0.25)
    [st] = _over(env.registry)
    assert st.seq == 1 and st.stalled_for_s == pytest.approx(3 * STALL)
    # Once every member has been through #1 the plain timeout is back.
    stall_pattern(env, seq=2)
    env.clock.advance(STALL)
    [st] = _over(env.registry)
    assert st.seq == 2


@pytest.mark.timeout(10)
def test_a_member_whose_first_numbers_have_not_arrived_is_unknown_not_behind(env: Env) -> None:
    """Thousands of agents register over seconds: node a's ranks report and wait
    in #5 while node b, registered, has sent nothing yet. That is no stall,
    however long node b takes within the lost-agent timeout; once b's numbers
    arrive the stall is judged on them."""
    for step in (STALL, STALL, LOST - 2 * STALL - 1):
        env.a.report({0: (5, 4), 1: (5, 4)})
        env.clock.advance(step)
        assert _over(env.registry) == []
    # b's first report: rank 3 has not entered #5, and the group has made no
    # progress for nearly three timeouts: over at once.
    env.b.report({2: (5, 4), 3: (4, 4)})
    [st] = _over(env.registry)
    assert (st.seq, st.waiting_ranks, st.not_entered_ranks) == (5, [0, 1, 2], [3])


@pytest.mark.timeout(10)
def test_a_member_not_heard_from_since_its_peers_moved_on_is_unknown_not_behind(
    env: Env,
) -> None:
    """Rank 3's last numbers arrived before ranks 0-2 completed #4 and entered
    #5: "not entered" is only what it said before, and an overloaded
    coordinator (or agent) can hold its newer report back for seconds. No page
    however long that lasts; once rank 3 is heard from again, still short of
    #5, the stall is judged at once on the group's clock."""
    env.a.report({0: (4, 3), 1: (4, 3)})
    env.b.report({2: (4, 3), 3: (4, 3)})
    env.clock.advance(1)
    env.b.report({3: (4, 4)})  # rank 3 completed #4: its last report
    env.clock.advance(1)
    env.a.report({0: (5, 4), 1: (5, 4)})
    env.b.report({2: (5, 4)})  # the group's last progress: after rank 3 was heard
    env.clock.advance(3 * STALL)
    [st] = env.registry.stalls(JOB)
    assert (st.seq, st.not_entered_ranks, st.unheard_ranks) == (5, [3], [3])
    assert st.stalled_for_s == pytest.approx(3 * STALL) and not st.over_timeout
    assert _over(env.registry) == []
    env.b.report({2: (5, 4), 3: (4, 4)})  # b's heartbeat: rank 3 still short of #5
    [st] = _over(env.registry)
    assert (st.seq, st.not_entered_ranks, st.unheard_ranks) == (5, [3], [])


@pytest.mark.timeout(10)
def test_a_group_used_once_a_minute_is_judged_from_when_its_members_sat_down(
    env: Env,
) -> None:
    """The group completed #4 a minute ago and has been idle since (an
    evaluation barrier, a world all_reduce once a step): ranks 0-2 entering #5
    while rank 3 is still on its way is no stall, and would have been at once
    on the group's clock alone. It is one a stall timeout after they sat down."""
    env.a.report({0: (4, 3), 1: (4, 3)})
    env.b.report({2: (4, 3), 3: (4, 3)})
    env.clock.advance(1)
    env.a.report({0: (4, 4), 1: (4, 4)})
    env.b.report({2: (4, 4), 3: (4, 4)})  # the group's last progress
    env.clock.advance(60)
    env.a.report({0: (5, 4), 1: (5, 4)})
    env.b.report({2: (5, 4), 3: (4, 4)})
    [st] = env.registry.stalls(JOB)
    assert (st.seq, st.not_entered_ranks, st.stalled_for_s, st.over_timeout) == (5, [3], 0, False)
    env.clock.advance(STALL - 0.5)
    env.b.report({2: (5, 4), 3: (4, 4)})
    assert _over(env.registry) == []
    env.clock.advance(0.5)
    [st] = _over(env.registry)
    assert (st.seq, st.not_entered_ranks) == (5, [3])
    assert st.stalled_for_s == pytest.approx(STALL)
    # An agent that saw them sit down before it reported says how long ago.
    env.clock.advance(1)
    env.a.send(
        [
            pb.RankProgress(
                rank=r,
                state=pb.PROCESS_STATE_RUNNING,
                groups=[
                    pb.GroupProgress(
                        group="0",
                        last_enqueued=5,
                        last_completed=4,
                        oldest_in_flight=pb.InFlight(seq=5, op="all_reduce", age_s=30.0),
                    )
                ],
            )
            for r in (0, 1)
        ]
    )
    [st] = env.registry.stalls(JOB)
    assert st.stalled_for_s == pytest.approx(30.0)


@pytest.mark.timeout(10)
def test_an_agent_that_registers_and_never_reports_is_judged_once_lost(env: Env) -> None:
    """The wait for first numbers ends with the lost-agent timeout: then b is
    lost, its ranks unobserved (not blamed), and the stall is judged."""
    for _ in range(int(LOST / STALL)):
        env.a.report({0: (5, 4), 1: (5, 4)})
        assert _over(env.registry) == []
        env.clock.advance(STALL)
    env.clock.advance(0.5)  # past the timeout, not on it
    env.a.report({0: (5, 4), 1: (5, 4)})
    assert env.registry.mark_lost_agents() == [(JOB, "b")]
    [st] = _over(env.registry)
    assert (st.seq, st.waiting_ranks, st.unobserved_ranks) == (5, [0, 1], [2, 3]), st


@pytest.mark.timeout(10)
def test_progress_restarts_the_stall_clock(env: Env) -> None:
    stall_pattern(env, seq=5)
    env.clock.advance(STALL - 2)
    # Everyone moved on by one, and the same shape formed at the next seq.
    stall_pattern(env, seq=6)
    [st] = env.registry.stalls(JOB)
    assert (st.seq, st.stalled_for_s, st.not_entered_ranks) == (6, 0.0, [3])
    env.clock.advance(STALL - 2)
    assert _over(env.registry) == []  # 16 s without a new seq, 8 s since progress
    env.clock.advance(2)
    [st] = _over(env.registry)
    assert st.seq == 6 and st.stalled_for_s == pytest.approx(STALL)


@pytest.mark.timeout(10)
def test_completion_unknown_rank_behind_the_others_is_not_entered(env: Env) -> None:
    env.a.enter({0: 7, 1: 7})
    env.b.enter({2: 7, 3: 6})
    assert _over(env.registry) == []
    env.clock.advance(STALL / 2)
    env.b.enter({2: 7, 3: 6})  # same enqueue counts: no progress
    env.clock.advance(STALL / 2)
    [st] = _over(env.registry)
    assert (st.seq, st.kind, st.op) == (7, "stall", "all_reduce")
    assert (st.waiting_ranks, st.not_entered_ranks) == ([0, 1, 2], [3])
    assert st.stalled_for_s == pytest.approx(STALL)
    # Rank 3 catches up as the others enter #8: entering is the progress here.
    env.a.enter({0: 8, 1: 8})
    env.b.enter({2: 8, 3: 7})
    [st] = env.registry.stalls(JOB)
    assert (st.seq, st.not_entered_ranks, st.stalled_for_s) == (8, [3], 0.0)
    # Rank 3 enters #8 too: all equal is no stall, however long it lasts.
    env.b.enter({2: 8, 3: 8})
    assert env.registry.stalls(JOB) == []
    env.clock.advance(3 * STALL)
    assert env.registry.stalls(JOB) == [] and _over(env.registry) == []


@pytest.mark.timeout(10)
def test_completion_unknown_rank_late_for_the_first_collective_stalls_it_as_1(env: Env) -> None:
    """None entered is -1 and the first collective 1 (wire.seq_count): the
    stall is #1 with its op, not "#0" with none (its completed count was taken
    as -1 and its op looked up under 0)."""
    env.a.enter({0: 1, 1: 1})
    env.b.enter({2: 1, 3: -1})
    env.clock.advance(STALL)
    env.b.enter({2: 1, 3: -1})
    [st] = _over(env.registry)
    assert (st.seq, st.kind, st.op) == (1, "stall", "all_reduce")
    assert (st.waiting_ranks, st.not_entered_ranks) == ([0, 1, 2], [3])


@pytest.mark.timeout(10)
def test_completion_unknown_members_all_equal_never_stall(env: Env) -> None:
    env.a.enter({0: 7, 1: 7})
    env.b.enter({2: 7, 3: 7})
    for _ in range(5):
        env.clock.advance(STALL)
        env.a.enter({0: 7, 1: 7})
        assert env.registry.stalls(JOB) == []
    snap = env.registry.snapshot(JOB)
    assert snap is not None and snap.stalled == []
    assert snap.groups[0].no_progress_for_s == pytest.approx(5 * STALL)


@pytest.mark.timeout(10)
def test_completion_unknown_job_end_with_one_rank_gone_is_rank_lost_unless_it_finished(
    env: Env,
) -> None:
    """A job ending normally on a backend that records no completion: every rank
    entered the last collective, and one exits while the others are still in
    their teardown. Gone with no word of how, it is a rank lost in the collective
    its peers wait in; gone having finished (its hook's final numbers read at
    exit), it returned from that collective, so nobody hangs in it (CI saw the
    former raised at the end of a healthy hwstore job)."""
    env.a.enter({0: 7, 1: 7})
    env.b.enter({2: 7, 3: 7}, gone=frozenset({3}))
    env.clock.advance(STALL)
    [st] = _over(env.registry)
    assert (st.kind, st.seq, st.dead_ranks, st.waiting_ranks) == ("rank-lost", 7, [3], [0, 1, 2])
    env.b.enter({2: 7, 3: 7}, gone=frozenset({3}), finished=frozenset({3}))
    for _ in range(3):
        env.clock.advance(STALL)
        assert env.registry.stalls(JOB) == [] and _over(env.registry) == []


@pytest.mark.timeout(10)
def test_a_rank_that_finished_before_entering_what_its_peers_wait_in_is_not_entered(
    env: Env,
) -> None:
    """Finishing is no excuse for leaving early: a rank that exited normally after
    collective #6 while its peers wait in #7 is the one they wait for."""
    env.a.enter({0: 7, 1: 7})
    env.b.enter({2: 7, 3: 6}, gone=frozenset({3}), finished=frozenset({3}))
    env.clock.advance(STALL)
    [st] = _over(env.registry)
    assert (st.kind, st.seq, st.not_entered_ranks, st.waiting_ranks) == (
        "stall",
        7,
        [3],
        [0, 1, 2],
    )


# ---- the registry: lost agents, sessions ----------------------------------------


@pytest.mark.timeout(10)
def test_agents_are_lost_after_the_lost_agent_timeout_and_found_by_a_report(env: Env) -> None:
    env.clock.advance(LOST / 2)
    env.a.report({0: (3, 3), 1: (3, 3)})
    env.clock.advance(LOST / 2)
    assert env.registry.mark_lost_agents() == []  # b silent exactly the timeout
    env.clock.advance(0.01)
    assert env.registry.mark_lost_agents() == [(JOB, "b")]
    assert env.registry.mark_lost_agents() == []  # only newly lost agents are returned
    assert env.registry.agents_connected() == 1 and env.registry.ranks_connected() == 2
    snap = env.registry.snapshot(JOB)
    assert snap is not None
    assert [(r.rank, r.connected, r.observed) for r in snap.ranks] == [
        (0, True, True),
        (1, True, True),
        (2, False, False),
        (3, False, False),
    ]
    assert {a.agent_id: a.last_report_age_s for a in snap.agents} == pytest.approx(
        {"a": LOST / 2 + 0.01, "b": LOST + 0.01}
    )
    env.b.report({2: (3, 3), 3: (3, 3)})
    assert env.registry.agents_connected() == 2
    snap = env.registry.snapshot(JOB)
    assert snap is not None and all(a.connected for a in snap.agents)


@pytest.mark.timeout(10)
def test_behind_a_lost_agent_ranks_are_unobserved_not_behind(env: Env) -> None:
    stall_pattern(env)
    [st] = env.registry.stalls(JOB)
    assert (st.kind, st.not_entered_ranks) == ("stall", [3])
    env.clock.advance(LOST / 2)
    env.a.report({0: (5, 4), 1: (5, 4)})  # a stays alive, b goes silent
    env.clock.advance(LOST / 2 + 0.01)
    env.registry.mark_lost_agents()
    [st] = env.registry.stalls(JOB)
    assert (st.kind, st.waiting_ranks, st.not_entered_ranks) == ("agent-lost", [0, 1], [])
    assert st.unobserved_ranks == [2, 3]
    assert env.registry.oldest_in_flight_age(JOB) == pytest.approx(LOST / 2 + 0.01)


@pytest.mark.timeout(10)
def test_reregistration_replaces_the_session_and_keeps_undelivered_commands(env: Env) -> None:
    env.a.report({0: (5, 4), 1: (5, 4)})
    now = env.clock.now
    dump = Command(
        kind=pb.COMMAND_KIND_DUMP, incident_id="i1", reason="r", deadline_s=5, expires=now + 5
    )
    short = Command(
        kind=pb.COMMAND_KIND_DUMP, incident_id="i0", reason="r", deadline_s=1, expires=now + 1
    )
    assert env.registry.push_command(JOB, "a", short)
    assert env.registry.push_command(JOB, "a", dump)
    assert not env.registry.push_command(JOB, "nobody", dump)
    woken: list[str] = []
    env.registry.add_waker(env.a.session, JOB, "a", lambda: woken.append("old stream"))
    env.clock.advance(2)
    old = env.a.session
    new = env.a.register()
    assert new != old and woken == ["old stream"]  # the old stream is told to look
    with pytest.raises(StaleSession):
        env.registry.pending_commands(old, JOB, "a")
    with pytest.raises(StaleSession):
        env.registry.session(old, JOB, "a")
    # The dump request survived the reconnect; the expired one did not.
    assert [c.incident_id for c in env.a.commands()] == ["i1"]
    assert env.a.commands()[0].to_pb(env.clock.now).deadline_s == pytest.approx(3)
    # The same processes keep the numbers they last reported: their next report
    # is compared with those (a restarted agent is not progress, issue 27).
    snap = env.registry.snapshot(JOB)
    assert snap is not None
    assert [g.last_completed for r in snap.ranks[:2] for g in r.groups] == [4, 4]
    # A retried report of the old session is refused, not applied.
    env.a.session = old
    with pytest.raises(StaleSession):
        env.a.report({0: (9, 9), 1: (9, 9)})
    # A rank that moves to another agent leaves its old one.
    env.b.register(ranks=[1, 2, 3])
    snap = env.registry.snapshot(JOB)
    assert snap is not None
    assert {a.agent_id: a.ranks for a in snap.agents} == {"a": [0], "b": [1, 2, 3]}


# ---- the incident lifecycle ---------------------------------------------------------


@pytest.mark.timeout(10)
def test_a_stall_opens_one_incident_that_closes_once_every_rank_answered(env: Env) -> None:
    stall_pattern(env)
    env.manager.tick()
    assert env.store.list_incidents() == []
    env.clock.advance(STALL)
    env.manager.tick()
    row = env.only_incident()
    assert (row.status, row.trigger, row.ranks_expected) == ("collecting", "stall", [0, 1, 2, 3])
    assert row.reason.startswith(
        "group 0 stalled at seq 5 (all_reduce): ranks 0-2 waiting, ranks 3 not entered"
    )
    assert env.registry.open_incident(JOB) == row.id
    for node in (env.a, env.b):
        [cmd] = node.commands()
        assert (cmd.kind, cmd.incident_id, cmd.expires) == (
            pb.COMMAND_KIND_DUMP,
            row.id,
            env.clock.now + DEADLINE,
        )
        assert cmd.tail_context == 8  # 4 ranks > full_dump_max_ranks: tails first
    assert (env.store.incident_dir(row.id) / formats.INCIDENT_FILE).is_file()

    env.clock.advance(1)
    assert env.a.answer(env.manager, row.id)
    assert env.a.commands() == []  # answered: no longer re-delivered
    env.manager.tick()
    assert env.manager.is_collecting(row.id) and env.analysis.calls == []
    assert env.b.answer(env.manager, row.id)
    env.manager.tick()
    done = env.finalized(row.id)
    assert (done.status, done.verdict, done.lagging_ranks) == ("analyzed", "hang", [3])
    assert (done.ranks_dumped, done.ranks_unreachable) == ([0, 1, 2, 3], {})
    assert done.detection_s == pytest.approx(STALL + 1)
    assert env.analysis.calls == [(env.store.incident_dir(row.id), 4)]
    assert env.registry.open_incident(JOB) is None
    assert not env.b.answer(env.manager, row.id)  # closed: a late answer is refused
    # Phase two: the laggard's full FR history, from its own agent only.
    assert env.a.commands() == []
    [full] = env.b.commands()
    assert (full.kind, full.ranks) == (pb.COMMAND_KIND_UPLOAD_FULL, (3,))
    # The same stall is that incident's, however long it lasts.
    for _ in range(3):
        env.clock.advance(STALL)
        env.manager.tick()
    assert len(env.store.list_incidents()) == 1
    assert env.metrics.counter("hangwatch_incidents_opened_total", {"trigger": "stall"}) == 1


@pytest.mark.timeout(10)
def test_the_deadline_closes_collection_without_every_answer(env: Env) -> None:
    stall_pattern(env)
    env.clock.advance(STALL)
    env.manager.tick()
    row = env.only_incident()
    assert env.a.answer(env.manager, row.id, dumped=[0], failures={1: "process stopped"})
    # Agent b never answers, but rank 2's FR upload landed in the bundle.
    fr = env.store.incident_dir(row.id) / "rank_2" / f"{formats.FR_FILE_PREFIX}2"
    fr.parent.mkdir(parents=True)
    fr.write_bytes(b"fr")
    env.clock.advance(DEADLINE - 0.25)
    env.manager.tick()
    assert env.manager.is_collecting(row.id)
    env.clock.advance(0.25)
    env.manager.tick()
    done = env.finalized(row.id)
    assert done.status == "analyzed" and done.ranks_dumped == [0, 2]
    assert done.ranks_unreachable == {
        1: "process stopped",
        3: f"{NO_ANSWER} ({DEADLINE:.0f}s)",
    }
    # Nobody could look at rank 3, but the (stand-in) analysis blames it anyway.
    assert done.report is not None
    [finding] = [f for f in done.report.findings if f.kind == "agent-unreachable"]
    assert finding.ranks == [3]
    assert "Ranks 3 were unobserved (no answer before deadline)" in (done.summary or "")
    # The coordinator's meta for the rank nobody dumped places it in its groups.
    meta = env.store.incident_dir(row.id) / "rank_3" / formats.META_FILE
    assert '"reachable": false' in meta.read_text()
    # Its DUMP is withdrawn; what is left is phase two's request for rank 3.
    assert [(c.kind, c.ranks) for c in env.b.commands()] == [(pb.COMMAND_KIND_UPLOAD_FULL, (3,))]


@pytest.mark.timeout(10)
def test_a_lost_agents_ranks_are_accounted_for_at_once(env: Env) -> None:
    env.a.report({0: (5, 4), 1: (5, 4)})
    env.b.report({2: (5, 4), 3: (5, 4)})  # all inside #5: healthy while observed
    env.clock.advance(LOST / 2)
    env.a.report({0: (5, 4), 1: (5, 4)})
    env.manager.tick()
    assert env.store.list_incidents() == []
    env.clock.advance(LOST / 2 + 0.01)
    env.manager.tick()  # b is lost, then the scan sees its ranks unobserved
    row = env.only_incident()
    assert row.trigger == "agent-lost"
    assert env.b.commands() == []  # nobody to ask
    assert [c.incident_id for c in env.a.commands()] == [row.id]
    assert env.a.answer(env.manager, row.id)
    env.manager.tick()  # every rank answered for: no wait for the deadline
    done = env.finalized(row.id)
    assert done.ranks_dumped == [0, 1]
    assert sorted(done.ranks_unreachable) == [2, 3]
    assert done.ranks_unreachable[2] == f"agent unreachable: b silent for {LOST + 0.01:.1f}s"
    assert env.metrics.counter("hangwatch_agents_lost_total") == 1


@pytest.mark.timeout(10)
def test_an_event_opens_at_once_and_later_symptoms_join_it(env: Env) -> None:
    env.a.report({0: (5, 4), 1: (5, 4)})
    env.b.report({2: (5, 4), 3: (5, 4)})

    def event(kind: pb.EventKind, rank: int) -> str:
        ev = pb.Event(
            job_id=JOB,
            agent_id="b",
            session_id=env.b.session,
            kind=kind,
            rank=rank,
            detail="boom",
            age_s=2.0,
        )
        env.registry.record_event(ev)
        return env.manager.on_event(ev)

    assert event(pb.EVENT_KIND_RANK_EXITED, 3) == ""  # a rank exiting opens nothing
    first = event(pb.EVENT_KIND_WATCHDOG_DUMP, 2)
    row = env.only_incident()
    assert (row.id, row.trigger, row.reason) == (first, "watchdog", "watchdog dump on rank 2: boom")
    assert event(pb.EVENT_KIND_COLLECTIVE_TIMEOUT, 1) == first  # open: joins it
    env.clock.advance(STALL)
    env.manager.tick()  # rank 3 is gone: a rank-lost stall, but the job's incident is open
    assert len(env.store.list_incidents()) == 1
    env.a.answer(env.manager, first)
    env.b.answer(env.manager, first)
    env.manager.tick()
    assert env.finalized(first).detection_s == pytest.approx(STALL + 2.0)
    # Closed, and the job made no progress since: still the same hang.
    assert event(pb.EVENT_KIND_BACKEND_UNHEALTHY, 0) == first
    # After progress a new symptom is a new incident.
    env.clock.advance(1)
    env.a.report({0: (6, 5), 1: (6, 5)})
    env.b.report({2: (6, 5), 3: (6, 5)})
    second = event(pb.EVENT_KIND_COLLECTIVE_TIMEOUT, 0)
    assert second not in ("", first)
    assert len(env.store.list_incidents()) == 2


@pytest.mark.timeout(10)
def test_the_stall_scan_runs_once_per_tick_interval(env: Env) -> None:
    stall_pattern(env)
    env.clock.advance(STALL - 0.5)
    env.manager.tick()  # scans: nothing over the timeout yet
    env.clock.advance(0.75)
    assert _over(env.registry)
    env.manager.tick()  # an early wake-up: no scan until the tick interval passed
    assert env.store.list_incidents() == []
    env.clock.advance(TICK - 0.75)
    env.manager.tick()
    assert env.only_incident().trigger == "stall"


@pytest.mark.timeout(10)
def test_a_job_restarted_under_the_same_id_gets_a_new_incident_for_the_same_seq(
    env: Env,
) -> None:
    """New processes reach the same (group, seq) again: a new hang, not the old one's."""
    stall_pattern(env)
    env.clock.advance(STALL)
    env.manager.tick()
    first = env.only_incident()
    for node in (env.a, env.b):
        assert node.answer(env.manager, first.id)
    env.manager.tick()
    assert env.finalized(first.id).status == "analyzed"
    # The same processes, the same stall: still the first incident's.
    env.clock.advance(STALL)
    env.manager.tick()
    assert len(env.store.list_incidents(job_id=JOB)) == 1
    # The job restarts (new pids), trains a little and hangs at the same seq.
    for node in (env.a, env.b):
        node.pid_base = 30_000
        node.register()
    env.a.report({0: (2, 2), 1: (2, 2)})
    env.b.report({2: (2, 2), 3: (2, 2)})
    env.clock.advance(1)
    stall_pattern(env)
    env.clock.advance(STALL)
    env.manager.tick()
    rows = env.store.list_incidents(job_id=JOB)
    assert len(rows) == 2 and {r.id for r in rows} - {first.id}
