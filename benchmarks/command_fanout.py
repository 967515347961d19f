"""What an incident's fan-out costs the coordinator: a DUMP to every agent,
on one WatchCommands call each (the anchor) or through relays (RelayCommands).

    python benchmarks/command_fanout.py --agents 4096 --relays 16 --rounds 3

A real coordinator runs in this process (gRPC on port 0, SQLite in a temp
dir). The agents' side is one child process speaking the real protocol: it
registers `--agents` node agents (8 ranks each, their groups as runs), then
holds their watches either as one WatchCommands call each (`direct`, what
every agent did before relays carried commands) or as `--relays`
RelayCommands streams carrying agents/relays watches each (`relayed`: what
the relays send; their own work is on their own machines). With every watch
held at the coordinator, it queues a DUMP for every agent as the incident
manager does (`JobRegistry.push_command`) and the child counts what arrives.

Per mode, medians over `--rounds` (each a fresh process holding a fresh
coordinator, so that no round's RSS reuses what an earlier one freed): the wall time
from the first DUMP queued to the last one received, the coordinator's CPU
over it (this process: its gRPC loop and every thread), its CPU over `--idle-s`
with every watch held (the streams' periodic re-check), and what holding the
watches added to its RSS. Ratios are to `direct`, measured in the same run.

`--channel-per-agent` gives each simulated agent its own channel and TCP
connection, as real nodes have (by default they share one): the coordinator's
RSS growth from the agents' registrations over their own connections is then
reported too (`rss_registered_kb_per_agent`), what an idle agent costs it
before any watch.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc
from hangwatch.server.coordinator import Coordinator
from hangwatch.server.live.commands import Command

from hangwatch.config import Config
from hangwatch.wire import group_info, pb, rpc

JOB = "fanout"
RANKS_PER_AGENT = 8


def _rss_kb() -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def _register_request(node: int, world: int) -> pb.RegisterRequest:
    world_group = group_info(name="0", desc="default_pg", pg_id=0, members=range(world))
    ranks = [
        pb.RankInfo(
            rank=r,
            local_rank=r % RANKS_PER_AGENT,
            world_size=world,
            pid=10_000 + r,
            backend="nccl",
            torch_version="2.15.0",
            fr_source="worker-server",
            groups=[world_group],
        )
        for r in range(node * RANKS_PER_AGENT, (node + 1) * RANKS_PER_AGENT)
    ]
    return pb.RegisterRequest(job_id=JOB, agent_id=f"node-{node:05d}", host=f"h{node}", ranks=ranks)


async def _agents(target: str, mode: str, n: int, relays: int, own: bool, conn: Connection) -> None:
    options = [("grpc.max_receive_message_length", 64 * 1024 * 1024)]
    if own:  # each node its own TCP connection, as the agent's channel is
        options.append(("grpc.use_local_subchannel_pool", 1))
    async with grpc.aio.insecure_channel(target, options=options) as ch:
        stub = rpc.CoordinatorStub(ch)
        nodes = [grpc.aio.insecure_channel(target, options=options) for _ in range(n if own else 0)]
        stubs = [rpc.CoordinatorStub(c) for c in nodes] or [stub] * n
        world = n * RANKS_PER_AGENT
        sem = asyncio.Semaphore(64)

        async def register(node: int) -> pb.WatchRequest:
            async with sem:
                resp = await stubs[node].Register(_register_request(node, world), timeout=60)
            return pb.WatchRequest(
                job_id=JOB, agent_id=f"node-{node:05d}", session_id=resp.session_id
            )

        watches = await asyncio.gather(*(register(i) for i in range(n)))
        conn.send("registered")
        conn.recv()  # the coordinator measured its RSS: open the watches
        got = 0
        all_in = asyncio.Event()
        hold = asyncio.Event()  # never set: the relays' side stays open

        def count(k: int) -> None:
            nonlocal got
            got += k
            if got >= n:
                all_in.set()

        calls: list[Any] = []

        async def direct(node: int, req: pb.WatchRequest) -> None:
            calls.append(call := stubs[node].WatchCommands(req))
            async for _ in call:
                count(1)

        async def relay(reqs: list[pb.WatchRequest], r: int) -> None:
            async def feed() -> Any:
                yield pb.CommandWatch(opened=reqs, relay_id=f"bench-relay-{r}")
                await hold.wait()

            calls.append(call := stub.RelayCommands(feed()))
            async for msg in call:
                count(len(msg.commands))

        if mode == "direct":
            tasks = [asyncio.create_task(direct(i, w)) for i, w in enumerate(watches)]
        else:
            tasks = [asyncio.create_task(relay(list(watches[r::relays]), r)) for r in range(relays)]
        conn.send("watching")
        await all_in.wait()
        conn.send(("received", got))
        conn.recv()  # done
        for c in calls:  # the calls themselves, so that nothing of them is left in flight
            c.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(c.close() for c in nodes))


def _child(target: str, mode: str, n: int, relays: int, own: bool, conn: Connection) -> None:
    asyncio.run(_agents(target, mode, n, relays, own, conn))


def _held(coordinator: Coordinator, n: int) -> bool:
    reg = coordinator.registry
    return all(
        (a := reg._agent(JOB, f"node-{i:05d}")) is not None and a.mailbox.wakers for i in range(n)
    )


def one_round(mode: str, n: int, relays: int, idle_s: float, own: bool) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as d:
        conf = Config.of(
            job_id=JOB, grpc_port=0, http_port=0, data_dir=d, stall_timeout=3600.0,
            agent_lost_timeout=3600.0,
        )  # fmt: skip
        coordinator = Coordinator(conf)
        coordinator.start()
        ctx = mp.get_context("spawn")
        here, there = ctx.Pipe()
        rss_start = _rss_kb()
        child = ctx.Process(
            target=_child,
            args=(coordinator.grpc_address, mode, n, relays, own, there),
            daemon=True,
        )
        child.start()
        try:
            assert here.recv() == "registered"
            rss0 = _rss_kb()
            here.send("open")
            assert here.recv() == "watching"
            end = time.monotonic() + 120
            while not _held(coordinator, n):
                if time.monotonic() > end:
                    raise RuntimeError("the watches did not all open in 120 s")
                time.sleep(0.05)
            rss1 = _rss_kb()
            c0 = time.process_time()
            time.sleep(idle_s)  # idle: every watch held, nothing to send
            idle_cpu = time.process_time() - c0
            reg = coordinator.registry
            expires = reg.now() + 600.0
            t0, c0 = time.perf_counter(), time.process_time()
            for i in range(n):
                cmd = Command(
                    kind=pb.COMMAND_KIND_DUMP, incident_id="20261204T000000Z-fanout",
                    reason="benchmark", deadline_s=600.0, expires=expires, tail_context=8,
                )  # fmt: skip
                reg.push_command(JOB, f"node-{i:05d}", cmd)
            if not here.poll(120):
                raise RuntimeError("not every DUMP arrived in 120 s")
            kind, got = here.recv()
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            assert kind == "received" and got == n, (kind, got)
            here.send("done")
            child.join(30)
        finally:
            if child.is_alive():
                child.kill()
            coordinator.stop(grace=1.0)
    return {
        "fanout_s": wall,
        "fanout_cpu_s": cpu,
        "idle_cpu_cores": idle_cpu / idle_s,
        "rss_watches_kb_per_agent": (rss1 - rss0) / n,
        "rss_registered_kb_per_agent": (rss0 - rss_start) / n,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agents", type=int, default=4096, help="node agents (8 ranks each)")
    ap.add_argument("--relays", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--idle-s", type=float, default=10.0)
    ap.add_argument("--channel-per-agent", action="store_true", help="a connection per agent")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--one-round", choices=("direct", "relayed"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one_round:  # a round in this process: its numbers as one JSON line
        got = one_round(
            args.one_round, args.agents, args.relays, args.idle_s, args.channel_per_agent
        )
        print(json.dumps(got))
        return 0
    runs: dict[str, list[dict[str, float]]] = {"direct": [], "relayed": []}
    for _ in range(args.rounds):  # interleaved: the machine's drift hits both alike
        for mode in runs:
            cmd = [sys.executable, __file__, "--one-round", mode, "--agents", str(args.agents),
                   "--relays", str(args.relays), "--idle-s", str(args.idle_s)]  # fmt: skip
            if args.channel_per_agent:
                cmd.append("--channel-per-agent")
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"a {mode} round failed: {done.stderr[-2000:]}")
            runs[mode].append(json.loads(done.stdout.strip().splitlines()[-1]))
    med = {m: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for m, rs in runs.items()}
    out: dict[str, Any] = {
        "agents": args.agents,
        "ranks": args.agents * RANKS_PER_AGENT,
        "relays": args.relays,
        "rounds": args.rounds,
        "channel_per_agent": args.channel_per_agent,
        "median": med,
        "runs": runs,
        "ratio_relayed_to_direct": {
            k: (med["relayed"][k] / med["direct"][k] if med["direct"][k] else None)
            for k in med["direct"]
        },
        "loadavg": Path("/proc/loadavg").read_text().split()[:3],
        "threads": threading.active_count(),
    }
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(
        f"{args.agents} agents ({out['ranks']} ranks), {args.relays} relays, medians of {args.rounds}"
    )
    for k in med["direct"]:
        d, r = med["direct"][k], med["relayed"][k]
        ratio = out["ratio_relayed_to_direct"][k]
        shown = f"{ratio:.2f}x" if ratio is not None else "n/a"
        print(f"  {k:26s} direct {d:10.4f}   relayed {r:10.4f}   {shown}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
