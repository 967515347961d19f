"""ProgressReport.columns: the columnar form says what the per-rank messages say.

The agent's encoder and the coordinator's decoder round-trip any report
(hypothesis); two real registries fed the same reports, one as messages and one
as columns, hold the same state and find the same stalls at every step; a
straggler replay gives the same flags in both forms; every malformed column is
refused with a message naming it, over real gRPC too.
"""

from __future__ import annotations

import dataclasses
import math
import re
import struct

import grpc
import pytest
from hangwatch.server.coordinator import Coordinator
from hangwatch.server.ingest import validate
from hangwatch.server.ingest.validate import Invalid
from hangwatch.server.live.rates import RateColumns
from hangwatch.server.live.registry import JobRegistry, StaleSession
from hangwatch.server.live.views import JobSnapshot
from hypothesis import given, settings
from hypothesis import strategies as st

from hangwatch import progress_columns
from hangwatch.progress_columns import decode, encode, group_table
from hangwatch.wire import COLLECTIVES_UNKNOWN, pb, rpc
from tests.support.simagents.lateness import SimJob, replay

# An agent's 4 ranks of an 8-rank job: the world group, two DP halves, one TP pair each.
WORLD = 8
RANKS = [0, 1, 2, 3]
GROUPS = {
    "0": list(range(WORLD)),
    "1": [0, 1, 2, 3],
    "2": [4, 5, 6, 7],
    "tp0": [0, 1],
    "tp1": [2, 3],
}


def _infos() -> list[pb.RankInfo]:
    return [
        pb.RankInfo(
            rank=r,
            local_rank=r,
            world_size=WORLD,
            pid=1000 + r,
            backend="nccl",
            groups=[pb.GroupInfo(name=n, ranks=m) for n, m in GROUPS.items() if r in m],
        )
        for r in RANKS
    ]


def _member_groups(rank: int) -> list[str]:
    return [n for n, m in GROUPS.items() if rank in m]


seqs = st.integers(min_value=-1, max_value=40)


@st.composite
def group_progress(draw: st.DrawFn, name: str) -> pb.GroupProgress:
    enq = draw(seqs)
    comp = draw(st.integers(min_value=-1, max_value=max(enq, -1)))
    gp = pb.GroupProgress(
        group=name,
        last_enqueued=enq,
        last_completed=comp,
        last_started=draw(seqs),
        completion_unknown=draw(st.booleans()),
    )
    if draw(st.booleans()):
        gp.collectives_enqueued = draw(
            st.sampled_from([COLLECTIVES_UNKNOWN, enq, max(enq - 1, -1)])
        )
        gp.collectives_completed = draw(st.sampled_from([COLLECTIVES_UNKNOWN, comp]))
    if draw(st.booleans()):
        gp.oldest_in_flight.seq = draw(seqs)
        gp.oldest_in_flight.op = draw(
            st.sampled_from(["all_reduce", "broadcast", "_allgather_base"])
        )
        gp.oldest_in_flight.age_s = draw(st.floats(min_value=0, max_value=100, allow_nan=False))
    return gp


@st.composite
def rank_progress(draw: st.DrawFn, rank: int) -> pb.RankProgress:
    names = draw(st.lists(st.sampled_from(_member_groups(rank)), unique=True))
    return pb.RankProgress(
        rank=rank,
        state=draw(st.sampled_from([1, 1, 1, 2, 3, 4, 5])),
        groups=[draw(group_progress(n)) for n in names],
        fr_age_s=draw(st.floats(min_value=0, max_value=60, allow_nan=False)),
        status_at_ns=draw(st.integers(min_value=0, max_value=1 << 62)),
        cpu_time_ns=draw(st.integers(min_value=0, max_value=1 << 40)),
        runqueue_wait_ns=draw(st.integers(min_value=0, max_value=1 << 40)),
        finished=draw(st.booleans()),
        in_compile=draw(st.booleans()),
        compiler_running=draw(st.booleans()),
        io_bytes=draw(st.integers(min_value=0, max_value=1 << 50)),
    )


@st.composite
def report_ranks(draw: st.DrawFn) -> list[pb.RankProgress]:
    chosen = draw(st.lists(st.sampled_from(RANKS), unique=True))
    return [draw(rank_progress(r)) for r in sorted(chosen)]


def _as_messages(c: progress_columns.Columns, table: list[str]) -> list[pb.RankProgress]:
    """What the columns say, rebuilt as messages (for comparison only)."""
    out = [
        pb.RankProgress(
            rank=c.rank[i],
            state=c.state[i],  # type: ignore[arg-type]
            fr_age_s=c.fr_age_s[i],
            status_at_ns=c.status_at_ns[i],
            cpu_time_ns=c.cpu_time_ns[i],
            runqueue_wait_ns=c.runqueue_wait_ns[i],
            finished=bool(c.rank_flags[i] & progress_columns.FINISHED),
            in_compile=bool(c.rank_flags[i] & progress_columns.IN_COMPILE),
            compiler_running=bool(c.rank_flags[i] & progress_columns.COMPILER_RUNNING),
            io_bytes=c.io_bytes[i],
        )
        for i in range(len(c.rank))
    ]
    for k in range(len(c.cell_rank)):
        flags = c.cell_flags[k]
        gp = out[c.cell_rank[k]].groups.add(
            group=table[c.cell_group[k]],
            last_enqueued=c.last_enqueued[k],
            last_completed=c.last_completed[k],
            last_started=c.last_started[k],
            completion_unknown=bool(flags & progress_columns.COMPLETION_UNKNOWN),
        )
        if flags & progress_columns.HAS_COLLECTIVES:
            gp.collectives_enqueued = c.collectives_enqueued[k]
            gp.collectives_completed = c.collectives_completed[k]
        if flags & progress_columns.HAS_IN_FLIGHT:
            gp.oldest_in_flight.seq = c.in_flight_seq[k]
            gp.oldest_in_flight.op = c.ops[c.in_flight_op[k]]
            gp.oldest_in_flight.age_s = c.in_flight_age_s[k]
    return out


def _without_unchanged_s(ranks: list[pb.RankProgress]) -> list[pb.RankProgress]:
    out = []
    for rp in ranks:
        rp = pb.RankProgress.FromString(rp.SerializeToString())
        for gp in rp.groups:
            gp.ClearField("completed_unchanged_s")  # not carried: nothing reads it
        out.append(rp)
    return out


@pytest.mark.timeout(120)
@settings(max_examples=200, deadline=None)
@given(report_ranks())
def test_columns_round_trip(ranks: list[pb.RankProgress]) -> None:
    table = group_table(_infos())
    cols, rest = encode(ranks, table)
    assert rest == []
    if not ranks:
        assert cols is None
        return
    assert cols is not None
    back = decode(pb.ProgressColumns.FromString(cols.SerializeToString()))
    assert _as_messages(back, list(table)) == _without_unchanged_s(ranks)
    # The columns read as bytes (the straggler monitor's) are decode's.
    n_cells, n_ranks = len(back.cell_rank), len(back.rank)
    for raw, k, n, want in (
        (cols.cell_counts, progress_columns.LAST_ENQUEUED, n_cells, back.last_enqueued),
        (cols.cell_counts, progress_columns.LAST_STARTED, n_cells, back.last_started),
        (cols.rank_counts, progress_columns.STATUS_AT, n_ranks, back.status_at_ns),
    ):
        column = progress_columns.count_column(raw, k, n)
        assert struct.unpack(f"<{n}q", column) == tuple(want)


@pytest.mark.timeout(30)
def test_a_rank_in_a_group_made_after_registering_stays_a_message() -> None:
    table = group_table(_infos())
    late = pb.RankProgress(rank=1, groups=[pb.GroupProgress(group="made-later", last_enqueued=3)])
    known = pb.RankProgress(rank=0, groups=[pb.GroupProgress(group="tp0", last_enqueued=3)])
    cols, rest = encode([known, late], table)
    assert rest == [late]
    assert cols is not None and decode(cols).rank == (0,)


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _registry(clock: _Clock) -> tuple[JobRegistry, str]:
    reg = JobRegistry(stall_timeout=5.0, agent_lost_timeout=30.0, clock=clock)
    sid = reg.register(pb.RegisterRequest(job_id="j", agent_id="a", host="h", ranks=_infos()))
    return reg, sid


def _state(reg: JobRegistry) -> JobSnapshot:
    """The job's snapshot, but for the session id (each registry made its own)."""
    snap = reg.snapshot("j")
    assert snap is not None
    agents = [dataclasses.replace(a, session_id="") for a in snap.agents]
    return dataclasses.replace(snap, agents=agents)


# Every number a cell holds, by its Cell property.
CELL_FIELDS = (
    "last_enqueued",
    "last_completed",
    "completion_unknown",
    "in_flight_seq",
    "in_flight_op",
    "in_flight_age_s",
    "in_flight_since",
    "reported_at",
    "reported",
    "coll_enqueued",
    "coll_completed",
    "counts_p2p",
)


def _records(reg: JobRegistry) -> dict[int, tuple[object, ...]]:
    """Every rank's record and its cells, field by field: the snapshot leaves
    out some of what the stall scan reads later (when a collective was first
    seen in flight), and each form stores them by its own loop."""
    job = reg._jobs["j"]
    return {
        rank: (
            r.process_state,
            r.finished,
            r.last_report,
            [getattr(job.rates.cpu, f)[r.rate_slot] for f in RateColumns.__slots__],
            [getattr(job.rates.io, f)[r.rate_slot] for f in RateColumns.__slots__],
            r.in_compile,
            r.compiler_running,
            {name: [getattr(cell, f) for f in CELL_FIELDS] for name, cell in job.cells_of(r)},
        )
        for rank, r in job.ranks.items()
    }


@pytest.mark.timeout(300)
@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(report_ranks(), st.floats(min_value=0, max_value=8)), max_size=12))
def test_two_registries_fed_both_forms_agree_at_every_step(
    steps: list[tuple[list[pb.RankProgress], float]],
) -> None:
    clock = _Clock()
    as_messages, sid_m = _registry(clock)
    as_columns, sid_c = _registry(clock)
    table = group_table(_infos())
    for seq, (ranks, dt) in enumerate(steps, start=1):
        clock.t += dt
        as_messages.report_progress(
            pb.ProgressReport(
                job_id="j", agent_id="a", session_id=sid_m, report_seq=seq, ranks=ranks
            )
        )
        cols, rest = encode(ranks, table)
        req = pb.ProgressReport(
            job_id="j", agent_id="a", session_id=sid_c, report_seq=seq, ranks=rest, columns=cols
        )
        as_columns.report_progress(req, validate.progress_report(req))
        assert _records(as_columns) == _records(as_messages)
        assert _state(as_columns) == _state(as_messages)
        assert as_columns.stalls("j") == as_messages.stalls("j")
        assert as_columns.quiet("j") == as_messages.quiet("j")
        assert as_columns.in_flight_key("j") == as_messages.in_flight_key("j")
        assert as_columns.last_progress("j") == as_messages.last_progress("j")


@st.composite
def full_report(draw: st.DrawFn) -> list[pb.RankProgress]:
    """Every rank, every group it is in, in the same order each time: a real
    agent's layout, so the registry reuses what it resolved (CellPlan)."""
    out = []
    for r in RANKS:
        rp = draw(rank_progress(r))
        del rp.groups[:]
        rp.groups.extend(draw(group_progress(n)) for n in _member_groups(r))
        out.append(rp)
    return out


def _another_agent(what: str) -> pb.RegisterRequest:
    """A registration by another agent of the job: `take` moves rank 3 to it;
    `regroup` registers rank 4 with the world group re-created (a new
    description), which gives the job a new record of that group."""
    if what == "take":
        ranks = [_infos()[3]]
    else:
        ranks = [
            pb.RankInfo(
                rank=4,
                local_rank=0,
                world_size=WORLD,
                pid=2004,
                backend="nccl",
                groups=[pb.GroupInfo(name="0", desc="re-created", ranks=GROUPS["0"])],
            )
        ]
    return pb.RegisterRequest(job_id="j", agent_id=f"b-{what}", host="h2", ranks=ranks)


@pytest.mark.timeout(300)
@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.tuples(full_report(), st.floats(min_value=0, max_value=8)),
            st.sampled_from(["take", "regroup"]),
        ),
        max_size=12,
    )
)
def test_registrations_between_same_layout_reports_are_seen_by_the_next(
    steps: list[tuple[list[pb.RankProgress], float] | str],
) -> None:
    """The columns path resolves a report's layout once and reuses it; a
    registration between two reports of the same layout (a rank moved away, a
    group re-created) must reach the next report as it reaches the messages
    path: the moved rank refused, the new group record the one that moves."""
    clock = _Clock()
    as_messages, sid_m = _registry(clock)
    as_columns, sid_c = _registry(clock)
    table = group_table(_infos())
    for seq, step in enumerate(steps, start=1):
        if isinstance(step, str):
            clock.t += 0.5
            for reg in (as_messages, as_columns):
                reg.register(_another_agent(step))
            continue
        ranks, dt = step
        clock.t += dt
        cols, rest = encode(ranks, table)
        req_c = pb.ProgressReport(
            job_id="j", agent_id="a", session_id=sid_c, report_seq=seq, ranks=rest, columns=cols
        )
        req_m = pb.ProgressReport(
            job_id="j", agent_id="a", session_id=sid_m, report_seq=seq, ranks=ranks
        )
        outcomes = []
        for reg, req, checked in (
            (as_messages, req_m, None),
            (as_columns, req_c, validate.progress_report(req_c)),
        ):
            try:
                reg.report_progress(req, checked)
                outcomes.append("applied")
            except StaleSession:
                outcomes.append("stale")
        assert outcomes[0] == outcomes[1], outcomes
        assert _records(as_columns) == _records(as_messages)
        assert _state(as_columns) == _state(as_messages)
        assert as_columns.stalls("j") == as_messages.stalls("j")
        assert as_columns.last_progress("j") == as_messages.last_progress("j")


@pytest.mark.timeout(60)
def test_a_wait_in_one_collective_keeps_its_earliest_entry_in_both_forms() -> None:
    """How long a rank has waited in one collective is the earliest entry any
    report implied (arrival time less the agent's age): a later report with a
    shorter age (its agent polled late) must not make the wait look newer.
    Random reports rarely repeat an in-flight seq, so this walks one through
    both forms: in flight with the agent's age, then without (enqueued past
    completed), then done."""
    clock = _Clock()
    as_messages, sid_m = _registry(clock)
    as_columns, sid_c = _registry(clock)
    table = group_table(_infos())

    def report(seq: int, enq: int, comp: int, age: float | None) -> None:
        gp = pb.GroupProgress(group="0", last_enqueued=enq, last_completed=comp)
        if age is not None:
            gp.oldest_in_flight.seq, gp.oldest_in_flight.op = comp + 1, "all_reduce"
            gp.oldest_in_flight.age_s = age
        ranks = [pb.RankProgress(rank=0, state=1, groups=[gp])]
        cols, rest = encode(ranks, table)
        for reg, req in (
            (as_messages, pb.ProgressReport(session_id=sid_m, ranks=ranks)),
            (as_columns, pb.ProgressReport(session_id=sid_c, ranks=rest, columns=cols)),
        ):
            req.job_id, req.agent_id, req.report_seq = "j", "a", seq
            reg.report_progress(req, validate.progress_report(req))

    def since(reg: JobRegistry) -> float | None:
        job = reg._jobs["j"]
        cell = job.cell(job.ranks[0], "0")
        assert cell is not None
        return cell.in_flight_since

    report(1, 7, 6, 2.0)  # arrived at 100: entered at 98
    clock.t += 1.0
    report(2, 7, 6, 0.5)  # at 101 with a late poll: entered "at 100.5", not earlier
    assert since(as_columns) == since(as_messages) == 98.0
    clock.t += 1.0
    report(3, 7, 6, 4.0)  # at 102, entered at 98 or before: 98.0 stays the earliest
    assert since(as_columns) == since(as_messages) == 98.0
    report(4, 7, 6, 5.0)  # at 102: entered at 97
    assert since(as_columns) == since(as_messages) == 97.0
    clock.t += 1.0
    report(5, 7, 6, None)  # the same #7 open, no age given: arrival (103) is no earlier
    assert since(as_columns) == since(as_messages) == 97.0
    clock.t += 1.0
    report(6, 8, 7, None)  # #8 now: a new wait, from this arrival
    assert since(as_columns) == since(as_messages) == 104.0
    report(7, 8, 8, None)  # nothing open
    assert since(as_columns) is since(as_messages) is None
    assert _records(as_columns) == _records(as_messages)


@pytest.mark.timeout(120)
def test_a_straggler_replay_flags_the_same_ranks_from_columns() -> None:
    job = SimJob(ranks=16, slow={5: 0.5}, started=True)
    messages = replay(job, 90, clock_error_s=0.001)
    columns = replay(job, 90, clock_error_s=0.001, columns=True)
    assert [s.rank for _, s in messages.flags] == [5]
    assert columns.flags == messages.flags
    assert columns.view == messages.view


def _good() -> pb.ProgressReport:
    ranks = [
        pb.RankProgress(
            rank=r,
            state=pb.PROCESS_STATE_RUNNING,
            groups=[
                pb.GroupProgress(
                    group=g,
                    last_enqueued=4,
                    last_completed=3,
                    oldest_in_flight=pb.InFlight(seq=4, op="all_reduce", age_s=1.0),
                )
                for g in _member_groups(r)
            ],
        )
        for r in RANKS
    ]
    cols, _ = encode(ranks, group_table(_infos()))
    return pb.ProgressReport(job_id="j", agent_id="a", session_id="s", columns=cols)


def _broken(**fields: bytes | list[str]) -> pb.ProgressReport:
    req = _good()
    for k, v in fields.items():
        if isinstance(v, list):
            del req.columns.ops[:]
            req.columns.ops.extend(v)
        else:
            setattr(req.columns, k, v)
    return req


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"fr_age_s": b"\x00" * 7}, "columns.fr_age_s: 7 bytes, expected 4 x 8"),
        ({"rank_io": b"\x00" * 9}, "columns.rank_io: 9 bytes, expected 4 x 8"),
        ({"rank": b"\x00" * 6}, "columns.rank: 6 bytes, not a multiple of 4"),
        ({"rank_codes": b"\x01" * 3}, "columns.rank_codes: 3 bytes, expected 8 x 1"),
        ({"cell_counts": b""}, "columns.cell_counts: 0 bytes, expected 72 x 8"),
        ({"rank": struct.pack("<4i", 0, 1, 2, -3)}, "columns.rank: outside"),
        ({"ops": []}, "columns.in_flight_op: 0 is not one of 0 ops"),
        (
            {"cell_rank": struct.pack("<12H", *([0] * 11), 4)},
            "columns.cell_rank: 4 is not one of 4",
        ),
        (
            {"cell_counts": struct.pack("<72q", *([3] * 12), *([-5] * 60))},
            "sequence numbers below -1",
        ),
        ({"ops": ["all\x00reduce"]}, "in-flight op contains NUL"),
    ],
)
def test_a_malformed_column_is_refused_by_name(
    fields: dict[str, bytes | list[str]], says: str
) -> None:
    with pytest.raises(Invalid, match=_literal(says)):
        validate.progress_report(_broken(**fields))


def _literal(text: str) -> str:
    return re.escape(text)


@pytest.mark.timeout(30)
def test_a_rank_in_both_forms_is_refused() -> None:
    req = _good()
    req.ranks.add(rank=2)
    with pytest.raises(Invalid, match="a rank is both in ranks and in columns"):
        validate.progress_report(req)


@pytest.mark.timeout(30)
def test_columns_from_an_agent_older_than_rank_io_read_as_no_io() -> None:
    req = _good()
    assert req.columns.rank_io  # the agent's encoder fills it
    req.columns.ClearField("rank_io")
    c = validate.progress_report(req)
    assert c is not None and c.io_bytes == (0,) * len(RANKS)


@pytest.mark.timeout(30)
def test_the_good_report_passes() -> None:
    c = validate.progress_report(_good())
    assert c is not None and c.rank == tuple(RANKS)
    assert not any(math.isnan(x) for x in c.in_flight_age_s)


@pytest.mark.timeout(60)
def test_a_group_index_past_the_sessions_table_is_invalid_argument_over_grpc(
    coordinator: Coordinator, stub: rpc.CoordinatorStub
) -> None:
    resp = stub.Register(pb.RegisterRequest(job_id="j", agent_id="a", host="h", ranks=_infos()))
    assert resp.progress_columns
    req = _good()
    req.session_id = resp.session_id
    req.report_seq = 1
    assert stub.ReportProgress(req).known
    # One index past the session's table: its ranks are in four groups.
    groups = struct.unpack("<12I", req.columns.cell_group)
    req.columns.cell_group = struct.pack("<12I", *groups[:-1], 4)
    req.report_seq = 2
    with pytest.raises(grpc.RpcError) as e:
        stub.ReportProgress(req)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "columns.cell_group: 4 is not one of the session's 4 groups" in str(e.value.details())
    # The first report stands; nothing of the refused one was applied.
    snap = coordinator.registry.snapshot("j")
    assert snap is not None
    row = next(r for r in snap.ranks if r.rank == 0)
    assert {g.group: g.last_enqueued for g in row.groups}["0"] == 4
