"""`kill -9` of the coordinator leaves no process of its own behind (its analyzer forkserver,
the analysis worker, multiprocessing's resource tracker)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import wait_until

from hangwatch.formats import ServerInfo


def _descendants(pid: int) -> set[int]:
    out: set[int] = set()
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/task/{p}/children", encoding="ascii") as f:
                kids = [int(x) for x in f.read().split()]
        except OSError:
            continue
        out.update(kids)
        todo.extend(kids)
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.timeout(60)
def test_kill_9_of_the_coordinator_takes_its_children_with_it(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "hangwatch", "server", "--grpc-port", "0", "--http-port", "0",
         "--data-dir", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_until(lambda: ServerInfo.read(tmp_path) is not None, timeout=30, what="server.json")
        # The analyzer's forkserver, its warmed worker and the resource tracker.
        wait_until(lambda: len(_descendants(proc.pid)) >= 3, timeout=30, what="the analyzer child")
        children = _descendants(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        wait_until(
            lambda: not any(_alive(p) for p in children), timeout=10, what="children to exit"
        )
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for p in _descendants(proc.pid):
            os.kill(p, signal.SIGKILL)
