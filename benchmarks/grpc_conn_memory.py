"""What one idle client connection costs a gRPC server's memory, and whether a channel argument shrinks it.

    python benchmarks/grpc_conn_memory.py [--conns 1024] [--rounds 3]

A node agent behind a progress relay still holds one connection to the
coordinator (registration, clock exchange, uploads). `coordinator_load.py`
put the C heap's growth at about 12 KB per node agent; this measures the
connection alone, with nothing of hangwatch's on the server: a `grpc.aio`
server process (the coordinator's kind) with one unary echo method, and one
client process that opens `--conns` channels (each its own connection, with
the agents' keepalive options) and makes two calls on each, then holds them
open. The server's RSS growth from before the client starts to 2 s after
every channel is open, divided by `--conns`, is the cost of a connection.

Variants (server channel arguments), each in a fresh server process,
interleaved within a round; the anchor is gRPC's defaults measured in the
same round:
- `default`: none (the anchor);
- `read-chunk`: `grpc.experimental.tcp_read_chunk_size` 512, min 256, max 2,048;
- `hpack-0`: both HPACK dynamic tables at 0 bytes;
- `write-buffer-0`: `grpc.http2.write_buffer_size` 0;
- `streams-4`: `grpc.max_concurrent_streams` 4;
- `lookahead-8k`: `grpc.http2.lookahead_bytes` 8,192.

Prints KB a connection per variant and its ratio to the anchor; medians over rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support.simagents.coordinator import proc_status_kb

METHOD = "/connmem.ConnMem/Echo"
VARIANTS: dict[str, list[tuple[str, int]]] = {
    "default": [],
    "read-chunk": [
        ("grpc.experimental.tcp_read_chunk_size", 512),
        ("grpc.experimental.tcp_min_read_chunk_size", 256),
        ("grpc.experimental.tcp_max_read_chunk_size", 2048),
    ],
    "hpack-0": [
        ("grpc.http2.hpack_table_size.decoder", 0),
        ("grpc.http2.hpack_table_size.encoder", 0),
    ],
    "write-buffer-0": [("grpc.http2.write_buffer_size", 0)],
    "streams-4": [("grpc.max_concurrent_streams", 4)],
    "lookahead-8k": [("grpc.http2.lookahead_bytes", 8192)],
}
# The agent's channel options that keep an idle connection open (agent/client.py).
CLIENT_OPTIONS = [
    ("grpc.use_local_subchannel_pool", 1),  # one connection per channel, as one per agent
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_permit_without_calls", 1),
]
SETTLE_S = 2.0


async def _serve(variant: str, conns: int) -> dict[str, Any]:
    """One server process: its RSS growth per connection of one client process."""
    server = grpc.aio.server(options=VARIANTS[variant])

    async def echo(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        return request

    handler = grpc.method_handlers_generic_handler(
        "connmem.ConnMem", {"Echo": grpc.unary_unary_rpc_method_handler(echo)}
    )
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await asyncio.sleep(0.5)  # the server's own threads and pools, before any client
    before = proc_status_kb(os.getpid(), "VmRSS")
    client = subprocess.Popen(
        [sys.executable, __file__, "--client", str(port), "--conns", str(conns)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert client.stdout is not None and client.stdin is not None
    try:
        line = await asyncio.to_thread(client.stdout.readline)
        if line.strip() != b"open":
            raise RuntimeError(f"client failed: {line!r}")
        await asyncio.sleep(SETTLE_S)
        after = proc_status_kb(os.getpid(), "VmRSS")
    finally:
        client.stdin.close()
        client.wait(30)
        await server.stop(0)
    return {"variant": variant, "kb_per_conn": (after - before) / conns}


def _client(port: int, conns: int) -> None:
    channels = []
    for i in range(conns):
        ch = grpc.insecure_channel(f"127.0.0.1:{port}", options=CLIENT_OPTIONS)
        call = ch.unary_unary(METHOD)
        for _ in range(2):  # a registration and a clock exchange, in size
            call(b"x" * 100, metadata=(("x-agent", f"agent-{i}"),), timeout=30)
        channels.append(ch)
    print("open", flush=True)
    sys.stdin.read()  # held open until the server has read its RSS
    for ch in channels:
        ch.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--conns", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", action="store_true")
    p.add_argument("--client", type=int, help=argparse.SUPPRESS)
    p.add_argument("--serve", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.client is not None:
        _client(a.client, a.conns)
        return 0
    if a.serve is not None:
        print(json.dumps(asyncio.run(_serve(a.serve, a.conns))))
        return 0
    kb: dict[str, list[float]] = {v: [] for v in VARIANTS}
    ratio: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for _ in range(a.rounds):
        got: dict[str, float] = {}
        for variant in VARIANTS:
            out = subprocess.run(
                [sys.executable, __file__, "--serve", variant, "--conns", str(a.conns)],
                capture_output=True,
                text=True,
                timeout=300,
                check=True,
            )
            got[variant] = json.loads(out.stdout)["kb_per_conn"]
        for v, k in got.items():
            kb[v].append(k)
            ratio[v].append(k / got["default"])
    rows = {
        v: {"kb_per_conn": statistics.median(kb[v]), "ratio": statistics.median(ratio[v])}
        for v in VARIANTS
    }
    if a.json:
        print(json.dumps({"conns": a.conns, "rounds": a.rounds, "variants": rows}))
    else:
        for v, r in rows.items():
            print(f"{v:15s} {r['kb_per_conn']:7.2f} KB a connection  x{r['ratio']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
