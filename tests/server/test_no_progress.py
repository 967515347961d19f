"""The no-progress rule on the fake clock: hangs FR cannot see (gloo p2p, Python before
any collective) open an incident only after the job made steady progress.

The real registry, incident manager and SQLite store with test_fake_clock's
harness (agents played by feeding real protobuf messages to the registry).
"""

from __future__ import annotations

import pytest
from hangwatch.server.live.detector import (
    BUSY_CORES,
    STEADY_MOVES,
    JobQuiet,
    QuietRank,
    find_job_quiet,
    quiet_bound,
)

from hangwatch.wire import pb
from tests.support.clock import FakeClock

from . import test_fake_clock
from .test_fake_clock import STALL, Env

env = test_fake_clock.env  # its fixture: real registry, manager and store on a FakeClock

STEP = 0.5  # seconds between two reports of a training job


def _train(env: Env, steps: int, *, start: int = 0, every: float = STEP) -> int:
    """Every rank completes one collective per report (nothing left in flight); both
    nodes report each step at the same moment: one move (the first report is a baseline)."""
    seq = start
    for _ in range(steps):
        env.clock.advance(every)
        seq += 1
        env.a.report({0: (seq, seq), 1: (seq, seq)})
        env.b.report({2: (seq, seq), 3: (seq, seq)})
    return seq


def _quiet_for(env: Env, seconds: float, seq: int) -> None:
    """Heartbeats that repeat the same numbers, one tick a second."""
    for _ in range(int(seconds)):
        env.clock.advance(1.0)
        env.a.report({0: (seq, seq), 1: (seq, seq)})
        env.b.report({2: (seq, seq), 3: (seq, seq)})
        env.manager.tick()


@pytest.mark.timeout(20)
def test_a_steady_job_that_stops_outside_any_collective_opens_one_incident(env: Env) -> None:
    seq = _train(env, STEADY_MOVES + 1)
    _quiet_for(env, STALL - 1, seq)
    assert env.store.list_incidents() == []  # not yet: quiet for less than the stall timeout
    _quiet_for(env, 1, seq)
    row = env.only_incident()
    assert (row.status, row.trigger) == ("collecting", "no-progress")
    assert row.reason == (
        f"no progress for {STALL:.1f}s on any rank (ranks 0-3 alive, none in a collective): "
        "FR cannot see this hang; diagnosing from the stacks"
    )
    # Every rank is asked for its dump: the verdict comes from their stacks.
    for node in (env.a, env.b):
        [cmd] = node.commands()
        assert (cmd.kind, cmd.incident_id) == (pb.COMMAND_KIND_DUMP, row.id)
    env.a.answer(env.manager, row.id)
    env.b.answer(env.manager, row.id)
    env.manager.tick()
    assert env.finalized(row.id).status == "analyzed"
    # The same quiet period, however long, is that one incident.
    _quiet_for(env, 3 * STALL, seq)
    assert len(env.store.list_incidents()) == 1
    assert env.metrics.counter("hangwatch_incidents_opened_total", {"trigger": "no-progress"}) == 1


BOUND = quiet_bound(STALL, 0.0)  # the env's registry: no start-up grace


@pytest.mark.timeout(20)
def test_a_job_whose_counters_never_moved_is_paged_at_the_bound_not_before(env: Env) -> None:
    """An early hang (a pipeline stage stuck in its first forward, a pure-p2p job):
    no counter ever moves, so the rhythm rule never arms; the bound still holds."""
    env.a.report({0: (0, 0), 1: (0, 0)})  # baselines, not moves
    env.b.report({2: (0, 0), 3: (0, 0)})
    _quiet_for(env, BOUND - 1, 0)
    assert env.store.list_incidents() == []
    _quiet_for(env, 1, 0)
    row = env.only_incident()
    assert row.trigger == "no-progress"
    # Nobody's CPU is known (these reports carry none): all count as idle.
    assert row.reason == (
        f"no progress for {BOUND:.1f}s on any rank, past the {BOUND:.0f}s bound "
        "(ranks 0-3 idle, none in a collective): FR cannot see this hang; diagnosing from the stacks"
    )


@pytest.mark.timeout(20)
def test_the_bound_runs_from_the_first_rank_not_from_its_agent() -> None:
    """A node agent starts before its ranks and registers none; the ranks then
    spend seconds importing torch (9 s in a loaded test run, when a compiling
    job was paged 0.4 s after its ranks appeared). The job is quiet from when
    its first rank registered."""
    clock = FakeClock()
    registry = test_fake_clock._registry(clock)
    node = test_fake_clock.Node(registry, "a", [])
    node.register([])
    clock.advance(2 * BOUND)
    node.register([0, 1, 2, 3])
    node.report({r: (0, 0) for r in range(4)})
    for _ in range(int(BOUND) - 1):
        clock.advance(1.0)
        node.report({r: (0, 0) for r in range(4)})
        assert registry.quiet(test_fake_clock.JOB) is None
    clock.advance(1.0)
    node.report({r: (0, 0) for r in range(4)})
    quiet = registry.quiet(test_fake_clock.JOB)
    assert quiet is not None and quiet.rule == "bound" and quiet.quiet_for_s == BOUND
    # What made them idle is on record: no CPU reading at all (these reports carry none).
    assert quiet.cores == {0: None, 1: None, 2: None, 3: None}


def _working(
    env: Env,
    seconds: int,
    seq: int,
    busy: set[int],
    cores: float = 1.0,
    in_compile: frozenset[int] = frozenset(),
    compiler_running: frozenset[int] = frozenset(),
    io_mib_s: dict[int, float] | None = None,
) -> None:
    """Heartbeats with the same numbers; `busy` ranks burn `cores` of CPU meanwhile;
    `in_compile` as the agents' stack samples say; `compiler_running` as their polls;
    each rank moves `io_mib_s` MiB a second to or from storage (0 if absent)."""
    for _ in range(seconds):
        env.clock.advance(1.0)
        env.cpu_s = getattr(env, "cpu_s", 0.0) + cores
        cpu = {r: int((1.0 + (env.cpu_s if r in busy else 0.0)) * 1e9) for r in range(4)}
        io: dict[int, int] = env.__dict__.setdefault("io_bytes", {r: 0 for r in range(4)})
        for r in range(4):
            io[r] += int((io_mib_s or {}).get(r, 0.0) * (1 << 20))
        kw = {
            "cpu_ns": cpu,
            "in_compile": in_compile,
            "compiler_running": compiler_running,
            "io_bytes": dict(io),
        }
        env.a.report({0: (seq, seq), 1: (seq, seq)}, **kw)
        env.b.report({2: (seq, seq), 3: (seq, seq)}, **kw)
        env.manager.tick()


@pytest.mark.timeout(20)
def test_a_rank_that_waits_for_a_cpu_is_working_not_idle(env: Env) -> None:
    """An oversubscribed node: every rank compiles but gets a tenth of a core,
    waiting on the run queue the rest of the time. Its CPU rate alone is under
    the busy mark; with its run-queue wait it is working, and nothing opens.
    The same ranks with no wait (asleep) are paged past the bound."""
    env.a.report({0: (0, 0), 1: (0, 0)})
    env.b.report({2: (0, 0), 3: (0, 0)})
    for t in range(1, int(3 * BOUND)):
        env.clock.advance(1.0)
        cpu = {r: int((1.0 + 0.1 * t) * 1e9) for r in range(4)}
        wait = {r: int(0.8 * t * 1e9) for r in range(4)}
        env.a.report({0: (0, 0), 1: (0, 0)}, cpu_ns=cpu, wait_ns=wait)
        env.b.report({2: (0, 0), 3: (0, 0)}, cpu_ns=cpu, wait_ns=wait)
        env.manager.tick()
    assert env.store.list_incidents() == []
    # Now they sleep: a tenth of a core and no wait is idle, and the job is paged.
    _working(env, int(3 * BOUND), 0, {0, 1, 2, 3}, cores=0.1)
    row = env.only_incident()
    assert "ranks 0-3 idle" in row.reason, row.reason


@pytest.mark.timeout(20)
def test_a_job_that_works_on_every_rank_is_not_paged_however_long(env: Env) -> None:
    """A 40 s torch.compile, a checkpoint being written: counters quiet, every rank
    on a CPU. Past the bound nothing opens; when one rank goes idle it does."""
    everyone = {0, 1, 2, 3}
    env.a.report({0: (0, 0), 1: (0, 0)})
    env.b.report({2: (0, 0), 3: (0, 0)})
    _working(env, int(3 * BOUND), 0, everyone)
    assert env.store.list_incidents() == []
    # Rank 2 blocks (its peers keep compiling): idle within a window, then paged.
    _working(env, int(STALL), 0, everyone - {2})
    row = env.only_incident()
    assert "ranks 2 idle, ranks 0,1,3 busy" in row.reason, row.reason


@pytest.mark.timeout(20)
def test_ranks_waiting_on_a_shared_compile_are_work_while_it_runs(env: Env) -> None:
    """One compile cache for the job: rank 0 compiles (on a CPU), ranks 1-3 wait,
    idle, on its lock, their stacks inside torch.compile. Not paged past the
    bound; once rank 0 goes idle too (a compile that hangs), nobody is working
    and it is paged within a window, waiters counted idle."""
    waiting = frozenset({1, 2, 3})
    env.a.report({0: (0, 0), 1: (0, 0)})
    env.b.report({2: (0, 0), 3: (0, 0)})
    _working(env, int(3 * BOUND), 0, {0}, in_compile=waiting)
    assert env.store.list_incidents() == []
    _working(env, int(2 * STALL), 0, set(), in_compile=waiting | {0})
    row = env.only_incident()
    assert "ranks 0-3 idle" in row.reason and "compile" not in row.reason, row.reason


@pytest.mark.timeout(20)
def test_a_stage_done_compiling_waits_for_the_next_stages_compile(env: Env) -> None:
    """Pipeline stages compile at their own pace: rank 0 is done and waits,
    idle, in a send that no counter shows, for stages 1-3, inside
    torch.compile and on a CPU. Not paged past the bound while they work; a
    compile whose ranks are idle (waiting on a lock nobody works under) is no
    excuse; and once the compiles end with nothing moving, paged within a
    window."""
    compiling = frozenset({1, 2, 3})
    env.a.report({0: (0, 0), 1: (0, 0)})
    env.b.report({2: (0, 0), 3: (0, 0)})
    _working(env, int(3 * BOUND), 0, {1, 2, 3}, in_compile=compiling)
    assert env.store.list_incidents() == []
    _working(env, int(2 * STALL), 0, set(), in_compile=compiling)
    row = env.only_incident()
    assert "ranks 0-3 idle" in row.reason, row.reason


@pytest.mark.timeout(20)
def test_a_busy_rank_outside_torch_compile_is_no_compile_to_wait_on(env: Env) -> None:
    """Rank 2 inside torch.compile but idle, rank 1 spinning outside it (a busy
    culprit), rank 0 idle: no compile is running, and past the bound rank 0 is
    paged (rank 2 counts as waiting on work, as ranks sharing a cache do)."""
    env.a.report({0: (0, 0), 1: (0, 0)})
    env.b.report({2: (0, 0), 3: (0, 0)})
    _working(env, int(BOUND) + 1, 0, {1, 3}, in_compile=frozenset({2}))
    row = env.only_incident()
    assert "ranks 0 idle, ranks 1-3 busy" in row.reason, row.reason


@pytest.mark.timeout(20)
def test_a_compiler_running_under_a_rank_is_work_whatever_its_cpu(env: Env) -> None:
    """Measured in a loaded test run: rank 0 ran g++ for inductor and read
    0.009 cores over 3 s (the compile took 49 s, not 26), ranks 1-2 waited on
    its cache lock, and the job was paged. A compiler process alive under a
    rank is work: not paged past the bound; once it is gone and nobody works,
    paged within a window."""
    waiting = frozenset({0, 1, 2, 3})
    env.a.report({0: (0, 0), 1: (0, 0)})
    env.b.report({2: (0, 0), 3: (0, 0)})
    _working(env, int(3 * BOUND), 0, set(), in_compile=waiting, compiler_running=frozenset({0}))
    assert env.store.list_incidents() == []
    _working(env, int(2 * STALL), 0, set(), in_compile=waiting)
    row = env.only_incident()
    assert "ranks 0-3 idle" in row.reason, row.reason


@pytest.mark.timeout(20)
def test_a_job_still_launching_is_quiet_from_its_last_new_rank() -> None:
    """A big job's ranks register over minutes (4,096 simulated nodes took 65 s
    here; a real rendezvous waits for the slowest node), the early ones idle
    meanwhile. Not paged while ranks keep arriving; paged the bound after the
    last one if nothing moves, as when a node never comes up. An agent that
    registers its ranks again (it restarted) is not a new rank."""
    clock = FakeClock()
    registry = test_fake_clock._registry(clock)
    a = test_fake_clock.Node(registry, "a", [0, 1])
    b = test_fake_clock.Node(registry, "b", [2, 3])
    a.register([0, 1])
    a.report({0: (0, 0), 1: (0, 0)})
    for _ in range(int(BOUND) - 2):
        clock.advance(1.0)
        a.report({0: (0, 0), 1: (0, 0)})
    b.register([2, 3])  # the second node arrives 2 s short of the bound
    for _ in range(int(BOUND) - 1):
        clock.advance(1.0)
        a.report({0: (0, 0), 1: (0, 0)})
        b.report({2: (0, 0), 3: (0, 0)})
        assert registry.quiet(test_fake_clock.JOB) is None
    a.register([0, 1])  # node a's agent restarted: the same processes
    clock.advance(1.0)
    a.report({0: (0, 0), 1: (0, 0)})
    b.report({2: (0, 0), 3: (0, 0)})
    quiet = registry.quiet(test_fake_clock.JOB)
    assert quiet is not None and quiet.rule == "bound" and quiet.quiet_for_s == BOUND


@pytest.mark.timeout(20)
def test_ranks_waiting_on_storage_are_working_not_idle(env: Env) -> None:
    """Measured in a loaded test run: three ranks hashing torch's source tree at
    the start of torch.compile, on a disk shared with a database's syncfs, read
    0.035-0.04 cores for 12 s and were paged. Ranks that move MiBs a second to or
    from storage are working: not paged past the bound, whatever their CPU. When
    the reads stop (a rank blocked for good) the job is paged within a window,
    and the trigger records what each rank read."""
    env.a.report({0: (0, 0), 1: (0, 0)})
    env.b.report({2: (0, 0), 3: (0, 0)})
    everyone = {0, 1, 2, 3}
    disk = {r: 3.0 for r in everyone}
    _working(env, int(3 * BOUND), 0, everyone, cores=0.04, io_mib_s=disk)
    assert env.store.list_incidents() == []
    _working(env, int(2 * STALL), 0, everyone, cores=0.04)
    row = env.only_incident()
    assert "ranks 0-3 idle" in row.reason, row.reason
    quiet = env.registry.quiet(test_fake_clock.JOB)
    assert quiet is not None and quiet.io_mib_s == {r: 0.0 for r in everyone}


@pytest.mark.timeout(20)
def test_a_trickle_of_storage_io_is_idle_not_work(env: Env) -> None:
    """A hung rank's logging thread writes kilobytes a second: under the mark."""
    env.a.report({0: (0, 0), 1: (0, 0)})
    env.b.report({2: (0, 0), 3: (0, 0)})
    trickle = {r: 1 / 64 for r in range(4)}
    _working(env, int(BOUND), 0, {0, 1, 2, 3}, cores=0.04, io_mib_s=trickle)
    assert env.only_incident().trigger == "no-progress"


@pytest.mark.timeout(20)
def test_a_trickle_of_cpu_is_idle_not_work(env: Env) -> None:
    """A rank blocked in gloo still wakes now and then: well under BUSY_CORES."""
    env.a.report({0: (0, 0), 1: (0, 0)})
    env.b.report({2: (0, 0), 3: (0, 0)})
    _working(env, int(BOUND), 0, {0, 1, 2, 3}, cores=BUSY_CORES / 5)
    assert env.only_incident().trigger == "no-progress"


@pytest.mark.timeout(20)
def test_fewer_moves_than_steady_waits_for_the_bound(env: Env) -> None:
    # An init barrier and one more collective, then a long data load: not the
    # rhythm rule's (no rhythm yet), so only the bound can page it.
    seq = _train(env, STEADY_MOVES)  # a baseline and STEADY_MOVES - 1 moves
    # The jobs list says which rule is armed (what a live test waits for before its fault).
    [c] = env.registry.census()
    assert (c.progress_moves, c.quiet_rule) == (STEADY_MOVES - 1, "bound")
    _quiet_for(env, BOUND - 1, seq)
    assert env.store.list_incidents() == []
    _quiet_for(env, 1, seq)
    row = env.only_incident()
    assert row.trigger == "no-progress" and "bound" in row.reason


@pytest.mark.timeout(20)
def test_a_steady_job_is_paged_by_its_rhythm_before_the_bound(env: Env) -> None:
    seq = _train(env, STEADY_MOVES)
    _quiet_for(env, 2 * STALL, seq)  # data loading at start-up, under the bound
    assert env.store.list_incidents() == []
    # Training starts: now it is steady, and a stop after that is paged on the stall timeout.
    seq = _train(env, 1, start=seq)
    [c] = env.registry.census()
    assert (c.progress_moves, c.quiet_rule) == (STEADY_MOVES, "rhythm")
    _quiet_for(env, STALL, seq)
    row = env.only_incident()
    assert row.trigger == "no-progress" and "bound" not in row.reason


@pytest.mark.timeout(20)
def test_a_quiet_period_that_ends_resolves_the_incident(env: Env) -> None:
    seq = _train(env, STEADY_MOVES + 1)
    _quiet_for(env, STALL, seq)
    row = env.only_incident()
    env.a.answer(env.manager, row.id)
    env.b.answer(env.manager, row.id)
    env.manager.tick()
    assert env.finalized(row.id).status == "analyzed"
    # The job resumes 3 s later (a long evaluation, say): a transient stall.
    env.clock.advance(3)
    _train(env, 1, start=seq, every=0.0)
    env.manager.tick()
    done = env.only_incident()
    assert done.status == "resolved" and done.transient
    assert done.stall_s == pytest.approx(STALL + 3)


@pytest.mark.timeout(20)
def test_a_job_with_a_long_pause_in_its_rhythm_is_judged_by_that_rhythm(env: Env) -> None:
    # Steps every 0.5 s, then an 8 s evaluation (shorter than the timeout), steps again.
    seq = _train(env, STEADY_MOVES + 1)
    seq = _train(env, 1, start=seq, every=8.0)
    seq = _train(env, 4, start=seq)
    # Quiet for 1.5x the stall timeout: below twice the job's own 8 s pause.
    _quiet_for(env, 15, seq)
    assert env.store.list_incidents() == []
    _quiet_for(env, 1, seq)
    assert env.only_incident().trigger == "no-progress"


@pytest.mark.timeout(20)
def test_a_collective_in_flight_is_the_stall_rule_s_not_this_one(env: Env) -> None:
    seq = _train(env, STEADY_MOVES + 1)
    # Every rank inside the next collective (a long, healthy all_reduce): no incident at all.
    for _ in range(3 * int(STALL)):
        env.clock.advance(1.0)
        env.a.report({0: (seq + 1, seq), 1: (seq + 1, seq)})
        env.b.report({2: (seq + 1, seq), 3: (seq + 1, seq)})
        env.manager.tick()
    assert env.store.list_incidents() == []


@pytest.mark.timeout(20)
def test_a_job_whose_ranks_exited_is_over_not_quiet(env: Env) -> None:
    seq = _train(env, STEADY_MOVES + 1)
    for node, ranks in ((env.a, [0, 1]), (env.b, [2, 3])):
        gone = [
            pb.RankProgress(
                rank=r,
                state=pb.PROCESS_STATE_GONE,
                groups=[pb.GroupProgress(group="0", last_enqueued=seq, last_completed=seq)],
            )
            for r in ranks
        ]
        node.send(gone)
    for _ in range(3 * int(STALL)):
        env.clock.advance(1.0)
        env.manager.tick()
    assert env.store.list_incidents() == []


def _rule(
    *,
    ranks: list[QuietRank] | None = None,
    moves: int = STEADY_MOVES,
    longest_gap_s: float = 1.0,
    quiet_for_s: float,
) -> JobQuiet | None:
    return find_job_quiet(
        ranks=ranks if ranks is not None else [QuietRank(rank=r) for r in range(4)],
        moves=moves,
        longest_gap_s=longest_gap_s,
        quiet_for_s=quiet_for_s,
        stall_timeout=5.0,
    )


def test_the_rule_itself() -> None:
    q = _rule(quiet_for_s=5.0)
    assert q is not None and (q.threshold_s, q.ranks, q.moves) == (5.0, [0, 1, 2, 3], STEADY_MOVES)
    assert _rule(quiet_for_s=4.9) is None
    assert _rule(moves=STEADY_MOVES - 1, quiet_for_s=60.0) is None
    assert _rule(longest_gap_s=4.0, quiet_for_s=7.9) is None
    assert _rule(longest_gap_s=4.0, quiet_for_s=8.0) is not None
    alive = [QuietRank(rank=r) for r in range(3)]
    for odd in (
        QuietRank(rank=3, observed=False),
        QuietRank(rank=3, process_state="gone"),
        QuietRank(rank=3, in_flight=True),
    ):
        assert _rule(ranks=[*alive, odd], quiet_for_s=60.0) is None, odd
    # A stopped rank (SIGSTOP) is still there: its peers' silence counts.
    stopped = QuietRank(rank=3, process_state="stopped")
    assert _rule(ranks=[*alive, stopped], quiet_for_s=60.0) is not None


def test_the_bound_itself() -> None:
    def rule(ranks: list[QuietRank], quiet_for_s: float, moves: int = 0) -> JobQuiet | None:
        return find_job_quiet(
            ranks=ranks,
            moves=moves,
            longest_gap_s=100.0,  # a rhythm far past the bound
            quiet_for_s=quiet_for_s,
            stall_timeout=5.0,
            bound_s=15.0,
        )

    busy = [QuietRank(rank=r, cores=1.0) for r in range(3)]
    idle, unknown = QuietRank(rank=3, cores=0.01), QuietRank(rank=3)
    assert rule([*busy, idle], 14.9) is None
    q = rule([*busy, idle], 15.0)
    assert q is not None and (q.rule, q.idle_ranks, q.busy_ranks) == ("bound", [3], [0, 1, 2])
    assert rule([*busy, unknown], 15.0) is not None  # unknown is not evidence of work
    assert rule([*busy, QuietRank(rank=3, cores=BUSY_CORES)], 1000.0) is None  # all working
    # A steady job with a long rhythm is held to the bound too.
    assert rule([*busy, idle], 15.0, moves=STEADY_MOVES) is not None
    assert quiet_bound(10.0, 60.0) == 60.0 and quiet_bound(30.0, 60.0) == 90.0
