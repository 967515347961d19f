"""The dependency rules of docs/ARCHITECTURE.md, checked on every import in the source.

Every `import` counts, at module level or inside a function: a lazy import is
still a dependency, only a later one. Rules:

* the analyzer is a library: it imports neither the coordinator nor the agent,
  and no UI (rich, fastapi, jinja2, uvicorn) outside its terminal renderer
  (`analyzer/render.py`) and its CLI (`analyzer/cli.py`);
* the core (`hangwatch/`) imports no role package (agent, server, analyzer),
  except in the command-line entry points and the demo, which wire them together;
* the agent imports neither the coordinator nor the analyzer;
* the coordinator never imports the agent;
* what runs inside a training rank or on its node (the hook and the core it
  uses, the agent) never imports pandas or numpy.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import REPO_ROOT, absolute_imports

ROLE = {"agent": "hangwatch.agent", "server": "hangwatch.server", "analyzer": "hangwatch.analyzer"}
UI = ("rich", "fastapi", "jinja2", "uvicorn", "starlette", "markupsafe")
DATAFRAME = ("pandas", "numpy")
# The core modules allowed to import role packages: they are where the roles meet.
ENTRY_POINTS = {"cli.py", "__main__.py", "demo.py"}
ANALYZER_UI = {"render.py", "cli.py"}


def _sources(folder: str) -> list[Path]:
    return sorted(
        p
        for p in (REPO_ROOT / folder).rglob("*.py")
        if "_proto" not in p.parts and "testing" not in p.parts
    )


def _hits(imports: set[str], prefixes: tuple[str, ...]) -> list[str]:
    return sorted(m for m in imports if any(m == p or m.startswith(p + ".") for p in prefixes))


def _violations(folder: str, banned: tuple[str, ...], skip: set[str] = frozenset()) -> list[str]:  # type: ignore[assignment]
    bad = []
    for path in _sources(folder):
        if path.name in skip:
            continue
        for m in _hits(absolute_imports(path), banned):
            bad.append(f"{path.relative_to(REPO_ROOT)} imports {m}")
    return bad


@pytest.mark.timeout(30)
def test_analyzer_is_a_library() -> None:
    banned = (ROLE["agent"], ROLE["server"], *UI)
    assert _violations("analyzer", banned, skip=ANALYZER_UI) == []
    assert _violations("analyzer", (ROLE["agent"], ROLE["server"])) == []


@pytest.mark.timeout(30)
def test_core_imports_no_role_package_outside_entry_points() -> None:
    assert _violations("hangwatch", tuple(ROLE.values()), skip=ENTRY_POINTS) == []


@pytest.mark.timeout(30)
def test_agent_and_coordinator_stay_apart() -> None:
    assert _violations("agent", (ROLE["server"], ROLE["analyzer"])) == []
    assert _violations("server", (ROLE["agent"],)) == []


@pytest.mark.timeout(30)
def test_nothing_on_a_training_node_imports_a_dataframe_stack() -> None:
    assert _violations("agent", DATAFRAME) == []
    core = [p.name for p in _sources("hangwatch")]
    assert "hook.py" in core and "recorders.py" in core
    assert _violations("hangwatch", DATAFRAME, skip=ENTRY_POINTS) == []


MAX_MODULE_LINES = 600


@pytest.mark.timeout(30)
def test_no_hand_written_module_is_over_600_lines() -> None:
    big = [
        f"{p.relative_to(REPO_ROOT)}: {n} lines"
        for folder in ("hangwatch", "agent", "server", "analyzer", "tests/support")
        for p in sorted((REPO_ROOT / folder).rglob("*.py"))
        if "_proto" not in p.parts
        and (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES
    ]
    assert big == []
