"""The straggler detector on simulated jobs replayed through the real monitor on a fake clock.

Each job is minutes of a training job's timing (tests/support/simagents/lateness.py),
read the way agents read it (a grid of 1 s ticks, clock errors, changed ranks only)
and fed to `StragglerMonitor` as real ProgressReports.
"""

from __future__ import annotations

import random
import statistics

import pytest
from hangwatch.server.live.stragglers import (
    KIND_DEVICE,
    KIND_HOST,
    StragglerMonitor,
    median_without,
)

from hangwatch.wire import pb
from tests.support.simagents.lateness import SimJob, replay

CLOCK_ERROR_S = 0.0005  # an NTP-style offset over a LAN round trip


def test_rank_slowed_by_half_is_named_within_a_minute_and_nobody_else() -> None:
    r = replay(SimJob(ranks=16, slow={5: 0.5}), 90, clock_error_s=CLOCK_ERROR_S)
    named = r.first_flag(5)
    assert named is not None and named <= 60, r.flags
    assert r.others({5}) == []
    assert r.view is not None
    (s,) = r.view.stragglers
    assert (s.rank, s.kind, s.host) == (5, KIND_HOST, "host-sim-0")
    # A 50% slower rank keeps the others waiting about a third of the time.
    assert 0.2 <= s.score <= 0.5 and s.late_ms > 5
    others = [x.score for x in r.view.ranks if x.rank != 5]
    assert max(others) < 0.05


def test_rank_slowed_by_a_tenth_is_named_within_five_minutes() -> None:
    r = replay(SimJob(ranks=16, jitter=0.02, slow={9: 0.1}), 300, clock_error_s=CLOCK_ERROR_S)
    named = r.first_flag(9)
    assert named is not None and named <= 300, r.flags
    assert r.others({9}) == []


@pytest.mark.parametrize(
    ("jitter", "clock_error_s"), [(0.02, CLOCK_ERROR_S), (0.05, CLOCK_ERROR_S), (0.2, 0.005)]
)
def test_healthy_job_names_nobody_in_ten_minutes(jitter: float, clock_error_s: float) -> None:
    r = replay(SimJob(ranks=32, jitter=jitter, seed=3), 600, clock_error_s=clock_error_s)
    assert r.flags == []
    assert r.view is not None and len(r.view.ranks) == 32


def test_one_long_pause_is_not_a_straggler() -> None:
    # rank 0 writes a checkpoint for 8 s once: everybody waits, once.
    r = replay(SimJob(ranks=16, pauses=((0, 100.0, 8.0),)), 300, clock_error_s=CLOCK_ERROR_S)
    assert r.flags == []


def test_a_hang_is_not_a_straggler() -> None:
    r = replay(SimJob(ranks=16, hang=(3, 100.0)), 300, clock_error_s=CLOCK_ERROR_S)
    assert r.flags == []


def test_late_start_with_on_time_enqueue_is_device_side() -> None:
    job = SimJob(ranks=16, device_slow={7: 0.5}, started=True)
    r = replay(job, 90, clock_error_s=CLOCK_ERROR_S)
    assert [(s.rank, s.kind) for _, s in r.flags] == [(7, KIND_DEVICE)]
    assert r.view is not None
    row = next(x for x in r.view.ranks if x.rank == 7)
    assert row.score < 0.05 and row.started_score is not None and row.started_score > 0.2


def test_steps_longer_than_the_poll_interval() -> None:
    # 4.8 s steps, one collective every 1.2 s: fewer collectives than ticks.
    r = replay(SimJob(ranks=16, chunk_s=0.8, slow={2: 0.5}), 120, clock_error_s=CLOCK_ERROR_S)
    assert r.step_s > 4
    named = r.first_flag(2)
    assert named is not None and named <= 60
    assert r.others({2}) == []


def test_a_recovered_rank_is_cleared_and_stays_cleared() -> None:
    job = SimJob(ranks=16, slow={4: 0.5}, slow_until_s=60.0)
    r = replay(job, 400, clock_error_s=CLOCK_ERROR_S)
    assert [s.rank for _, s in r.flags] == [4]  # named once, not again
    assert r.view is not None and r.view.stragglers == []


def test_reports_without_a_clock_estimate_are_not_compared() -> None:
    now = [10_000_000_000]
    m = StragglerMonitor(clock_ns=lambda: now[0])
    rep = pb.ProgressReport(
        job_id="j",
        agent_id="a",
        ranks=[
            pb.RankProgress(
                rank=r,
                state=pb.PROCESS_STATE_RUNNING,
                status_at_ns=now[0],
                groups=[pb.GroupProgress(group="0", last_enqueued=5)],
            )
            for r in range(4)
        ],
    )
    m.observe(rep)  # clock_error_ns 0: the agent has no offset estimate
    assert m.view("j") is None
    rep.clock_error_ns = 1000
    for rp in rep.ranks:
        rp.status_at_ns = now[0] + 60_000_000_000  # a minute off the coordinator's clock
    m.observe(rep)
    view = m.view("j")
    assert view is not None and view.ranks == []


def test_a_slow_node_names_each_of_its_ranks_and_nobody_else() -> None:
    node = set(range(8, 16))  # one agent's 8 ranks: a slow NIC, a throttled host
    r = replay(SimJob(ranks=32, slow=dict.fromkeys(node, 0.3)), 120, clock_error_s=CLOCK_ERROR_S)
    assert {s.rank for _, s in r.flags} == node
    assert max(t for t, _ in r.flags) <= 90


def test_two_rank_job() -> None:
    # The median of two sits halfway: the straggler is half a collective behind, its peer ahead.
    r = replay(SimJob(ranks=2, slow={1: 0.5}), 120, clock_error_s=CLOCK_ERROR_S, per_agent=1)
    assert [s.rank for _, s in r.flags] == [1]
    assert r.flags[0][0] <= 90


@pytest.mark.timeout(10)
def test_median_without_is_the_median_of_the_others() -> None:
    rng = random.Random(7)
    for n in (2, 3, 4, 5, 8, 33):
        for _ in range(50):
            vals = [rng.choice([0.0, 0.01, 0.02, rng.random()]) for _ in range(n)]
            ordered = sorted(vals)
            for i, v in enumerate(vals):
                rest = vals[:i] + vals[i + 1 :]
                assert median_without(ordered, v) == statistics.median(rest)


def test_a_rank_late_in_one_long_run_is_explained_not_contradicted() -> None:
    """The strip shows a hung rank red (it kept its group waiting); the table beside
    it must say why that is not a straggler, not a bare "No stragglers."."""
    from hangwatch.server.live.stragglers import JobStragglers, RankLateness

    def rank(r: int, score: float) -> RankLateness:
        return RankLateness(
            rank=r, host="h", score=score, late_ms=1.0, group="0", ticks=40,
            started_score=None, straggler=False,
        )  # fmt: skip

    calm = JobStragglers(job="j", window_s=60, tick_s=1, ranks=[rank(0, 0.0)], stragglers=[])
    assert calm.none_named == "No stragglers."
    hung = JobStragglers(
        job="j", window_s=60, tick_s=1, ranks=[rank(0, 0.0), rank(1, 0.4)], stragglers=[]
    )
    assert hung.none_named.startswith("No stragglers: ranks 1 kept their group waiting 25%+")
    assert [r.long_run for r in hung.ranks] == [False, True]
