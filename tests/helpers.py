"""Small helpers shared by tests (importable as `helpers`, see conftest.py)."""

from __future__ import annotations

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


def skip_unless_backend(backend: str) -> None:
    """Skip, saying which feature this torch lacks, when `backend` cannot run here."""
    if backend == "gloo":
        return
    import pytest

    from hangwatch.testing import storebackend

    reason = storebackend.unsupported_reason()
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
