"""The coordinator analyses untrusted bundles in a capped child process."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from hangwatch.server.incidents.analysis import IsolatedAnalyzer

REPO = Path(__file__).resolve().parents[2]
BOMB = REPO / "tests" / "fuzz_corpus" / "loader" / "oom-882e3bf657eaf90758f35506f1cf0829649088e1"
GOLDEN = REPO / "tests" / "golden" / "skip"


@pytest.mark.timeout(120)
def test_memory_bomb_in_a_bundle_is_a_per_file_error_and_the_analyzer_survives(
    tmp_path: Path,
) -> None:
    # A 2.7 KB pickle whose memo index makes CPython's unpickler allocate and
    # zero gigabytes: under the child's cap it must fail as one bad file.
    bundle = tmp_path / "incident"
    shutil.copytree(GOLDEN, bundle)
    shutil.copy(BOMB, bundle / "rank_3" / "fr_trace_rank_3")
    analyzer = IsolatedAnalyzer(memory_limit_bytes=2 << 30)
    try:
        report = analyzer(bundle, 4)
        bad = {e.file: e.error for e in report.errors}
        assert "rank_3/fr_trace_rank_3" in bad, report.errors
        assert "memory" in bad["rank_3/fr_trace_rank_3"]
        assert report.ranks_loaded == [0, 1, 2]
        # The same worker still answers: the bomb cost one file, not the process.
        again = analyzer(GOLDEN, 4)
        assert (again.verdict, again.lagging_ranks) == ("hang", [1])
    finally:
        analyzer.close()
