"""The generated gRPC stubs under short names: `pb` (messages) and `rpc` (service),
and the names of the enums that other formats (meta.json, the API) spell out."""

from typing import Final

from hangwatch._proto.hangwatch.v1 import hangwatch_pb2 as pb
from hangwatch._proto.hangwatch.v1 import hangwatch_pb2_grpc as rpc

__all__ = [
    "COLLECTIVES_UNKNOWN",
    "DEAD_PROCESS_STATES",
    "EXITED_PROCESS_STATES",
    "pb",
    "process_state_name",
    "rpc",
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
