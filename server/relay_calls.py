"""The agents' own calls that a relay carries to the coordinator unchanged.

An agent behind a relay used to register, report events, upload and answer
dumps on a connection of its own to the coordinator, held open for its
session by its clock exchange. Each such connection costs the coordinator
about 20 KB whatever the channel's arguments (benchmarks/grpc_conn_memory.py):
2.5 KB a rank at 8 ranks a node, most of the 3 KB a rank the coordinator may
spend. Through its relay an agent needs no connection to the coordinator at
all, and an incident's uploads reach the coordinator on a relay's few
connections, not on one per node opened in the same second.

A call passes as bytes, never decoded here: the request, the agent's own
`authorization` (so the coordinator, not the relay, decides who it is), its
deadline, and the coordinator's answer or status and details, unchanged. A
relay that cannot reach the coordinator answers as the coordinator's gRPC
client sees it (UNAVAILABLE); the agent then makes the same call straight to
the coordinator (agent.client.RELAY_FAULTS). An upload already streaming
cannot be replayed by the relay; the agent's uploader sends it again.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Awaitable
from typing import Any, Final

import grpc
from hangwatch.server.ingest.auth import SERVICE

from hangwatch.wire import pb, rpc

log = logging.getLogger("hangwatch.relay")

# Carried as they are: the calls an agent makes on its session besides its
# progress and commands (the relay's own) and Health (answered here for
# probes; an agent's clock exchange is passed on by RelayService.Health).
# True: the request is a client stream (uploads).
CARRIED: Final = {
    "Register": False,
    "ReportEntries": False,
    "ReportEvent": False,
    "CompleteDump": False,
    "UploadBundle": True,
    "UploadFiles": True,
}
# Of the agent's metadata, what the coordinator reads. Nothing else crosses:
# gRPC's own headers are the relay's to set on its call.
PASSED_METADATA: Final = frozenset({"authorization"})


def agent_metadata(context: grpc.aio.ServicerContext[Any, Any]) -> tuple[tuple[str, str], ...]:
    """The agent's metadata that goes on with its call."""
    return tuple(
        (k, v if isinstance(v, str) else bytes(v).decode())
        for k, v in context.invocation_metadata() or ()
        if k in PASSED_METADATA
    )


class CarriedCalls:
    """Handlers for the CARRIED methods on a channel to the coordinator, and
    what they carried (`calls`, by method) or failed with (`failed`, by
    status code), for /metrics. The counters are the relay loop's alone."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self._channel = channel
        self._stub = rpc.CoordinatorStub(channel)
        self.calls: Counter[str] = Counter()
        self.failed: Counter[str] = Counter()

    def handlers(self) -> dict[str, grpc.RpcMethodHandler]:
        return {name: self._handler(name, streaming) for name, streaming in CARRIED.items()}

    def _handler(self, name: str, streaming: bool) -> grpc.RpcMethodHandler:
        """The method's call made again upstream: the request (a unary one's
        bytes, or a stream's messages as they come), then the answer."""
        path = f"/{SERVICE}/{name}"
        channel = self._channel
        upstream = channel.stream_unary(path) if streaming else channel.unary_unary(path)

        async def carry(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
            call = upstream(
                request, timeout=context.time_remaining(), metadata=agent_metadata(context)
            )
            answer: bytes = await self._answer(name, call, context)
            return answer

        if streaming:
            return grpc.stream_unary_rpc_method_handler(carry)
        return grpc.unary_unary_rpc_method_handler(carry)

    async def health(
        self, request: pb.HealthRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.HealthResponse:
        """An agent's clock exchange, answered by the coordinator."""
        call = self._stub.Health(
            request, timeout=context.time_remaining(), metadata=agent_metadata(context)
        )
        resp: pb.HealthResponse = await self._answer("Health", call, context)
        return resp

    async def _answer(
        self, name: str, call: Awaitable[Any], context: grpc.aio.ServicerContext[Any, Any]
    ) -> Any:
        """The coordinator's answer, or its status given to the agent as is."""
        self.calls[name] += 1
        try:
            return await call
        except grpc.aio.AioRpcError as e:
            code = e.code()
            self.failed[code.name] += 1
            log.debug("carried %s failed: %s: %s", name, code.name, e.details())
            await context.abort(code, e.details() or "")
            raise  # abort raises; this line only tells mypy so
