"""Ending ranks (END_RANKS): real child processes, real signals, the pid-reuse check."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest
from hangwatch.agent import terminate

from hangwatch import hook_protocol
from hangwatch.wire import pb

IGNORES_TERM = (
    "import signal, sys, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "print('ready', flush=True)\n"
    "time.sleep(60)\n"
)


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait(10)
        if p.stdout is not None:
            p.stdout.close()


def _sleeper(procs: list[subprocess.Popen[bytes]], code: str = "") -> subprocess.Popen[bytes]:
    if code:
        p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
        assert p.stdout is not None and p.stdout.readline() == b"ready\n"
    else:
        p = subprocess.Popen(["sleep", "60"])
    procs.append(p)
    return p


def _target(p: subprocess.Popen[bytes], rank: int = 0, start_delta: int = 0) -> terminate.Target:
    start = hook_protocol.proc_starttime(p.pid)
    assert start is not None
    return terminate.Target(rank=rank, pid=p.pid, starttime=start + start_delta)


@pytest.mark.timeout(30)
def test_sigterm_ends_a_process_and_says_so(procs: list[subprocess.Popen[bytes]]) -> None:
    p = _sleeper(procs)
    [out] = terminate.end_processes([_target(p)], grace_s=10)
    assert out.outcome == terminate.TERMINATED and out.signals == ["SIGTERM"], out
    assert p.wait(5) == -15
    assert 0 <= out.exit_s < 5


@pytest.mark.timeout(30)
def test_sigkill_after_the_grace_for_a_process_that_ignores_sigterm(
    procs: list[subprocess.Popen[bytes]],
) -> None:
    stubborn = _sleeper(procs, IGNORES_TERM)
    polite = _sleeper(procs)
    outs = terminate.end_processes([_target(stubborn, 0), _target(polite, 1)], grace_s=0.5)
    assert [o.rank for o in outs] == [0, 1]
    assert outs[0].outcome == terminate.KILLED and outs[0].signals == ["SIGTERM", "SIGKILL"]
    assert outs[0].exit_s >= 0.5
    assert outs[1].outcome == terminate.TERMINATED and outs[1].signals == ["SIGTERM"]
    assert stubborn.wait(5) == -9 and polite.wait(5) == -15


@pytest.mark.timeout(30)
def test_a_reused_pid_or_an_undiscovered_one_is_never_signalled(
    procs: list[subprocess.Popen[bytes]],
) -> None:
    reused = _sleeper(procs)
    unknown = _sleeper(procs)
    outs = terminate.end_processes(
        [
            _target(reused, 0, start_delta=-1),  # the rank started earlier: another process now
            terminate.Target(rank=1, pid=unknown.pid, starttime=None),
            terminate.Target(rank=2, pid=1, starttime=0),
        ],
        grace_s=0.1,
    )
    assert [o.outcome for o in outs] == [
        terminate.PID_REUSED,
        terminate.NOT_FOUND,
        terminate.NOT_FOUND,
    ]
    assert all(o.signals == [] for o in outs)
    assert reused.poll() is None and unknown.poll() is None


@pytest.mark.timeout(30)
def test_a_process_already_gone_is_reported_as_such(procs: list[subprocess.Popen[bytes]]) -> None:
    p = _sleeper(procs)
    t = _target(p)
    p.kill()
    p.wait(5)
    [out] = terminate.end_processes([t], grace_s=1)
    assert out.outcome == terminate.ALREADY_GONE and out.signals == []


@pytest.mark.timeout(30)
def test_answer_refuses_without_consent_and_checks_pid_against_rank(
    procs: list[subprocess.Popen[bytes]],
) -> None:
    a, b = _sleeper(procs), _sleeper(procs)
    known = {
        a.pid: (0, hook_protocol.proc_starttime(a.pid)),
        b.pid: (5, hook_protocol.proc_starttime(b.pid)),  # b holds rank 5, not rank 1
    }
    cmd = pb.Command(
        kind=pb.COMMAND_KIND_END_RANKS, incident_id="i1", ranks=[0, 1], pids=[a.pid, b.pid],
        grace_s=5,
    )  # fmt: skip
    refused = terminate.answer(cmd, known, allowed=False, job_id="j", agent_id="n")
    assert [r.outcome for r in refused.actions] == [terminate.REFUSED] * 2
    assert a.poll() is None and b.poll() is None

    done = terminate.answer(cmd, known, allowed=True, job_id="j", agent_id="n")
    assert (done.job_id, done.agent_id, done.incident_id) == ("j", "n", "i1")
    assert [(r.rank, r.pid, r.outcome) for r in done.actions] == [
        (0, a.pid, terminate.TERMINATED),
        (1, b.pid, terminate.NOT_FOUND),
    ]
    assert a.wait(5) == -15 and b.poll() is None
