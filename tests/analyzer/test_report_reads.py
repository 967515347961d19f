"""The terminal report reads right on real dumps: the hang zoo's gloo dumps
and the real 16-rank NCCL incident.

Bounded at 80 columns, no raw FR sentinel or torch placeholder reaching a
person, groups in numeric order, culprits told apart from their waiters.
"""

from __future__ import annotations

import dataclasses
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hangwatch.analyzer import analyze_path
from hangwatch.analyzer.render import FR_FRAME_LINES, STACK_EXCERPT_LINES, render
from hangwatch.analyzer.report import Report
from hangwatch.analyzer.text import finding_roles, group_sort_key
from helpers import CONFORMANCE_DIR, GOLDEN_DIR, conformance_incident, golden_report
from rich.console import Console

pytestmark = pytest.mark.timeout(120)

GOLDEN = sorted(p.name for p in GOLDEN_DIR.iterdir() if (p / "manifest.json").is_file())
GPU_ERROR = CONFORMANCE_DIR / "gpu_error_2nd"
# A "-1" standing alone (not the end of a range such as "0-1").
_SENTINEL = re.compile(r"(?<![\w-])-1\b")


def _nvrx() -> Report:
    return analyze_path(conformance_incident(GPU_ERROR.name))


def _text(report: Report, width: int = 80) -> str:
    out = io.StringIO()
    render(report, Console(file=out, width=width, color_system=None, legacy_windows=False))
    return out.getvalue()


def test_group_sort_key_is_numeric_then_names() -> None:
    names = ["108", "b", "2", "0", "33", "1", "a"]
    assert sorted(names, key=group_sort_key) == ["0", "1", "2", "33", "108", "a", "b"]


@pytest.mark.parametrize("name", GOLDEN)
def test_golden_reports_fit_80_columns_without_sentinels(name: str) -> None:
    report = golden_report(name)
    text = _text(report)
    assert max(len(line) for line in text.splitlines()) <= 80
    assert not _SENTINEL.search(text), text
    assert "undefined" not in text, text


def test_lagging_rows_are_bounded_at_80_columns() -> None:
    # Two ranks stuck in Python, each with a deep stack: before, each row
    # wrapped its stack excerpt over about 20 lines.
    report = golden_report("two")
    assert len(report.lagging_ranks) == 2
    assert all(report.evidence[r].stacks for r in report.lagging_ranks)
    text = _text(report)
    lines = text.splitlines()
    top = next(i for i, ln in enumerate(lines) if ln.strip() == "lagging ranks")
    end = next(i for i, ln in enumerate(lines) if i > top and ln.startswith("└"))
    body = [ln for ln in lines[top:end] if ln.startswith("│")]
    # One line per FR frame and stack frame, the '-- now' line, the 'outer frames' line.
    per_row = FR_FRAME_LINES + 1 + STACK_EXCERPT_LINES + 1
    assert len(body) <= per_row * len(report.lagging_ranks), "\n".join(lines[top:end])
    assert "…" in "\n".join(body)  # cut, not wrapped
    assert "full stacks in --html, or --json evidence.<rank>.stacks" in text


def test_real_nccl_report_reads_right() -> None:
    report = _nvrx()
    text = _text(report)
    assert max(len(line) for line in text.splitlines()) <= 80
    assert not _SENTINEL.search(text) and "none" in text  # group 0: nothing completed
    # JSON and tables: groups numeric (0, 1, 2, ..., 33, ..., 108).
    names = [g.group for g in report.groups]
    assert names == sorted(names, key=group_sort_key) and names[:3] == ["0", "1", "2"]
    # A last completed collective named from a peer's dump; where no dump holds it, said so.
    assert report.evidence[8].last_completed is not None
    assert report.evidence[8].last_completed.op == "all_to_all"
    assert report.evidence[9].last_completed is not None
    assert report.evidence[9].last_completed.op == ""
    assert "#44787 (op not in any dump)" in _text(report, width=200)
    # p2p: torch's group-local peers next to the global ranks.
    p2p = [f for f in report.findings if f.kind == "p2p-unmatched"]
    assert p2p and all(set(f.ranks) - set(report.lagging_ranks) for f in p2p)
    nine = next(f for f in p2p if 9 in f.ranks)
    assert "nccl:send 0->1 (group ranks; global 1->9) #13999 in group 42" in nine.detail
    assert "posted by rank 1" in nine.detail
    # The culprit and its waiter are told apart.
    assert finding_roles(nine.kind, nine.ranks, report.lagging_ranks) == [
        ("blamed", [9]),
        ("waiting", [1]),
    ]
    assert re.search(r"blamed 9\s.*\n.*waiting 1\s", text)


def test_findings_blaming_everyone_listed_stay_plain() -> None:
    assert finding_roles("not-entered", [9], [9, 14]) == [("", [9])]
    assert finding_roles("buffer-wrapped", [1, 2], []) == [("", [1, 2])]
    assert finding_roles("missing-dump", [3, 4], [4]) == [("blamed", [4]), ("not blamed", [3])]


def test_group_error_lists_groups_numerically(tmp_path: Path) -> None:
    if not GPU_ERROR.is_dir():
        pytest.skip(f"conformance dumps absent: {GPU_ERROR} not found")
    p = subprocess.run(
        [sys.executable, "-m", "hangwatch", "analyze", str(GPU_ERROR), "--group", "nope"],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert p.returncode == 2
    listed = p.stderr.split("groups: ", 1)[1].strip().split(", ")
    assert listed == sorted(listed, key=group_sort_key) and listed[:3] == ["0", "1", "2"]
    assert "108" in listed and listed.index("33") < listed.index("108")


@pytest.mark.parametrize("name", ["mismatch", "p2p", "subgroup"])
def test_report_dict_is_what_asdict_gives(name: str) -> None:
    """Report.to_dict skips asdict's deep copies of atoms; nothing else may differ."""
    report = golden_report(name)
    d = dataclasses.asdict(report)
    d["evidence"] = {str(k): v for k, v in sorted(d["evidence"].items())}
    assert json.dumps(report.to_dict()) == json.dumps({"schema": d.pop("schema"), **d})
