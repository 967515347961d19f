"""The agents' command watches a relay carries on one RelayCommands stream.

Each watch is what a WatchCommands call is at the coordinator, without a
stream of its own: the agent's mailbox wakes it, its commands are sent once
each per watch (a new watch sends the mailbox again, as a new call does), and
it ends as WatchCommands ends (an unknown session: FAILED_PRECONDITION, the
agent re-registers; a replaced one: normally). What a whole relay's watches
have due goes out as one message: an incident's DUMP to 512 agents through 8
relays is 8 messages on the coordinator's loop, not 512 streams woken.

Lives on the gRPC loop only; the registry's wakers reach it through
`call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Any, Final

import grpc
from hangwatch.server.ingest import validate
from hangwatch.server.ingest.requests import next_request
from hangwatch.server.live.registry import JobRegistry, StaleSession

from hangwatch.wire import pb

# Commands a RelayedCommands message carries at most: a DUMP is ~100 bytes,
# so a relay of 4,096 agents gets its incident in 4 messages of ~100 KB.
MAX_COMMANDS_A_MESSAGE: Final = 1024


@dataclass
class _Watch:
    # The WatchRequest's names, not the message: a sub-message keeps its
    # whole CommandWatch alive (ingest.requests).
    job_id: str
    agent_id: str
    token: int
    delivered: set[tuple[str, int]] = field(default_factory=set)


class RelayedWatches:
    """One RelayCommands stream's watches (`read` its CommandWatch messages;
    `due` what is to be sent; `close` at its end)."""

    def __init__(self, registry: JobRegistry, loop: asyncio.AbstractEventLoop) -> None:
        self.registry = registry
        self.loop = loop
        self.wake = asyncio.Event()
        self.relay_id = ""
        self._watches: dict[str, _Watch] = {}
        self._woken: set[str] = set()
        self._ended: list[pb.RelayedCommand] = []

    def __len__(self) -> int:
        return len(self._watches)

    async def read(self, context: grpc.aio.ServicerContext[pb.CommandWatch, Any]) -> None:
        """Apply the relay's messages until it closes its side. Raises
        validate.Invalid for a watch naming no valid sender."""
        while (msg := await next_request(context)) is not None:
            self._apply(msg)
            del msg

    def _apply(self, msg: pb.CommandWatch) -> None:
        if msg.relay_id and not self.relay_id:
            self.relay_id = msg.relay_id[:128]
        for req in msg.closed:
            self._close(req.session_id)
        for req in msg.opened:
            validate.sender(req)
            self._open(req)

    def _open(self, req: pb.WatchRequest) -> None:
        sid = req.session_id
        self._close(sid)  # opened again: a new call, its commands sent again

        def waker() -> None:
            self.loop.call_soon_threadsafe(self._woke, sid)

        try:
            token = self.registry.add_waker(sid, req.job_id, req.agent_id, waker)
        except StaleSession:
            self._ended.append(pb.RelayedCommand(session_id=sid, end=pb.WATCH_END_UNKNOWN_SESSION))
            self.wake.set()
            return
        self._watches[sid] = _Watch(job_id=req.job_id, agent_id=req.agent_id, token=token)
        self._woke(sid)

    def _woke(self, sid: str) -> None:
        self._woken.add(sid)
        self.wake.set()

    def _close(self, sid: str) -> None:
        w = self._watches.pop(sid, None)
        self._woken.discard(sid)
        if w is not None:
            self.registry.remove_waker(w.job_id, w.agent_id, w.token)

    def due(self, *, every: bool = False) -> list[pb.RelayedCommand]:
        """What to send now: the woken watches' new commands (every watch's,
        with `every`: the periodic re-check) and the watches that ended."""
        sids = list(self._watches) if every else [s for s in self._woken if s in self._watches]
        self._woken.clear()
        out, self._ended = self._ended, []
        now = self.registry.now()
        for sid in sids:
            w = self._watches[sid]
            try:
                cmds = self.registry.pending_commands(sid, w.job_id, w.agent_id)
            except StaleSession:  # a newer Register replaced it: the agent opens a new call
                self._close(sid)
                out.append(pb.RelayedCommand(session_id=sid, end=pb.WATCH_END_REPLACED))
                continue
            for cmd in cmds:
                if (cmd.incident_id, cmd.kind) not in w.delivered:
                    w.delivered.add((cmd.incident_id, cmd.kind))
                    out.append(pb.RelayedCommand(session_id=sid, command=cmd.to_pb(now)))
        return out

    async def wait(self, timeout: float) -> bool:
        """Until woken or `timeout`; False on the timeout (re-check every watch)."""
        woken = False
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.wake.wait(), timeout)
            woken = True
        self.wake.clear()
        return woken

    def close(self) -> None:
        """The stream ended: no waker outlives it."""
        for sid in list(self._watches):
            self._close(sid)


def messages(commands: list[pb.RelayedCommand]) -> list[pb.RelayedCommands]:
    """`commands` in messages of at most MAX_COMMANDS_A_MESSAGE."""
    return [
        pb.RelayedCommands(commands=commands[i : i + MAX_COMMANDS_A_MESSAGE])
        for i in range(0, len(commands), MAX_COMMANDS_A_MESSAGE)
    ]
