"""Simulated node agents that speak the real gRPC protocol, for load tests and benchmarks.

Each simulated agent stands for one 8-GPU node: it opens its own gRPC channel
(its own TCP connection), registers its 8 ranks with their process groups,
reports progress at 1 Hz, keeps a WatchCommands stream open, and answers a
DUMP command the way `hangwatch agent` does: per rank, the FR dump, meta.json
and stacks.txt uploaded file by file in chunks with a sha256, then
CompleteDump; or, when the command asks for tails (a large incident), every
rank's FR tail (`hangwatch.frtail`), meta.json and stacks.txt in one
compressed UploadFiles stream, and later the full dumps of the ranks an
UPLOAD_FULL names. Hundreds of agents share one asyncio loop per process, and a
fleet can span a few processes (`Fleet`).

The job is a Megatron-style TP x PP x DP layout (tensor-parallel groups of 8
inside a node, pipeline and data-parallel groups across nodes) running a
fixed program of collectives per step, so every rank's sequence numbers are
a pure function of time: all processes of a fleet agree on them without
talking to each other. A hang is one rank that stops before a TP collective;
where every other rank ends up blocked follows from NCCL semantics (a
collective completes only when every member's stream reaches it), computed
by one forward sweep, exactly as in `benchmarks/gen_nccl_dumps.py`.

Dumps are NCCL-shaped (FR format 2.10: `pg_config` with member lists,
`pg_status` keyed by local pg_id, entries with `started`/`completed` states,
timestamps and call-site frames) and pickled the way torch writes them
(protocol 2). Pickling 2,000 entries costs ~35 ms, far too much to do for
4,096 ranks inside a fan-out being timed, so each distinct rank *state* is
pickled once as a template whose per-rank strings (group names, member
lists, thread id) are sentinels; a rank's bytes are the template's segments
joined around its own strings. Protocol 2 has no byte offsets or frames and
the memo is by object, so the patched pickle is exactly what pickling that
rank's dict would give.

Modules: `constants` (node size, versions, wire limits, the step program),
`topology` (layout, program, clock, the hang sweep), `dumps` (FR dump
templates, stacks.txt), `agent` (one agent's gRPC client loops), `upload`
(the DUMP command's one- and two-phase uploads), `fleet` (agents in one
process, and `Fleet`, driving child processes), `ingest` (the ingest probe),
`coordinator` (the coordinator under test as a process). Import from here.
"""

from __future__ import annotations

from tests.support.simagents.agent import FleetSpec, SimAgent
from tests.support.simagents.constants import KINDS, OPS_PER_STEP, RANKS_PER_AGENT
from tests.support.simagents.coordinator import CoordinatorProcess, proc_cpu_s, proc_status_kb
from tests.support.simagents.dumps import DumpFactory, stacks_text
from tests.support.simagents.fleet import Fleet, FleetError, FleetState, merge_stats
from tests.support.simagents.ingest import IngestProbe, IngestSpec
from tests.support.simagents.topology import (
    Clock,
    Hang,
    RankPos,
    Topology,
    index_of,
    last_seq,
    op_at,
    rank_pos,
    sweep,
)

__all__ = [
    "KINDS",
    "OPS_PER_STEP",
    "RANKS_PER_AGENT",
    "Clock",
    "CoordinatorProcess",
    "DumpFactory",
    "Fleet",
    "FleetError",
    "FleetSpec",
    "FleetState",
    "Hang",
    "IngestProbe",
    "IngestSpec",
    "RankPos",
    "SimAgent",
    "Topology",
    "index_of",
    "last_seq",
    "merge_stats",
    "op_at",
    "proc_cpu_s",
    "proc_status_kb",
    "rank_pos",
    "stacks_text",
    "sweep",
]
