from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ProcessState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROCESS_STATE_UNSPECIFIED: _ClassVar[ProcessState]
    PROCESS_STATE_RUNNING: _ClassVar[ProcessState]
    PROCESS_STATE_STOPPED: _ClassVar[ProcessState]
    PROCESS_STATE_ZOMBIE: _ClassVar[ProcessState]
    PROCESS_STATE_GONE: _ClassVar[ProcessState]
    PROCESS_STATE_UNRESPONSIVE: _ClassVar[ProcessState]

class EventKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EVENT_KIND_UNSPECIFIED: _ClassVar[EventKind]
    EVENT_KIND_WATCHDOG_DUMP: _ClassVar[EventKind]
    EVENT_KIND_COLLECTIVE_TIMEOUT: _ClassVar[EventKind]
    EVENT_KIND_RANK_EXITED: _ClassVar[EventKind]
    EVENT_KIND_RANK_UNRESPONSIVE: _ClassVar[EventKind]
    EVENT_KIND_BACKEND_UNHEALTHY: _ClassVar[EventKind]
    EVENT_KIND_RANK_CRASHED: _ClassVar[EventKind]

class WatchEnd(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WATCH_END_NONE: _ClassVar[WatchEnd]
    WATCH_END_UNKNOWN_SESSION: _ClassVar[WatchEnd]
    WATCH_END_REPLACED: _ClassVar[WatchEnd]

class CommandKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    COMMAND_KIND_UNSPECIFIED: _ClassVar[CommandKind]
    COMMAND_KIND_DUMP: _ClassVar[CommandKind]
    COMMAND_KIND_UPLOAD_FULL: _ClassVar[CommandKind]
    COMMAND_KIND_END_RANKS: _ClassVar[CommandKind]
PROCESS_STATE_UNSPECIFIED: ProcessState
PROCESS_STATE_RUNNING: ProcessState
PROCESS_STATE_STOPPED: ProcessState
PROCESS_STATE_ZOMBIE: ProcessState
PROCESS_STATE_GONE: ProcessState
PROCESS_STATE_UNRESPONSIVE: ProcessState
EVENT_KIND_UNSPECIFIED: EventKind
EVENT_KIND_WATCHDOG_DUMP: EventKind
EVENT_KIND_COLLECTIVE_TIMEOUT: EventKind
EVENT_KIND_RANK_EXITED: EventKind
EVENT_KIND_RANK_UNRESPONSIVE: EventKind
EVENT_KIND_BACKEND_UNHEALTHY: EventKind
EVENT_KIND_RANK_CRASHED: EventKind
WATCH_END_NONE: WatchEnd
WATCH_END_UNKNOWN_SESSION: WatchEnd
WATCH_END_REPLACED: WatchEnd
COMMAND_KIND_UNSPECIFIED: CommandKind
COMMAND_KIND_DUMP: CommandKind
COMMAND_KIND_UPLOAD_FULL: CommandKind
COMMAND_KIND_END_RANKS: CommandKind

class GroupInfo(_message.Message):
    __slots__ = ("name", "desc", "pg_id", "ranks", "rank_ranges")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESC_FIELD_NUMBER: _ClassVar[int]
    PG_ID_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    RANK_RANGES_FIELD_NUMBER: _ClassVar[int]
    name: str
    desc: str
    pg_id: int
    ranks: _containers.RepeatedScalarFieldContainer[int]
    rank_ranges: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., desc: _Optional[str] = ..., pg_id: _Optional[int] = ..., ranks: _Optional[_Iterable[int]] = ..., rank_ranges: _Optional[_Iterable[int]] = ...) -> None: ...

class RankInfo(_message.Message):
    __slots__ = ("rank", "local_rank", "world_size", "pid", "backend", "torch_version", "groups", "fr_source")
    RANK_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    TORCH_VERSION_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    FR_SOURCE_FIELD_NUMBER: _ClassVar[int]
    rank: int
    local_rank: int
    world_size: int
    pid: int
    backend: str
    torch_version: str
    groups: _containers.RepeatedCompositeFieldContainer[GroupInfo]
    fr_source: str
    def __init__(self, rank: _Optional[int] = ..., local_rank: _Optional[int] = ..., world_size: _Optional[int] = ..., pid: _Optional[int] = ..., backend: _Optional[str] = ..., torch_version: _Optional[str] = ..., groups: _Optional[_Iterable[_Union[GroupInfo, _Mapping]]] = ..., fr_source: _Optional[str] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("job_id", "agent_id", "host", "ranks", "agent_version")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    AGENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    agent_id: str
    host: str
    ranks: _containers.RepeatedCompositeFieldContainer[RankInfo]
    agent_version: str
    def __init__(self, job_id: _Optional[str] = ..., agent_id: _Optional[str] = ..., host: _Optional[str] = ..., ranks: _Optional[_Iterable[_Union[RankInfo, _Mapping]]] = ..., agent_version: _Optional[str] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("session_id", "poll_interval_s", "heartbeat_s", "progress_stream", "progress_columns", "node_archives")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    POLL_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_S_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_STREAM_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_COLUMNS_FIELD_NUMBER: _ClassVar[int]
    NODE_ARCHIVES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    poll_interval_s: float
    heartbeat_s: float
    progress_stream: bool
    progress_columns: bool
    node_archives: bool
    def __init__(self, session_id: _Optional[str] = ..., poll_interval_s: _Optional[float] = ..., heartbeat_s: _Optional[float] = ..., progress_stream: _Optional[bool] = ..., progress_columns: _Optional[bool] = ..., node_archives: _Optional[bool] = ...) -> None: ...

class InFlight(_message.Message):
    __slots__ = ("seq", "op", "age_s")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    AGE_S_FIELD_NUMBER: _ClassVar[int]
    seq: int
    op: str
    age_s: float
    def __init__(self, seq: _Optional[int] = ..., op: _Optional[str] = ..., age_s: _Optional[float] = ...) -> None: ...

class GroupProgress(_message.Message):
    __slots__ = ("group", "last_enqueued", "last_completed", "last_started", "oldest_in_flight", "completed_unchanged_s", "completion_unknown", "collectives_enqueued", "collectives_completed")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    LAST_ENQUEUED_FIELD_NUMBER: _ClassVar[int]
    LAST_COMPLETED_FIELD_NUMBER: _ClassVar[int]
    LAST_STARTED_FIELD_NUMBER: _ClassVar[int]
    OLDEST_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_UNCHANGED_S_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_UNKNOWN_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVES_ENQUEUED_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVES_COMPLETED_FIELD_NUMBER: _ClassVar[int]
    group: str
    last_enqueued: int
    last_completed: int
    last_started: int
    oldest_in_flight: InFlight
    completed_unchanged_s: float
    completion_unknown: bool
    collectives_enqueued: int
    collectives_completed: int
    def __init__(self, group: _Optional[str] = ..., last_enqueued: _Optional[int] = ..., last_completed: _Optional[int] = ..., last_started: _Optional[int] = ..., oldest_in_flight: _Optional[_Union[InFlight, _Mapping]] = ..., completed_unchanged_s: _Optional[float] = ..., completion_unknown: _Optional[bool] = ..., collectives_enqueued: _Optional[int] = ..., collectives_completed: _Optional[int] = ...) -> None: ...

class RankProgress(_message.Message):
    __slots__ = ("rank", "state", "groups", "fr_age_s", "status_at_ns", "cpu_time_ns", "finished", "in_compile", "runqueue_wait_ns", "compiler_running", "io_bytes")
    RANK_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    FR_AGE_S_FIELD_NUMBER: _ClassVar[int]
    STATUS_AT_NS_FIELD_NUMBER: _ClassVar[int]
    CPU_TIME_NS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    IN_COMPILE_FIELD_NUMBER: _ClassVar[int]
    RUNQUEUE_WAIT_NS_FIELD_NUMBER: _ClassVar[int]
    COMPILER_RUNNING_FIELD_NUMBER: _ClassVar[int]
    IO_BYTES_FIELD_NUMBER: _ClassVar[int]
    rank: int
    state: ProcessState
    groups: _containers.RepeatedCompositeFieldContainer[GroupProgress]
    fr_age_s: float
    status_at_ns: int
    cpu_time_ns: int
    finished: bool
    in_compile: bool
    runqueue_wait_ns: int
    compiler_running: bool
    io_bytes: int
    def __init__(self, rank: _Optional[int] = ..., state: _Optional[_Union[ProcessState, str]] = ..., groups: _Optional[_Iterable[_Union[GroupProgress, _Mapping]]] = ..., fr_age_s: _Optional[float] = ..., status_at_ns: _Optional[int] = ..., cpu_time_ns: _Optional[int] = ..., finished: _Optional[bool] = ..., in_compile: _Optional[bool] = ..., runqueue_wait_ns: _Optional[int] = ..., compiler_running: _Optional[bool] = ..., io_bytes: _Optional[int] = ...) -> None: ...

class ProgressReport(_message.Message):
    __slots__ = ("job_id", "agent_id", "session_id", "report_seq", "ranks", "clock_offset_ns", "clock_error_ns", "columns")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REPORT_SEQ_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    CLOCK_OFFSET_NS_FIELD_NUMBER: _ClassVar[int]
    CLOCK_ERROR_NS_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    agent_id: str
    session_id: str
    report_seq: int
    ranks: _containers.RepeatedCompositeFieldContainer[RankProgress]
    clock_offset_ns: int
    clock_error_ns: int
    columns: ProgressColumns
    def __init__(self, job_id: _Optional[str] = ..., agent_id: _Optional[str] = ..., session_id: _Optional[str] = ..., report_seq: _Optional[int] = ..., ranks: _Optional[_Iterable[_Union[RankProgress, _Mapping]]] = ..., clock_offset_ns: _Optional[int] = ..., clock_error_ns: _Optional[int] = ..., columns: _Optional[_Union[ProgressColumns, _Mapping]] = ...) -> None: ...

class ProgressColumns(_message.Message):
    __slots__ = ("rank", "rank_codes", "rank_counts", "fr_age_s", "cell_rank", "cell_group", "cell_flags", "cell_counts", "in_flight_age_s", "in_flight_op", "ops", "rank_io")
    RANK_FIELD_NUMBER: _ClassVar[int]
    RANK_CODES_FIELD_NUMBER: _ClassVar[int]
    RANK_COUNTS_FIELD_NUMBER: _ClassVar[int]
    FR_AGE_S_FIELD_NUMBER: _ClassVar[int]
    CELL_RANK_FIELD_NUMBER: _ClassVar[int]
    CELL_GROUP_FIELD_NUMBER: _ClassVar[int]
    CELL_FLAGS_FIELD_NUMBER: _ClassVar[int]
    CELL_COUNTS_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_AGE_S_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_OP_FIELD_NUMBER: _ClassVar[int]
    OPS_FIELD_NUMBER: _ClassVar[int]
    RANK_IO_FIELD_NUMBER: _ClassVar[int]
    rank: bytes
    rank_codes: bytes
    rank_counts: bytes
    fr_age_s: bytes
    cell_rank: bytes
    cell_group: bytes
    cell_flags: bytes
    cell_counts: bytes
    in_flight_age_s: bytes
    in_flight_op: bytes
    ops: _containers.RepeatedScalarFieldContainer[str]
    rank_io: bytes
    def __init__(self, rank: _Optional[bytes] = ..., rank_codes: _Optional[bytes] = ..., rank_counts: _Optional[bytes] = ..., fr_age_s: _Optional[bytes] = ..., cell_rank: _Optional[bytes] = ..., cell_group: _Optional[bytes] = ..., cell_flags: _Optional[bytes] = ..., cell_counts: _Optional[bytes] = ..., in_flight_age_s: _Optional[bytes] = ..., in_flight_op: _Optional[bytes] = ..., ops: _Optional[_Iterable[str]] = ..., rank_io: _Optional[bytes] = ...) -> None: ...

class ProgressAck(_message.Message):
    __slots__ = ("known", "report_seq")
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    REPORT_SEQ_FIELD_NUMBER: _ClassVar[int]
    known: bool
    report_seq: int
    def __init__(self, known: _Optional[bool] = ..., report_seq: _Optional[int] = ...) -> None: ...

class ProgressBatch(_message.Message):
    __slots__ = ("reports", "relay_id")
    REPORTS_FIELD_NUMBER: _ClassVar[int]
    RELAY_ID_FIELD_NUMBER: _ClassVar[int]
    reports: _containers.RepeatedCompositeFieldContainer[ProgressReport]
    relay_id: str
    def __init__(self, reports: _Optional[_Iterable[_Union[ProgressReport, _Mapping]]] = ..., relay_id: _Optional[str] = ...) -> None: ...

class RelayAck(_message.Message):
    __slots__ = ("acks",)
    ACKS_FIELD_NUMBER: _ClassVar[int]
    acks: _containers.RepeatedCompositeFieldContainer[RelayedAck]
    def __init__(self, acks: _Optional[_Iterable[_Union[RelayedAck, _Mapping]]] = ...) -> None: ...

class RelayedAck(_message.Message):
    __slots__ = ("session_id", "report_seq", "known", "invalid")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REPORT_SEQ_FIELD_NUMBER: _ClassVar[int]
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    INVALID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    report_seq: int
    known: bool
    invalid: str
    def __init__(self, session_id: _Optional[str] = ..., report_seq: _Optional[int] = ..., known: _Optional[bool] = ..., invalid: _Optional[str] = ...) -> None: ...

class FrEntry(_message.Message):
    __slots__ = ("rank", "record_id", "group", "collective_seq", "p2p_seq", "profiling_name", "state", "retired", "is_p2p", "age_s", "input_sizes_json", "input_dtypes_json")
    RANK_FIELD_NUMBER: _ClassVar[int]
    RECORD_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVE_SEQ_FIELD_NUMBER: _ClassVar[int]
    P2P_SEQ_FIELD_NUMBER: _ClassVar[int]
    PROFILING_NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    RETIRED_FIELD_NUMBER: _ClassVar[int]
    IS_P2P_FIELD_NUMBER: _ClassVar[int]
    AGE_S_FIELD_NUMBER: _ClassVar[int]
    INPUT_SIZES_JSON_FIELD_NUMBER: _ClassVar[int]
    INPUT_DTYPES_JSON_FIELD_NUMBER: _ClassVar[int]
    rank: int
    record_id: int
    group: str
    collective_seq: int
    p2p_seq: int
    profiling_name: str
    state: str
    retired: bool
    is_p2p: bool
    age_s: float
    input_sizes_json: str
    input_dtypes_json: str
    def __init__(self, rank: _Optional[int] = ..., record_id: _Optional[int] = ..., group: _Optional[str] = ..., collective_seq: _Optional[int] = ..., p2p_seq: _Optional[int] = ..., profiling_name: _Optional[str] = ..., state: _Optional[str] = ..., retired: _Optional[bool] = ..., is_p2p: _Optional[bool] = ..., age_s: _Optional[float] = ..., input_sizes_json: _Optional[str] = ..., input_dtypes_json: _Optional[str] = ...) -> None: ...

class EntryBatch(_message.Message):
    __slots__ = ("job_id", "agent_id", "session_id", "entries", "dropped")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    agent_id: str
    session_id: str
    entries: _containers.RepeatedCompositeFieldContainer[FrEntry]
    dropped: int
    def __init__(self, job_id: _Optional[str] = ..., agent_id: _Optional[str] = ..., session_id: _Optional[str] = ..., entries: _Optional[_Iterable[_Union[FrEntry, _Mapping]]] = ..., dropped: _Optional[int] = ...) -> None: ...

class EntryAck(_message.Message):
    __slots__ = ("known",)
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    known: bool
    def __init__(self, known: _Optional[bool] = ...) -> None: ...

class Event(_message.Message):
    __slots__ = ("job_id", "agent_id", "session_id", "kind", "rank", "detail", "age_s")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    AGE_S_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    agent_id: str
    session_id: str
    kind: EventKind
    rank: int
    detail: str
    age_s: float
    def __init__(self, job_id: _Optional[str] = ..., agent_id: _Optional[str] = ..., session_id: _Optional[str] = ..., kind: _Optional[_Union[EventKind, str]] = ..., rank: _Optional[int] = ..., detail: _Optional[str] = ..., age_s: _Optional[float] = ...) -> None: ...

class EventAck(_message.Message):
    __slots__ = ("incident_id",)
    INCIDENT_ID_FIELD_NUMBER: _ClassVar[int]
    incident_id: str
    def __init__(self, incident_id: _Optional[str] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("job_id", "agent_id", "session_id")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    agent_id: str
    session_id: str
    def __init__(self, job_id: _Optional[str] = ..., agent_id: _Optional[str] = ..., session_id: _Optional[str] = ...) -> None: ...

class CommandWatch(_message.Message):
    __slots__ = ("opened", "closed", "relay_id")
    OPENED_FIELD_NUMBER: _ClassVar[int]
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    RELAY_ID_FIELD_NUMBER: _ClassVar[int]
    opened: _containers.RepeatedCompositeFieldContainer[WatchRequest]
    closed: _containers.RepeatedCompositeFieldContainer[WatchRequest]
    relay_id: str
    def __init__(self, opened: _Optional[_Iterable[_Union[WatchRequest, _Mapping]]] = ..., closed: _Optional[_Iterable[_Union[WatchRequest, _Mapping]]] = ..., relay_id: _Optional[str] = ...) -> None: ...

class RelayedCommand(_message.Message):
    __slots__ = ("session_id", "command", "end")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    command: Command
    end: WatchEnd
    def __init__(self, session_id: _Optional[str] = ..., command: _Optional[_Union[Command, _Mapping]] = ..., end: _Optional[_Union[WatchEnd, str]] = ...) -> None: ...

class RelayedCommands(_message.Message):
    __slots__ = ("commands",)
    COMMANDS_FIELD_NUMBER: _ClassVar[int]
    commands: _containers.RepeatedCompositeFieldContainer[RelayedCommand]
    def __init__(self, commands: _Optional[_Iterable[_Union[RelayedCommand, _Mapping]]] = ...) -> None: ...

class Command(_message.Message):
    __slots__ = ("kind", "incident_id", "reason", "deadline_s", "tail_context", "ranks", "grace_s", "pids")
    KIND_FIELD_NUMBER: _ClassVar[int]
    INCIDENT_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    TAIL_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    GRACE_S_FIELD_NUMBER: _ClassVar[int]
    PIDS_FIELD_NUMBER: _ClassVar[int]
    kind: CommandKind
    incident_id: str
    reason: str
    deadline_s: float
    tail_context: int
    ranks: _containers.RepeatedScalarFieldContainer[int]
    grace_s: float
    pids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, kind: _Optional[_Union[CommandKind, str]] = ..., incident_id: _Optional[str] = ..., reason: _Optional[str] = ..., deadline_s: _Optional[float] = ..., tail_context: _Optional[int] = ..., ranks: _Optional[_Iterable[int]] = ..., grace_s: _Optional[float] = ..., pids: _Optional[_Iterable[int]] = ...) -> None: ...

class BundleChunk(_message.Message):
    __slots__ = ("job_id", "agent_id", "incident_id", "rank", "file_name", "offset", "data", "last", "sha256", "total_size", "node_archive")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    INCIDENT_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    FILE_NAME_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SIZE_FIELD_NUMBER: _ClassVar[int]
    NODE_ARCHIVE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    agent_id: str
    incident_id: str
    rank: int
    file_name: str
    offset: int
    data: bytes
    last: bool
    sha256: str
    total_size: int
    node_archive: bool
    def __init__(self, job_id: _Optional[str] = ..., agent_id: _Optional[str] = ..., incident_id: _Optional[str] = ..., rank: _Optional[int] = ..., file_name: _Optional[str] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., last: _Optional[bool] = ..., sha256: _Optional[str] = ..., total_size: _Optional[int] = ..., node_archive: _Optional[bool] = ...) -> None: ...

class UploadAck(_message.Message):
    __slots__ = ("incident_id", "rank", "file_name", "bytes_stored", "complete", "duplicate")
    INCIDENT_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    FILE_NAME_FIELD_NUMBER: _ClassVar[int]
    BYTES_STORED_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    incident_id: str
    rank: int
    file_name: str
    bytes_stored: int
    complete: bool
    duplicate: bool
    def __init__(self, incident_id: _Optional[str] = ..., rank: _Optional[int] = ..., file_name: _Optional[str] = ..., bytes_stored: _Optional[int] = ..., complete: _Optional[bool] = ..., duplicate: _Optional[bool] = ...) -> None: ...

class BundleChunks(_message.Message):
    __slots__ = ("chunks",)
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    chunks: _containers.RepeatedCompositeFieldContainer[BundleChunk]
    def __init__(self, chunks: _Optional[_Iterable[_Union[BundleChunk, _Mapping]]] = ...) -> None: ...

class UploadFilesAck(_message.Message):
    __slots__ = ("files",)
    FILES_FIELD_NUMBER: _ClassVar[int]
    files: _containers.RepeatedCompositeFieldContainer[UploadAck]
    def __init__(self, files: _Optional[_Iterable[_Union[UploadAck, _Mapping]]] = ...) -> None: ...

class DumpResult(_message.Message):
    __slots__ = ("job_id", "agent_id", "incident_id", "ranks_dumped", "failures", "actions")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    INCIDENT_ID_FIELD_NUMBER: _ClassVar[int]
    RANKS_DUMPED_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    ACTIONS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    agent_id: str
    incident_id: str
    ranks_dumped: _containers.RepeatedScalarFieldContainer[int]
    failures: _containers.RepeatedCompositeFieldContainer[RankFailure]
    actions: _containers.RepeatedCompositeFieldContainer[ActionResult]
    def __init__(self, job_id: _Optional[str] = ..., agent_id: _Optional[str] = ..., incident_id: _Optional[str] = ..., ranks_dumped: _Optional[_Iterable[int]] = ..., failures: _Optional[_Iterable[_Union[RankFailure, _Mapping]]] = ..., actions: _Optional[_Iterable[_Union[ActionResult, _Mapping]]] = ...) -> None: ...

class ActionResult(_message.Message):
    __slots__ = ("rank", "pid", "outcome", "signals", "exit_s", "detail")
    RANK_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    SIGNALS_FIELD_NUMBER: _ClassVar[int]
    EXIT_S_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    rank: int
    pid: int
    outcome: str
    signals: _containers.RepeatedScalarFieldContainer[str]
    exit_s: float
    detail: str
    def __init__(self, rank: _Optional[int] = ..., pid: _Optional[int] = ..., outcome: _Optional[str] = ..., signals: _Optional[_Iterable[str]] = ..., exit_s: _Optional[float] = ..., detail: _Optional[str] = ...) -> None: ...

class RankFailure(_message.Message):
    __slots__ = ("rank", "reason")
    RANK_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    rank: int
    reason: str
    def __init__(self, rank: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class DumpResultAck(_message.Message):
    __slots__ = ("accepted",)
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    def __init__(self, accepted: _Optional[bool] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ("client_send_ns",)
    CLIENT_SEND_NS_FIELD_NUMBER: _ClassVar[int]
    client_send_ns: int
    def __init__(self, client_send_ns: _Optional[int] = ...) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("serving", "version", "agents_connected", "dashboard_url", "stall_timeout_s", "receive_ns", "send_ns")
    SERVING_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    AGENTS_CONNECTED_FIELD_NUMBER: _ClassVar[int]
    DASHBOARD_URL_FIELD_NUMBER: _ClassVar[int]
    STALL_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    RECEIVE_NS_FIELD_NUMBER: _ClassVar[int]
    SEND_NS_FIELD_NUMBER: _ClassVar[int]
    serving: bool
    version: str
    agents_connected: int
    dashboard_url: str
    stall_timeout_s: float
    receive_ns: int
    send_ns: int
    def __init__(self, serving: _Optional[bool] = ..., version: _Optional[str] = ..., agents_connected: _Optional[int] = ..., dashboard_url: _Optional[str] = ..., stall_timeout_s: _Optional[float] = ..., receive_ns: _Optional[int] = ..., send_ns: _Optional[int] = ...) -> None: ...
