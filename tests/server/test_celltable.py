"""The registry's columns (server/live/celltable.py, rates.py), through the real registry.

Registrations are what move cells: a rank registered again by the same
process keeps its numbers, a new process on the same groups starts over in
the same cells, and spans left behind by changed groups are reclaimed, so an
agent that re-registers for ever cannot grow the table without bound. A
rank's rate row follows it the same way, and a row given up is reused. A
property test churns registrations (ranks moving between agents, dropped,
restarted, their groups changed, compaction forced often) against a model.
"""

from __future__ import annotations

import pytest
from hangwatch.server.live import celltable
from hangwatch.server.live.celltable import MAX_OPS
from hangwatch.server.live.registry import JobRegistry
from hypothesis import given, settings
from hypothesis import strategies as st

from hangwatch.wire import pb

WORLD = 8
RANKS = range(4)
BASE_GROUPS = {"0": list(range(WORLD)), "dp0": [0, 1, 2, 3]}


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _register(reg: JobRegistry, groups: dict[str, list[int]], pid_base: int = 1000) -> str:
    return reg.register(
        pb.RegisterRequest(
            job_id="j",
            agent_id="a",
            host="h",
            ranks=[
                pb.RankInfo(
                    rank=r,
                    local_rank=r,
                    world_size=WORLD,
                    pid=pid_base + r,
                    backend="gloo",
                    groups=[pb.GroupInfo(name=n, ranks=m) for n, m in groups.items() if r in m],
                )
                for r in RANKS
            ],
        )
    )


def _report(
    reg: JobRegistry,
    sid: str,
    seq: int,
    completed: int = 0,
    groups: tuple[str, ...] = (),
    *,
    ranks: range = RANKS,
    op: str = "",
    cpu_ns: int = 0,
) -> None:
    """Each of `ranks` running, `completed` collectives done and the next one
    entered in each of `groups` (named in flight as `op` when given)."""
    flight = pb.InFlight(seq=completed + 1, op=op, age_s=0.1) if op else None
    reg.report_progress(
        pb.ProgressReport(
            session_id=sid,
            job_id="j",
            agent_id="a",
            report_seq=seq,
            ranks=[
                pb.RankProgress(
                    rank=r,
                    state=pb.PROCESS_STATE_RUNNING,
                    cpu_time_ns=cpu_ns,
                    groups=[
                        pb.GroupProgress(
                            group=g,
                            last_enqueued=completed + 1,
                            last_completed=completed,
                            oldest_in_flight=flight,
                        )
                        for g in groups
                    ],
                )
                for r in ranks
            ],
        )
    )


def _completed(reg: JobRegistry) -> dict[int, dict[str, int]]:
    snap = reg.snapshot("j")
    assert snap is not None
    return {r.rank: {g.group: g.last_completed for g in r.groups} for r in snap.ranks}


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("pid_base", "completed"),
    [(1000, 41), (2000, -1)],
    ids=["same-process-keeps-its-numbers", "new-process-starts-over"],
)
def test_a_rank_registered_again_on_the_same_groups_stays_in_its_cells(
    pid_base: int, completed: int
) -> None:
    """An agent restart (the same pids) keeps what the ranks reported; the job
    restarted under the same id (new pids) starts over. Either way in the
    cells the ranks had."""
    reg = JobRegistry(clock=_Clock())
    sid = _register(reg, BASE_GROUPS)
    _report(reg, sid, 1, 41, ("0", "dp0"))
    size = len(reg._jobs["j"].cells)
    _register(reg, BASE_GROUPS, pid_base=pid_base)
    assert _completed(reg) == {r: {"0": completed, "dp0": completed} for r in RANKS}
    assert len(reg._jobs["j"].cells) == size


@pytest.mark.timeout(60)
def test_re_registering_with_changing_groups_reclaims_cells_and_keeps_the_numbers() -> None:
    """Each registration adds a group the ranks were not in before (the job
    made a new one) and drops the one made before it: the world group's
    numbers carry over every time, and the table stays bounded."""
    clock = _Clock()
    reg = JobRegistry(clock=clock)
    sid = _register(reg, BASE_GROUPS)
    _report(reg, sid, 1, 0, ("0", "dp0"))
    live = len(RANKS) * 3  # the world group, dp0 and this round's group
    for k in range(1, 600):
        clock.t += 0.01
        sid = _register(reg, {**BASE_GROUPS, f"extra{k}": list(range(WORLD))})
        _report(reg, sid, k + 1, k, ("0", f"extra{k}"))
        cells = len(reg._jobs["j"].cells)
        # 4,096 dead cells before compacting, and never more dead than live after.
        assert cells <= 4096 + 2 * live + live, (k, cells)
    assert _completed(reg) == {r: {"0": 599, "dp0": 0, "extra599": 599} for r in RANKS}
    # Compacting happened (600 registrations allocated 7,200 cells).
    assert len(reg._jobs["j"].cells) < 600 * live


@pytest.mark.timeout(60)
def test_a_group_the_rank_never_registered_is_not_applied() -> None:
    reg = JobRegistry(clock=_Clock())
    sid = _register(reg, BASE_GROUPS)
    _report(reg, sid, 1, 7, ("0", "dp0", "never-registered"))
    assert _completed(reg) == {r: {"0": 7, "dp0": 7} for r in RANKS}


@pytest.mark.timeout(60)
def test_rate_rows_follow_their_ranks_and_are_reused_once_given_up() -> None:
    """A rank's CPU rate survives its agent re-registering the same process;
    a rank an agent stops holding gives its row up, and the next rank takes it."""
    clock = _Clock()
    reg = JobRegistry(clock=clock, stall_timeout=10.0)
    sid = _register(reg, BASE_GROUPS)

    _report(reg, sid, 1, cpu_ns=1_000_000_000)
    clock.t += 10.0
    _report(reg, sid, 2, cpu_ns=6_000_000_000)  # 0.5 of a core over 10 s
    job = reg._jobs["j"]
    assert {job.rates.cpu.rate(r.rate_slot, 5.0) for r in job.ranks.values()} == {5e8}
    sid = _register(reg, BASE_GROUPS)  # the same processes: the rate stays
    assert {job.rates.cpu.rate(r.rate_slot, 5.0) for r in job.ranks.values()} == {5e8}
    rows = len(job.rates.cpu.seen)
    for k in range(100):
        # The agent gives up ranks 2 and 3, then takes them back.
        reg.register(
            pb.RegisterRequest(
                job_id="j",
                agent_id="a",
                host="h",
                ranks=[
                    pb.RankInfo(rank=r, local_rank=r, world_size=WORLD, pid=1000 + r)
                    for r in (0, 1)
                ],
            )
        )
        _register(reg, BASE_GROUPS, pid_base=3000 + 10 * k)
    assert len(job.rates.cpu.seen) == rows
    assert {job.rates.cpu.rate(r.rate_slot, 5.0) for r in job.ranks.values()} == {None}


@pytest.mark.timeout(60)
def test_in_flight_op_names_are_bounded_per_job() -> None:
    """Op names are kept once per job; an agent sending endless distinct ones
    gets "" (none known) past the bound instead of growing the table."""
    reg = JobRegistry(clock=_Clock())
    sid = _register(reg, BASE_GROUPS)
    for seq in range(1, MAX_OPS + 11):
        _report(reg, sid, seq, seq - 1, ("0",), ranks=range(1), op=f"op{seq}")
    job = reg._jobs["j"]
    assert len(job.cells.ops) == MAX_OPS
    cell = job.cell(job.ranks[0], "0")
    assert cell is not None and cell.in_flight_op == "" and cell.in_flight_seq == MAX_OPS + 10


# Registration churn against a model: agents take ranks from each other, drop
# them, restart their processes and change their groups, with compaction made
# to run every few registrations. What a rank holds must always be what the
# model says: its numbers where the same process kept a group, -1 elsewhere.
AGENTS = ("a", "b")
ALL_GROUPS = ("0", "g1", "g2", "g3")


# (what, agent, registration: rank -> (process, its groups), completed)
Step = tuple[str, str, dict[int, tuple[int, tuple[str, ...]]], int]


@st.composite
def churn(draw: st.DrawFn) -> list[Step]:
    steps: list[Step] = []
    for _ in range(draw(st.integers(1, 30))):
        if draw(st.booleans()):
            agent = draw(st.sampled_from(AGENTS))
            ranks = draw(st.lists(st.integers(0, WORLD - 1), unique=True, max_size=WORLD))
            held = {
                r: (
                    draw(st.sampled_from((1, 2))),  # which process (pid) holds it
                    tuple(g for g in ALL_GROUPS if g == "0" or draw(st.booleans())),
                )
                for r in ranks
            }
            steps.append(("register", agent, held, 0))
        else:
            steps.append(("report", draw(st.sampled_from(AGENTS)), {}, draw(st.integers(0, 1000))))
    return steps


@pytest.mark.timeout(120)
@settings(max_examples=150, deadline=None)
@given(churn())
def test_registration_churn_keeps_every_ranks_numbers_where_they_belong(
    steps: list[Step],
) -> None:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(celltable, "COMPACT_MIN_CELLS", 4)
        reg = JobRegistry(clock=_Clock())
        sessions: dict[str, str] = {}
        seqs = dict.fromkeys(AGENTS, 0)
        # rank -> (agent, pid, {group: completed or -1})
        model: dict[int, tuple[str, int, dict[str, int]]] = {}
        for kind, agent, held, completed in steps:
            if kind == "register":
                for r in [r for r, (a, _, _) in model.items() if a == agent and r not in held]:
                    del model[r]
                for r, (pid, groups) in held.items():
                    before = model.get(r)
                    kept = before[2] if before is not None and before[1] == pid else {}
                    model[r] = (agent, pid, {g: kept.get(g, -1) for g in groups})
                sessions[agent] = reg.register(
                    pb.RegisterRequest(
                        job_id="j",
                        agent_id=agent,
                        host=agent,
                        ranks=[
                            pb.RankInfo(
                                rank=r,
                                local_rank=r,
                                world_size=WORLD,
                                pid=1000 * pid + r,
                                groups=[pb.GroupInfo(name=g, ranks=list(range(WORLD))) for g in gs],
                            )
                            for r, (pid, gs) in held.items()
                        ],
                    )
                )
                seqs[agent] = 0
            else:
                if agent not in sessions:
                    continue
                mine = [r for r, (a, _, _) in model.items() if a == agent]
                seqs[agent] += 1
                reg.report_progress(
                    pb.ProgressReport(
                        session_id=sessions[agent],
                        job_id="j",
                        agent_id=agent,
                        report_seq=seqs[agent],
                        ranks=[
                            pb.RankProgress(
                                rank=r,
                                state=pb.PROCESS_STATE_RUNNING,
                                groups=[
                                    pb.GroupProgress(
                                        group=g, last_enqueued=completed, last_completed=completed
                                    )
                                    for g in model[r][2]
                                ],
                            )
                            for r in mine
                        ],
                    )
                )
                for r in mine:
                    model[r] = (agent, model[r][1], dict.fromkeys(model[r][2], completed))
            held_now = _completed(reg) if "j" in reg.jobs() else {}
            assert held_now == {r: groups for r, (_, _, groups) in model.items()}
