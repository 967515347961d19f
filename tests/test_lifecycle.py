"""Signal handling shared by the server and the agent: the first signal asks, the second forces."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

_CHILD = """
import sys, time
from hangwatch.lifecycle import ShutdownSignals
with ShutdownSignals("child") as stop:
    print("ready", flush=True)
    stop.wait(30)
    print("stopping", flush=True)
    if sys.argv[1] == "stuck":
        time.sleep(30)  # a shutdown step that hangs
print("done", flush=True)
"""


def _start(mode: str) -> subprocess.Popen[str]:
    p = subprocess.Popen(
        [sys.executable, "-c", _CHILD, mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    return p


@pytest.mark.timeout(30)
def test_first_signal_sets_the_flag_and_the_loop_exits_cleanly() -> None:
    p = _start("clean")
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=20)
    assert p.returncode == 0, err
    assert out.split() == ["stopping", "done"]


@pytest.mark.timeout(30)
def test_second_signal_forces_exit_even_when_shutdown_hangs() -> None:
    p = _start("stuck")
    p.send_signal(signal.SIGINT)
    assert p.stdout is not None and p.stdout.readline().strip() == "stopping"
    t0 = time.monotonic()
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=20)
    assert time.monotonic() - t0 < 10
    assert p.returncode == -signal.SIGTERM  # died of the signal, not a clean exit
    assert "second signal, exiting now" in err
