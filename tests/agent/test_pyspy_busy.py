"""py-spy's idle flag against /proc CPU time: a thread computing in Python is never "idle".

py-spy reads a thread's OS state at one instant; a thread that computes in
pure Python reads idle whenever it waits for the GIL another thread holds.
The agent checks each such thread's CPU time around the dump (collector.pyspy_stacks).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest
from hangwatch.agent import collector
from hangwatch.agent.procstate import thread_demand_ns
from helpers import wait_until

_JOB = """
import threading, time
def spin():
    x = 0
    while True:
        x = (x * 31 + 1) % 1000003
def nap():
    while True:
        time.sleep(3600)
threading.Thread(target=spin, name="spinner", daemon=True).start()
threading.Thread(target=nap, name="napper", daemon=True).start()
spin()
"""


@pytest.fixture
def busy_process() -> Iterator[int]:
    p = subprocess.Popen([sys.executable, "-c", _JOB])
    try:
        wait_until(lambda: len(thread_demand_ns(p.pid)) >= 3, timeout=20, what="3 threads")
        yield p.pid
    finally:
        p.kill()
        p.wait()


def _statuses(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        if line.startswith("Thread "):
            status = line.split("(", 1)[1].split(")", 1)[0]
            out[line.rsplit('"', 2)[-2]] = status
    return out


@pytest.mark.timeout(120)
def test_spinning_threads_never_read_idle_and_a_sleeping_one_does(busy_process: int) -> None:
    # Two threads share the GIL: py-spy alone calls one of them idle most dumps.
    for _ in range(8):
        st = _statuses(collector.pyspy_stacks("py-spy", busy_process, nonblocking=False))
        assert not st["MainThread"].startswith("idle"), st
        assert not st["spinner"].startswith("idle"), st
        assert st["napper"] == "idle", st


@pytest.mark.timeout(10)
def test_busy_threads_need_a_real_share_of_a_core() -> None:
    window = 0.2
    need = int(collector.BUSY_SHARE * window * 1e9)
    before = {1: 100, 2: 100, 3: 100}
    after = {1: 100 + need, 2: 100 + need - 1, 3: 100, 4: 10**12}
    # 4 started inside the window: no baseline, no claim.
    assert collector.busy_threads(before, after, window) == {1}
    text = 'Thread 1 (idle): "a"\nThread 2 (idle): "b"\nThread 3 (active): "c"\n'
    assert collector.mark_busy(text, {1, 3}) == (
        'Thread 1 (active+cpu): "a"\nThread 2 (idle): "b"\nThread 3 (active): "c"\n'
    )
