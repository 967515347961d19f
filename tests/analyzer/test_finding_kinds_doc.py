"""The verdicts and finding kinds are constants of the code, and
docs/operations.md lists exactly them (generated, like docs/configuration.md)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import get_args

import pytest
from hangwatch.analyzer import report
from helpers import module_output

ROOT = Path(__file__).resolve().parents[2]
BEGIN = "<!-- BEGIN verdicts and finding kinds"
END = "<!-- END verdicts and finding kinds -->"


def _doc_block() -> str:
    doc = (ROOT / "docs" / "operations.md").read_text(encoding="utf-8")
    start = doc.index(BEGIN)
    start = doc.index("\n", start) + 1
    return doc[start : doc.index(END, start)]


@pytest.mark.timeout(30)
def test_operations_doc_lists_exactly_the_generated_verdicts_and_kinds() -> None:
    out = module_output("hangwatch.analyzer.report")
    assert out == report.verdicts_markdown()
    assert _doc_block() == out, (
        "docs/operations.md is stale: paste `python -m hangwatch.analyzer.report` "
        f"between {BEGIN!r} and {END!r}"
    )


def test_every_verdict_has_a_meaning() -> None:
    assert list(report.VERDICTS) == list(get_args(report.Verdict))
    assert set(report.FINDING_KINDS) == set(report.FindingKind)
    assert all(report.VERDICTS.values()) and all(report.FINDING_KINDS.values())


def test_findings_are_made_from_the_constant_only() -> None:
    # No finding kind spelled as a string literal where findings are made.
    known = {k.value for k in report.FindingKind}
    for path in (ROOT / "analyzer").glob("*.py"):
        text = path.read_text(encoding="utf-8")
        for m in re.finditer(r'kind(?:, detail)?\s*=\s*"([a-z0-9-]+)"', text):
            assert m[1] in ("collective", "p2p", "stable"), f"{path.name}: kind {m[1]!r} literal"
        for lit in re.findall(r'"([a-z0-9]+(?:-[a-z0-9]+)+)"', text):
            if lit in known and path.name != "report.py":
                pytest.fail(f"{path.name} spells the finding kind {lit!r}: use FindingKind")


def test_emitted_kinds_are_known(tmp_path: Path) -> None:
    from hangwatch.analyzer import analyze_path

    golden = ROOT / "tests" / "golden"
    for d in sorted(p for p in golden.iterdir() if p.is_dir()):
        rep = analyze_path(d)
        assert rep.verdict in report.VERDICTS
        for f in rep.findings:
            assert f.kind in report.FINDING_KINDS, (d.name, f.kind)
        # The JSON form carries the plain string.
        assert all(isinstance(f["kind"], str) for f in rep.to_dict()["findings"])
        again = report.Report.from_json(rep.to_json())
        assert [f.kind for f in again.findings] == [f.kind for f in rep.findings]
