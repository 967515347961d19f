"""Suite-wide setup shared by every test directory.

* `helpers.py` (next to this file) is importable as `helpers`: the suite runs
  with --import-mode=importlib, which puts no test directory on sys.path.
* Tests marked `torch` (real gloo ranks) are skipped, with the reason shown,
  only when torch cannot be imported at all. CI installs torch, so there they
  always run; a laptop without torch still runs everything else.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.pgserver import PgServer, require_postgres

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


def _torch_missing() -> str | None:
    # find_spec does not import torch (seconds of CPU); a broken install that
    # is found but fails to import makes the torch tests fail, not skip.
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed (pip install -e '.[test,torch]' brings torch==2.13.0)"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = _torch_missing()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "torch" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def pg() -> Iterator[PgServer]:
    """A real PostgreSQL server for this test process (tests/support/pgserver.py),
    started on first use and stopped at the end; `pg.new_database()` per test."""
    server = PgServer(require_postgres())
    try:
        yield server
    finally:
        server.close()
