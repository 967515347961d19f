"""What the module split promised: the report carries the graph's roots and cycles, the
dashboard draws those, and the loader reports progress without drawing anything."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from fr_dumps import SimJob
from hangwatch.analyzer import analyze_path, load_dumps
from hangwatch.analyzer.graph import MAX_WAIT_EDGES, rank_terminals
from hangwatch.analyzer.render import LoadProgressBar
from hangwatch.analyzer.report import Report, WaitEdge
from hangwatch.server.web import waitgraph

pytestmark = pytest.mark.timeout(60)
GOLDEN = Path(__file__).resolve().parents[1] / "golden"


def test_report_carries_roots_and_cycles() -> None:
    two = analyze_path(GOLDEN / "two")
    assert (two.roots, two.cycles) == ([1, 3], [])
    order = analyze_path(GOLDEN / "order")  # a cross-group deadlock
    assert order.roots == [] and order.cycles == [[0, 1, 2, 3]]
    doc = json.loads(order.to_json())
    assert doc["roots"] == [] and doc["cycles"] == [[0, 1, 2, 3]]
    assert Report.from_json(order.to_json()).to_dict() == order.to_dict()


def test_old_json_without_roots_still_loads() -> None:
    doc = json.loads(analyze_path(GOLDEN / "skip").to_json())
    del doc["roots"], doc["cycles"]
    old = Report.from_json(json.dumps(doc))
    assert old.roots == [] and old.cycles == []
    # The drawing of such a report classifies its edges with the analyzer's graph code.
    assert waitgraph.build(old).roots == [1]


def test_dashboard_draws_the_reports_culprits_not_the_capped_edges(tmp_path: Path) -> None:
    # Ranks 0-598 and 600 wait in group 0 on 599; 599 waits in group 1 on 600:
    # a cross-group deadlock of 599 and 600. The capped edges hold only the
    # first 512 waits on 599, which on their own make 599 look like a root.
    world = 601
    job = SimJob(world)
    job.group("1", [599, 600])
    job.all("0")
    job.all("1", ranks=[599], done=False)
    job.all("0", ranks=[r for r in range(world) if r != 599], done=False)
    rep = analyze_path(job.write(tmp_path))
    assert rep.cycles == [[599, 600]] and rep.roots == []
    assert len(rep.waits_for) == MAX_WAIT_EDGES
    assert rank_terminals((e.waiter, e.waits_on) for e in rep.waits_for) == ([599], [])
    drawn = waitgraph.build(rep)
    assert drawn.roots == [] and drawn.cycle_ranks == [599]
    assert waitgraph.build(rep.waits_for).roots == [599]  # bare edges know no better


def test_explicit_culprits_win_over_the_edges() -> None:
    edges = [WaitEdge(waiter=0, waits_on=1, group="0", seq=1)]
    assert waitgraph.build(edges).roots == [1]
    assert waitgraph.build(edges, roots=[], cycles=[]).roots == []


@pytest.mark.parametrize("workers", [1, 2])
def test_load_reports_progress_and_draws_nothing(tmp_path: Path, workers: int) -> None:
    job = SimJob(4)
    job.all("0")
    job.write(tmp_path)
    calls: list[tuple[int, int]] = []
    loaded = load_dumps(tmp_path, workers=workers, on_progress=lambda d, t: calls.append((d, t)))
    assert loaded.ranks_loaded == [0, 1, 2, 3]
    assert calls[0] == (0, 4) and calls[-1] == (4, 4)
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)
    assert load_dumps(tmp_path, progress=True).ranks_loaded == [0, 1, 2, 3]  # old keyword


def test_progress_bar_closes_itself() -> None:
    bar = LoadProgressBar()
    bar(0, 0)
    assert not bar.showing  # nothing to show
    bar(0, 2)
    bar(1, 2)
    assert bar.showing
    bar(2, 2)
    assert not bar.showing


def test_the_library_imports_no_ui() -> None:
    code = (
        "import sys, hangwatch.analyzer.loader, hangwatch.analyzer.diagnose, "
        "hangwatch.analyzer.cli\n"
        "print(sorted(m for m in ('rich', 'fastapi', 'jinja2', 'uvicorn') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
