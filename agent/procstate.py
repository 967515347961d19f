"""A rank's process state from /proc/<pid>/stat."""

from __future__ import annotations

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
