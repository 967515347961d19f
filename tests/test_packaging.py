"""The distribution's shape: stubs current, packages listed, torch not a core dependency,
test support (tests/support) not shipped."""

from __future__ import annotations

import filecmp
import importlib
import tomllib
from pathlib import Path

import pytest
from helpers import absolute_imports

ROOT = Path(__file__).resolve().parent.parent
# Fault injectors, simulated agents and the golden generator: tests/support/, never shipped.
TEST_ONLY = ("chaos", "simagents", "make_golden")


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


def _shipped_sources() -> list[Path]:
    mapping = _pyproject()["tool"]["setuptools"]["package-dir"]
    return sorted(
        p for src in mapping.values() for p in (ROOT / src).rglob("*.py") if "_proto" not in p.parts
    )


def test_test_support_is_not_in_the_distribution() -> None:
    # tests/support is a package (tests and benchmarks import tests.support...),
    # but not one of the distribution's: nothing under tests/ is listed or mapped.
    tool = _pyproject()["tool"]["setuptools"]
    assert (ROOT / "tests" / "support" / "__init__.py").is_file()
    assert not [p for p in tool["packages"] if p.split(".")[0] == "tests"], tool["packages"]
    assert not [s for s in tool["package-dir"].values() if Path(s).parts[0] == "tests"]
    shipped = _shipped_sources()
    for name in TEST_ONLY:
        strays = [p for p in shipped if p.stem == name or name in p.parts]
        assert not strays, f"test-only {name} is back in a shipped package: {strays}"
    for path in shipped:
        for mod in absolute_imports(path):
            rel = path.relative_to(ROOT)
            # Shipped code must not need the test support: the wheel lacks it.
            assert mod.split(".")[0] != "tests", f"{rel} imports {mod}"
            # What it takes from the hang zoo (the demo) ships with it.
            parts = mod.split(".")
            if parts[:2] == ["hangwatch", "testing"] and len(parts) > 2:
                assert parts[2] not in TEST_ONLY, f"{rel} imports {mod}"
                assert (ROOT / "hangwatch" / "testing" / f"{parts[2]}.py").is_file(), (
                    f"{rel} imports {mod}"
                )
