"""A burst of calls that arrives while the server cannot take them.

An incident makes every agent call the coordinator at once (phase-one
uploads, CompleteDump). gRPC's C core keeps calls the Python server has not
taken yet in a queue and cancels new ones past its limits (from 1,000 at
random, all past 3,000): at 16,384 simulated ranks up to 130 of 2,048 nodes'
uploads ended CANCELLED. The coordinator's and the relay's servers raise the
limits (`hangwatch.wire.server_backlog_options`). Here the server's event loop
is held busy while 3,500 calls arrive, so all of them wait in that queue:
with gRPC's defaults some are cancelled (the control: the burst did build
the backlog), with the coordinator's options none.
"""

from __future__ import annotations

import asyncio
import collections
import threading
from typing import Any

import grpc
import pytest
from hangwatch.server.coordinator import grpc_options
from hangwatch.server.relay import Relay

from hangwatch.config import Config
from hangwatch.wire import server_backlog_options

BURST = 3_500  # past gRPC's default hard limit
CHANNELS = 16
HOLD_MAX_S = 30.0  # the server's loop is held until the burst is out, at most this


class _Server:
    """A plain grpc.aio server on its own thread and loop, port 0."""

    def __init__(self, options: list[tuple[str, Any]]) -> None:
        self._options = options
        self.release = threading.Event()  # ends the Hold call
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.port = 0
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)
        self._thread.start()
        assert self._ready.wait(30), "server did not start"

    async def _main(self) -> None:
        async def hold(request: bytes, context: Any) -> bytes:
            # Blocks this loop: no call is taken until the burst is out.
            self.release.wait(HOLD_MAX_S)
            return b""

        async def echo(request: bytes, context: Any) -> bytes:
            return request

        server = grpc.aio.server(options=self._options)
        server.add_generic_rpc_handlers(
            (
                grpc.method_handlers_generic_handler(
                    "t.Burst",
                    {
                        "Hold": grpc.unary_unary_rpc_method_handler(hold),
                        "Echo": grpc.unary_unary_rpc_method_handler(echo),
                    },
                ),
            )
        )
        self.port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._ready.set()
        await self._stop.wait()
        await server.stop(None)

    def close(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)


async def _burst(port: int, release: threading.Event) -> collections.Counter[str]:
    # Separate connections, as separate agents have.
    opts = [("grpc.use_local_subchannel_pool", 1), ("grpc.enable_retries", 0)]
    channels = [
        grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=opts) for _ in range(CHANNELS)
    ]
    try:
        for ch in channels:
            await asyncio.wait_for(ch.channel_ready(), 30)
        hold = asyncio.ensure_future(channels[0].unary_unary("/t.Burst/Hold")(b"", timeout=60))
        await asyncio.sleep(0.3)  # the server's loop is now held

        started = 0

        async def one(i: int) -> str:
            nonlocal started
            call = channels[i % CHANNELS].unary_unary("/t.Burst/Echo")(b"x", timeout=60)
            started += 1
            try:
                await call
                return "OK"
            except grpc.aio.AioRpcError as e:
                return e.code().name

        async def release_when_out() -> None:
            # Every call started, and half a second for the last to reach
            # the server: on a loaded machine the burst takes seconds to send.
            while started < BURST:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.5)
            release.set()

        releaser = asyncio.ensure_future(release_when_out())
        out = collections.Counter(await asyncio.gather(*(one(i) for i in range(BURST))))
        await releaser
        await hold
        return out
    finally:
        await asyncio.gather(*(ch.close() for ch in channels))


def _run(options: list[tuple[str, Any]]) -> collections.Counter[str]:
    server = _Server(options)
    try:
        return asyncio.run(_burst(server.port, server.release))
    finally:
        server.release.set()
        server.close()


@pytest.mark.timeout(120)
def test_a_burst_past_grpcs_default_backlog_is_taken_whole_by_the_coordinators_options() -> None:
    control = _run([])
    assert control["CANCELLED"] > 0, control  # gRPC's defaults: the burst lost calls
    ours = _run(grpc_options(Config()))
    assert ours == collections.Counter({"OK": BURST}), ours


def test_the_relay_serves_with_the_same_backlog() -> None:
    """The relay's agent-facing server takes the same options (its agents
    reconnect together when it restarts)."""
    assert set(server_backlog_options()) <= set(Relay.server_options(1 << 20))
