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
    fields = hook_protocol.proc_stat_fields(pid)
    if fields is None or not fields:
        return pb.PROCESS_STATE_GONE
    if starttime is not None and len(fields) > 19 and int(fields[19]) != starttime:
        return pb.PROCESS_STATE_GONE
    return _STATE.get(fields[0], pb.PROCESS_STATE_RUNNING)


def state_name(state: int) -> str:
    return process_state_name(state)


def thread_cpu_ticks(pid: int) -> dict[int, int]:
    """Each thread's CPU time (user + system, clock ticks) from /proc/<pid>/task; {} if gone."""
    out: dict[int, int] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                raw = f.read().decode("ascii", "replace")
        except OSError:
            continue  # the thread ended meanwhile
        fields = raw[raw.rfind(")") + 2 :].split()
        if len(fields) > 12 and tid.isdigit():
            out[int(tid)] = int(fields[11]) + int(fields[12])  # utime, stime
    return out
