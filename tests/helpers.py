"""Small helpers shared by tests (importable as `helpers`, see conftest.py)."""

from __future__ import annotations

import ast
import functools
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hangwatch.testing.backends import BACKENDS as TEST_BACKENDS
from hangwatch.testing.ports import free_port

REPO_ROOT = Path(__file__).resolve().parent.parent
GOLDEN_DIR = REPO_ROOT / "tests" / "golden"
# Real NCCL dumps live outside the repository and are never copied into it.
CONFORMANCE_DIR = REPO_ROOT.parent / "shared" / "conformance" / "nvrx"

__all__ = [
    "BACKENDS",
    "CONFORMANCE_DIR",
    "CULPRIT_KINDS",
    "GOLDEN_DIR",
    "REPO_ROOT",
    "absolute_imports",
    "conformance_incident",
    "fault_ranks",
    "free_port",
    "golden_report",
    "module_output",
    "observed_verdict",
    "skip_unless_backend",
    "wait_until",
]

# Finding kinds that name a rank as the cause of a hang (the others describe it).
CULPRIT_KINDS = frozenset(
    {
        "not-entered",
        "stuck-outside-collective",
        "stuck-inside-op",
        "missing-dump",
        "frozen",
        "cross-group-deadlock",
        "late-arrival",
    }
)

# The live hang zoo runs on each: gloo records itself; hwstore and hwhooks are
# recorded by torch 2.15's FlightRecorderHook, hwhooks with NCCL2's hooks.
BACKENDS = TEST_BACKENDS
# Every scenario of the hang zoo runs live once per backend, in one place: these
# through the whole system (tests/live/test_e2e.py: coordinator, agent, ranks,
# then the analyzer on the collected bundle); the rest in tests/test_zoo_offline.py
# (ranks that snapshot their own FR, then the analyzer). Each launch costs four
# torch imports, so no scenario is launched twice.
E2E_SCENARIOS = ("skip", "compute", "frozen", "two", "mismatch", "subgroup", "order", "gil")


@functools.cache
def _backend_unsupported(backend: str) -> str | None:
    # Probed (and hwhooks built) in a child: importing torch here would cost
    # seconds and leave torch's import-time state (and its open files) in the
    # test process. A failed build fails the test; only a missing feature skips.
    code = (
        "import sys\n"
        "from hangwatch.testing import backends\n"
        f"why = backends.unsupported_reason({backend!r})\n"
        "print(why or '')\n"
        "if why is None:\n"
        f"    backends.register({backend!r})\n"
    )
    # Building hwhooks takes about 40 s on 2 idle cores; a loaded CI machine, more.
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=False
    )
    if r.returncode != 0:
        raise AssertionError(f"cannot ready backend {backend}: {r.stderr.strip()[-2000:]}")
    return r.stdout.strip().splitlines()[0] if r.stdout.strip() else None


def skip_unless_backend(backend: str) -> None:
    """Skip, saying which feature this torch lacks, when `backend` cannot run here."""
    if backend == "gloo":
        return
    import pytest

    reason = _backend_unsupported(backend)
    if reason is not None:
        pytest.skip(f"{backend}: {reason}")


def wait_until(
    done: Callable[[], bool], *, timeout: float, what: str, interval: float = 0.05
) -> None:
    """Poll `done` until it is true; fail with `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def absolute_imports(path: Path) -> set[str]:
    """Every module a source file imports, at module level or inside functions:
    `from a import b` counts as both `a` and `a.b` (b may be a subpackage)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def observed_verdict(report: Any) -> dict[str, Any]:
    """What a scenario's ground truth (`Scenario.expected`) says about a Report."""
    sc = report.stalled_collective
    return {
        "verdict": report.verdict,
        "lagging_ranks": sorted(report.lagging_ranks),
        "stalled": {"group": sc.group, "seq": sc.seq, "op": sc.op} if sc else None,
    }


def module_output(module: str) -> str:
    """What `python -m MODULE` prints, from the repository root: the generator
    behind a generated doc (the doc tests compare the file with this)."""
    return subprocess.run(
        [sys.executable, "-m", module],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=25,
    ).stdout


def golden_report(name: str) -> Any:
    """The analyzer's report on golden set `name`, at the world size its manifest gives."""
    from hangwatch.analyzer import analyze_path

    world = json.loads((GOLDEN_DIR / name / "manifest.json").read_text())["world_size"]
    return analyze_path(GOLDEN_DIR / name, world_size=world)


def conformance_incident(name: str) -> Path:
    """The real NCCL incident `name`, or a skip naming where it comes from."""
    import pytest

    d = CONFORMANCE_DIR / name
    if not d.is_dir():
        pytest.skip(
            f"incident {name} not present at {d} (nvidia-resiliency-ext "
            f"tests/attribution/unit/fr_traces/{name})"
        )
    return d


def fault_ranks(incident: Path) -> set[int]:
    """The ground truth of a conformance incident: its fault_injection.log's ranks."""
    for line in (incident / "fault_injection.log").read_text().splitlines():
        if line.startswith("Fault ranks:"):
            return {int(x) for x in line.split(":", 1)[1].strip(" []").split(",")}
    raise AssertionError(f"no ground truth in {incident}")
