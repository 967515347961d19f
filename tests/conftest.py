"""Suite-wide setup shared by every test directory.

* `helpers.py` (next to this file) is importable as `helpers`: the suite runs
  with --import-mode=importlib, which puts no test directory on sys.path.
* Tests marked `torch` (real gloo ranks) are skipped, with the reason shown,
  only when torch cannot be imported at all. CI installs torch, so there they
  always run; a laptop without torch still runs everything else.
"""

from __future__ import annotations

import importlib.util
import os
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


# Under pytest-xdist (`-n 2`, the README's command) the suite is two groups,
# one per worker. Realtime tests run real jobs against real deadlines (stall
# timeouts of 1-5 s, steps timed on the wall clock): they run one at a time on
# one worker, as in a plain run. The rest run on the other worker at a lower
# CPU priority, so that on a 2-core machine they take only the CPU the realtime
# tests leave idle (a plain run uses 0.75 of one core on average) and never
# starve a rank or a coordinator racing its deadline: nice 10 weighs 110
# against 1024 in the kernel's fair scheduler, about a tenth of a contended core.
_REALTIME_DIRS = ("live", "hardening", "scale", "deploy")
REALTIME_GROUP = "realtime"
LIGHT_GROUP = "light"
LIGHT_NICENESS = 10


def _realtime(item: pytest.Item) -> bool:
    # `realtime`: a test outside those folders that races a real clock (a
    # database server stopped and started again, a process killed mid-write).
    if "torch" in item.keywords or "browser" in item.keywords or "realtime" in item.keywords:
        return True
    parts = Path(str(item.path)).resolve().relative_to(_HERE).parts
    return len(parts) > 1 and parts[0] in _REALTIME_DIRS


def pytest_runtest_setup(item: pytest.Item) -> None:
    # Once per worker process: the light group's worker never runs a realtime
    # test, so its priority is lowered once and never raised again.
    marker = item.get_closest_marker("xdist_group")
    if marker is None:
        return
    if marker.args[0] == LIGHT_GROUP and os.getpriority(os.PRIO_PROCESS, 0) < LIGHT_NICENESS:
        os.setpriority(os.PRIO_PROCESS, 0, LIGHT_NICENESS)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if getattr(config.option, "numprocesses", None):
        for item in items:
            group = REALTIME_GROUP if _realtime(item) else LIGHT_GROUP
            item.add_marker(pytest.mark.xdist_group(group))
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
