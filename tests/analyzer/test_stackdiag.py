"""The stack diagnosis on stacks captured from real processes in known states.

`tests/analyzer/stacks/` is written by `python -m tests.support.make_stack_fixtures
tests/analyzer/stacks` (py-spy --locals of real processes, cut down the way the
agent cuts it); `tests/golden/p2p` holds torch's own dump_traceback text. What
each process was doing is the generator's plan, not the classifier's output.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hangwatch.analyzer import load_dumps
from hangwatch.analyzer.diagnose import analyze
from hangwatch.analyzer.report import Report, StackState
from hangwatch.analyzer.stackdiag import PREFIX, classify, diagnose_stacks

from hangwatch import formats
from hangwatch.formats import RankMeta

HERE = Path(__file__).resolve().parent
STACKS = HERE / "stacks"
GOLDEN_P2P = HERE.parent / "golden" / "p2p"


def _peer_meta(case: str, **extra: Any) -> RankMeta:
    return RankMeta(rank=0, peer_stacks=(STACKS / f"{case}.txt").read_text(), **extra)


@pytest.mark.parametrize(
    "case,state",
    [
        ("sleeping", StackState.SLEEPING),
        ("event", StackState.SLEEPING),
        ("compute", StackState.COMPUTE),
        ("data-loader", StackState.DATA_LOADER),
        ("p2p-rank0", StackState.P2P),
        # Waiting on inductor's cache lock while another process compiles.
        ("compile-lock", StackState.COMPILE),
        # Compiled code running (dynamo's eval_frame on the stack), asleep: not a compile.
        ("compiled-run", StackState.SLEEPING),
    ],
)
def test_each_real_state_is_classified(case: str, state: StackState) -> None:
    assert classify(0, _peer_meta(case)).state == state


def test_a_collective_made_while_compiling_is_a_collective() -> None:
    """dynamo can run collectives while it compiles (compiler collectives): a rank
    blocked in one is blocked in communication, whatever called it."""
    text = (STACKS / "compile-lock.txt").read_text()
    inner = "    all_reduce (torch/distributed/distributed_c10d.py:2950)\n"
    head, _, rest = text.partition("\n")
    meta = RankMeta(rank=0, peer_stacks=f"{head}\n{inner}{rest}")
    assert classify(0, meta).state == StackState.COLLECTIVE


def test_the_peer_comes_from_the_recv_s_src_argument() -> None:
    peers = {r: classify(r, _peer_meta(f"p2p-rank{r}")).peer for r in range(4)}
    assert peers == {0: 1, 1: 0, 2: 0, 3: 1}
    row = classify(0, _peer_meta("p2p-rank0"))
    assert row.detail == "recv from rank 1 (distributed_c10d.py:2799)"
    assert row.frames[0] == "recv (distributed_c10d.py:2799)"


def test_a_p2p_deadlock_names_its_cycle_and_the_rest_wait_on_it() -> None:
    diag = diagnose_stacks({r: _peer_meta(f"p2p-rank{r}") for r in range(4)})
    assert diag is not None
    assert (diag.odd_ranks, diag.cycles) == ([0, 1], [[0, 1]])
    assert diag.summary == (
        PREFIX + "ranks 0,1 deadlock in p2p (0 recv from rank 1, 1 recv from rank 0); "
        "ranks 2,3 wait on them."
    )


def test_a_stalled_pipeline_stage_is_the_one_its_neighbours_wait_on() -> None:
    # Stages 0 and 2 blocked in recv from 1 (real recv stacks whose src is 1); 1 sleeps.
    metas = {0: _peer_meta("p2p-rank3"), 1: _peer_meta("sleeping"), 2: _peer_meta("p2p-rank3")}
    diag = diagnose_stacks(metas)
    assert diag is not None and (diag.odd_ranks, diag.cycles) == ([1], [])
    assert diag.summary.startswith(PREFIX + "rank 1 is idle (sleeping")
    assert diag.summary.endswith("; ranks 0,2 wait on them.")


def test_without_peers_the_ranks_not_blocked_are_the_odd_ones_out() -> None:
    golden = (GOLDEN_P2P / "rank_2" / "stacks.txt").read_text()  # dump_traceback: no arguments
    metas = {
        0: RankMeta(rank=0, stacks=golden),
        1: _peer_meta("data-loader"),
        2: RankMeta(rank=2, stacks=golden),
    }
    diag = diagnose_stacks(metas)
    assert diag is not None and diag.odd_ranks == [1]
    assert classify(0, metas[0]).peer is None


def test_a_gil_holder_is_named_from_the_agent_s_note() -> None:
    # What the agent writes when the rank's Python handlers stop answering.
    note = {"stacks": "Python handlers not answering (GIL held?): used py-spy"}
    row = classify(3, _peer_meta("sleeping", errors=note))
    assert row.state == StackState.GIL_HELD
    assert classify(3, RankMeta(rank=3, errors=note)).state == StackState.GIL_HELD


def test_nobody_is_blamed_when_every_rank_is_blocked_and_no_peer_is_known() -> None:
    report = analyze(load_dumps(GOLDEN_P2P))
    assert (report.verdict, report.basis, report.lagging_ranks) == ("no-culprit-visible", "fr", [])
    assert report.stack_diagnosis is not None and report.stack_diagnosis.odd_ranks == []
    assert "which ranks form it cannot be told" in report.summary


def test_offline_analyze_of_a_bundle_with_peer_stacks_says_it_is_from_the_stacks(
    tmp_path: Path,
) -> None:
    import json
    import shutil

    bundle = tmp_path / "bundle"
    shutil.copytree(GOLDEN_P2P, bundle)
    for r in range(4):
        meta_path = bundle / f"rank_{r}" / formats.META_FILE
        meta = json.loads(meta_path.read_text())
        meta[formats.PEER_STACKS_KEY] = (STACKS / f"p2p-rank{r}.txt").read_text()
        meta_path.write_text(json.dumps(meta))
    report = analyze(load_dumps(bundle))
    assert (report.verdict, report.basis, report.lagging_ranks) == ("hang", "stacks", [0, 1])
    assert report.summary.startswith(PREFIX)
    assert [f.kind for f in report.findings][:1] == ["p2p-deadlock"]
    again = Report.from_json(report.to_json())
    assert again.basis == "stacks" and again.stack_diagnosis == report.stack_diagnosis
