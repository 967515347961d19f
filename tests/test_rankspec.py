"""One rank formatter for the analyzer, the incident reasons and the dashboard."""

from __future__ import annotations

import pytest

from hangwatch.rankspec import format_ranks, spans


@pytest.mark.timeout(10)
def test_runs_collapse_in_each_readers_punctuation() -> None:
    ranks = [10, 9, 7, 3, 2, 1, 0, 0]
    assert spans(ranks) == [(0, 3), (7, 7), (9, 10)]
    assert format_ranks(ranks) == "0-3,7,9-10"  # incident reasons
    assert format_ranks(ranks, sep=", ") == "0-3, 7, 9-10"  # the dashboard
    assert format_ranks(ranks, pairs_as_ranges=False) == "0-3,7,9,10"  # the analyzer
    assert format_ranks([]) == "none"


@pytest.mark.timeout(10)
def test_long_lists_are_capped_and_say_what_was_left_out() -> None:
    evens = range(0, 100, 2)
    assert format_ranks(evens, sep=", ", limit=3) == "0, 2, 4 (+47 more)"
    assert format_ranks(evens, limit=3, more="total") == "0,2,4,... (50 ranks)"
    assert format_ranks(range(4096), limit=3) == "0-4095"
