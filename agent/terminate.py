"""Ending a job's ranks on this node for an END_RANKS command (--on-hang abort).

A process is signalled only through a pidfd opened on the pid the command
names, and only after the process behind that pidfd is checked to be the one
the agent discovered for the rank (its /proc start time equals the one the
hook recorded): a pid the kernel has handed to another process since, or a
rank that was restarted, is never signalled. A pidfd pins the process, so the
check and the signal concern the same one, and polling it tells when it
exited without being its parent.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import select
import signal
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Final

from hangwatch import hook_protocol
from hangwatch.wire import pb

log = logging.getLogger("hangwatch.agent")

# Seconds to wait for a process to go after SIGKILL before calling it a survivor
# (uninterruptible sleep in a driver can outlast any signal).
KILL_WAIT_S: Final = 5.0
MAX_DETAIL: Final = 500

TERMINATED: Final = "terminated"
KILLED: Final = "killed"
SURVIVED: Final = "survived"
ALREADY_GONE: Final = "already-gone"
PID_REUSED: Final = "pid-reused"
NOT_FOUND: Final = "not-found"
REFUSED: Final = "refused"
ERROR: Final = "error"


@dataclass(frozen=True, kw_only=True)
class Target:
    """One process to end: what the command named and what discovery recorded."""

    rank: int
    pid: int
    # The start time the hook recorded for this pid (None: the agent never
    # discovered this pid as a rank, so it is not ours to signal).
    starttime: int | None


@dataclass(kw_only=True)
class Outcome:
    rank: int
    pid: int
    outcome: str
    signals: list[str] = field(default_factory=list)
    exit_s: float = 0.0
    detail: str = ""

    def to_pb(self) -> pb.ActionResult:
        # The message is exactly these fields; only the detail is capped.
        return pb.ActionResult(**{**asdict(self), "detail": self.detail[:MAX_DETAIL]})


def refuse(targets: Iterable[Target], why: str) -> list[Outcome]:
    return [Outcome(rank=t.rank, pid=t.pid, outcome=REFUSED, detail=why) for t in targets]


@dataclass
class _Live:
    target: Target
    fd: int
    out: Outcome
    t0: float = 0.0


def end_processes(
    targets: Iterable[Target], *, grace_s: float, kill_wait_s: float = KILL_WAIT_S
) -> list[Outcome]:
    """SIGTERM every target, SIGKILL those still there after `grace_s`; one
    Outcome per target, in order. Never raises for one process's trouble."""
    outcomes: list[Outcome] = []
    opened: list[_Live] = []
    try:
        for t in targets:
            out, fd = _open_checked(t)
            outcomes.append(out)
            if fd is not None:
                opened.append(_Live(target=t, fd=fd, out=out))
        for lv in opened:
            _send(lv, signal.SIGTERM)
        late = _wait_exit([lv for lv in opened if lv.out.outcome == ""], grace_s, TERMINATED)
        for lv in late:
            _send(lv, signal.SIGKILL)
        left = _wait_exit([lv for lv in late if lv.out.outcome == ""], kill_wait_s, KILLED)
        for lv in left:
            lv.out.outcome = SURVIVED
            lv.out.detail = f"still running {kill_wait_s:.0f}s after SIGKILL"
    finally:
        for lv in opened:
            with contextlib.suppress(OSError):
                os.close(lv.fd)
    return outcomes


def _open_checked(t: Target) -> tuple[Outcome, int | None]:
    out = Outcome(rank=t.rank, pid=t.pid, outcome="")
    if t.starttime is None or t.pid <= 1:
        out.outcome = NOT_FOUND
        out.detail = f"pid {t.pid} is not a rank this agent discovered"
        return out, None
    try:
        fd = os.pidfd_open(t.pid)
    except ProcessLookupError:
        out.outcome = ALREADY_GONE
        return out, None
    except OSError as e:
        out.outcome = ERROR
        out.detail = f"pidfd_open: {e}"
        return out, None
    # Checked after the pidfd pins the process: the start time read now is
    # that of the process every later signal goes to.
    now = hook_protocol.proc_starttime(t.pid)
    if now is None or _exited(fd):
        out.outcome = ALREADY_GONE
    elif now != t.starttime:
        out.outcome = PID_REUSED
        out.detail = f"pid {t.pid} started at tick {now}, the rank at {t.starttime}"
    else:
        return out, fd
    os.close(fd)
    return out, None


def _send(lv: _Live, sig: signal.Signals) -> None:
    try:
        signal.pidfd_send_signal(lv.fd, sig)
    except ProcessLookupError:
        lv.out.outcome = lv.out.outcome or (TERMINATED if lv.out.signals else ALREADY_GONE)
        return
    except OSError as e:
        lv.out.outcome = ERROR
        lv.out.detail = f"{sig.name}: {errno.errorcode.get(e.errno or 0, '')} {e.strerror}"
        return
    if not lv.out.signals:
        lv.t0 = time.monotonic()
    lv.out.signals.append(sig.name)
    log.warning("sent %s to rank %d (pid %d)", sig.name, lv.target.rank, lv.target.pid)


def _exited(fd: int) -> bool:
    p = select.poll()
    p.register(fd, select.POLLIN)
    return bool(p.poll(0))


def _wait_exit(live: list[_Live], within_s: float, outcome: str) -> list[_Live]:
    """Wait up to `within_s` for the processes to exit; returns those still there."""
    end = time.monotonic() + within_s
    poller = select.poll()
    by_fd = {lv.fd: lv for lv in live}
    for fd in by_fd:
        poller.register(fd, select.POLLIN)
    while by_fd:
        left = end - time.monotonic()
        if left <= 0:
            break
        for fd, _ev in poller.poll(int(left * 1000) + 1):
            lv = by_fd.pop(fd, None)
            if lv is not None:
                poller.unregister(fd)
                lv.out.outcome = outcome
                lv.out.exit_s = round(time.monotonic() - lv.t0, 3)
    return list(by_fd.values())


def answer(
    cmd: pb.Command,
    known: dict[int, tuple[int, int | None]],
    *,
    allowed: bool,
    job_id: str,
    agent_id: str,
) -> pb.DumpResult:
    """Carry out an END_RANKS command; `known` maps each discovered rank's pid
    to (rank, start time the hook recorded). The answer for CompleteDump."""
    targets: list[Target] = []
    for rank, pid in zip(cmd.ranks, cmd.pids, strict=False):
        mine = known.get(pid)
        start = mine[1] if mine is not None and mine[0] == rank else None
        targets.append(Target(rank=rank, pid=pid, starttime=start))
    if len(cmd.ranks) != len(cmd.pids):
        log.error("END_RANKS for %s names %d ranks and %d pids", cmd.incident_id,
                  len(cmd.ranks), len(cmd.pids))  # fmt: skip
    if not allowed:
        log.warning(
            "incident %s: refusing to end ranks %s: this agent is not set to --on-hang abort",
            cmd.incident_id,
            [t.rank for t in targets],
        )
        outcomes = refuse(targets, "the agent is not set to --on-hang abort")
    else:
        log.warning(
            "incident %s: ending ranks %s (%s)", cmd.incident_id, [t.rank for t in targets],
            cmd.reason,
        )  # fmt: skip
        outcomes = end_processes(targets, grace_s=max(0.0, cmd.grace_s))
    return pb.DumpResult(
        job_id=job_id,
        agent_id=agent_id,
        incident_id=cmd.incident_id,
        actions=[o.to_pb() for o in outcomes],
    )
