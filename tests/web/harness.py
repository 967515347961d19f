"""Real pieces for dashboard tests: a SQLite store on disk, a job registry fed
through its gRPC-facing methods with real protobuf messages, and uvicorn on an
OS-chosen port in a thread. Reusable by the lead's live-demo browser test."""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import uvicorn
from fastapi import FastAPI
from hangwatch.analyzer.report import (
    CollectiveRef,
    Finding,
    Frame,
    GroupProgress,
    RankEvidence,
    Report,
    StalledCollective,
    WaitEdge,
)
from hangwatch.server.app_state import ServerContext
from hangwatch.server.incidents.store import IncidentStore
from hangwatch.server.integrations.gauges import LiveGauges
from hangwatch.server.integrations.metrics import Metrics
from hangwatch.server.live.registry import JobRegistry

from hangwatch.config import Config
from hangwatch.wire import pb

REPO = Path(__file__).resolve().parents[2]
GOLDEN_SKIP = REPO / "tests" / "golden" / "skip"  # a real 4-rank gloo hang, see its manifest

HOSTILE_FRAME = "<script>alert(1)</script>"
HOSTILE_FILE = '"><img src=x onerror=alert(2)>'
HOSTILE_DESC = "default_pg</td><script>alert(3)</script>"


def make_context(
    data_dir: Path,
    *,
    token: str | None = None,
    store: IncidentStore | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> ServerContext:
    """`store`: another than the SQLite one in `data_dir` (a PostgreSQL one);
    `clock`: the registry's (a FakeClock moves a stall past its timeout)."""
    config = Config.of(data_dir=str(data_dir), token=token, stall_timeout=5.0)
    store = store if store is not None else IncidentStore.in_dir(data_dir)
    registry = JobRegistry(agent_lost_timeout=10.0, stall_timeout=5.0, clock=clock)
    ctx = ServerContext(
        config=config,
        store=store,
        registry=registry,
        data_dir=data_dir,
        metrics=Metrics(),
        grpc_address="127.0.0.1:1",
    )
    # As the coordinator does: /metrics serves this context's registry, store and
    # stragglers (a test may give the context a monitor later).
    ctx.metrics.add_collector(
        LiveGauges(registry, store, config, stragglers=lambda: ctx.stragglers)
    )
    return ctx


def feed_job(
    registry: JobRegistry,
    *,
    job: str,
    world: int,
    stuck: int,
    seq: int = 42,
    ranks_per_agent: int = 8,
    group_desc: str = "default_pg",
) -> dict[int, tuple[str, str]]:
    """Register agents for `world` ranks of one default group and report a hang:
    every rank completed seq-1; all but `stuck` entered `seq` (in flight 12 s).
    Returns rank -> (agent id, session id) for later reports."""
    sessions: dict[int, tuple[str, str]] = {}
    for first in range(0, world, ranks_per_agent):
        ranks = range(first, min(world, first + ranks_per_agent))
        agent = f"agent-{first // ranks_per_agent}"
        req = pb.RegisterRequest(
            job_id=job,
            agent_id=agent,
            host=f"node{first // ranks_per_agent}",
            agent_version="test",
            ranks=[
                pb.RankInfo(
                    rank=r,
                    local_rank=r - first,
                    world_size=world,
                    pid=10_000 + r,
                    backend="gloo",
                    torch_version="2.13.0",
                    fr_source="worker-server",
                    groups=[
                        pb.GroupInfo(name="0", desc=group_desc, pg_id=0, ranks=list(range(world)))
                    ],
                )
                for r in ranks
            ],
        )
        session = registry.register(req)
        sessions.update({r: (agent, session) for r in ranks})
        progress = []
        for r in ranks:
            gp = pb.GroupProgress(
                group="0",
                last_enqueued=seq if r != stuck else seq - 1,
                last_completed=seq - 1,
            )
            if r != stuck:
                gp.oldest_in_flight.CopyFrom(pb.InFlight(seq=seq, op="all_reduce", age_s=12.0))
            progress.append(
                pb.RankProgress(rank=r, state=pb.PROCESS_STATE_RUNNING, groups=[gp], fr_age_s=0.1)
            )
        registry.report_progress(
            pb.ProgressReport(
                job_id=job, agent_id=agent, session_id=session, report_seq=1, ranks=progress
            )
        )
    return sessions


def report_rank(
    registry: JobRegistry,
    *,
    job: str,
    sessions: dict[int, tuple[str, str]],
    rank: int,
    last_enqueued: int,
    last_completed: int,
    report_seq: int,
    state: int = pb.PROCESS_STATE_RUNNING,
) -> None:
    """One more progress report for one rank, as its agent would send it."""
    agent, session = sessions[rank]
    gp = pb.GroupProgress(group="0", last_enqueued=last_enqueued, last_completed=last_completed)
    if last_enqueued > last_completed:
        gp.oldest_in_flight.CopyFrom(pb.InFlight(seq=last_enqueued, op="all_reduce", age_s=0.5))
    registry.report_progress(
        pb.ProgressReport(
            job_id=job,
            agent_id=agent,
            session_id=session,
            report_seq=report_seq,
            ranks=[pb.RankProgress(rank=rank, state=state, groups=[gp], fr_age_s=0.1)],  # type: ignore[arg-type]
        )
    )


def hang_report(*, world: int, stuck: int, seq: int = 42, hostile: bool = False) -> Report:
    """The report the analyzer gives for "rank `stuck` never entered all_reduce #seq"."""
    frame_name = HOSTILE_FRAME if hostile else "train_step"
    filename = HOSTILE_FILE if hostile else "train.py"
    desc = HOSTILE_DESC if hostile else "default_pg"
    others = [r for r in range(world) if r != stuck]
    evidence = {}
    for r in range(world):
        entered = (
            None
            if r == stuck
            else CollectiveRef(group="0", seq=seq, op="all_reduce", state="scheduled")
        )
        evidence[r] = RankEvidence(
            rank=r,
            host=f"node{r // 8}",
            pid=10_000 + r,
            process_state="running",
            last_completed=CollectiveRef(group="0", seq=seq - 1, op="all_gather", state="retired"),
            last_entered=entered,
            frames=[Frame(name=frame_name, filename=filename, line=17)] if entered else [],
            stacks=(
                f'Thread 0x1 (idle): "MainThread"\n    slow_data_loader ({filename}:88)\n    {frame_name} (train.py:12)\n'
                if r == stuck
                else 'Thread 0x1 (idle): "MainThread"\n    all_reduce (torch/distributed/distributed_c10d.py:2950)\n    train_step (train.py:17)\n'
            ),
            gpu={"available": False, "reason": "no NVML on this host"},
            sources={
                "fr": "worker-server",
                "stacks": "py-spy" if r == stuck else "worker-server",
                "gpu": "none",
            },
        )
    return Report(
        verdict="hang",
        summary=f"Rank {stuck} never entered all_reduce #{seq} of group 0 ({desc}); {world - 1} ranks wait for it.",
        stalled_collective=StalledCollective(
            group="0",
            group_desc=desc,
            group_ranks=list(range(world)),
            seq=seq,
            op="all_reduce",
            profiling_name="gloo:all_reduce",
            entered_ranks=others,
            completed_ranks=[],
            missing_ranks=[stuck],
            input_sizes=[[1024]],
            dtypes=["Float"],
        ),
        lagging_ranks=[stuck],
        findings=[
            Finding(
                kind="not-entered",
                ranks=[stuck],
                group="0",
                seq=seq,
                detail=f"rank {stuck} last completed #{seq - 1} and has not enqueued #{seq}",
            )
        ],
        ranks_loaded=list(range(world)),
        groups=[
            GroupProgress(
                group="0",
                group_desc=desc,
                ranks=list(range(world)),
                min_completed=seq - 1,
                max_enqueued=seq,
                lagging=[stuck],
            )
        ],
        waits_for=[WaitEdge(waiter=r, waits_on=stuck, group="0", seq=seq) for r in others],
        evidence=evidence,
    )


@dataclass(frozen=True, kw_only=True)
class RealIncident:
    report: Report
    lagging_ranks: list[int]
    group: str
    seq: int
    op: str
    source: str
    dumps: Path | None = None  # the dump directory the report came from


def real_incident() -> RealIncident:
    """The real analyzer on real gloo dumps (the hang zoo's golden "skip" job),
    with the expected answer taken from the dumps' manifest, not the analyzer."""
    from hangwatch.analyzer import analyze_path

    manifest = json.loads((GOLDEN_SKIP / "manifest.json").read_text())
    want = manifest["expected"]
    return RealIncident(
        report=analyze_path(GOLDEN_SKIP),
        lagging_ranks=list(want["lagging_ranks"]),
        group=str(want["stalled"]["group"]),
        seq=int(want["stalled"]["seq"]),
        op=str(want["stalled"]["op"]),
        source=str(GOLDEN_SKIP.relative_to(REPO)),
        dumps=GOLDEN_SKIP,
    )


def demo_incident() -> RealIncident:
    """`real_incident()` when the golden dumps are in the tree, else the same
    shape of hang built by hand (16 ranks, rank 5 never enters all_reduce #42)."""
    if (GOLDEN_SKIP / "manifest.json").is_file():
        return real_incident()
    return RealIncident(
        report=hang_report(world=16, stuck=5),
        lagging_ranks=[5],
        group="0",
        seq=42,
        op="all_reduce",
        source="constructed",
    )


def insert_incident(
    ctx: ServerContext,
    *,
    job: str,
    report: Report,
    created: float | None = None,
    bundle_from: Path | None = None,
) -> str:
    """Store an analysed incident with a bundle on disk: a copy of `bundle_from`
    (real dumps) or, without it, a small stand-in bundle."""
    world = len(report.ranks_loaded)
    sc = report.stalled_collective
    row = ctx.store.create_incident(
        job_id=job,
        reason=f"group {sc.group} stalled at {sc.op} #{sc.seq}" if sc else "stall",
        trigger="stall",
        ranks_expected=range(world),
        created=created,
    )
    ctx.store.set_dump_outcome(row.id, ranks_dumped=report.ranks_loaded, ranks_unreachable={})
    ctx.store.finish_incident(row.id, report=report, detection_s=13.5)
    ctx.metrics.inc(
        "hangwatch_incidents_total", labels={"verdict": report.verdict, "trigger": "stall"}
    )
    ctx.metrics.observe("hangwatch_detection_latency_seconds", 13.5)
    bundle = ctx.store.incident_dir(row.id)
    if bundle_from is not None:
        shutil.copytree(bundle_from, bundle, dirs_exist_ok=True)
        return row.id
    (bundle / "rank_0").mkdir(parents=True, exist_ok=True)
    (bundle / "incident.json").write_text(
        json.dumps({"schema": "hangwatch.incident/1", "id": row.id})
    )
    (bundle / "rank_0" / "fr_trace_rank_0").write_bytes(b"\x80\x04}\x94." * 100)
    first = report.evidence.get(0)
    (bundle / "rank_0" / "stacks.txt").write_text((first.stacks if first else None) or "")
    return row.id


@contextlib.contextmanager
def serve(app: FastAPI) -> Iterator[str]:
    """uvicorn on 127.0.0.1, port chosen by the OS; yields the base URL."""
    # IPPROTO_TCP explicitly: asyncio only sets TCP_NODELAY on accepted sockets
    # whose proto says TCP, and without it every response waits ~40 ms for a
    # delayed ACK (Nagle).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off")
    )  # type: ignore[arg-type]
    errors: list[BaseException] = []

    def run() -> None:
        try:
            server.run(sockets=[sock])
        except BaseException as e:  # surfaced to the test below
            errors.append(e)

    thread = threading.Thread(target=run, name="test-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if errors or not thread.is_alive():
            raise RuntimeError(f"uvicorn did not start: {errors!r}")
        if time.monotonic() > deadline:
            raise TimeoutError("uvicorn did not start within 10 s")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
        if thread.is_alive():
            raise RuntimeError("uvicorn did not stop within 10 s")
        if errors:
            raise RuntimeError(f"uvicorn failed: {errors!r}")
