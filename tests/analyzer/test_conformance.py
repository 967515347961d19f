"""Real 16-rank NCCL Megatron incidents (nvidia-resiliency-ext test data).

Ground truth for both: ranks 9 and 14 were made faulty (GPU_ERROR, LOCK_GIL).
The analyzer must name exactly those: every faulty rank, never an innocent one.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hangwatch.analyzer import analyze_path, load_dumps

CONFORMANCE = Path(__file__).resolve().parents[2].parent / "shared" / "conformance" / "nvrx"

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(
        not CONFORMANCE.is_dir(), reason=f"conformance data not present at {CONFORMANCE}"
    ),
]


def _truth(incident: Path) -> set[int]:
    for line in (incident / "fault_injection.log").read_text().splitlines():
        if line.startswith("Fault ranks:"):
            return {int(x) for x in line.split(":", 1)[1].strip(" []").split(",")}
    raise AssertionError(f"no ground truth in {incident}")


@pytest.mark.parametrize("incident", ["gpu_error_2nd", "lock_gil_1st"])
def test_names_exactly_the_faulty_ranks(incident: str) -> None:
    d = CONFORMANCE / incident
    truth = _truth(d)
    assert truth == {9, 14}
    rep = analyze_path(d)
    assert rep.errors == []
    assert rep.ranks_loaded == list(range(16))
    assert rep.verdict == "hang"
    assert set(rep.lagging_ranks) == truth
    sc = rep.stalled_collective
    assert sc is not None
    assert set(sc.missing_ranks) <= truth and set(sc.missing_ranks)
    assert not set(sc.entered_ranks) & truth
    # No finding may blame an innocent rank as the culprit.
    culprit_kinds = {"not-entered", "stuck-outside-collective", "missing-dump", "frozen"}
    for f in rep.findings:
        if f.kind in culprit_kinds:
            assert set(f.ranks) <= truth, f


def test_lock_gil_ranks_are_stuck_outside_any_collective() -> None:
    rep = analyze_path(CONFORMANCE / "lock_gil_1st")
    stuck = {r for f in rep.findings if f.kind == "stuck-outside-collective" for r in f.ranks}
    assert stuck == {9, 14}


def test_pg_status_of_entry_less_ranks_is_mapped_by_creation_order() -> None:
    # In lock_gil_1st, ranks 9 and 14 dumped zero entries: only creation order
    # ties their pg_status to group names.
    loaded = load_dumps(CONFORMANCE / "lock_gil_1st", selected_ranks=[8, 9])
    assert len(loaded.entries[loaded.entries["rank"] == 9]) == 0
    st = loaded.pg_status[9]
    assert st["37"].mapped_by == "creation-order"
    assert st["37"].last_enqueued < loaded.pg_status[8]["37"].last_enqueued
    assert loaded.unmapped_pg_ids == {}
