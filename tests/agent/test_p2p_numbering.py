"""Collective numbering where pg_status also counts p2p ops (agent/numbering.py).

A pipeline's middle stage does twice the p2p of its ends, and pg_status counts
those ops too (gloo: one counter; NCCL: the last op's own number). Lag and
stalls must compare collectives only: read from real gloo ranks, real NCCL
dumps, and fed to the real registry.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hangwatch.agent import ranks as ranks_mod
from hangwatch.agent.ranks import RankTracker
from hangwatch.server.live.registry import JobRegistry

from hangwatch import safepickle
from hangwatch.formats import RankInfo
from hangwatch.recorders import COMPLETION_TRACKED, KIND_GENERIC, KIND_NCCL
from hangwatch.wire import COLLECTIVES_UNKNOWN, pb
from tests.helpers import CONFORMANCE_DIR

HERE = Path(__file__).resolve().parent


def _tracker(kind: str, instance: str, groups: list[str], rank: int = 0) -> RankTracker:
    info = {
        "rank": rank,
        "pid": 1000 + rank,
        "world_size": 3,
        "groups": [],
        "recorders": [
            {"instance": instance, "kind": kind, "completion": COMPLETION_TRACKED, "groups": groups}
        ],
    }
    return RankTracker(info=RankInfo.from_json(info), rankinfo_path="", rankinfo_mtime=0.0)


@pytest.fixture(scope="module")
def stages(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("stages")
    env = {**os.environ, "TORCH_FR_BUFFER_SIZE": "200"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(HERE / "p2p_stages.py"), str(tmp / "store"), str(tmp), str(r)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for r in range(3)
    ]
    outs = [p.communicate(timeout=90)[0].decode(errors="replace") for p in procs]
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r}:\n{outs[r][-3000:]}"
    return {r: json.loads((tmp / f"rank{r}.json").read_text()) for r in range(3)}


def _progress(stages: dict[int, dict[str, Any]]) -> dict[int, pb.RankProgress]:
    out = {}
    for r, doc in stages.items():
        t = _tracker(KIND_GENERIC, "gloo", ["0"], rank=r)
        t.ingest_entries(doc["full"], "gloo")
        t.apply_status(doc["status"], 10.0, "gloo")
        out[r] = t.progress_pb(11.0)
    return out


@pytest.mark.torch
@pytest.mark.timeout(120)
def test_gloo_stages_report_collectives_not_p2p(stages: dict[int, dict[str, Any]]) -> None:
    raw = {r: d["status"]["pg_status"]["0"] for r, d in stages.items()}
    # What torch says: the middle stage's counter is ahead by its extra p2p ops.
    assert int(raw[1]["last_completed_collective"]) > int(raw[0]["last_enqueued_collective"])
    progress = _progress(stages)
    got = {
        r: (gp.collectives_enqueued, gp.collectives_completed)
        for r, p in progress.items()
        for gp in p.groups
    }
    assert got == {0: (5, 4), 1: (4, 4), 2: (5, 4)}
    for r in (0, 2):  # waiting in all_reduce #5, by FR's own numbering
        (gp,) = progress[r].groups
        assert (gp.oldest_in_flight.seq, gp.oldest_in_flight.op) == (5, "all_reduce")
    assert not progress[1].groups[0].HasField("oldest_in_flight")


def _registry(progress: dict[int, pb.RankProgress]) -> JobRegistry:
    reg = JobRegistry(stall_timeout=0.0)
    sid = reg.register(
        pb.RegisterRequest(
            job_id="pp",
            agent_id="node",
            host="h",
            ranks=[
                pb.RankInfo(
                    rank=r,
                    world_size=3,
                    pid=1000 + r,
                    groups=[pb.GroupInfo(name="0", desc="default_pg", pg_id=0, ranks=[0, 1, 2])],
                )
                for r in range(3)
            ],
        )
    )
    reg.report_progress(
        pb.ProgressReport(
            job_id="pp", agent_id="node", session_id=sid, report_seq=1, ranks=progress.values()
        )
    )
    return reg


@pytest.mark.torch
@pytest.mark.timeout(120)
def test_registry_lag_and_stall_count_collectives(stages: dict[int, dict[str, Any]]) -> None:
    progress = _progress(stages)
    snap = _registry(progress).snapshot("pp")
    assert snap is not None
    # Rank 1 is the one behind (it has not entered #5), not the ends.
    assert {r.rank: r.lag for r in snap.ranks} == {0: 0, 1: 1, 2: 0}
    assert all(g.counts_p2p for r in snap.ranks for g in r.groups)
    (st,) = snap.stalled
    assert (st.group, st.seq, st.op) == ("0", 5, "all_reduce")
    assert (st.waiting_ranks, st.not_entered_ranks) == ([0, 2], [1])

    # What pg_status alone said (an agent without the numbering): the ends behind.
    for p in progress.values():
        for gp in p.groups:
            gp.ClearField("collectives_enqueued")
            gp.ClearField("collectives_completed")
    snap = _registry(progress).snapshot("pp")
    assert snap is not None
    lags = {r.rank: r.lag for r in snap.ranks}
    assert lags[0] > 0 and lags[2] > 0 and lags[1] == 0, lags


def test_unknown_numbering_puts_nobody_behind() -> None:
    reg = _registry(
        {
            r: pb.RankProgress(
                rank=r,
                state=pb.PROCESS_STATE_RUNNING,
                groups=[
                    pb.GroupProgress(
                        group="0",
                        last_enqueued=enq,
                        last_completed=enq,
                        collectives_enqueued=coll,
                        collectives_completed=coll,
                    )
                ],
            )
            for r, enq, coll in ((0, 40, 10), (1, 70, COLLECTIVES_UNKNOWN), (2, 40, 10))
        }
    )
    snap = reg.snapshot("pp")
    assert snap is not None
    assert {r.rank: r.lag for r in snap.ranks} == {0: 0, 1: 0, 2: 0}
    (rank1,) = [r for r in snap.ranks if r.rank == 1]
    assert rank1.groups[0].collectives_completed is None
    assert snap.stalled == []


def test_calibration_reads_entries_at_start_when_quiet_and_rarely() -> None:
    t = _tracker(KIND_GENERIC, "gloo", ["0"])
    g = t.groups["0"]
    assert not t.needs_calibration(0.0)  # nothing done yet
    t.last_entries_fetch = 0.5  # read before its first collective: not the first look
    t.apply_status({"pg_status": {"0": {"last_enqueued_collective": 3}}}, 1.0, "gloo")
    assert t.needs_calibration(1.0)  # the first look
    entries = [
        {"process_group": ["0", "default_pg"], "pg_id": 0, "record_id": i, "collective_seq_id": i,
         "op_id": 2 * i, "profiling_name": "gloo:all_reduce", "retired": True}
        for i in (1, 2)
    ]  # fmt: skip
    t.ingest_entries({"entries": entries}, "gloo")
    t.last_entries_fetch, t.looked = 1.0, True
    t.apply_status(
        {"pg_status": {"0": {"last_enqueued_collective": 4, "last_completed_collective": 4}}},
        1.0,
        "gloo",
    )
    assert g.numbering.counts_p2p and g.collectives() == (2, 2)
    assert not t.needs_calibration(1.5)
    t.apply_status(
        {"pg_status": {"0": {"last_enqueued_collective": 9, "last_completed_collective": 9}}},
        2.0,
        "gloo",
    )
    assert g.collectives() is None  # moved past what the entries said
    assert not t.needs_calibration(2.5)  # still moving
    assert t.needs_calibration(2.0 + ranks_mod.QUIET_S)  # quiet: read once
    t.last_entries_fetch = 3.5
    assert not t.needs_calibration(10.0)  # nothing moved since
    t.apply_status(
        {"pg_status": {"0": {"last_enqueued_collective": 11, "last_completed_collective": 11}}},
        11.0,
        "gloo",
    )
    assert not t.needs_calibration(11.1)
    assert t.needs_calibration(3.5 + ranks_mod.CALIBRATE_S)


@pytest.mark.skipif(
    not CONFORMANCE_DIR.is_dir(), reason=f"no conformance data at {CONFORMANCE_DIR}"
)
def test_nccl_pipeline_group_counts_p2p() -> None:
    """Rank 0 of a real 16-GPU Megatron incident: the pipeline group's pg_status
    reads a send's p2p_seq_id (14000); its collective count is 29."""
    d = safepickle.safe_loads((CONFORMANCE_DIR / "gpu_error_2nd" / "_dump_0").read_bytes())
    assert isinstance(d, dict)
    names = {e["pg_id"]: e["process_group"][0] for e in d["entries"]}
    n = max(int(k) for k in d["pg_status"]) + 1
    t = _tracker(KIND_NCCL, "nccl", [names.get(i, f"unnamed-{i}") for i in range(n)])
    t.ingest_entries(d, "nccl")
    t.apply_status(d, 10.0, "nccl")
    pp = t.groups[names[6]]
    assert (pp.last_enqueued, pp.numbering.counts_p2p) == (14000, True)
    assert pp.numbering.enqueued == 29
    tp = t.groups[names[5]]  # tensor parallel: collectives only, reported as they are
    assert not tp.numbering.counts_p2p
    by_group = {gp.group: gp for gp in t.progress_pb(11.0).groups}
    assert not by_group[names[5]].HasField("collectives_enqueued")
    assert by_group[names[6]].collectives_enqueued == 29
    # Its completed op is older than the entries in the dump: not known, not guessed.
    assert by_group[names[6]].collectives_completed == COLLECTIVES_UNKNOWN


def test_a_rank_late_for_the_first_collective_is_not_in_collective_0() -> None:
    def rank(r: int, enq: int) -> pb.RankProgress:
        gp = pb.GroupProgress(group="0", last_enqueued=enq, last_completed=-1)
        return pb.RankProgress(rank=r, state=pb.PROCESS_STATE_RUNNING, groups=[gp])

    snap = _registry({0: rank(0, 1), 1: rank(1, -1), 2: rank(2, 1)}).snapshot("pp")
    assert snap is not None
    (st,) = snap.stalled
    assert (st.seq, st.waiting_ranks, st.not_entered_ranks) == (1, [0, 2], [1])


def test_a_crash_caused_by_a_dead_peer_goes_after_its_cause() -> None:
    from hangwatch.agent.causes import causes_first

    crashed = pb.EVENT_KIND_RANK_CRASHED
    peer = (
        crashed,
        0,
        "process is a zombie; uncaught exception: RuntimeError: [../gloo/transport/tcp/pair.cc:553]"
        " Connection closed by peer [127.0.0.1]:11497",
    )
    cause = (crashed, 1, "process gone; uncaught exception: RuntimeError: rank 1: corrupt sample")
    exited = (pb.EVENT_KIND_RANK_EXITED, 2, "process gone")
    assert causes_first([peer, exited, cause]) == [exited, cause, peer]


@pytest.mark.parametrize(("op_id", "p2p"), [(1, False), (2, True)])
def test_a_rank_in_its_first_collective_names_it_as_1_with_its_op(op_id: int, p2p: bool) -> None:
    """pg_status says -1 for none completed; the collective in flight is #1
    (FR's collective_seq_id), and its op is found under that number. As "#0"
    (-1 + 1) its op was never found. p2p: a pipeline's first stage, whose send
    was op 1 (gloo numbers both with one counter), in all_reduce #1 as op 2."""
    t = _tracker(KIND_GENERIC, "gloo", ["0"])
    status = {
        "pg_status": {"0": {"last_enqueued_collective": op_id, "last_completed_collective": -1}}
    }
    entry = {"process_group": ["0", "default_pg"], "pg_id": 0, "record_id": 0,
             "collective_seq_id": 1, "op_id": op_id, "profiling_name": "gloo:all_reduce"}  # fmt: skip
    t.apply_status(status, 1.0, "gloo")
    t.ingest_entries({"entries": [entry]}, "gloo")
    t.apply_status(status, 1.0, "gloo")
    (gp,) = t.progress_pb(2.0).groups
    assert (gp.oldest_in_flight.seq, gp.oldest_in_flight.op) == (1, "all_reduce")
    assert gp.HasField("collectives_enqueued") == p2p


# A rank's lag (RankLive.lag, server/live/views.py) counts collectives, it does
# not subtract numbers: every counter numbers the first collective 1 and says
# -1 for none. Read as numbers, a healthy pipeline's first stage in all_reduce
# #1, not yet completed, was 2 behind a peer that completed it (CI, stop 52).


def _lags(groups: dict[int, pb.GroupProgress]) -> dict[int, int]:
    snap = _registry(
        {
            r: pb.RankProgress(rank=r, state=pb.PROCESS_STATE_RUNNING, groups=[gp])
            for r, gp in groups.items()
        }
    ).snapshot("pp")
    assert snap is not None
    return {r.rank: r.lag for r in snap.ranks}


def _p2p(raw: int, entered: int, completed: int) -> pb.GroupProgress:
    """A group whose pg_status counts p2p too: its collective counts beside it."""
    return pb.GroupProgress(
        group="0",
        last_enqueued=raw,
        last_completed=-1,
        collectives_enqueued=entered,
        collectives_completed=completed,
    )


def _plain(enqueued: int, completed: int) -> pb.GroupProgress:
    return pb.GroupProgress(group="0", last_enqueued=enqueued, last_completed=completed)


def test_a_stage_still_in_its_first_p2p_is_one_collective_behind_not_two() -> None:
    # The CI failure's numbers: stage 0 has sent and is receiving (raw 2, no
    # collective yet); the others are in the first all_reduce.
    lags = _lags({0: _p2p(2, -1, -1), 1: _p2p(4, 1, -1), 2: _p2p(3, 1, -1)})
    assert lags == {0: 1, 1: 0, 2: 0}


def test_none_entered_against_the_first_is_one_behind_on_either_counter() -> None:
    assert _lags({0: _plain(-1, -1), 1: _plain(1, -1), 2: _plain(1, -1)}) == {0: 1, 1: 0, 2: 0}
    assert _lags({0: _plain(-1, -1), 1: _plain(1, 1), 2: _plain(1, 1)}) == {0: 1, 1: 0, 2: 0}
    assert _lags({0: _plain(1, -1), 1: _plain(1, 1), 2: _plain(2, 1)}) == {0: 1, 1: 1, 2: 0}


def test_past_the_first_collective_the_numbers_are_the_counts() -> None:
    assert _lags({0: _plain(3, 3), 1: _plain(5, 4), 2: _plain(5, 5)}) == {0: 2, 1: 1, 2: 0}
    assert _lags({0: _p2p(9, 3, 2), 1: _p2p(20, 5, 4), 2: _p2p(12, 4, 4)}) == {0: 2, 1: 0, 2: 1}
