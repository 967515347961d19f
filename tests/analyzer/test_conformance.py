"""Real 16-rank NCCL Megatron incidents (nvidia-resiliency-ext test data,
tests/attribution/unit/fr_traces).

Ground truth is each incident's fault_injection.log: two ranks were made faulty
(GPU_ERROR or LOCK_GIL). The analyzer must name exactly those: every faulty rank,
never an innocent one. All four are pipeline-parallel jobs (send/recv between
stages, dozens of groups); gpu_error_1st and lock_gil_2nd are the ones where a
stage's collectives sit queued behind its own pending p2p work (stream order).
"""

from __future__ import annotations

import pytest
from hangwatch.analyzer import analyze_path, load_dumps
from helpers import CONFORMANCE_DIR as CONFORMANCE
from helpers import CULPRIT_KINDS
from helpers import conformance_incident as _incident
from helpers import fault_ranks as _truth

INCIDENTS = ["gpu_error_1st", "gpu_error_2nd", "lock_gil_1st", "lock_gil_2nd"]

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(
        not CONFORMANCE.is_dir(), reason=f"conformance data not present at {CONFORMANCE}"
    ),
]


@pytest.mark.parametrize("incident", INCIDENTS)
def test_names_exactly_the_faulty_ranks(incident: str) -> None:
    d = _incident(incident)
    truth = _truth(d)
    assert len(truth) == 2
    rep = analyze_path(d)
    assert rep.errors == []
    assert rep.ranks_loaded == list(range(16))
    assert rep.verdict == "hang"
    assert set(rep.lagging_ranks) == truth
    assert set(rep.roots) == truth and rep.cycles == []
    sc = rep.stalled_collective
    assert sc is not None
    assert set(sc.missing_ranks) <= truth and set(sc.missing_ranks)
    # No finding may blame an innocent rank as the culprit.
    for f in rep.findings:
        if f.kind in CULPRIT_KINDS:
            assert set(f.ranks) <= truth, f
    assert {r for f in rep.findings if f.kind in CULPRIT_KINDS for r in f.ranks} == truth


@pytest.mark.parametrize("incident", ["gpu_error_2nd", "lock_gil_1st"])
def test_the_faulty_ranks_never_entered_the_stalled_collective(incident: str) -> None:
    rep = analyze_path(_incident(incident))
    sc = rep.stalled_collective
    assert sc is not None and not set(sc.entered_ranks) & _truth(CONFORMANCE / incident)


def test_a_gpu_stuck_inside_an_op_is_found_through_the_work_queued_behind_it() -> None:
    # gpu_error_1st: rank 14 entered everything its peers wait on; its oldest op
    # (an all_gather its tensor-parallel peer finished) never finishes.
    rep = analyze_path(_incident("gpu_error_1st"))
    f = next(f for f in rep.findings if f.ranks == [14])
    assert f.kind == "stuck-inside-op" and "#42806 in group 42" in f.detail


def test_lock_gil_ranks_are_stuck_outside_any_collective() -> None:
    rep = analyze_path(_incident("lock_gil_1st"))
    stuck = {r for f in rep.findings if f.kind == "stuck-outside-collective" for r in f.ranks}
    assert stuck == {9, 14}


def test_pg_status_of_entry_less_ranks_is_mapped_by_creation_order() -> None:
    # In lock_gil_1st, ranks 9 and 14 dumped zero entries: only creation order
    # ties their pg_status to group names.
    loaded = load_dumps(_incident("lock_gil_1st"), selected_ranks=[8, 9])
    assert len(loaded.entries[loaded.entries["rank"] == 9]) == 0
    st = loaded.pg_status[9]
    assert st["37"].mapped_by == "creation-order"
    assert st["37"].last_enqueued < loaded.pg_status[8]["37"].last_enqueued
    assert loaded.unmapped_pg_ids == {}
