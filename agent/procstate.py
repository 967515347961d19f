"""A rank's process state from /proc/<pid>/stat."""

from __future__ import annotations

import os

from hangwatch import hook_protocol
from hangwatch.wire import pb, process_state_name

_STATE = {
    "R": pb.PROCESS_STATE_RUNNING,
    "S": pb.PROCESS_STATE_RUNNING,
    "D": pb.PROCESS_STATE_RUNNING,  # uninterruptible I/O: alive, not stopped
    "I": pb.PROCESS_STATE_RUNNING,
    "T": pb.PROCESS_STATE_STOPPED,  # SIGSTOP
    "t": pb.PROCESS_STATE_STOPPED,  # tracing stop
    "Z": pb.PROCESS_STATE_ZOMBIE,
    "X": pb.PROCESS_STATE_GONE,
}


def process_state(pid: int, starttime: int | None = None) -> int:
    """A `pb.ProcessState`. A pid whose start time differs from `starttime` was reused: GONE."""
    return process_sample(pid, starttime)[0]


def process_sample(pid: int, starttime: int | None = None) -> tuple[int, int]:
    """(`pb.ProcessState`, CPU time in ns: user + system over all threads, 0 when
    unknown) from one read of /proc/<pid>/stat: what every poll costs a rank is
    this one read, about 10 us."""
    fields = hook_protocol.proc_stat_fields(pid)
    if fields is None or not fields:
        return pb.PROCESS_STATE_GONE, 0
    if starttime is not None and len(fields) > 19 and int(fields[19]) != starttime:
        return pb.PROCESS_STATE_GONE, 0
    cpu_ns = 0
    if len(fields) > 12:
        try:
            cpu_ns = (int(fields[11]) + int(fields[12])) * _TICK_NS  # utime, stime (ticks)
        except ValueError:
            cpu_ns = 0
    return _STATE.get(fields[0], pb.PROCESS_STATE_RUNNING), cpu_ns


def state_name(state: int) -> str:
    return process_state_name(state)


def thread_demand_ns(pid: int) -> dict[int, int]:
    """Each thread's time on a CPU plus its time waiting on a run queue, in ns
    (/proc/<pid>/task/<tid>/schedstat); {} if the process is gone.

    A thread that computes wants the CPU whether or not a loaded machine
    gives it one: the wait counts too. Where schedstat cannot be read, the
    thread's CPU time from stat (10 ms ticks) stands in.
    """
    out: dict[int, int] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        if not tid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
                run, wait = f.read().split()[:2]
            out[int(tid)] = int(run) + int(wait)
            continue
        except (OSError, ValueError):
            pass  # no schedstat here: fall back to stat
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                raw = f.read().decode("ascii", "replace")
        except OSError:
            continue  # the thread ended meanwhile
        fields = raw[raw.rfind(")") + 2 :].split()
        if len(fields) > 12:
            out[int(tid)] = (int(fields[11]) + int(fields[12])) * _TICK_NS  # utime, stime
    return out


_TICK_NS = 1_000_000_000 // os.sysconf("SC_CLK_TCK")
