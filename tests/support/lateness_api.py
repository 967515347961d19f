"""Waiting on the coordinator's straggler view, for the live tests and benchmarks/straggler_live.py."""

from __future__ import annotations

import time
import urllib.error
from collections.abc import Callable
from typing import Any


def wait_scored(get: Callable[[str], Any], job_id: str, world: int, timeout: float) -> float:
    """The monotonic time when every rank of `job_id` first has lateness ticks:
    training has started and is being read. `get` fetches an API path as JSON."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            view = get(f"/api/jobs/{job_id}/stragglers")
        except urllib.error.HTTPError:
            view = {"ranks": []}
        if len(view["ranks"]) == world and all(r["ticks"] > 0 for r in view["ranks"]):
            return time.monotonic()
        time.sleep(0.5)
    raise AssertionError(f"no lateness for {job_id} within {timeout:.0f}s")
