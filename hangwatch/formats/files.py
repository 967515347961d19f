"""Names and paths of the files that cross a process boundary, and how they are written.

Run directory (node-local, shared by the hook in each rank and the agent):
    <run_dir>/hook/<pid>.json          RankInfo: written by the hook, rewritten
                                       atomically whenever a group is created
    <run_dir>/hook/<pid>.events.jsonl  HookEvent lines (collective timeouts, ...)
    <run_dir>/hook/<pid>.sock          torch C++ worker server (Unix socket)
    <run_dir>/fr/<prefix><rank>        torch's own dump-on-timeout files
    <run_dir>/bundles/<incident>/...   the agent's local copy of each bundle

Incident bundle (the agent's local copy and the coordinator's copy alike):
    <bundle>/incident.json             IncidentDoc (the coordinator writes it)
    <bundle>/rank_<R>/fr_trace_rank_<R>  FR dump bytes exactly as torch produced
                                       them (pickle or JSON; readers sniff)
    <bundle>/rank_<R>/fr_tail_rank_<R>   the same dump cut to its tail (hangwatch.frtail):
                                       what a large incident collects first;
                                       the full file follows on demand
    <bundle>/rank_<R>/meta.json        RankMeta
    <bundle>/rank_<R>/stacks.txt       Python stacks, all threads (when taken; a
                                       tails-first upload carries them inside
                                       meta.json instead)
    <bundle>/nodes/node_<R>.zip        one node's phase-one files (formats.nodearchive),
                                       with rank_<R>/fr_columns: its tails already
                                       decoded (hangwatch.analyzer.packed)

Coordinator data directory:
    <data_dir>/server.json             ServerInfo: where it listens

The analyzer's loader reads a bundle through the same door as a plain dump
directory: FR files are found by their trailing rank number and each
`meta.json` adds stacks, process state and group memberships to its rank.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile


def atomic_write(path: str | os.PathLike[str], data: bytes, *, durable: bool = False) -> None:
    """Readers see the old file or the new one, never part of one (same-directory rename).

    `durable`: the data reaches the disk before the rename (the coordinator's
    incident files must survive a power cut; a rank's rank-info need not).
    """
    path = os.fspath(path)
    d = os.path.dirname(path) or "."
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=d, prefix=f".{os.path.basename(path)}.")
    try:
        # mkstemp makes 0600; these files are read by other processes (the
        # agent may run as another user than the rank that writes them).
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


HOOK_DIR = "hook"
FR_DIR = "fr"
BUNDLES_DIR = "bundles"
FR_FILE_PREFIX = "fr_trace_rank_"
FR_TAIL_PREFIX = "fr_tail_rank_"
# The recorder instance whose files keep the plain prefixes (torch's default one).
GENERIC_INSTANCE = "gloo"


def fr_file_prefix(instance: str = "") -> str:
    """A rank's FR file name without the rank, per recorder instance:
    fr_trace_rank_<R> for the generic (gloo) one, fr_<instance>_rank_<R> for others."""
    if not instance or instance == GENERIC_INSTANCE:
        return FR_FILE_PREFIX
    return f"fr_{instance}_rank_"


def fr_tail_prefix(instance: str = "") -> str:
    if not instance or instance == GENERIC_INSTANCE:
        return FR_TAIL_PREFIX
    return f"fr_tail_{instance}_rank_"


def abort_dump_name(instance: str, rank: int) -> str:
    """The hook's dump of one recorder instance when torch aborts a group (in <run_dir>/fr/)."""
    return f"fr_abort_{instance}_rank_{rank}"


def exit_dump_name(instance: str, rank: int, pid: int) -> str:
    """The hook's dump of one recorder instance as its process dies (an uncaught
    exception, the launcher's SIGTERM), in <run_dir>/fr/. Not an `fr_` name: the
    agent's watchdog scan must not read a dying rank's dump as torch's watchdog
    firing; the pid keeps a restarted job's rank from reading an older attempt's."""
    return f"hw_exit_{instance}_pid_{pid}_rank_{rank}"


_FULL_FR_RE = re.compile(r"^fr_(?!tail_)[A-Za-z0-9_.-]*rank_\d+$")


def is_full_fr_name(name: str) -> bool:
    """fr_trace_rank_3, fr_nccl2_rank_3: a full FR file of some recorder instance."""
    return bool(_FULL_FR_RE.match(name))


_TAIL_FR_RE = re.compile(r"^fr_tail_[A-Za-z0-9_.-]*rank_\d+$")


def is_tail_fr_name(name: str) -> bool:
    """fr_tail_rank_3, fr_tail_nccl2_rank_3: an FR tail of some recorder instance."""
    return bool(_TAIL_FR_RE.match(name))


def tail_name_for(fr_name: str) -> str:
    """The tail file that goes with a full FR file name."""
    assert fr_name.startswith("fr_"), fr_name
    return "fr_tail_" + fr_name[len("fr_") :].removeprefix("trace_")


META_FILE = "meta.json"
STACKS_FILE = "stacks.txt"
# In a node archive, under its lowest rank: every tail of the archive decoded.
FR_COLUMNS_FILE = "fr_columns"
INCIDENT_FILE = "incident.json"
SERVER_FILE = "server.json"
AGENT_FILE = "agent.json"  # in the run directory (AgentInfo)


# Above this many members a strided group's member list is written as a
# range: every rank's meta.json carries the world group, and at 4,096 ranks
# its list was half of what a large incident uploaded.
COMPACT_RANKS_ABOVE = 64
MAX_RANKS = 1 << 20  # a range this long is an error, not a job


def compact_ranks(ranks: list[int]) -> list[int] | dict[str, int]:
    """`ranks`, or {"start", "stop", "step"} when it is a long arithmetic run."""
    n = len(ranks)
    if n <= COMPACT_RANKS_ABOVE:
        return ranks
    step = ranks[1] - ranks[0]
    if step <= 0 or ranks != list(range(ranks[0], ranks[0] + n * step, step)):
        return ranks
    return {"start": ranks[0], "stop": ranks[0] + n * step, "step": step}


def rank_range(value: object) -> range | None:
    """The {"start", "stop", "step"} form of a member list as a range; None
    when it is not that form or is out of bounds (a memory bomb, not a job)."""
    if not isinstance(value, dict):
        return None
    start, stop, step = value.get("start"), value.get("stop"), value.get("step")
    if not (type(start) is int and type(stop) is int and type(step) is int):
        return None
    if step <= 0 or start < 0 or stop < start or (stop - start) // step > MAX_RANKS:
        return None
    return range(start, stop, step)


def expand_ranks(value: object) -> list[int] | None:
    """A meta.json "ranks" value as a list; None when it is neither form."""
    if isinstance(value, list):
        return [x for x in value if isinstance(x, int) and not isinstance(x, bool)]
    r = rank_range(value)
    return None if r is None else list(r)
