"""Which of one poll's events come first: causes before their consequences."""

from __future__ import annotations

from typing import Final

from hangwatch.wire import pb

# How a rank's collective fails when a peer died first (gloo's TCP pair,
# NCCL's watchdog): its crash is a consequence, not the cause.
PEER_DEATH_MARKS: Final = (
    "Connection closed by peer",
    "Connection reset by peer",
    "remote process exited",
)


def causes_first(events: list[tuple[int, int, str]]) -> list[tuple[int, int, str]]:
    """One poll's events with the crashes caused by a peer's death last, so
    that the incident a crash opens names the rank that died first, and why."""

    def consequence(ev: tuple[int, int, str]) -> bool:
        return ev[0] == pb.EVENT_KIND_RANK_CRASHED and any(m in ev[2] for m in PEER_DEATH_MARKS)

    return sorted(events, key=consequence)
