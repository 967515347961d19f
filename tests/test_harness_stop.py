"""The test harness's stop: a child still there at SIGKILL leaves its stacks in its log."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.chaos import _ChildProc

_DEAF = """
import signal, threading
signal.signal(signal.SIGTERM, signal.SIG_IGN)

def stuck_in_its_stop():
    threading.Event().wait()

print("ready", flush=True)
stuck_in_its_stop()
"""


class _Deaf(_ChildProc):
    what = "deaf child"

    def __init__(self, log_path: Path) -> None:
        self.log_path = log_path
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _DEAF], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
        )
        assert self.proc.stdout is not None
        with self.proc.stdout:
            assert self.proc.stdout.readline().strip() == b"ready"


@pytest.mark.timeout(60)
def test_a_child_that_outlives_its_sigterm_grace_leaves_its_stacks(tmp_path: Path) -> None:
    child = _Deaf(tmp_path / "deaf.log")
    assert child.stop(grace=0.5) == -signal.SIGKILL
    log = child.log()
    assert f"the test harness: pid {child.pid} still running 0.5 s after SIGTERM" in log
    assert "stuck_in_its_stop" in log, log  # py-spy's dump of the stuck thread
