"""The bearer-token check of every hangwatch gRPC server (the coordinator, the relay)."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import grpc

if TYPE_CHECKING:
    from hangwatch.server.integrations.metrics import Metrics

SERVICE = "hangwatch.v1.Coordinator"
# Health answers without a token so load balancers and liveness probes work;
# it reveals only the version and a count of connected agents.
UNAUTHENTICATED_METHODS = frozenset({f"/{SERVICE}/Health"})


class TokenAuth(grpc.aio.ServerInterceptor):
    """Require `authorization: Bearer <token>` on every RPC but Health."""

    def __init__(self, token: str, metrics: Metrics | None = None) -> None:
        self._expected = f"Bearer {token}".encode()
        self._metrics = metrics

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method
        if method in UNAUTHENTICATED_METHODS:
            return await continuation(handler_call_details)
        presented = b""
        for key, value in handler_call_details.invocation_metadata or ():
            if key == "authorization":
                presented = value.encode() if isinstance(value, str) else bytes(value)
                break
        # compare_digest on equal-type bytes: no timing signal about the token.
        if presented and hmac.compare_digest(presented, self._expected):
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        if self._metrics is not None:
            self._metrics.inc(
                "hangwatch_grpc_requests_total",
                labels={"method": method.rsplit("/", 1)[-1], "code": "UNAUTHENTICATED"},
            )
        why = "missing bearer token" if not presented else "wrong bearer token"
        return _deny(handler, why)


def _deny(handler: grpc.RpcMethodHandler, why: str) -> grpc.RpcMethodHandler:
    async def unary(_request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)

    async def streaming(_requests: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)

    kw = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(streaming, **kw)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(streaming, **kw)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(unary, **kw)
    return grpc.unary_unary_rpc_method_handler(unary, **kw)
