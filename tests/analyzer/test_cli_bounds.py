"""`hangwatch analyze` bounds its arguments: one line on stderr, exit 2, no
traceback, within a second, before anything is sized by them."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from hangwatch.analyzer.discovery import parse_ranks

from hangwatch import formats


def _cli(*args: str) -> tuple[subprocess.CompletedProcess[str], float]:
    t = time.monotonic()
    p = subprocess.run(
        [sys.executable, "-m", "hangwatch", "analyze", *args],
        capture_output=True,
        text=True,
        timeout=50,
    )
    return p, time.monotonic() - t


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--selected-ranks", "0-99999999999"], "over the maximum rank"),
        (["--selected-ranks", f"0-{formats.MAX_RANKS}"], "over the maximum rank"),
        (["--selected-ranks", "0-600000,600001-1048575,5-7"], "more than"),
        (["--selected-ranks", "1,x"], "not a rank number"),
        (["--selected-ranks", "-3"], "bad rank"),
        (["--world-size", "99999999999"], "over the maximum"),
        (["--world-size", str(formats.MAX_RANKS + 1)], "over the maximum"),
        (["--world-size", "abc"], "whole number"),
        (["--world-size", "0"], "positive"),
    ],
)
def test_bad_bounds_are_one_line_exit_2(tmp_path: Path, args: list[str], words: str) -> None:
    p, took = _cli(str(tmp_path), *args)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hangwatch analyze: "), p.stderr
    assert words in lines[0] and "Traceback" not in p.stderr
    assert took < 10  # the process start dominates; the check itself is instant


def test_nothing_loaded_is_exit_2(tmp_path: Path) -> None:
    p, _ = _cli(str(tmp_path), "--world-size", str(formats.MAX_RANKS))
    assert p.returncode == 2 and "no loadable" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


def test_parse_ranks_is_bounded_before_allocating() -> None:
    t = time.monotonic()
    with pytest.raises(ValueError, match="over the maximum rank"):
        parse_ranks("0-99999999999")
    with pytest.raises(ValueError, match="more than"):
        parse_ranks(",".join(["0-1048575"] * 2))
    assert time.monotonic() - t < 1.0
    assert parse_ranks(f"0-{formats.MAX_RANKS - 1}") == set(range(formats.MAX_RANKS))
    assert parse_ranks("0,3,5-7") == {0, 3, 5, 6, 7}
    with pytest.raises(ValueError):
        parse_ranks([formats.MAX_RANKS])
