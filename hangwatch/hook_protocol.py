"""What the hook and the agent agree on besides `hangwatch.formats`: handler names and socket paths.

Importable without torch (the agent runs on machines without it).
"""

from __future__ import annotations

import hashlib
import os
import tempfile

from hangwatch import formats

# torch's C++ worker-server handlers (torch 2.13; also served by the fallback thread).
PING = "ping"
FR_TRACE_JSON = "fr_trace_json"  # full JSON dump; C++, needs no GIL; 2.15 takes ?backend=
DUMP_TRACEBACK = "dump_traceback"  # all threads' Python stacks; empty while the GIL is held
PYSPY_DUMP = "pyspy_dump"
# torch 2.15: {"healthy": bool, "unhealthy_backends": [...]}, from the backends' watchdogs.
HEALTH_CHECK = "c10d_health_check"
# Python handlers the hook registers. They need the GIL.
STATUS = "hangwatch_status"  # FR dump with includeCollectives=False: pg_status only (~µs)
FR_PICKLE = "hangwatch_fr_pickle"  # torch's pickle dump, with Python call-site frames
# Query parameter of FR_PICKLE naming the recorder instance (hangwatch.recorders).
INSTANCE_PARAM = "instance"

# sun_path is 108 bytes on Linux; leave room for the terminating NUL.
_MAX_SUN_PATH = 100


def hook_dir(run_dir: str) -> str:
    return os.path.join(run_dir, formats.HOOK_DIR)


def rankinfo_path(run_dir: str, pid: int) -> str:
    return os.path.join(hook_dir(run_dir), f"{pid}.json")


def events_path(run_dir: str, pid: int) -> str:
    return os.path.join(hook_dir(run_dir), f"{pid}.events.jsonl")


def final_status_path(run_dir: str, pid: int) -> str:
    """The FRSTATUS document a rank's hook writes as its process exits through
    Python: its recorders' last numbers, which the agent's polls may have missed
    (not `.json`: the agent reads every `*.json` here as a rank-info file)."""
    return os.path.join(hook_dir(run_dir), f"{pid}.final.frstatus")


def socket_path(run_dir: str, pid: int) -> str:
    """`<run_dir>/hook/<pid>.sock`, or a short path under the temp dir when that is too long.

    The rank-info file records the path actually used, so the agent never guesses.
    """
    path = os.path.join(os.path.abspath(hook_dir(run_dir)), f"{pid}.sock")
    if len(path.encode()) <= _MAX_SUN_PATH:
        return path
    digest = hashlib.sha1(os.path.abspath(run_dir).encode()).hexdigest()[:12]
    short_dir = os.path.join(tempfile.gettempdir(), f"hangwatch-{os.getuid()}")
    return os.path.join(short_dir, f"{digest}-{pid}.sock")


def fr_dump_prefix(run_dir: str) -> str:
    """Value for TORCH_FR_DUMP_TEMP_FILE: torch appends the rank to it."""
    return os.path.join(os.path.abspath(run_dir), formats.FR_DIR, formats.FR_FILE_PREFIX)


def proc_stat_fields(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name (field 3 onwards), or None if gone."""
    got = proc_stat(pid)
    return None if got is None else got[1]


def proc_stat(pid: int) -> tuple[str, list[str]] | None:
    """(command name, the fields after it) of /proc/<pid>/stat, or None if gone.

    The command name is in parentheses and may itself contain spaces or
    parentheses, so split after the last ')'.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode("ascii", "replace")
    except OSError:
        return None
    close = raw.rfind(")")
    if close < 0:
        return None
    return raw[raw.find("(") + 1 : close], raw[close + 2 :].split()


def proc_starttime(pid: int) -> int | None:
    """Process start time in clock ticks since boot: tells a live pid from a reused one."""
    fields = proc_stat_fields(pid)
    if fields is None or len(fields) < 20:
        return None
    return int(fields[19])
