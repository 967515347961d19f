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
  uses, the agent) never imports pandas or numpy;
* inside the coordinator, each folder imports only the folders below it
  (`SERVER_LAYERS`): live <- incidents <- integrations <- ingest, web; the
  process modules at `server/`'s top wire them together;
* a name is imported from the module that defines it: no module re-exports
  another's names, except a package's `__init__`.
"""

from __future__ import annotations

import ast
import warnings
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


# What each folder of the coordinator may import from the rest of `server/`
# (docs/ARCHITECTURE.md's folder map). `integrations.metrics` is the counters
# registry every part bumps: a leaf, importable from anywhere below the top.
SERVER_LAYERS: dict[str, tuple[str, ...]] = {
    "live": (),
    # `workers`: the thread-ownership primitive every layer's threads are declared with.
    "incidents": ("live", "integrations.metrics", "workers"),
    "integrations": ("live", "incidents", "workers"),
    "ingest": ("live", "incidents", "integrations"),
    "web": ("live", "incidents", "integrations", "app_state"),
}


@pytest.mark.timeout(30)
def test_each_server_folder_imports_only_the_layers_below_it() -> None:
    prefix = ROLE["server"] + "."
    bad = []
    for folder, allowed in SERVER_LAYERS.items():
        own = prefix + folder
        ok = (own, *(prefix + a for a in allowed))
        for path in _sources(f"server/{folder}"):
            for m in _hits(absolute_imports(path), (ROLE["server"],)):
                if m == ROLE["server"] or any(m == o or m.startswith(o + ".") for o in ok):
                    continue
                # `from hangwatch.server.live import registry` names the module too.
                bad.append(f"{path.relative_to(REPO_ROOT)} imports {m}")
    assert bad == []


def _top_level_definitions(path: Path) -> tuple[set[str], set[str]]:
    """(names a module defines, names it imports as modules) at top level."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    defined: set[str] = set()
    module_aliases: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            defined.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            defined.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, ast.Import):
            module_aliases.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                if _module_path(f"{node.module}.{a.name}") is not None:
                    module_aliases.add(a.asname or a.name)
    return defined, module_aliases


def _module_path(module: str) -> Path | None:
    parts = module.split(".")
    if parts[0] != "hangwatch":
        return None
    roots = {"agent": "agent", "server": "server", "analyzer": "analyzer"}
    if len(parts) > 1 and parts[1] in roots:
        base = (
            REPO_ROOT / roots[parts[1]] / Path(*parts[2:])
            if parts[2:]
            else REPO_ROOT / roots[parts[1]]
        )
    else:
        base = REPO_ROOT / "hangwatch" / Path(*parts[1:]) if parts[1:] else REPO_ROOT / "hangwatch"
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    return None


@pytest.mark.timeout(60)
def test_every_name_is_imported_from_the_module_that_defines_it() -> None:
    """One home per name: `from M import n` needs n defined in M (a package's
    `__init__` may gather names; a module imported as a module counts)."""
    everything = [
        p
        for folder in ("hangwatch", "agent", "server", "analyzer", "tests", "benchmarks")
        for p in sorted((REPO_ROOT / folder).rglob("*.py"))
        if "_proto" not in p.parts
    ]
    homes: dict[Path, tuple[set[str], set[str]]] = {}
    bad = []
    for path in everything:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not (isinstance(node, ast.ImportFrom) and node.module and not node.level):
                continue
            home = _module_path(node.module)
            if home is None or home.name == "__init__.py":
                continue
            if home not in homes:
                homes[home] = _top_level_definitions(home)
            defined, modules = homes[home]
            for a in node.names:
                if a.name not in defined and a.name not in modules:
                    bad.append(f"{path.relative_to(REPO_ROOT)}: {a.name} from {node.module}")
    assert bad == []


# A module is as long as its concept needs: past WARN_MODULE_LINES the suite
# says so (a split along a concept may be due), past MAX_MODULE_LINES it fails.
WARN_MODULE_LINES = 600
MAX_MODULE_LINES = 800


def _module_lengths() -> list[tuple[str, int]]:
    return [
        (str(p.relative_to(REPO_ROOT)), n)
        for folder in ("hangwatch", "agent", "server", "analyzer", "tests/support")
        for p in sorted((REPO_ROOT / folder).rglob("*.py"))
        if "_proto" not in p.parts
        and (n := len(p.read_text(encoding="utf-8").splitlines())) > WARN_MODULE_LINES
    ]


@pytest.mark.timeout(30)
def test_no_hand_written_module_is_over_800_lines() -> None:
    long = _module_lengths()
    for path, n in long:
        if n <= MAX_MODULE_LINES:
            warnings.warn(f"{path}: {n} lines (over {WARN_MODULE_LINES})", stacklevel=1)
    assert [f"{path}: {n} lines" for path, n in long if n > MAX_MODULE_LINES] == []
