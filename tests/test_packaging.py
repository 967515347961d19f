"""The distribution's shape: stubs current, packages listed, torch not a core dependency."""

from __future__ import annotations

import filecmp
import importlib
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


@pytest.mark.timeout(60)
def test_generated_stubs_are_current(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools", reason="grpcio-tools is in the test extra")
    from hangwatch.protogen import generate

    generate(tmp_path)
    committed = ROOT / "hangwatch" / "_proto"
    for fresh in tmp_path.rglob("*.py*"):
        rel = fresh.relative_to(tmp_path)
        old = committed / rel
        assert old.exists(), f"{rel} is not committed; run python -m hangwatch.protogen"
        assert filecmp.cmp(fresh, old, shallow=False), (
            f"{rel} is stale; run python -m hangwatch.protogen and commit"
        )


def test_torch_is_not_a_core_dependency() -> None:
    project = _pyproject()["project"]
    assert not any(
        d.split("=")[0].split(">")[0].strip() == "torch" for d in project["dependencies"]
    )
    extras = project["optional-dependencies"]
    # The test tools never pull torch in (a user's torch 2.15 survives them);
    # the pinned test torch is its own extra.
    assert not any(d.startswith("torch") for d in extras["test"]), extras["test"]
    assert extras["torch"] == ["torch==2.13.0"]


def test_every_package_directory_is_listed() -> None:
    tool = _pyproject()["tool"]["setuptools"]
    listed = set(tool["packages"])
    mapping = tool["package-dir"]
    found = set()
    for pkg, src in mapping.items():
        for init in (ROOT / src).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / src)
            parts = [] if str(rel) == "." else list(rel.parts)
            if "__pycache__" in parts:
                continue
            found.add(".".join([pkg, *parts]))
    missing = sorted(found - listed)
    assert not missing, f"add to [tool.setuptools] packages: {missing}"
    for pkg in listed:
        importlib.import_module(pkg)
