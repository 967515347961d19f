"""Reason codes that files, the wire and the store spell as text, as enums.

Each value is exactly the text earlier releases wrote, so old incidents,
bundles and rank-info files read unchanged; code compares members, never
string literals or prefixes.
"""

from __future__ import annotations

from enum import StrEnum


class TriggerKind(StrEnum):
    """What opened an incident (the store's trigger column, incident.json's trigger.kind)."""

    STALL = "stall"
    WATCHDOG = "watchdog"  # torch's watchdog wrote its dump-on-timeout file
    TIMEOUT = "timeout"  # a collective timeout escaped to the top of a rank
    RANK_LOST = "rank-lost"  # a stalled group's member process is dead
    AGENT_LOST = "agent-lost"  # the only missing members are ones nobody can observe
    BACKEND_UNHEALTHY = "backend-unhealthy"  # torch 2.15 health check or abort hook
    CRASH = "crash"  # a rank died of an uncaught exception
    # every rank alive, none in a collective, no counter moving after steady
    # progress: a hang FR cannot see (gloo p2p, Python before a collective)
    NO_PROGRESS = "no-progress"


class StallKind(StrEnum):
    """How the detector classed one stalled (group, seq)."""

    STALL = "stall"  # some members never entered it
    MISMATCH = "mismatch"  # members entered different ops at that seq
    RANK_LOST = "rank-lost"
    AGENT_LOST = "agent-lost"


class MissingReason(StrEnum):
    """Why a rank's dump is not in an incident's bundle.

    On the wire (`RankFailure.reason`), in incident.json's
    `ranks_unreachable` and in the store the reason is text: the code's
    value, then sometimes a detail (`"agent unreachable: node-3 silent for
    12.0s"`, `"no answer before deadline (30s)"`). `of` reads the code back.
    """

    # Nobody could look at the rank: it is unobserved, not guilty.
    AGENT_UNREACHABLE = "agent unreachable"
    NO_ANSWER = "no answer before deadline"
    RESTARTED = "coordinator restarted before this rank's dump arrived"
    # The agent looked and could not dump it.
    NO_RESULT = "agent reported no result for this rank"
    DUMP_FAILED = "dump failed"
    PROCESS_STOPPED = "process stopped (SIGSTOP?)"
    PROCESS_DEAD = "process"  # "process gone", "process zombie": the state follows
    NO_FR_DUMP = "no FR dump"

    @property
    def unobserved(self) -> bool:
        return self in _UNOBSERVED

    def text(self, detail: str = "") -> str:
        """The reason as written: `"<code>: <detail>"`, or the code alone."""
        return f"{self.value}: {detail}" if detail else self.value

    @classmethod
    def of(cls, text: str) -> MissingReason | None:
        """The code a written reason starts with (longest match); None for
        free text (an upload refusal, a newer agent's reason)."""
        for code in _BY_LENGTH:
            if text.startswith(code.value):
                return code
        return None


_UNOBSERVED = frozenset(
    {MissingReason.AGENT_UNREACHABLE, MissingReason.NO_ANSWER, MissingReason.RESTARTED}
)
_BY_LENGTH = sorted(MissingReason, key=lambda c: -len(c.value))


class JobStopped(StrEnum):
    """Why a job counts as over (an ended incident's close reason says it)."""

    FORGOTTEN = "the coordinator no longer tracks the job"
    AGENTS_GONE = "every agent of the job is gone"
    RANKS_EXITED = "every rank of the job exited"


class HookEventKind(StrEnum):
    """A line of a rank's `<pid>.events.jsonl` (HookEvent.kind)."""

    COLLECTIVE_TIMEOUT = "collective-timeout"
    UNCAUGHT_EXCEPTION = "uncaught-exception"
    BACKEND_ABORT = "backend-abort"  # torch called our abort hook on a group


class RecorderKind(StrEnum):
    """Which family of flight recorder an instance is (hangwatch.recorders)."""

    GENERIC = "generic"  # torch's default instance: gloo
    NCCL = "nccl-legacy"  # ProcessGroupNCCL's own recorder
    HOOKED = "hooked"  # FlightRecorderHook, one instance per backend name


class Completion(StrEnum):
    """Whether a recorder instance records when a collective completes."""

    TRACKED = "tracked"
    UNKNOWN = "unknown"  # hook-recorded: `retired` means the call returned


class FrSource(StrEnum):
    """How a rank's FR was read (rank-info `fr_source`, rank-meta `sources.fr`)."""

    WORKER_SERVER = "worker-server"  # torch's C++ worker server on the rank's socket
    THREAD = "thread"  # the hook's Python-thread fallback server
    ABORT_FILE = "abort-file"  # the hook's dump when torch aborted a group
    EXIT_FILE = "exit-file"  # the hook's dump as the rank died (exception, SIGTERM)
    WATCHDOG_FILE = "watchdog-file"  # torch's own dump-on-timeout file
    DUMP_FILE = "dump-file"  # a plain dump directory, no agent
    NONE = "none"
