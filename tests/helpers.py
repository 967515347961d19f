"""Small helpers shared by tests (importable as `helpers`, see conftest.py)."""

from __future__ import annotations

import functools
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from hangwatch.testing.ports import free_port

REPO_ROOT = Path(__file__).resolve().parent.parent
GOLDEN_DIR = REPO_ROOT / "tests" / "golden"
# Real NCCL dumps live outside the repository and are never copied into it.
CONFORMANCE_DIR = REPO_ROOT.parent / "shared" / "conformance" / "nvrx"

__all__ = [
    "BACKENDS",
    "CONFORMANCE_DIR",
    "GOLDEN_DIR",
    "REPO_ROOT",
    "free_port",
    "skip_unless_backend",
    "wait_until",
]

# The live hang zoo runs on both: gloo records itself; hwstore is recorded by
# torch 2.15's FlightRecorderHook, as 2.15's default NCCL is.
BACKENDS = ("gloo", "hwstore")


@functools.cache
def _hooked_unsupported() -> str | None:
    # Probed in a child: importing torch here would cost seconds and leave
    # torch's import-time state (and its open files) in the test process.
    code = "from hangwatch.testing.storebackend import unsupported_reason as u\nprint(u() or '')"
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    if r.returncode != 0:
        return f"cannot probe torch: {r.stderr.strip()[-300:]}"
    return r.stdout.strip() or None


def skip_unless_backend(backend: str) -> None:
    """Skip, saying which feature this torch lacks, when `backend` cannot run here."""
    if backend == "gloo":
        return
    import pytest

    reason = _hooked_unsupported()
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
