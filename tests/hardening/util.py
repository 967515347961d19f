"""Shared helpers for the fault-injection tests (real coordinator, agents and gloo ranks)."""

from __future__ import annotations

import hashlib
import time
import urllib.error
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

from tests.support.chaos import CoordinatorProc, FaultUnavailable, TmpfsMount

T = TypeVar("T")


def wait_for(pred: Callable[[], T | None], timeout: float, what: str, every: float = 0.05) -> T:
    """Poll `pred` until it returns something truthy; returns that value."""
    end = time.monotonic() + timeout
    last_err: BaseException | None = None
    while time.monotonic() < end:
        try:
            v = pred()
        except (urllib.error.URLError, OSError, ValueError) as e:
            # The HTTP side may still be starting; keep the evidence.
            last_err, v = e, None
        if v:
            return v
        time.sleep(every)
    raise AssertionError(
        f"timed out after {timeout:.0f}s waiting for {what} (last error: {last_err})"
    )


def ranks_view(coord: CoordinatorProc, job: str) -> dict[int, dict[str, Any]]:
    """rank -> its row of /api/jobs/{job}/ranks ({} when the job is unknown)."""
    try:
        doc = coord.api(f"/api/jobs/{job}/ranks")
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return {}
        raise
    return {int(r["rank"]): r for r in doc["ranks"]}


def all_connected(coord: CoordinatorProc, job: str, ranks: list[int]) -> bool:
    view = ranks_view(coord, job)
    return all(r in view and view[r]["connected"] and view[r]["observed"] for r in ranks)


def finished_incidents(coord: CoordinatorProc, job: str) -> list[dict[str, Any]]:
    """The job's incidents that are analysed or failed, in detail form."""
    rows = coord.api(f"/api/incidents?job={job}")
    return [
        coord.api(f"/api/incidents/{r['id']}")
        for r in rows
        if r["status"] in ("analyzed", "failed")
    ]


def tmpfs(path: Path, size_bytes: int) -> TmpfsMount:
    """A tmpfs of its own over `path`, or the test skipped where none can be mounted."""
    try:
        return TmpfsMount(path, size_bytes).mount()
    except FaultUnavailable as e:
        pytest.skip(f"cannot mount a tmpfs here (needs root/CAP_SYS_ADMIN): {e}")


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return out


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def analyzer_worker(coordinator_pid: int) -> int | None:
    """The forkserver's child: the coordinator's one long-lived analyzer worker."""
    for c in _children(coordinator_pid):
        if "multiprocessing.forkserver" in _cmdline(c):
            workers = _children(c)
            return workers[0] if workers else None
    return None


def rank_files(bundle: Path) -> dict[str, str]:
    """Each file the agents uploaded into a bundle (its rank directories), by sha256."""
    return {
        str(p.relative_to(bundle)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(bundle.glob("rank_*/*"))
    }


def rank_2_named(coord: CoordinatorProc, iid: str, what: str) -> dict[str, Any]:
    """Wait for incident `iid` (of job "job": two protocol nodes, rank 2 never
    entered #5) to be analysed; check it names rank 2 with every rank dumped
    and is the job's only incident. Returns its detail."""
    row: dict[str, Any] = wait_for(
        lambda: (r := coord.api(f"/api/incidents/{iid}"))["status"] == "analyzed" and r,
        30,
        what,
    )
    assert (row["verdict"], row["lagging_ranks"]) == ("hang", [2]), row["summary"]
    assert row["ranks_dumped"] == [0, 1, 2, 3] and row["ranks_unreachable"] == {}
    assert [r["id"] for r in coord.api("/api/incidents?job=job")] == [iid]
    return row
