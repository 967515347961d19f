"""File formats that cross a process boundary without gRPC. Each has a schema tag.

Run directory (node-local, shared by the hook in each rank and the agent):
    <run_dir>/hook/<pid>.json          RANKINFO: written by the hook, rewritten
                                       atomically whenever a group is created
    <run_dir>/hook/<pid>.events.jsonl  HOOK_EVENT lines (collective timeouts)
    <run_dir>/hook/<pid>.sock          torch C++ worker server (Unix socket)
    <run_dir>/fr/<prefix><rank>        torch's own dump-on-timeout files
    <run_dir>/bundles/<incident>/...   the agent's local copy of each bundle

Incident bundle (the agent's local copy and the coordinator's copy alike):
    <bundle>/incident.json             INCIDENT
    <bundle>/rank_<R>/fr_trace_rank_<R>  FR dump bytes exactly as torch produced
                                       them (pickle or JSON; readers sniff)
    <bundle>/rank_<R>/fr_tail_rank_<R>   the same dump cut to its tail (hangwatch.frtail):
                                       what a large incident collects first;
                                       the full file follows on demand
    <bundle>/rank_<R>/meta.json        RANKMETA
    <bundle>/rank_<R>/stacks.txt       Python stacks, all threads (when taken; a
                                       tails-first upload carries them inside
                                       meta.json instead)

The analyzer's loader reads a bundle through the same door as a plain dump
directory: FR files are found by their trailing rank number and each
`meta.json` adds stacks, process state and group memberships to its rank.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

RANKINFO = "hangwatch.rankinfo/1"
# {"schema", "job_id", "rank", "local_rank", "world_size", "pid", "host",
#  "backend", "torch_version", "socket": path|None,
#  "fr_source": "worker-server"|"thread", "started_unix": float,
#  "groups": [{"name", "desc", "pg_id", "ranks": [...]}]}

# What the hook's status handler answers: one status-only dump per recorder
# instance (hangwatch.recorders).
FRSTATUS = "hangwatch.frstatus/1"
# {"schema", "recorders": [{"instance", "dump": <torch's status-only JSON dump,
#   with "pg_status": {pg_id: {...}}>} | {"instance", "error"}]}

HOOK_EVENT = "hangwatch.hookevent/1"
# {"schema", "kind": "collective-timeout"|..., "rank", "detail", "unix": float}

SERVER_INFO = "hangwatch.serverinfo/1"

INCIDENT = "hangwatch.incident/1"
# {"schema", "id", "job_id", "reason", "created_unix", "trigger": {...},
#  "ranks_expected": [...], "tail_context": int, "ranks_dumped": [...],
#  "ranks_unreachable": {"<rank>": "<reason>"}}

RANKMETA = "hangwatch.rankmeta/1"
# {"schema", "rank", "host", "pid", "process_state", "reachable": bool,
#  "groups": [{"name", "desc", "pg_id", "ranks"}],
#      "ranks": a list of global ranks, or for a big evenly strided group
#      {"start", "stop", "step"} as in range() (see compact_ranks)
#  "sources": {"fr": "worker-server"|"thread"|"watchdog-file"|"none",
#              "stacks": "worker-server"|"py-spy"|"none",
#              "gpu": "nvml"|"none", "process": "procfs"},
#  "gpu": {...} | {"available": false, "reason": "..."},
#  "stacks": "..." (only in a tails-first incident, instead of stacks.txt),
#  "errors": {"fr": "...", "stacks": "..."}}


@dataclass(frozen=True, kw_only=True)
class ServerInfo:
    """<data_dir>/server.json: where a running coordinator listens (SERVER_INFO)."""

    grpc: str  # HOST:PORT
    http: str  # http://HOST:PORT
    pid: int
    started_unix: float

    FILE: ClassVar[str] = "server.json"

    def to_json(self) -> dict[str, Any]:
        return {"schema": SERVER_INFO, **asdict(self)}

    @classmethod
    def from_json(cls, d: Any) -> ServerInfo:
        if not isinstance(d, dict) or d.get("schema") != SERVER_INFO:
            raise ValueError(f"not a {SERVER_INFO} document")
        return cls(
            grpc=str(d["grpc"]),
            http=str(d["http"]),
            pid=int(d["pid"]),
            started_unix=float(d["started_unix"]),
        )

    def write(self, data_dir: str | os.PathLike[str]) -> None:
        atomic_write(
            os.path.join(data_dir, self.FILE), json.dumps(self.to_json(), indent=2).encode()
        )

    @classmethod
    def read(cls, data_dir: str | os.PathLike[str]) -> ServerInfo | None:
        """The file's contents; None while it is absent or half-written."""
        try:
            with open(os.path.join(data_dir, cls.FILE), encoding="utf-8") as f:
                return cls.from_json(json.load(f))
        except (OSError, ValueError, KeyError, TypeError):
            return None


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


_FULL_FR_RE = re.compile(r"^fr_(?!tail_)[A-Za-z0-9_.-]*rank_\d+$")


def is_full_fr_name(name: str) -> bool:
    """fr_trace_rank_3, fr_nccl2_rank_3: a full FR file of some recorder instance."""
    return bool(_FULL_FR_RE.match(name))


def tail_name_for(fr_name: str) -> str:
    """The tail file that goes with a full FR file name."""
    assert fr_name.startswith("fr_"), fr_name
    return "fr_tail_" + fr_name[len("fr_") :].removeprefix("trace_")


META_FILE = "meta.json"
STACKS_FILE = "stacks.txt"
INCIDENT_FILE = "incident.json"


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


def expand_ranks(value: object) -> list[int] | None:
    """A meta.json "ranks" value as a list; None when it is neither form."""
    if isinstance(value, list):
        return [x for x in value if isinstance(x, int) and not isinstance(x, bool)]
    if isinstance(value, dict):
        start, stop, step = value.get("start"), value.get("stop"), value.get("step")
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in (start, stop, step)):
            return None
        assert isinstance(start, int) and isinstance(stop, int) and isinstance(step, int)
        if step <= 0 or start < 0 or stop < start or (stop - start) // step > MAX_RANKS:
            return None
        return list(range(start, stop, step))
    return None
