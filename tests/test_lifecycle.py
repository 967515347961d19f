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


def _start(mode: str, child: str = _CHILD, *args: str) -> subprocess.Popen[str]:
    p = subprocess.Popen(
        [sys.executable, "-c", child, mode, *args],
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


_HELD = """
import os, signal
from hangwatch.lifecycle import ShutdownSignals
with ShutdownSignals("child") as stop:
    # Where the main thread sits for part of every stop.wait(1.0): inside the
    # Event's own lock. The signal's handler runs at one of these bytecodes.
    with stop._cond:
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(100_000):
            pass
    print("handled", flush=True)
    print("stopped" if stop.wait(10) else "not stopped", flush=True)
print("done", flush=True)
"""


@pytest.mark.timeout(30)
def test_a_signal_while_the_main_thread_holds_the_flags_lock_still_stops_it() -> None:
    """A handler that set the Event itself waited for ever on the lock its own
    thread held: the process then ignored the signal until SIGKILL."""
    p = subprocess.run([sys.executable, "-c", _HELD], capture_output=True, text=True, timeout=20)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["handled", "stopped", "done"]


_BOUNDED = """
import sys, time
from hangwatch.lifecycle import ShutdownSignals
signals = ShutdownSignals("child", exit_bound_s=float(sys.argv[2]))
with signals as stop:
    print("ready", flush=True)
    if sys.argv[1] != "own":
        stop.wait(30)
    print("stopping", flush=True)
    signals.stopping()  # as a role does when it stops: armed once, by whichever came first
    if sys.argv[1] in ("stuck", "own"):
        time.sleep(30)  # a shutdown step that hangs, and no second signal comes
print("done", flush=True)
"""


@pytest.mark.timeout(30)
def test_a_stop_a_signal_began_is_bounded_by_the_roles_exit_bound() -> None:
    """The first signal arms exit_if_stuck with the role's bound: a stop that
    hangs ends there with its stacks, and nobody has to send a second one."""
    p = _start("stuck", _BOUNDED, "1")
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=20)
    assert p.returncode == 1, err
    assert out.split() == ["stopping"]
    assert "child: stopping (bound 1 s)" in err
    assert "Timeout (0:00:01)!" in err  # faulthandler's watchdog fired
    assert "<module>" in err  # the main thread's stack, stuck in the sleep


@pytest.mark.timeout(30)
def test_a_stop_a_signal_began_within_its_bound_exits_0() -> None:
    p = _start("clean", _BOUNDED, "10")
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=20)
    assert p.returncode == 0, err
    assert out.split() == ["stopping", "done"]
    assert "child: stopping (bound 10 s)" in err and "Timeout" not in err
    assert err.count("stopping (bound") == 1  # the signal armed it; the role's call did not again


@pytest.mark.timeout(30)
def test_a_stop_the_role_began_itself_is_bounded_too() -> None:
    """No signal (a coordinator whose HTTP server ended, a relay whose loop
    did): the role's own call to stopping() arms the same bound."""
    p = subprocess.run(
        [sys.executable, "-c", _BOUNDED, "own", "1"], capture_output=True, text=True, timeout=20
    )
    assert p.returncode == 1, p.stderr
    assert p.stdout.split() == ["ready", "stopping"]
    assert "child: stopping (bound 1 s)" in p.stderr and "Timeout (0:00:01)!" in p.stderr


_STOPPING = """
import sys, threading, time
from hangwatch.lifecycle import exit_if_stuck

def wait_for_ever():
    threading.Event().wait()

# A thread no stop reaches (not a daemon): the interpreter's exit waits on it.
if sys.argv[1] == "stuck":
    threading.Thread(target=wait_for_ever, name="forgotten").start()
exit_if_stuck("child", float(sys.argv[2]))
print("stopped", flush=True)
"""


@pytest.mark.timeout(30)
def test_a_stop_stuck_past_its_bound_leaves_every_stack_and_exits_1() -> None:
    """The bound covers the interpreter's own exit: here it waits for ever on
    a thread nothing stopped, and the watchdog (a C thread) ends it."""
    p = subprocess.run(
        [sys.executable, "-c", _STOPPING, "stuck", "1"], capture_output=True, text=True, timeout=20
    )
    assert p.returncode == 1, p.stderr
    assert p.stdout.split() == ["stopped"]
    assert "child: stopping (bound 1 s)" in p.stderr
    assert "Timeout (0:00:01)!" in p.stderr  # faulthandler's watchdog fired
    assert "in wait_for_ever" in p.stderr  # the stuck thread's stack is there


@pytest.mark.timeout(30)
def test_a_stop_within_its_bound_exits_as_it_would_have() -> None:
    p = subprocess.run(
        [sys.executable, "-c", _STOPPING, "clean", "10"], capture_output=True, text=True, timeout=20
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["stopped"]
    assert "Timeout" not in p.stderr and "Thread" not in p.stderr
