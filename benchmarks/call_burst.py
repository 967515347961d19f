"""A burst of client-streaming calls at one grpc.aio server: how many gRPC cancels.

What an incident does to the coordinator: every agent opens its phase-one
upload (a client stream, like UploadFiles) within a second or two. Each
simulated agent here has its own connection; client processes share the
burst. The server reads each stream to its end and answers. gRPC's C core
queues calls the Python server has not taken yet and cancels arrivals past
its limits (at random from 1,000 waiting, all from 3,000), so part of the
burst ends CANCELLED before the server sees it.

The anchor is the server with gRPC's defaults; the other row is the same
server with `hangwatch.wire.server_backlog_options()`, as the coordinator and
the relay serve. Medians over `--rounds`.

    python benchmarks/call_burst.py                # 2,048 calls of 64 KB, 4 client processes
    python benchmarks/call_burst.py --calls 4096 --bytes 262144
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import multiprocessing
import multiprocessing.queues
import os
import statistics
import sys
import time
from typing import Any

import grpc

from hangwatch.wire import server_backlog_options

CHUNK = 64 * 1024
START_AFTER_S = 20.0  # every client connected before the burst


def _server(options: list[tuple[str, int]], ports: multiprocessing.queues.Queue[int]) -> None:
    async def up(request_iterator: Any, context: Any) -> bytes:
        n = 0
        async for m in request_iterator:
            n += len(m)
        return n.to_bytes(8, "little")

    async def main() -> None:
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", 8 << 20), *options])
        server.add_generic_rpc_handlers(
            (
                grpc.method_handlers_generic_handler(
                    "b.Burst", {"Up": grpc.stream_unary_rpc_method_handler(up)}
                ),
            )
        )
        ports.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await server.wait_for_termination()

    asyncio.run(main())


def _clients(
    port: int, n: int, size: int, start_at: float, out: multiprocessing.queues.Queue[Any]
) -> None:
    async def main() -> collections.Counter[str]:
        opts = [("grpc.use_local_subchannel_pool", 1), ("grpc.enable_retries", 0)]
        chans = [grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=opts) for _ in range(n)]
        for c in chans:
            await c.channel_ready()
        data = os.urandom(size)

        async def one(c: grpc.aio.Channel) -> str:
            async def chunks() -> Any:
                for i in range(0, size, CHUNK):
                    yield data[i : i + CHUNK]

            try:
                await c.stream_unary("/b.Burst/Up")(chunks(), timeout=120)
                return "OK"
            except grpc.aio.AioRpcError as e:
                return e.code().name

        await asyncio.sleep(max(0.0, start_at - time.time()))
        res = collections.Counter(await asyncio.gather(*(one(c) for c in chans)))
        await asyncio.gather(*(c.close() for c in chans))
        return res

    out.put(dict(asyncio.run(main())))


def burst(options: list[tuple[str, int]], calls: int, size: int, procs: int) -> dict[str, int]:
    ctx = multiprocessing.get_context("spawn")
    ports: multiprocessing.queues.Queue[int] = ctx.Queue()
    server = ctx.Process(target=_server, args=(options, ports), daemon=True)
    server.start()
    try:
        port = ports.get(timeout=60)
        out: multiprocessing.queues.Queue[Any] = ctx.Queue()
        start_at = time.time() + START_AFTER_S
        clients = [
            ctx.Process(target=_clients, args=(port, calls // procs, size, start_at, out))
            for _ in range(procs)
        ]
        for p in clients:
            p.start()
        total: collections.Counter[str] = collections.Counter()
        for _ in clients:
            total.update(out.get(timeout=300))
        for p in clients:
            p.join(60)
        return dict(total)
    finally:
        server.kill()
        server.join(10)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--calls", type=int, default=2048, help="calls in the burst, one connection each"
    )
    ap.add_argument("--bytes", type=int, default=65536, help="bytes each call streams")
    ap.add_argument("--procs", type=int, default=4, help="client processes")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    variants = {"grpc defaults (anchor)": [], "hangwatch server options": server_backlog_options()}
    lost: dict[str, list[int]] = {k: [] for k in variants}
    for _ in range(args.rounds):  # interleaved
        for name, options in variants.items():
            res = burst(options, args.calls, args.bytes, args.procs)
            lost[name].append(sum(v for k, v in res.items() if k != "OK"))
    med = {k: statistics.median(v) for k, v in lost.items()}
    anchor = med["grpc defaults (anchor)"]
    if args.json:
        print(json.dumps({"calls": args.calls, "bytes": args.bytes, "lost": lost, "median": med}))
        return 0
    print(f"{args.calls} calls of {args.bytes} bytes, {args.procs} client processes")
    for name, m in med.items():
        ratio = f"{m / anchor:.2f}x" if anchor else "-"
        print(
            f"  {name:<26} lost {m:6.0f} ({100 * m / args.calls:4.1f}%)  {ratio}  rounds {lost[name]}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
