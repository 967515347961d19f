"""Fleets: the agents of one process on one asyncio loop (`FleetState`, with the
payloads pre-built while the stall timeout runs), and `Fleet`, which drives a
whole job's agents in a few child processes from a test or benchmark."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import multiprocessing
import multiprocessing.connection
import os
import time
import traceback
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict
from typing import Any

from hangwatch.analyzer import packed

from hangwatch import formats, frtail
from tests.support.simagents.agent import FleetSpec, SimAgent
from tests.support.simagents.constants import KINDS, RANKS_PER_AGENT
from tests.support.simagents.dumps import DumpFactory, stacks_text
from tests.support.simagents.packer import Packer
from tests.support.simagents.topology import Clock, Hang, RankPos, Topology, rank_pos, sweep


class FleetState:
    """Agents of one process, the job's clock and the hang, once there is one."""

    def __init__(self, spec: FleetSpec) -> None:
        self.spec = spec
        self.topo = Topology(ranks=spec.ranks, pp=spec.pp)
        self.clock = Clock(epoch=spec.epoch, op_s=spec.op_s)
        self.dumps = DumpFactory(self.topo, self.clock, entries=spec.entries)
        self._tails: dict[int, DumpFactory] = {}  # context -> factory
        self.hang: Hang | None = None
        nodes = spec.nodes or tuple(range(self.topo.nodes))
        self.names = {
            k: {r: self.topo.group_name(k, r) for n in nodes for r in _node_ranks(n)} for k in KINDS
        }
        self.agents = [SimAgent(self, n) for n in nodes]
        self.tasks: set[asyncio.Task[None]] = set()
        self._digests: dict[tuple[int, RankPos], str] = {}
        self._metas: dict[int, tuple[bytes, str]] = {}
        self._phase_one: dict[tuple[int, RankPos, int], list[tuple[str, bytes, str]]] = {}
        # A node's decoded tails (hangwatch.analyzer.packed), by its tails'
        # digests, decoded ahead in a process of their own (`_packer`).
        self._columns: dict[tuple[str, ...], Future[bytes | None]] = {}
        self._packer: Packer | None = None
        self._hasher = ThreadPoolExecutor(max_workers=2, thread_name_prefix="sim-sha")

    def spawn(self, coro: Any) -> None:
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            exc = task.exception()
            self.agents[0].stats.error(f"task failed: {type(exc).__name__}: {exc}")

    def dump_with_digest(self, rank: int, pos: RankPos) -> tuple[bytes, str]:
        data = self.dumps.dump_bytes(rank, pos)
        digest = self._digests.pop((rank, pos), None)
        return data, digest or hashlib.sha256(data).hexdigest()

    def tail_factory(self, context: int) -> DumpFactory:
        f = self._tails.get(context)
        if f is None:
            f = self._tails[context] = DumpFactory(
                self.topo, self.clock, entries=self.spec.entries, tail_context=context
            )
        return f

    def tail_with_digest(self, rank: int, pos: RankPos, context: int) -> tuple[bytes, str]:
        data = self.tail_factory(context).dump_bytes(rank, pos)
        return data, hashlib.sha256(data).hexdigest()

    def meta_bytes(self, rank: int, *, stacks: str | None = None) -> bytes:
        """meta.json as the real agent writes it (compact, every group's members)."""
        topo = self.topo
        node = rank // RANKS_PER_AGENT
        return formats.RankMeta(
            rank=rank,
            host=f"sim-host-{node:05d}",
            pid=10_000 + rank,
            process_state="running",
            reachable=True,
            groups=tuple(topo.rank_groups(rank, formats.GroupInfo)),
            sources={"fr": "worker-server", "stacks": "py-spy", "gpu": "none", "process": "procfs"},
            gpu={"available": False, "reason": "simulated agent"},
            stacks=stacks,
        ).to_bytes()

    def meta_with_digest(self, rank: int) -> tuple[bytes, str]:
        got = self._metas.pop(rank, None)
        if got is not None:
            return got
        data = self.meta_bytes(rank)
        return data, hashlib.sha256(data).hexdigest()

    def stall(self, lagging: int, hang_index: int) -> None:
        self.hang = Hang(
            lagging=lagging, hang_index=hang_index, blocked=sweep(self.topo, lagging, hang_index)
        )
        # On real nodes each agent hashes its own 8 dumps in parallel with the
        # others; here the final (frozen) dumps are known now, so hash them and
        # build meta.json ahead, during the stall timeout, and keep the
        # fan-out's CPU for the wire.
        hang = self.hang
        mine = [r for a in self.agents for r in a.ranks]
        final = {r: rank_pos(r, 1 << 62, hang) for r in mine}
        self._hasher.submit(self._prehash, final)

    def phase_one_files(
        self, rank: int, pos: RankPos, context: int, pid: int
    ) -> list[tuple[str, bytes, str]]:
        got = self._phase_one.pop((rank, pos, context), None)
        if got is not None:
            return got
        fr = self.tail_with_digest(rank, pos, context)
        # Stacks ride inside meta.json, as the real agent sends them here.
        st = stacks_text(rank, pos, pid) if self.spec.stacks else None
        meta = self.meta_bytes(rank, stacks=st)
        return [
            (f"{formats.FR_TAIL_PREFIX}{rank}", *fr),
            (formats.META_FILE, meta, hashlib.sha256(meta).hexdigest()),
        ]

    def _prehash(self, final: dict[int, RankPos]) -> None:
        # What the DUMP will send, built while the stall timeout runs: real
        # agents build theirs on 512 machines at once, not on one event loop.
        if self.spec.prehash_full:
            for r, pos in final.items():
                data = self.dumps.dump_bytes(r, pos)
                self._digests[(r, pos)] = hashlib.sha256(data).hexdigest()
                meta = self.meta_bytes(r)
                self._metas[r] = (meta, hashlib.sha256(meta).hexdigest())
            return
        # Each real agent decodes its own node's tails on its node; here, in a
        # child of this fleet process (see packer.py), node by node as soon as
        # its files are built: queued after all of them, the decoding of
        # 1,024 nodes was still running when the DUMP came.
        if self._packer is None:
            self._packer = Packer()
        for a in self.agents:
            tails: list[tuple[int, str, bytes, str]] = []
            for r in a.ranks:
                if r not in final:
                    continue
                key = (r, final[r], frtail.DEFAULT_CONTEXT)
                files = self._phase_one[key] = self.phase_one_files(r, final[r], key[2], 10_000 + r)
                tails += [(r, *f) for f in files if formats.is_tail_fr_name(f[0])]
            self._columns[tuple(d for *_, d in tails)] = self._packer.submit(
                [(r, n, b) for r, n, b, _ in tails]
            )

    def node_columns(self, tails: list[tuple[int, str, bytes, str]]) -> bytes | None:
        """The columns member of a node's tails ((rank, name, bytes, sha256) each),
        built ahead when they are the ones expected, else now."""
        ahead = self._columns.pop(tuple(d for *_, d in tails), None)
        if ahead is not None:
            return ahead.result()
        return packed.pack([(r, n, b) for r, n, b, _ in tails])

    def stats(self) -> dict[str, Any]:
        return merge_stats([asdict(a.stats) for a in self.agents])

    def close(self) -> None:
        self._hasher.shutdown(wait=False, cancel_futures=True)
        if self._packer is not None:
            self._packer.close()


def _node_ranks(node: int) -> range:
    return range(node * RANKS_PER_AGENT, (node + 1) * RANKS_PER_AGENT)


def merge_stats(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Fleet-wide numbers from per-agent AgentStats dicts."""
    dumps = [d for p in parts for d in p["dumps"]]
    done = [d["done_at"] for d in dumps if d["done_at"] is not None]
    cmds = [d["command_at"] for d in dumps]
    return {
        "agents": len(parts),
        "registered": sum(1 for p in parts if p["registered"]),
        "register_retries": sum(p["register_retries"] for p in parts),
        "reports_sent": sum(p["reports_sent"] for p in parts),
        "rank_reports_sent": sum(p["rank_reports_sent"] for p in parts),
        "reports_failed": sum(p["reports_failed"] for p in parts),
        "reports_unknown": sum(p["reports_unknown"] for p in parts),
        "entry_batches": sum(p["entry_batches"] for p in parts),
        "dump_commands": len(dumps),
        "incidents": sorted({d["incident_id"] for d in dumps}),
        "command_ats": sorted(cmds),  # when each agent saw a DUMP (fan-out's spread)
        "first_command_at": min(cmds, default=None),
        "last_command_at": max(cmds, default=None),
        "last_done_at": max(done, default=None),
        "dumps_done": len(done),
        "ranks_dumped": sum(d["ranks_dumped"] for d in dumps),
        "files_uploaded": sum(d["files"] for d in dumps),
        "bytes_uploaded": sum(d["bytes"] for d in dumps),
        "dumps_rejected": sum(1 for d in dumps if d["accepted"] is False),
        "tail_dumps": sum(1 for d in dumps if d["tail_context"]),
        "full_uploads": sorted(r for p in parts for r in p["full_uploads"]),
        "errors": [e for p in parts for e in p["errors"]][:50],
    }


async def _run_fleet(spec: FleetSpec, conn: multiprocessing.connection.Connection) -> None:
    fleet = FleetState(spec)
    loop = asyncio.get_running_loop()
    try:
        sem = asyncio.Semaphore(64)

        async def reg(a: SimAgent) -> None:
            async with sem:
                await a.register()

        await asyncio.gather(*(reg(a) for a in fleet.agents))
        n = len(fleet.agents)
        for i, a in enumerate(fleet.agents):
            # Real agents read on the same grid instants; each node's poll and
            # encoding puts its report 0-50 ms after the instant.
            fleet.spawn(a.progress_loop(0.05 * ((i * 7919) % n) / max(1, n)))
            fleet.spawn(a.watch_loop())
        conn.send({"op": "ready", "agents": n})
        while True:
            msg = await loop.run_in_executor(None, conn.recv)
            if msg["op"] == "stall":
                fleet.stall(int(msg["rank"]), int(msg["hang_index"]))
                conn.send({"op": "ok"})
            elif msg["op"] == "stats":
                conn.send({"op": "stats", "stats": fleet.stats()})
            elif msg["op"] == "stop":
                break
    finally:
        for t in list(fleet.tasks):
            t.cancel()
        await asyncio.gather(*fleet.tasks, return_exceptions=True)
        channels = [c for a in fleet.agents for c in (a.channel, a.relay_channel) if c is not None]
        await asyncio.gather(*(c.close() for c in channels), return_exceptions=True)
        fleet.close()
    conn.send({"op": "stats", "stats": fleet.stats()})


def _fleet_main(spec: FleetSpec, conn: multiprocessing.connection.Connection) -> None:
    if spec.nice:
        os.nice(spec.nice)
    try:
        asyncio.run(_run_fleet(spec, conn))
    except BaseException:
        with contextlib.suppress(OSError):
            conn.send({"op": "error", "traceback": traceback.format_exc()})
        raise


# ---- driving fleets from a test or benchmark -----------------------------------------------


class FleetError(RuntimeError):
    pass


class Fleet:
    """Simulated agents for a whole job, in `procs` child processes.

    with Fleet(target="127.0.0.1:PORT", job_id="j", ranks=512) as fleet:
        fleet.wait_ready()
        hang = fleet.stall(rank=77)
        ...
        stats = fleet.stats()
    """

    def __init__(
        self,
        *,
        target: str,
        job_id: str,
        ranks: int,
        pp: int = 4,
        entries: int = 2000,
        procs: int = 1,
        op_s: float = 0.05,
        report_interval_s: float = 1.0,
        token: str | None = None,
        stacks: bool = True,
        prehash_full: bool = True,
        compress: bool = True,
        nice: int = 0,
        transport: str = "stream",
        form: str = "columns",
        progress_relays: tuple[str, ...] = (),
        calls_via_relay: bool = True,
    ) -> None:
        self.topo = Topology(ranks=ranks, pp=pp)
        self.clock = Clock(epoch=time.time(), op_s=op_s)
        nodes = list(range(self.topo.nodes))
        procs = max(1, min(procs, len(nodes)))
        self.specs = [
            FleetSpec(
                target=target,
                job_id=job_id,
                ranks=ranks,
                pp=pp,
                entries=entries,
                epoch=self.clock.epoch,
                op_s=op_s,
                report_interval_s=report_interval_s,
                token=token,
                stacks=stacks,
                nodes=tuple(nodes[i::procs]),
                prehash_full=prehash_full,
                compress=compress,
                nice=nice,
                transport=transport,
                form=form,
                progress_relays=progress_relays,
                calls_via_relay=calls_via_relay,
            )
            for i in range(procs)
        ]
        self._ctx = multiprocessing.get_context("spawn")
        self._procs: list[multiprocessing.process.BaseProcess] = []
        self._conns: list[multiprocessing.connection.Connection] = []
        self.hang: Hang | None = None
        self.final_stats: dict[str, Any] | None = None

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs if p.pid is not None]

    def start(self) -> Fleet:
        for spec in self.specs:
            parent, child = self._ctx.Pipe()
            p = self._ctx.Process(target=_fleet_main, args=(spec, child), daemon=True)
            p.start()
            child.close()
            self._procs.append(p)
            self._conns.append(parent)
        return self

    def _recv(self, i: int, timeout: float) -> dict[str, Any]:
        conn, proc = self._conns[i], self._procs[i]
        if not conn.poll(timeout):
            raise FleetError(
                f"fleet process {proc.pid} did not answer in {timeout:.0f}s (exit code {proc.exitcode})"
            )
        try:
            msg: dict[str, Any] = conn.recv()
        except EOFError as e:
            proc.join(5)
            raise FleetError(f"fleet process {proc.pid} exited with code {proc.exitcode}") from e
        if msg.get("op") == "error":
            raise FleetError(f"fleet process {proc.pid} failed:\n{msg['traceback']}")
        return msg

    def wait_ready(self, timeout: float = 60.0) -> int:
        """Block until every agent registered; returns the number of agents."""
        end = time.monotonic() + timeout
        return sum(
            int(self._recv(i, max(0.1, end - time.monotonic()))["agents"])
            for i in range(len(self._procs))
        )

    def stall(self, rank: int, margin_s: float = 0.5) -> Hang:
        """Make `rank` stop before the next TP collective at least `margin_s` ahead."""
        if not 0 <= rank < self.topo.ranks:
            raise ValueError(f"rank {rank} is not in [0, {self.topo.ranks})")
        h = self.clock.hang_index_after(time.time(), margin_s)
        for c in self._conns:
            c.send({"op": "stall", "rank": rank, "hang_index": h})
        for i in range(len(self._conns)):
            self._recv(i, 30.0)
        self.hang = Hang(lagging=rank, hang_index=h, blocked=sweep(self.topo, rank, h))
        return self.hang

    def stall_time(self) -> float:
        """time.time() at which the lagging rank failed to enter its collective."""
        if self.hang is None:
            raise FleetError("no stall yet")
        return self.clock.time_of(self.hang.hang_index)

    def stats(self, timeout: float = 30.0) -> dict[str, Any]:
        if self.final_stats is not None:
            return self.final_stats
        parts = []
        for i, c in enumerate(self._conns):
            c.send({"op": "stats"})
            parts.append(self._recv(i, timeout)["stats"])
        return _merge_fleet(parts)

    def stop(self, timeout: float = 30.0) -> dict[str, Any]:
        if self.final_stats is not None:
            return self.final_stats
        parts, problems = [], []
        for i, c in enumerate(self._conns):
            try:
                c.send({"op": "stop"})
                msg = self._recv(i, timeout)
                while "stats" not in msg:  # an answer a timed-out wait left behind
                    msg = self._recv(i, timeout)
                parts.append(msg["stats"])
            except (FleetError, OSError) as e:
                problems.append(str(e))
        for p in self._procs:
            p.join(timeout)
            if p.exitcode is None:
                p.kill()
                p.join(5)
                problems.append(f"fleet process {p.pid} did not exit; killed")
            elif p.exitcode != 0:
                problems.append(f"fleet process {p.pid} exited with code {p.exitcode}")
        for c in self._conns:
            c.close()
        self.final_stats = _merge_fleet(parts)
        if problems:
            raise FleetError("; ".join(problems))
        return self.final_stats

    def __enter__(self) -> Fleet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        try:
            self.stop()
        except FleetError:
            if exc[0] is None:
                raise


def _merge_fleet(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for p in parts:
        for k, v in p.items():
            if k in ("first_command_at",):
                out[k] = v if out.get(k) is None else (min(out[k], v) if v is not None else out[k])
            elif k in ("last_command_at", "last_done_at"):
                out[k] = v if out.get(k) is None else (max(out[k], v) if v is not None else out[k])
            elif k == "command_ats":
                out[k] = sorted(out.get(k, []) + v)
            elif k in ("incidents", "full_uploads"):
                out[k] = sorted(set(out.get(k, [])) | set(v))
            elif k == "errors":
                out[k] = (out.get(k, []) + v)[:50]
            else:
                out[k] = out.get(k, 0) + v
    return out
