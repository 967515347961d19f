"""A rank's process state and CPU time, from one read of /proc/<pid>/stat, on real processes."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hangwatch.agent.delta import signature
from hangwatch.agent.procstate import CpuTotal, RunqueueWait, _children, process_sample

from hangwatch.wire import pb

SPIN = "import time\nt = time.monotonic()\nwhile time.monotonic() - t < 30: pass\n"
SLEEP = "import time\ntime.sleep(30)\n"


# A rank that waits while a process it started works (torch.compile's workers
# and their compilers): the child, and the child's child, spin.
PARENT_OF = (
    "import subprocess, sys, time\n"
    "subprocess.Popen([sys.executable, '-c', sys.argv[1]] + sys.argv[2:3])\n"
    "time.sleep(30)\n"
)


# The same, the child started from a thread of the rank that lives on (a pool
# thread, as inductor's compile sidecar starts its workers): the kernel lists
# it under that thread, not the main one, for as long as the thread lives.
THREAD_PARENT_OF = (
    "import subprocess, sys, threading, time\n"
    "def pool_thread():\n"
    "    subprocess.Popen([sys.executable, '-c', sys.argv[1]])\n"
    "    time.sleep(30)\n"
    "threading.Thread(target=pool_thread, daemon=True).start()\n"
    "time.sleep(30)\n"
)


def _cpu_after(code: str, seconds: float, *args: str) -> tuple[int, int, int]:
    """(state, CPU ns at start, CPU ns `seconds` later) of a child running `code`."""
    # Its own session: the processes it starts are killed with it.
    p = subprocess.Popen([sys.executable, "-c", code, *args], start_new_session=True)
    try:
        time.sleep(0.5)  # past the interpreters' start-up
        state, first = process_sample(p.pid)
        time.sleep(seconds)
        _, second = process_sample(p.pid)
        return state, first, second
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()


@pytest.mark.timeout(30)
def test_a_spinning_process_accrues_cpu_and_a_sleeping_one_does_not() -> None:
    state, a, b = _cpu_after(SPIN, 1.0)
    assert state == pb.PROCESS_STATE_RUNNING
    assert a > 0 and (b - a) / 1e9 >= 0.25, (a, b)  # most of a core; 0.25 is BUSY_CORES
    _, a, b = _cpu_after(SLEEP, 1.0)
    assert (b - a) / 1e9 < 0.05, (a, b)


@pytest.mark.timeout(30)
def test_a_process_waiting_on_its_working_children_is_busy() -> None:
    """The rank sleeps; the process it started spins (a compile worker), or the
    process that one started does (the compiler the worker runs)."""
    _, a, b = _cpu_after(PARENT_OF, 1.0, SPIN)
    assert (b - a) / 1e9 >= 0.25, (a, b)
    _, a, b = _cpu_after(PARENT_OF, 1.0, PARENT_OF, SPIN)
    assert (b - a) / 1e9 >= 0.25, (a, b)
    # A child a pool thread started, and that one's own child started the same way.
    _, a, b = _cpu_after(THREAD_PARENT_OF, 1.0, SPIN)
    assert (b - a) / 1e9 >= 0.25, (a, b)
    _, a, b = _cpu_after(PARENT_OF, 1.0, THREAD_PARENT_OF, SPIN)
    assert (b - a) / 1e9 >= 0.25, (a, b)
    # Children that wait are no work either.
    _, a, b = _cpu_after(PARENT_OF, 1.0, SLEEP)
    assert (b - a) / 1e9 < 0.05, (a, b)


@pytest.mark.timeout(30)
def test_a_launcher_charged_no_cpu_of_its_own_reads_its_childrens() -> None:
    """A shell that starts a spinning child and waits on it: the shell ran well
    under a tick, and the kernel charges CPU time a tick at a time, so its own
    time reads 0 (10 of 10 starts here). Its child's time is still the tree's.
    A Python rank read so in a full run: 0 for 20 s over a spinning child."""
    sh = shutil.which("sh")
    assert sh is not None
    launcher = f'"{sys.executable}" -c "$0" & wait'
    p = subprocess.Popen([sh, "-c", launcher, SPIN], start_new_session=True)
    try:
        # Until the tree has used a quarter of a core-second (BUSY_CORES for a
        # second); the old code read 0 for as long as the child spun.
        _, first = process_sample(p.pid)
        deadline = time.monotonic() + 20
        while (now := process_sample(p.pid)[1]) - first < 250_000_000:
            assert time.monotonic() < deadline, f"the child's time never counted: {first}, {now}"
            time.sleep(0.05)
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()


@pytest.mark.timeout(10)
def test_a_gone_process_has_no_cpu_and_cpu_is_not_a_change() -> None:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    assert process_sample(p.pid) == (pb.PROCESS_STATE_GONE, 0)
    # The agent sends a rank on change or heartbeat; CPU time alone is neither.
    one = pb.RankProgress(rank=0, cpu_time_ns=1)
    two = pb.RankProgress(rank=0, cpu_time_ns=2_000_000_000)
    assert signature(one) == signature(two)
    # Nor is storage I/O.
    assert signature(pb.RankProgress(rank=0, io_bytes=1 << 30)) == signature(one)


@pytest.mark.timeout(30)
def test_a_spinning_process_starved_of_a_cpu_accrues_runqueue_wait() -> None:
    """Two spinners pinned to one CPU: each runs about half the time and waits
    on the run queue the other half. Its CPU rate alone halves; CPU plus wait
    stays about one core. A sleeper accrues neither."""
    cpu = sorted(os.sched_getaffinity(0))[0]
    procs = [
        subprocess.Popen([sys.executable, "-c", SPIN], start_new_session=True) for _ in range(2)
    ]
    sleeper = subprocess.Popen([sys.executable, "-c", SLEEP], start_new_session=True)
    try:
        for p in procs:
            os.sched_setaffinity(p.pid, {cpu})
        time.sleep(0.5)
        acc = {p.pid: RunqueueWait() for p in (*procs, sleeper)}
        first: dict[int, int] = {}
        for pid, w in acc.items():
            waits: dict[int, int] = {}
            _, first[pid] = process_sample(pid, None, waits)
            w.update(waits)
        t0 = time.monotonic()
        time.sleep(1.0)
        span = time.monotonic() - t0
        for pid, w in acc.items():
            waits = {}
            _, cpu_ns = process_sample(pid, None, waits)
            waited = w.update(waits) / 1e9 / span
            ran = (cpu_ns - first[pid]) / 1e9 / span
            if pid == sleeper.pid:
                assert waited < 0.05 and ran < 0.05, (waited, ran)
            else:
                assert waited >= 0.25, (waited, ran)  # about 0.5
                assert ran + waited >= 0.7, (waited, ran)  # about 1
    finally:
        for p in (*procs, sleeper):
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def test_runqueue_wait_only_grows_as_processes_come_and_go() -> None:
    w = RunqueueWait()
    assert w.update({10: 5, 11: 100}) == 0  # first sight of each: a baseline
    assert w.update({10: 8, 11: 160}) == 63
    # The compile worker 11 exits (its wait is not folded into its parent's):
    # the total keeps what it had, and a new worker 12 starts from its own baseline.
    assert w.update({10: 9, 12: 40}) == 64
    assert w.update({10: 9, 12: 70}) == 94


# A rank whose child's CPU time leaves the process tree unseen: with SIGCHLD
# ignored the kernel reaps the child itself and adds its time to nobody's
# cutime (the same fall a reap between two /proc reads makes, deterministic).
AUTO_REAPED_CHILD = (
    "import signal, subprocess, sys, time\n"
    "signal.signal(signal.SIGCHLD, signal.SIG_IGN)\n"
    "subprocess.Popen([sys.executable, '-c', sys.argv[1]])\n"
    "time.sleep(30)\n"
)
SPIN_1S = "import time\nt = time.monotonic()\nwhile time.monotonic() - t < 1.0: pass\n"


@pytest.mark.timeout(30)
def test_cpu_time_only_grows_when_a_childs_time_leaves_the_tree() -> None:
    p = subprocess.Popen([sys.executable, "-c", AUTO_REAPED_CHILD, SPIN_1S], start_new_session=True)
    total = CpuTotal()
    samples: list[int] = []
    try:
        deadline = time.monotonic() + 20
        # Sample while the child spins, then until it is gone from the tree.
        while time.monotonic() < deadline:
            _, ns = process_sample(p.pid)
            samples.append(ns)
            total.update(ns)
            if len(samples) > 5 and ns < max(samples) - 300_000_000:
                break
            time.sleep(0.1)
        else:
            pytest.fail(f"the child's time never left the tree: {samples}")
        # The raw sum fell by most of the child's second; the total did not.
        assert total.total_ns >= max(samples), (total.total_ns, samples)
        _, ns = process_sample(p.pid)
        assert total.update(ns) >= max(samples)
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def test_cpu_total_adds_increases_and_ignores_falls() -> None:
    c = CpuTotal()
    assert c.update(0) == 0  # unknown until the first readable sample
    assert c.update(1_000) == 1_000
    assert c.update(1_500) == 1_500
    assert c.update(900) == 1_500  # a child's 600 left the tree unseen
    assert c.update(1_200) == 1_800  # growth from the new, lower sum counts
    assert c.update(0) == 1_800  # unreadable this poll: the total stays


# A rank whose pool thread runs a program (inductor's cpp_builder runs g++
# from one) while the thread waits for it.
THREAD_RUNS = (
    "import subprocess, sys, threading, time\n"
    "def pool_thread():\n"
    "    subprocess.run([sys.argv[1], '30'])\n"
    "threading.Thread(target=pool_thread, daemon=True).start()\n"
    "time.sleep(30)\n"
)


def _runs(pid: int, name: str) -> bool:
    """Some child of `pid` has exec'd a program called `name`."""
    for c in _children(pid):
        try:
            if Path(f"/proc/{c}/comm").read_text().strip() == name:
                return True
        except OSError:
            pass  # gone meanwhile
    return False


@pytest.mark.timeout(30)
def test_a_compiler_under_a_rank_is_named(tmp_path: Path) -> None:
    """The compiler is found among the rank's descendants by its name; a
    sleeper is not a compiler."""
    sleep = shutil.which("sleep") or "/bin/sleep"
    cc1plus = tmp_path / "cc1plus"
    shutil.copy(sleep, cc1plus)
    for child, want in ((str(cc1plus), ["cc1plus"]), (sleep, [])):
        p = subprocess.Popen([sys.executable, "-c", THREAD_RUNS, child], start_new_session=True)
        try:
            # Until the child runs its program: between fork and exec it is a
            # copy of the rank, named as the rank (seen once in a full run).
            deadline = time.monotonic() + 10
            while not _runs(p.pid, Path(child).name) and time.monotonic() < deadline:
                time.sleep(0.05)
            found: list[str] = []
            process_sample(p.pid, compilers=found)
            assert found == want, (child, found)
        finally:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


# A rank whose child writes to storage when told to, then exits and is reaped,
# the rank living on: a checkpoint writer, a compile worker reading sources.
WRITER = (
    "import os, sys, time\n"
    "go, out = sys.argv[1:3]\n"
    "open(out + '.ready', 'w').close()\n"
    "while not os.path.exists(go): time.sleep(0.01)\n"
    "with open(out, 'wb') as f:\n"
    "    f.write(os.urandom(8 << 20)); f.flush(); os.fsync(f.fileno())\n"
    "os.rename(out + '.ready', out + '.done')\n"
)
WAITS_ON_CHILD = (
    "import subprocess, sys, time\n"
    "subprocess.Popen([sys.executable, '-c'] + sys.argv[1:]).wait()\n"
    "time.sleep(30)\n"
)
# Its logging thread's kind of output: a line at a time to a pipe.
PRINTS = "import time\nfor _ in range(3000):\n    print('step', flush=True)\ntime.sleep(30)\n"


def _io(pid: int) -> int:
    io: list[int] = []
    process_sample(pid, io=io)
    return sum(io)


def _until(path: Path) -> None:
    deadline = time.monotonic() + 20
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.01)


@pytest.mark.timeout(60)
def test_storage_io_under_a_rank_is_counted_and_stays_when_its_child_is_reaped(
    tmp_path: Path,
) -> None:
    """8 MiB written and synced by the rank's child count as the rank's I/O
    (the tree's read_bytes + write_bytes) while the child lives, and once it
    is reaped its bytes are its parent's (the kernel folds them in, as it does
    CPU time), so the rank's total never falls. Output to a pipe is not
    storage I/O: a rank printing 3,000 lines reads as none."""
    out = tmp_path / "ckpt"
    p = subprocess.Popen(
        [sys.executable, "-c", WAITS_ON_CHILD, WRITER, str(tmp_path / "go"), str(out)],
        start_new_session=True,
    )
    printer = subprocess.Popen(
        [sys.executable, "-c", PRINTS], stdout=subprocess.PIPE, start_new_session=True
    )
    try:
        _until(Path(f"{out}.ready"))
        total = CpuTotal()
        before = total.update(_io(p.pid))
        (tmp_path / "go").touch()
        _until(Path(f"{out}.done"))
        written = total.update(_io(p.pid)) - before
        assert written >= 8 << 20, written
        p_after = _io(p.pid)
        deadline = time.monotonic() + 20
        while _children(p.pid) and time.monotonic() < deadline:
            time.sleep(0.05)  # until the child is reaped
            p_after = _io(p.pid)
        assert not _children(p.pid)
        assert p_after >= before + (8 << 20), (before, p_after)  # the parent's own count now
        assert total.update(p_after) >= before + written
        assert printer.stdout is not None
        lines = sum(1 for _ in zip(range(3000), printer.stdout, strict=False))
        assert lines == 3000
        assert _io(printer.pid) == 0
    finally:
        for q in (p, printer):
            os.killpg(q.pid, signal.SIGKILL)
            q.wait()
        if printer.stdout is not None:
            printer.stdout.close()
