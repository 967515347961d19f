"""`hangwatch analyze` as a user runs it: a real subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from fr_dumps import SimJob

pytestmark = pytest.mark.timeout(60)


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hangwatch", "analyze", *args],
        capture_output=True,
        text=True,
        timeout=50,
    )


@pytest.fixture
def hang_dir(tmp_path: Path) -> Path:
    job = SimJob(4)
    job.all("0")
    job.all("0", ranks=[0, 1, 2], done=False)
    return job.write(tmp_path / "dumps")


def test_json_is_the_report_and_nothing_else(hang_dir: Path) -> None:
    p = run_cli(str(hang_dir), "--json")
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["schema"] == "hangwatch.report/1"
    for key in (
        "verdict",
        "summary",
        "stalled_collective",
        "lagging_ranks",
        "findings",
        "ranks_loaded",
        "ranks_missing",
        "errors",
        "groups",
        "waits_for",
        "evidence",
    ):
        assert key in doc
    assert doc["verdict"] == "hang" and doc["lagging_ranks"] == [3]
    assert doc["stalled_collective"]["seq"] == 2


def test_terminal_report_leads_with_the_verdict(hang_dir: Path) -> None:
    p = run_cli(str(hang_dir), "--world-size", "4", "--selected-ranks", "0-3", "--group", "0")
    assert p.returncode == 0, p.stderr
    first = p.stdout.strip().splitlines()[0]
    assert first.startswith("[hang] Rank 3 never entered all_reduce #2")
    assert "lagging ranks" in p.stdout and "stalled collective" in p.stdout


def test_the_verdict_line_wraps_as_one_block_when_piped(hang_dir: Path) -> None:
    """Piped, the console is 80 columns wide: the verdict line wraps at whole
    words with its continuation indented under the summary, so it reads as one
    block, and joined back it is the summary exactly."""
    doc = json.loads(run_cli(str(hang_dir), "--json").stdout)
    p = run_cli(str(hang_dir))
    assert p.returncode == 0, p.stderr
    tag = f"[{doc['verdict']}] "
    assert len(tag + doc["summary"]) > 80, doc["summary"]  # long enough to wrap
    lines = p.stdout.splitlines()
    n = next(i for i, ln in enumerate(lines[1:], 1) if not ln.startswith(" " * len(tag)))
    block = lines[:n]
    assert len(block) >= 2 and all(len(ln) <= 80 for ln in block), block
    assert block[0].startswith(tag)
    joined = " ".join([block[0][len(tag) :], *(ln.strip() for ln in block[1:])])
    assert joined == doc["summary"]


def test_missing_dir_exits_2_with_one_line(tmp_path: Path) -> None:
    p = run_cli(str(tmp_path / "nope"))
    assert p.returncode == 2
    assert p.stdout == ""
    assert p.stderr.count("\n") == 1 and "no such file or directory" in p.stderr
    assert "Traceback" not in p.stderr


def test_dir_without_dumps_exits_2(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    (tmp_path / "junk_3").write_bytes(b"\x00garbage")
    p = run_cli(str(tmp_path))
    assert p.returncode == 2
    assert p.stderr.count("\n") == 1 and "no loadable flight-recorder dumps" in p.stderr
    assert "junk_3" in p.stderr and "Traceback" not in p.stderr


def test_unknown_group_exits_2(hang_dir: Path) -> None:
    p = run_cli(str(hang_dir), "--group", "42")
    assert p.returncode == 2 and "no group named '42'" in p.stderr
