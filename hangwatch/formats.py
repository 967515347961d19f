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
    <bundle>/rank_<R>/stacks.txt       Python stacks, all threads (when taken)

The analyzer's loader reads a bundle through the same door as a plain dump
directory: FR files are found by their trailing rank number and each
`meta.json` adds stacks, process state and group memberships to its rank.
"""

from __future__ import annotations

RANKINFO = "hangwatch.rankinfo/1"
# {"schema", "job_id", "rank", "local_rank", "world_size", "pid", "host",
#  "backend", "torch_version", "socket": path|None,
#  "fr_source": "worker-server"|"thread", "started_unix": float,
#  "groups": [{"name", "desc", "pg_id", "ranks": [...]}]}

HOOK_EVENT = "hangwatch.hookevent/1"
# {"schema", "kind": "collective-timeout"|..., "rank", "detail", "unix": float}

INCIDENT = "hangwatch.incident/1"
# {"schema", "id", "job_id", "reason", "created_unix", "trigger": {...},
#  "ranks_expected": [...], "tail_context": int, "ranks_dumped": [...],
#  "ranks_unreachable": {"<rank>": "<reason>"}}

RANKMETA = "hangwatch.rankmeta/1"
# {"schema", "rank", "host", "pid", "process_state", "reachable": bool,
#  "groups": [{"name", "desc", "pg_id", "ranks"}],
#  "sources": {"fr": "worker-server"|"thread"|"watchdog-file"|"none",
#              "stacks": "worker-server"|"py-spy"|"none",
#              "gpu": "nvml"|"none", "process": "procfs"},
#  "gpu": {...} | {"available": false, "reason": "..."},
#  "errors": {"fr": "...", "stacks": "..."}}

HOOK_DIR = "hook"
FR_DIR = "fr"
BUNDLES_DIR = "bundles"
FR_FILE_PREFIX = "fr_trace_rank_"
FR_TAIL_PREFIX = "fr_tail_rank_"
META_FILE = "meta.json"
STACKS_FILE = "stacks.txt"
INCIDENT_FILE = "incident.json"
