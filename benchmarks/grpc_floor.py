"""What gRPC alone costs the coordinator per progress message, and what a relay would save.

    python benchmarks/grpc_floor.py [--streams 512] [--rounds 3]

A healthy 4,096-rank job is 512 node agents, each sending one ~2.5 KB
progress report a second on its own stream. The coordinator's CPU for that
(`coordinator_load.py`: 0.27-0.35 of a core, 65-85 µs a rank report) is
gRPC's work per message plus hangwatch's (`ingest_path.py`: 6-12 µs a rank
report in process). This measures gRPC's part with nothing of hangwatch's on
the server: a server process whose handler reads each message and drops it,
fed by one client process (at nice 10, as the simulated fleet runs) holding
one channel per simulated agent, each sending a real columnar report (built
by the simulated fleet's agent code) once a second at staggered phases.

Server variants, each measured in the same round, interleaved:
- `aio` (the anchor): a `grpc.aio` server, the coordinator's kind, bytes
  handed to the handler unparsed;
- `aio-parse`: the same, each message parsed as a ProgressReport;
- `sync`: a thread-per-stream `grpc.server`, bytes unparsed;
- `aio-relay`: the same bytes per second through `--streams / 64` streams,
  64 reports per message: what a relay tier batching 64 nodes would send.

Prints the server's cores, µs per message and per rank report (8 ranks a
message), and each variant's CPU as a ratio to the anchor's of the same
round; medians over rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent import futures
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc

from hangwatch.wire import pb
from tests.support.simagents import RANKS_PER_AGENT, FleetSpec
from tests.support.simagents.coordinator import proc_cpu_s
from tests.support.simagents.fleet import FleetState

METHOD = "/floor.Floor/Stream"
RELAY_FAN_IN = 64  # nodes per relay (docs/scaling.md's relay tier)
VARIANTS = ("aio", "aio-parse", "sync", "aio-relay")


def _report_bytes(ranks: int) -> bytes:
    """One node agent's columnar progress report, as the simulated fleet sends it."""

    async def build() -> bytes:
        spec = FleetSpec(target="127.0.0.1:1", job_id="floor", ranks=ranks, epoch=time.time())
        fleet = FleetState(spec)
        a = fleet.agents[0]
        a.session_id = "0" * 32
        a.coordinator_reads_columns = True
        body = a.as_sent(a.progress_report(time.time())).SerializeToString()
        await asyncio.gather(*(x.channel.close() for x in fleet.agents))
        fleet.close()
        return body

    return asyncio.run(build())


# ---- the server ------------------------------------------------------------


def _serve(variant: str) -> None:
    """Serve METHOD on a free loopback port; print it; run until stdin closes."""
    parse = variant == "aio-parse"
    deserializer = pb.ProgressReport.FromString if parse else None
    if variant == "sync":

        def drain_sync(it: Any, _ctx: Any) -> Any:
            for _ in it:
                pass
            return iter(())

        handler = grpc.stream_stream_rpc_method_handler(drain_sync)
        # A thread per stream: the sync server parks one on each open stream.
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4096))
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("floor.Floor", {"Stream": handler}),)
        )
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        print(port, flush=True)
        sys.stdin.read()
        server.stop(0)
        return

    async def drain(it: Any, _ctx: Any) -> Any:
        async for _ in it:
            pass
        return
        yield  # a generator: the handler answers nothing

    async def main() -> None:
        h = grpc.stream_stream_rpc_method_handler(drain, request_deserializer=deserializer)
        server = grpc.aio.server()
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("floor.Floor", {"Stream": h}),)
        )
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        print(port, flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        await server.stop(0)

    asyncio.run(main())


# ---- the client ------------------------------------------------------------


def _client(port: int, streams: int, body_hex_file: str, per_message: int) -> None:
    """`streams` channels, each sending `per_message` reports per message once a
    second, phases spread evenly; runs until stdin closes."""
    one = bytes.fromhex(Path(body_hex_file).read_text())
    body = one * per_message

    async def stream(i: int, t0: float, stop: asyncio.Event) -> None:
        ch = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        call = ch.stream_stream(METHOD, request_serializer=None, response_deserializer=None)

        async def messages() -> Any:
            k = 0
            while not stop.is_set():
                due = t0 + i / streams + k
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                yield body
                k += 1

        c = call(messages())
        try:
            async for _ in c:
                pass
        except grpc.aio.AioRpcError:
            pass
        await ch.close()

    async def main() -> None:
        stop = asyncio.Event()
        t0 = time.monotonic() + 0.5
        tasks = [asyncio.create_task(stream(i, t0, stop)) for i in range(streams)]
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        stop.set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(main())


# ---- the driver ------------------------------------------------------------


def _measure(variant: str, streams: int, body_file: str, warm_s: float, window_s: float) -> float:
    """The server's CPU cores over `window_s`, after `warm_s` of the load."""
    me = [sys.executable, os.path.abspath(__file__)]
    server = subprocess.Popen(
        [*me, "--serve", variant], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert server.stdout is not None and server.stdin is not None
    port = int(server.stdout.readline())
    relay = variant == "aio-relay"
    n = max(1, streams // RELAY_FAN_IN) if relay else streams
    per = RELAY_FAN_IN if relay else 1
    client = subprocess.Popen(
        ["nice", "-n", "10", *me, "--client", str(port), str(n), body_file, str(per)],
        stdin=subprocess.PIPE,
    )
    assert client.stdin is not None
    try:
        time.sleep(warm_s)
        c0, t0 = proc_cpu_s(server.pid), time.monotonic()
        time.sleep(window_s)
        c1, t1 = proc_cpu_s(server.pid), time.monotonic()
        if client.poll() is not None or server.poll() is not None:
            raise RuntimeError(f"{variant}: the client or the server exited during the window")
    finally:
        client.stdin.close()
        client.wait(30)
        server.stdin.close()
        server.wait(30)
    return (c1 - c0) / (t1 - t0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--streams", type=int, default=512, help="node agents (8 ranks each)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warm-s", type=float, default=6.0)
    p.add_argument("--window-s", type=float, default=15.0)
    p.add_argument("--json", action="store_true")
    p.add_argument("--serve", help=argparse.SUPPRESS)
    p.add_argument("--client", nargs=4, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        _serve(args.serve)
        return 0
    if args.client:
        port, n, body_file, per = args.client
        _client(int(port), int(n), body_file, int(per))
        return 0

    body = _report_bytes(args.streams * RANKS_PER_AGENT)
    body_file = Path(f"/tmp/grpc_floor_{os.getpid()}.hex")
    body_file.write_text(body.hex())
    cores: dict[str, list[float]] = {v: [] for v in VARIANTS}
    ratios: dict[str, list[float]] = {v: [] for v in VARIANTS}
    try:
        for _ in range(args.rounds):
            got = {
                v: _measure(v, args.streams, str(body_file), args.warm_s, args.window_s)
                for v in VARIANTS
            }
            for v in VARIANTS:
                cores[v].append(got[v])
                ratios[v].append(got[v] / got["aio"])
    finally:
        body_file.unlink()
    rank_reports = args.streams * RANKS_PER_AGENT  # a second, in every variant
    out: dict[str, Any] = {
        "streams": args.streams,
        "report_bytes": len(body),
        "loadavg_1m": os.getloadavg()[0],
        "variants": {},
    }
    for v in VARIANTS:
        msgs = max(1, args.streams // RELAY_FAN_IN) if v == "aio-relay" else args.streams
        c = statistics.median(cores[v])
        out["variants"][v] = {
            "cores": [round(x, 4) for x in cores[v]],
            "median_cores": round(c, 4),
            "us_per_message": round(c / msgs * 1e6, 1),
            "us_per_rank_report": round(c / rank_reports * 1e6, 2),
            "ratio_to_anchor": round(statistics.median(ratios[v]), 3),
        }
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"{args.streams} streams x 1 Hz, {len(body)} B a report, {args.rounds} rounds")
    for v, r in out["variants"].items():
        print(
            f"  {v:10s} {r['median_cores']:.3f} cores  {r['us_per_message']:8.1f} µs/message"
            f"  {r['us_per_rank_report']:6.2f} µs/rank report  {r['ratio_to_anchor']:.2f}x anchor"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
