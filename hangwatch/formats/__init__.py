"""File formats that cross a process boundary without gRPC, each with a schema tag.

One typed dataclass per file, with `to_json`/`from_json` (and `to_bytes`/
`from_bytes` with a size limit), used by every writer and every reader:

    RankInfo     <run_dir>/hook/<pid>.json          hook -> agent
    HookEvent    <run_dir>/hook/<pid>.events.jsonl  hook -> agent (one per line)
    RankMeta     <bundle>/rank_<R>/meta.json        agent, coordinator -> analyzer, coordinator
    IncidentDoc  <bundle>/incident.json             coordinator -> analyzer, coordinator
    ServerInfo   <data_dir>/server.json             coordinator -> demo, tools
    AgentInfo    <run_dir>/agent.json               agent -> hangwatch run

plus the hook's status answer on the rank's socket (FRSTATUS, spliced as
bytes by hangwatch.recorders). The layout of the directories is in
`files`; a node's phase-one files in one archive, `<bundle>/nodes/node_<R>.zip`,
in `nodearchive`; reason codes spelled as text in files and on the wire in `codes`.

The convention, the same for every format: readers accept a document
without a schema tag (the previous release wrote some untagged) and refuse
one tagged with another schema; unknown keys are ignored, so a newer
writer's additions never stop an older reader; a field of the wrong type,
truncated JSON or an oversized file is one `FormatError` (a ValueError)
whose message is a single line naming the schema and the field.
"""

from __future__ import annotations

from hangwatch.formats.checks import FormatError
from hangwatch.formats.codes import (
    Completion,
    FrSource,
    HookEventKind,
    JobStopped,
    MissingReason,
    RecorderKind,
    StallKind,
    TriggerKind,
)
from hangwatch.formats.files import (
    AGENT_FILE,
    BUNDLES_DIR,
    COMPACT_RANKS_ABOVE,
    FR_COLUMNS_FILE,
    FR_DIR,
    FR_FILE_PREFIX,
    FR_TAIL_PREFIX,
    GENERIC_INSTANCE,
    HOOK_DIR,
    INCIDENT_FILE,
    MAX_RANKS,
    META_FILE,
    SERVER_FILE,
    STACKS_FILE,
    abort_dump_name,
    atomic_write,
    compact_ranks,
    exit_dump_name,
    expand_ranks,
    fr_file_prefix,
    fr_tail_prefix,
    is_full_fr_name,
    is_tail_fr_name,
    rank_range,
    tail_name_for,
)
from hangwatch.formats.incident import INCIDENT, MAX_INCIDENT_BYTES, IncidentDoc
from hangwatch.formats.rankinfo import (
    HOOK_EVENT,
    MAX_EVENT_BYTES,
    MAX_RANKINFO_BYTES,
    RANKINFO,
    GroupInfo,
    HookEvent,
    RankInfo,
    Recorder,
)
from hangwatch.formats.rankmeta import MAX_RANKMETA_BYTES, PEER_STACKS_KEY, RANKMETA, RankMeta
from hangwatch.formats.serverinfo import AGENT_INFO, SERVER_INFO, AgentInfo, ServerInfo

# What the hook's status handler answers on the rank's socket: one
# status-only dump per recorder instance, spliced as torch wrote it
# (hangwatch.recorders.status_doc):
# {"schema", "recorders": [{"instance", "dump": <torch's status-only JSON dump,
#   with "pg_status": {pg_id: {...}}>} | {"instance", "error"}]}
FRSTATUS = "hangwatch.frstatus/1"
# A status-only dump is ~150 bytes a group; 16 MiB holds 100,000 groups.
MAX_FRSTATUS_BYTES = 16 * 1024**2

__all__ = [
    "AGENT_FILE",
    "AGENT_INFO",
    "BUNDLES_DIR",
    "COMPACT_RANKS_ABOVE",
    "FRSTATUS",
    "FR_COLUMNS_FILE",
    "FR_DIR",
    "FR_FILE_PREFIX",
    "FR_TAIL_PREFIX",
    "GENERIC_INSTANCE",
    "HOOK_DIR",
    "HOOK_EVENT",
    "INCIDENT",
    "INCIDENT_FILE",
    "MAX_EVENT_BYTES",
    "MAX_FRSTATUS_BYTES",
    "MAX_INCIDENT_BYTES",
    "MAX_RANKINFO_BYTES",
    "MAX_RANKMETA_BYTES",
    "MAX_RANKS",
    "META_FILE",
    "PEER_STACKS_KEY",
    "RANKINFO",
    "RANKMETA",
    "SERVER_FILE",
    "SERVER_INFO",
    "STACKS_FILE",
    "AgentInfo",
    "Completion",
    "FormatError",
    "FrSource",
    "GroupInfo",
    "HookEvent",
    "HookEventKind",
    "IncidentDoc",
    "JobStopped",
    "MissingReason",
    "RankInfo",
    "RankMeta",
    "Recorder",
    "RecorderKind",
    "ServerInfo",
    "StallKind",
    "TriggerKind",
    "abort_dump_name",
    "atomic_write",
    "compact_ranks",
    "exit_dump_name",
    "expand_ranks",
    "fr_file_prefix",
    "fr_tail_prefix",
    "is_full_fr_name",
    "is_tail_fr_name",
    "rank_range",
    "tail_name_for",
]
