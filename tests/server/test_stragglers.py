"""The straggler detector on simulated jobs replayed through the real monitor on a fake clock.

Each job is minutes of a training job's timing (tests/support/simagents/lateness.py),
read the way agents read it (a grid of 1 s ticks, clock errors, changed ranks only)
and fed to `StragglerMonitor` as real ProgressReports.
"""

from __future__ import annotations

import random
import statistics
import sys

import numpy as np
import pytest
from hangwatch.server.live.stragglers import (
    KIND_DEVICE,
    KIND_HOST,
    RankHosts,
    StragglerMonitor,
)
from hangwatch.server.live.tracks import (
    CLEAR_TICKS,
    GAP,
    WINDOW_TICKS,
    TickReadings,
    Tracks,
    medians_without,
)

from hangwatch import progress_columns
from hangwatch.wire import pb
from tests.support.simagents.lateness import Readings, SimJob, replay, simulate

CLOCK_ERROR_S = 0.0005  # an NTP-style offset over a LAN round trip


@pytest.mark.parametrize("columns", [False, True], ids=["messages", "columns"])
def test_rank_slowed_by_half_is_named_within_a_minute_and_nobody_else(columns: bool) -> None:
    r = replay(SimJob(ranks=16, slow={5: 0.5}), 90, clock_error_s=CLOCK_ERROR_S, columns=columns)
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


@pytest.mark.parametrize("columns", [False, True], ids=["messages", "columns"])
def test_late_start_with_on_time_enqueue_is_device_side(columns: bool) -> None:
    job = SimJob(ranks=16, device_slow={7: 0.5}, started=True)
    r = replay(job, 90, clock_error_s=CLOCK_ERROR_S, columns=columns)
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


@pytest.mark.parametrize("columns", [False, True], ids=["messages", "columns"])
def test_a_recovered_rank_is_cleared_and_stays_cleared(columns: bool) -> None:
    job = SimJob(ranks=16, slow={4: 0.5}, slow_until_s=60.0)
    r = replay(job, 400, clock_error_s=CLOCK_ERROR_S, columns=columns)
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
def test_medians_without_is_the_median_of_the_others_in_each_group() -> None:
    rng = random.Random(7)
    for _ in range(200):
        sizes = [rng.choice([2, 3, 4, 5, 8, 33]) for _ in range(rng.randint(1, 4))]
        group = np.array([g for g, n in enumerate(sizes) for _ in range(n)])
        vals = [rng.choice([0.0, 0.01, 0.02, rng.random()]) for _ in group]
        order = rng.sample(range(len(vals)), len(vals))  # members in no particular order
        group, values = group[order], np.array(vals)[order]
        pick = np.arange(len(values))
        got = medians_without(group, values, pick)
        for i in pick:
            rest = [float(v) for j, v in enumerate(values) if j != i and group[j] == group[i]]
            assert got[i] == statistics.median(rest)


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


def _off_level(rng: random.Random, share: float, started: bool) -> tuple[float, float]:
    """A push's (gap, started gap): level on both but for `share` of pushes."""
    gap = rng.choice([-1.0, 0.5, 1.0]) if rng.random() < share else 0.0
    if not started:
        return gap, np.nan
    return gap, rng.choice([-1.0, 1.0]) if rng.random() < share else 0.0


def _noisy(rng: random.Random, tick: int, row: int) -> tuple[float, float]:
    """Rows 0-1: any push any code; 2-3: 2% off level, but half in ticks
    150-210, past the odd pushes a row keeps (and back once they left the
    window); 4: its started counter measured from tick 150 on (a new base);
    5: level, started unmeasured, but for a burst in ticks 100-140."""
    if row < 2:
        return rng.choice([-1.0, 0.0, 0.0, 0.5, 1.0]), rng.choice([np.nan, -1.0, 0.0, 1.0])
    if row < 4:
        return _off_level(rng, 0.5 if 150 <= tick < 210 else 0.02, started=True)
    if row == 4:
        return _off_level(rng, 0.02, started=tick >= 150)
    return _off_level(rng, 0.9 if 100 <= tick < 140 else 0.0, started=False)


@pytest.mark.timeout(30)
def test_window_counts_kept_as_pushes_come_and_go_equal_a_recount() -> None:
    """The tracks keep their window's counts by adding each push and taking
    out the one that leaves (WINDOW_TICKS and CLEAR_TICKS back); after every
    push they must equal a count over the pushes themselves, and the window
    they keep must be those pushes, whether a row keeps its few odd pushes
    or a ring from the pool, through every move between the two. Rows are
    pushed at different rates, as ranks missing from some ticks are."""
    rng = random.Random(11)
    tracks = Tracks()
    rows = tracks.find(np.zeros(6, np.int64), np.arange(6))
    history: list[list[tuple[bool, bool, bool, bool, bool]]] = [[] for _ in rows]
    codes: list[list[int]] = [[] for _ in rows]
    pooled: list[list[bool]] = [[] for _ in rows]
    for tick in range(2 * WINDOW_TICKS + 40):
        pushed = np.array([r for r in rows.tolist() if rng.random() < 0.8 + 0.03 * r])
        if not len(pushed):
            continue
        gaps = [_noisy(rng, tick, r) for r in pushed.tolist()]
        gap = np.array([g for g, _ in gaps])
        sgap = np.array([sg for _, sg in gaps])
        tracks.push(pushed, gap, gap / 10, sgap, np.full(len(pushed), 1000))
        for r, g, sg in zip(pushed.tolist(), gap.tolist(), sgap.tolist(), strict=True):
            seen = not np.isnan(sg)
            history[r].append((g >= GAP, g <= -GAP, seen, seen and sg >= GAP, seen and sg <= -GAP))
            s_code = 0 if not seen else 2 if sg >= GAP else 3 if sg <= -GAP else 1
            codes[r].append((1 if g >= GAP else 2 if g <= -GAP else 0) | s_code << 2)
        for r in rows.tolist():
            pooled[r].append(bool(tracks.ring[r] >= 0))
            assert tracks.window(r) == codes[r][-WINDOW_TICKS:]
            win, last = history[r][-WINDOW_TICKS:], history[r][-CLEAR_TICKS:]
            one = np.array([r])
            assert tracks.seen(one)[0] == len(win)
            assert tracks.behind[r] == sum(p[0] for p in win)
            assert tracks.ahead[r] == sum(p[1] for p in win)
            assert (tracks.s_seen[r], tracks.s_behind[r], tracks.s_ahead[r]) == (
                sum(p[2] for p in win),
                sum(p[3] for p in win),
                sum(p[4] for p in win),
            )
            assert tracks.behind_clear[r] == sum(p[0] for p in last)
            assert tracks.ahead_clear[r] == sum(p[1] for p in last)
            hits = [p[0] or p[3] for p in win]
            runs = sum(h and (i == 0 or not hits[i - 1]) for i, h in enumerate(hits))
            assert tracks.episodes[r] == runs
    # Each way through was taken: rows 0-1 always pooled once their window
    # had more odd pushes than a row keeps; 2-5 each pooled in a burst (4: at its new base) and
    # out of the pool again; row 5 at the end keeps its base alone.
    assert all(pooled[r][-1] for r in (0, 1))
    for r in (2, 3, 4, 5):
        first_in = pooled[r].index(True)
        assert False in pooled[r][first_in:], f"row {r} never left the pool"
    assert not pooled[5][-1] and tracks.odd_count[5] == 0
    assert tracks.pool_used <= 6 and len(tracks.pool_free) + 2 <= tracks.pool_used


@pytest.mark.timeout(30)
def test_rows_added_in_batches_keep_their_state_and_new_rows_start_empty() -> None:
    """Growing copies only the rows in use into zeroed room: every row added
    before keeps its numbers and its ring, every new one starts unflagged and
    never read (the fills), across growths past the first capacity."""
    tracks = Tracks()
    first = tracks.find(np.zeros(40, np.int64), np.arange(40))
    ones = np.ones(40)
    for _ in range(3):
        tracks.push(first, ones, ones / 10, np.full(40, np.nan), np.full(40, 1000))
    tracks.last_tick[first] = 7
    tracks.flagged_at[first[:5]] = 12.5
    windows = [tracks.window(r) for r in first.tolist()]
    for batch in range(1, 6):  # 40 + 5 x 300 rows: grown 64 -> 128 -> ... -> 2,048
        new = tracks.find(np.full(300, batch, np.int64), np.arange(300))
        assert len(tracks.gid) >= tracks.n_rows == 40 + 300 * batch
        assert (tracks.last_tick[new] < -(1 << 61)).all()  # never read: no tick
        assert np.isnan(tracks.flagged_at[new]).all() and (tracks.n[new] == 0).all()
        assert (tracks.gid[new] == batch).all() and (tracks.rank[new] == np.arange(300)).all()
    assert (tracks.find(np.zeros(40, np.int64), np.arange(40)) == first).all()
    assert (tracks.n[first] == 3).all() and (tracks.behind[first] == 3).all()
    assert (tracks.last_tick[first] == 7).all()
    assert [tracks.window(r) for r in first.tolist()] == windows == [[1, 1, 1]] * 40
    assert (tracks.flagged_at[first[:5]] == 12.5).all() and np.isnan(
        tracks.flagged_at[first[5:]]
    ).all()
    assert not (tracks.last_tick[40 : tracks.n_rows] == 7).any()


def test_a_rank_in_two_groups_is_named_in_each_and_scored_against_its_own_peers() -> None:
    """Every rank sits in the world group and a 4-rank group that counts three
    collectives to the world's one; rank 6 is slow. It is named in both of
    its groups, nobody else is, and the view lists each rank once."""
    r = replay(SimJob(ranks=16, slow={6: 0.5}), 90, clock_error_s=CLOCK_ERROR_S, subgroup=4)
    assert sorted((s.rank, s.group) for _, s in r.flags) == [(6, "0"), (6, "sub1")]
    assert r.view is not None and sorted(x.rank for x in r.view.ranks) == list(range(16))
    # Each group's median is its own: with the groups' counters mixed, the
    # healthy ranks of sub3 scored 0.06 here.
    assert max(x.score for x in r.view.ranks if x.rank != 6) < 0.05


def _columns_monitor() -> tuple[Readings, list[int], StragglerMonitor]:
    """A 16-rank job's columns readings (two agents), and a monitor on a
    clock the test sets (ns), every agent registered."""
    job = SimJob(ranks=16)
    rd = Readings(job, simulate(job, 10), clock_error_s=CLOCK_ERROR_S, columns=True)
    now = [0]
    monitor = StragglerMonitor(clock_ns=lambda: now[0])
    for req in rd.register_requests():
        monitor.register(req)
    return rd, now, monitor


def test_an_agents_filed_reports_share_one_copy_of_its_layout() -> None:
    """A report waits two ticks to be scored, so three ticks of every agent's
    reports are held at once. Their rank, cell_rank and cell_group columns are
    the same bytes report after report: held once per agent, not once per
    report. An agent whose layout changes is filed with its new one."""
    rd, now, monitor = _columns_monitor()

    def filed(tick: int) -> list[tuple[bytes, bytes, bytes]]:
        return monitor._jobs[rd.job_id].pending[tick].c_layouts

    for tick in (3, 4):
        now[0] = int(tick * rd.tick_s * 1e9)
        for r in rd.reports(tick):
            monitor.observe(r, progress_columns.decode(r.columns))
    first, second = filed(3), filed(4)
    assert len(first) == len(second) == 2  # two agents
    for a, b in zip(first, second, strict=True):
        assert a == b and all(x is y for x, y in zip(a, b, strict=True))

    # The first agent now reports its ranks in the other order: new bytes.
    now[0] = int(5 * rd.tick_s * 1e9)
    r = next(iter(rd.reports(5)))
    cols = progress_columns.decode(r.columns)
    # rank_counts and the rest kept as they were: filing reads only the layout here.
    order = [1, 0, *range(2, len(cols.rank))]
    r.columns.rank = b"".join(r.columns.rank[4 * i : 4 * i + 4] for i in order)
    changed = progress_columns.decode(r.columns)
    monitor.observe(r, changed)
    (now_filed,) = filed(5)
    assert now_filed == changed.packed_layout != first[0]
    assert now_filed[0] is changed.packed_layout[0]


def test_a_report_read_between_collectives_files_one_copy_of_its_counts() -> None:
    """Filed, a report keeps its enqueued and started columns for three ticks.
    Where the two are the same counts (read between collectives) only one is
    stored; where they differ, each is read back as its own values, in the
    order the reports came, whichever kind came first."""
    rd, _, _ = _columns_monitor()
    r = next(iter(rd.reports(3)))
    cols = progress_columns.decode(r.columns)
    cells = len(cols.packed_layout[1]) // 2
    enq_k, st_k = progress_columns.LAST_ENQUEUED, progress_columns.LAST_STARTED
    raw = bytearray(r.columns.cell_counts)
    enqueued = bytes(raw[8 * enq_k * cells : 8 * (enq_k + 1) * cells])
    started = np.frombuffer(enqueued, "<i8") - np.arange(cells) % 2  # every other one behind
    raw[8 * st_k * cells : 8 * (st_k + 1) * cells] = enqueued
    same = pb.ProgressReport()
    same.CopyFrom(r)
    same.columns.cell_counts = bytes(raw)
    raw[8 * st_k * cells : 8 * (st_k + 1) * cells] = started.astype("<i8").tobytes()
    apart = pb.ProgressReport()
    apart.CopyFrom(r)
    apart.columns.cell_counts = bytes(raw)

    tick = TickReadings()
    table = np.arange(8, dtype=np.int64)
    for report in (same, apart, same):
        tick.add(table, 0, report, cols.packed_layout)
    assert len(tick.c_enqueued) == 3 * 8 * cells
    assert len(tick.c_started) == 8 * cells  # the one report whose started differs
    _, _, _, _, enq_read, started_read, _ = tick.readings()
    want_enq = np.frombuffer(enqueued * 3, "<i8")
    assert enq_read.tolist() == want_enq.tolist()
    assert started_read.tolist() == [
        *want_enq[:cells].tolist(),
        *started.tolist(),
        *want_enq[:cells].tolist(),
    ]


def test_a_filed_columns_report_is_not_kept_until_its_tick_is_scored() -> None:
    """Filing copies the columns scoring reads: a report kept whole until its
    tick was scored kept its relay's whole ProgressBatch parsed (protobuf's
    arena) with it, three ticks of every agent's reports at 4,096 ranks
    (benchmarks/coordinator_load.py: 0.8 KB a rank). Scoring still reads the
    same numbers: every test above replays columns reports."""
    rd, now, monitor = _columns_monitor()
    now[0] = int(3 * rd.tick_s * 1e9)
    batch = pb.ProgressBatch(reports=list(rd.reports(3)))
    assert len(batch.reports) == 2
    held = [batch.reports[0], batch.reports[1]]
    before = [sys.getrefcount(r) for r in held]
    for r in held:
        monitor.observe(r, progress_columns.decode(r.columns))
    del r  # the loop's own reference
    assert monitor.score_ready() == 0  # filed, not yet scored: its tick is still open
    assert [sys.getrefcount(r) for r in held] == before


@pytest.mark.timeout(10)
def test_rank_hosts_follow_a_rank_that_moves_and_know_none_they_were_not_told() -> None:
    hosts = RankHosts()
    hosts.set([8, 9, 10, 11], "node-1")
    hosts.set([0, 1], "node-0")
    assert [hosts.get(r) for r in (0, 1, 8, 11)] == ["node-0", "node-0", "node-1", "node-1"]
    # A gap between agents' ranks, past the highest, and a negative rank: no host.
    assert [hosts.get(r) for r in (2, 7, 12, 10**6, -1)] == ["", "", "", "", ""]
    hosts.set([9], "node-2")  # re-registered by another node's agent
    assert (hosts.get(8), hosts.get(9)) == ("node-1", "node-2")
    hosts.set([], "node-3")
    assert hosts.get(0) == "node-0"
