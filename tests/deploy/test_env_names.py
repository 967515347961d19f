"""Env var names live once, in hangwatch/env.py: each is used, none is spelled inline."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from hangwatch import env

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_DIRS = ("hangwatch", "agent", "server", "analyzer")
ENV_MODULE = ROOT / "hangwatch" / "env.py"
ENV_NAMES = {k: v for k, v in vars(env).items() if k.isupper() and isinstance(v, str)}
_LOOKS_LIKE_OURS = re.compile(r"^HANGWATCH_[A-Z0-9_]+$")
_ENV_METHODS = {"get", "pop", "setdefault", "__getitem__", "__contains__"}


def _package_sources() -> list[Path]:
    out: list[Path] = []
    for d in PACKAGE_DIRS:
        for p in sorted((ROOT / d).rglob("*.py")):
            if "_proto" in p.parts or p == ENV_MODULE:
                continue
            out.append(p)
    return out


def _env_aliases(tree: ast.AST) -> tuple[set[str], set[str]]:
    """Names bound to the hangwatch.env module, and names imported from it."""
    modules: set[str] = set()
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.module == "hangwatch":
                modules |= {a.asname or a.name for a in node.names if a.name == "env"}
            elif node.module == "hangwatch.env":
                names |= {a.name for a in node.names}
        elif isinstance(node, ast.Import):
            modules |= {a.asname for a in node.names if a.name == "hangwatch.env" and a.asname}
    return modules, names


def _is_os_environ(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "environ"
        and isinstance(node.value, ast.Name)
        and node.value.id == "os"
    ) or (isinstance(node, ast.Name) and node.id == "environ")


def _docstring_nodes(tree: ast.AST) -> set[int]:
    ids: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                ids.add(id(body[0].value))
    return ids


@pytest.mark.timeout(30)
def test_every_env_constant_is_used() -> None:
    used: set[str] = set()
    for path in _package_sources():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        modules, names = _env_aliases(tree)
        used |= names
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in modules
            ):
                used.add(node.attr)
    unused = sorted(set(ENV_NAMES) - used)
    assert not unused, f"hangwatch/env.py names nothing uses: {unused}"


@pytest.mark.timeout(30)
def test_no_env_name_is_spelled_inline() -> None:
    problems: list[str] = []
    values = set(ENV_NAMES.values())
    for path in _package_sources():
        rel = path.relative_to(ROOT)
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        docstrings = _docstring_nodes(tree)
        for node in ast.walk(tree):
            # Any literal that *is* an env var name, wherever it is used.
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and id(node) not in docstrings
                and (node.value in values or _LOOKS_LIKE_OURS.match(node.value))
            ):
                problems.append(f"{rel}:{node.lineno}: literal {node.value!r}")
            # os.environ["X"] / environ["X"] with any literal key.
            if (
                isinstance(node, ast.Subscript)
                and _is_os_environ(node.value)
                and isinstance(node.slice, ast.Constant)
            ):
                problems.append(f"{rel}:{node.lineno}: os.environ[{node.slice.value!r}]")
            # os.environ.get("X"), os.getenv("X"), os.putenv("X", ...), ...
            if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
                f = node.func
                if (
                    isinstance(f, ast.Attribute)
                    and (
                        (_is_os_environ(f.value) and f.attr in _ENV_METHODS)
                        or (
                            isinstance(f.value, ast.Name)
                            and f.value.id == "os"
                            and f.attr in {"getenv", "putenv", "unsetenv"}
                        )
                    )
                ) or (isinstance(f, ast.Name) and f.id == "getenv"):
                    problems.append(
                        f"{rel}:{node.lineno}: env access with literal {node.args[0].value!r}"
                    )
    assert not problems, "use the constants in hangwatch/env.py:\n" + "\n".join(
        sorted(set(problems))
    )


@pytest.mark.timeout(10)
def test_env_module_names_equal_their_values() -> None:
    for k, v in ENV_NAMES.items():
        assert k == v, f"env.{k} = {v!r}: a constant's name must be its value"
