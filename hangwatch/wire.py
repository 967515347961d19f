"""The generated gRPC stubs under short names: `pb` (messages) and `rpc` (service),
and the names of the enums that other formats (meta.json, the API) spell out."""

from collections.abc import Iterable, Sequence
from typing import Final

from hangwatch._proto.hangwatch.v1 import hangwatch_pb2 as pb
from hangwatch._proto.hangwatch.v1 import hangwatch_pb2_grpc as rpc

__all__ = [
    "COLLECTIVES_UNKNOWN",
    "DEAD_PROCESS_STATES",
    "EXITED_PROCESS_STATES",
    "MAX_RELAYED_REPORTS",
    "group_info",
    "group_members",
    "member_runs",
    "next_seq",
    "pb",
    "process_state_name",
    "rpc",
    "seq_count",
]

_PROCESS_STATE_NAMES: Final[dict[int, str]] = {
    pb.PROCESS_STATE_UNSPECIFIED: "unknown",
    pb.PROCESS_STATE_RUNNING: "running",
    pb.PROCESS_STATE_STOPPED: "stopped",
    pb.PROCESS_STATE_ZOMBIE: "zombie",
    pb.PROCESS_STATE_GONE: "gone",
    pb.PROCESS_STATE_UNRESPONSIVE: "unresponsive",
}
# Process states (by name) in which a rank can never finish a collective...
DEAD_PROCESS_STATES: Final = frozenset({"stopped", "zombie", "gone"})
# ... and in which it has left the job for good.
EXITED_PROCESS_STATES: Final = frozenset({"zombie", "gone"})
# GroupProgress.collectives_enqueued/_completed: the group does p2p and the
# rank moved on since its FR entries were read, so its collective count is not known.
COLLECTIVES_UNKNOWN: Final = -2


def seq_count(seq: int) -> int:
    """How many collectives a GroupProgress number (last_enqueued, last_completed,
    collectives_*) says: every counter numbers the first collective 1 and says
    -1 for none (hangwatch.recorders' status offset), so the numbers jump by two
    where the count moves by one."""
    return max(seq, 0)


def next_seq(completed: int) -> int:
    """The collective after `completed`: the one in flight where more were
    entered. #1 after none, not "#0" (no op is numbered 0: its name was not found)."""
    return seq_count(completed) + 1


# Most reports in one ProgressBatch. A relay of 64 nodes sends ~16 a batch at
# a 0.25 s window, and all 64 at once after a reconnect (full reports, ~2.5 KB
# each at 8 ranks); 1,024 of the largest reports an agent sends stay under the
# 8 MiB message limit only if they average 8 KB, so a relay also splits by bytes.
MAX_RELAYED_REPORTS: Final = 1024


def process_state_name(value: int) -> str:
    """A pb.ProcessState as meta.json, the API and the dashboard name it."""
    return _PROCESS_STATE_NAMES.get(value, "unknown")


def event_kind_name(value: int) -> str:
    """A pb.EventKind's name; a kind this build does not know (a newer agent's)
    reads EVENT_KIND_<number> instead of raising where it is logged or shown."""
    try:
        return pb.EventKind.Name(value)  # type: ignore[arg-type]
    except ValueError:
        return f"EVENT_KIND_{value}"


def message_size_options(max_bytes: int) -> list[tuple[str, int]]:
    """gRPC channel options capping messages both ways at `max_bytes`
    (--max-message-bytes): agent and coordinator must agree, since bundles travel
    in chunks sized below it."""
    return [
        ("grpc.max_send_message_length", max_bytes),
        ("grpc.max_receive_message_length", max_bytes),
    ]


# gRPC's C core cancels a call that arrives while too many others wait for
# the Python server to take them: at random past a soft limit (default
# 1,000), every one past a hard limit (3,000). An incident makes every agent
# call at once: at 16,384 simulated ranks 4-130 of 2,048 nodes' phase-one
# uploads ended CANCELLED, and on loopback a burst of 2,048 calls lost 7-9%
# (benchmarks/call_burst.py). Sized for 4,096 agents (32,768 ranks) with four
# calls each waiting; a waiting call holds its first bytes, tens of KB.
SERVER_MAX_PENDING: Final = 16_384
SERVER_MAX_PENDING_HARD: Final = 65_536


def server_keepalive_options() -> list[tuple[str, int]]:
    """gRPC server options on pings, for every server agents dial (the
    coordinator, a relay). Agents ping every 20 s, with or without calls
    (agent.client.build_channel), and a hangwatch server rarely sends its
    agents anything. gRPC's default server takes one ping in 5 min "without
    data" and ends the connection after 2 strikes (GOAWAY too_many_pings):
    a relay that kept the defaults dropped its agents about a minute after
    they connected (32,768 simulated ranks through 16 relays), and they went
    straight to the coordinator. The server's own pings find dead agents'
    streams without waiting for TCP's timeouts."""
    return [
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
        ("grpc.http2.max_ping_strikes", 0),
    ]


def server_backlog_options() -> list[tuple[str, int]]:
    """gRPC server options: how many calls may wait to be taken (above)."""
    return [
        ("grpc.server.max_pending_requests", SERVER_MAX_PENDING),
        ("grpc.server.max_pending_requests_hard_limit", SERVER_MAX_PENDING_HARD),
    ]


def agent_server_options(max_bytes: int) -> list[tuple[str, int]]:
    """Every option of a gRPC server agents dial (the coordinator, a relay):
    their messages, their pings, their bursts; and no second server may bind
    its port."""
    return [
        *message_size_options(max_bytes),
        *server_keepalive_options(),
        ("grpc.so_reuseport", 0),
        *server_backlog_options(),
    ]


def member_runs(members: Iterable[int]) -> list[int]:
    """GroupInfo.rank_ranges for `members`: (start, stop, step) triples, the
    longest arithmetic run first, greedily."""
    ms = sorted(set(members))
    if len(ms) > 1:
        # One run (a world or data-parallel group) compared in C, not walked.
        step = ms[1] - ms[0]
        if ms == list(range(ms[0], ms[-1] + 1, step)):
            return [ms[0], ms[-1] + step, step]
    out: list[int] = []
    i = 0
    while i < len(ms):
        step = ms[i + 1] - ms[i] if i + 1 < len(ms) else 1
        j = i + 1
        while j < len(ms) and ms[j] - ms[j - 1] == step:
            j += 1
        out += (ms[i], ms[j - 1] + step, step)
        i = j
    return out


def group_info(*, name: str, desc: str, pg_id: int, members: Sequence[int]) -> pb.GroupInfo:
    """A GroupInfo with its members in the shorter of the two forms."""
    runs = member_runs(members)
    if len(runs) < len(members):
        return pb.GroupInfo(name=name, desc=desc, pg_id=pg_id, rank_ranges=runs)
    return pb.GroupInfo(name=name, desc=desc, pg_id=pg_id, ranks=sorted(set(members)))


def group_members(g: pb.GroupInfo) -> tuple[int, ...]:
    """A GroupInfo's members, ascending, from whichever form it carries (the
    triples must be checked first: server/ingest/validate.py)."""
    rr = g.rank_ranges
    if not rr:
        return tuple(sorted(set(g.ranks)))
    out: list[int] = []
    for k in range(0, len(rr) - 2, 3):
        out.extend(range(rr[k], rr[k + 1], rr[k + 2]))
    return tuple(out)
