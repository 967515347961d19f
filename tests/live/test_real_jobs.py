"""Small real training jobs, each run live: `hangwatch server` + `hangwatch agent` +
`hangwatch run -- torchrun ...`, asserting incidents, states and words through
the JSON API read into its own models (never printed text).

One coordinator (stall timeout 5 s) serves the module; each test has its own
job id, run directory and agent. The jobs are in train_jobs.py.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import httpx
import pytest
from hangwatch.analyzer.report import FindingKind
from hangwatch.server.web import schemas

from hangwatch.config import DetectSection, env_var
from tests.live.conftest import coordinator_process, stop_job

pytestmark = [pytest.mark.torch, pytest.mark.slow, pytest.mark.realjob]

HERE = Path(__file__).resolve().parent
STALL_TIMEOUT_S = 5.0
T = TypeVar("T")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    data = tmp_path_factory.mktemp("realjobs")
    with coordinator_process(data, "--stall-timeout", str(STALL_TIMEOUT_S)) as info:
        yield info


@dataclass
class LiveJob:
    job_id: str
    http: httpx.Client
    agent: subprocess.Popen[bytes]
    train: subprocess.Popen[bytes]
    logs: dict[str, Path]

    def output(self) -> str:
        return "\n".join(
            f"--- {name}\n{p.read_text(errors='replace')[-4000:]}" for name, p in self.logs.items()
        )

    def summary(self) -> schemas.JobSummary | None:
        for j in self.http.get("/api/jobs").raise_for_status().json():
            if j["job"] == self.job_id:
                return schemas.JobSummary.model_validate(j)
        return None

    def incidents(self) -> list[schemas.IncidentSummary]:
        got = self.http.get("/api/incidents", params={"job": self.job_id}).raise_for_status()
        return [schemas.IncidentSummary.model_validate(i) for i in got.json()]

    def incident(self, incident_id: str) -> schemas.IncidentDetail:
        got = self.http.get(f"/api/incidents/{incident_id}").raise_for_status()
        return schemas.IncidentDetail.model_validate(got.json())

    def unresolved(self) -> list[schemas.IncidentSummary]:
        """The job's incidents but the transient stalls that resolved (a slow
        evaluation is one)."""
        return [i for i in self.incidents() if i.status != "resolved"]

    def wait(self, what: str, value: Callable[[], T | None], timeout: float = 60.0) -> T:
        """Poll `value` (the API) until it is not None; fail with every log."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = value()
            if got is not None:
                return got
            assert self.agent.poll() is None, (
                f"agent exited {self.agent.returncode}\n{self.output()}"
            )
            time.sleep(0.3)
        raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{self.output()}")

    def finished(self, timeout: float = 60.0) -> int:
        try:
            return self.train.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the job did not finish in {timeout}s\n{self.output()}") from None

    def ended(self) -> schemas.JobSummary:
        """The job's summary once the coordinator shows it ended."""
        return self.wait("the job to show as ended", lambda: _if(self.summary(), "ended"))

    def analyzed(self) -> schemas.IncidentDetail:
        """The job's first unresolved incident once its verdict is stored."""

        def first() -> schemas.IncidentDetail | None:
            done = [i for i in self.unresolved() if i.status != "collecting"]
            return self.incident(done[0].id) if done else None

        return self.wait("an analysed incident", first)


def _if_all(items: list[T], ok: Callable[[T], bool]) -> list[T] | None:
    return items if items and all(ok(i) for i in items) else None


def _if(s: schemas.JobSummary | None, state: str) -> schemas.JobSummary | None:
    return s if s is not None and s.state == state else None


def _stop(p: subprocess.Popen[bytes]) -> None:
    stop_job(p)


@contextlib.contextmanager
def live_job(
    server: dict[str, str], tmp_path: Path, job: str, *, nproc: int = 2, **extra: str
) -> Iterator[LiveJob]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("HANGWATCH_")}
    environ |= {env_var("poll_interval"): "0.5", "OMP_NUM_THREADS": "1", **extra}
    run_dir = tmp_path / "run"
    job_id = f"{job}-{tmp_path.name}"[:60]
    logs = {"agent": tmp_path / "agent.log", "train": tmp_path / "train.log"}
    procs: list[subprocess.Popen[bytes]] = []
    try:
        with logs["agent"].open("wb") as out:
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "hangwatch",
                        "agent",
                        "--coordinator",
                        server["grpc"],
                        "--run-dir",
                        str(run_dir),
                        "--job-id",
                        job_id,
                    ],
                    env=environ,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        with logs["train"].open("wb") as out:
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "hangwatch",
                        "run",
                        "--run-dir",
                        str(run_dir),
                        "--",
                        sys.executable,
                        "-m",
                        "torch.distributed.run",
                        "--standalone",
                        "--nproc-per-node",
                        str(nproc),
                        str(HERE / "train_jobs.py"),
                        job,
                    ],
                    env=environ,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        with httpx.Client(base_url=server["http"], timeout=10) as http:
            yield LiveJob(job_id=job_id, http=http, agent=procs[0], train=procs[1], logs=logs)
    finally:
        for p in reversed(procs):
            _stop(p)
    assert procs[0].returncode == 0, f"the agent did not stop cleanly\n{logs['agent'].read_text()}"


@pytest.mark.timeout(120)
def test_healthy_ddp_fsdp2_and_a_checkpoint_raise_nothing_and_end(
    server: dict[str, str], tmp_path: Path
) -> None:
    """DDP, then FSDP2, then a sharded checkpoint (every rank writes its shards),
    then more steps: one launch of a healthy job."""
    ckpt = tmp_path / "ckpt"
    with live_job(server, tmp_path, "healthy", CHECKPOINT_DIR=str(ckpt)) as j:
        assert j.finished() == 0, j.output()
        assert (ckpt / ".metadata").is_file(), sorted(p.name for p in tmp_path.rglob("*"))
        s = j.ended()
        assert s.ended_reason == "every rank of the job exited" and not s.live
        assert s.oldest_inflight_age_s is None and s.stalled_groups == 0
        # Not even a transient stall: on a loaded 2-core machine one rank can
        # reach its first collective seconds after its peers (measured: its FR
        # empty while py-spy had it in its first forward), which the start-up
        # grace absorbs.
        assert j.incidents() == []


@pytest.mark.timeout(150)
def test_ddp_uneven_batches_hang_is_an_op_mismatch(server: dict[str, str], tmp_path: Path) -> None:
    """Rank 1 runs out of batches and waits at the final barrier while rank 0 is
    in its next gradient all_reduce: the same seq, two different collectives."""
    with live_job(server, tmp_path, "ddp-uneven") as j:
        inc = j.analyzed()
        assert j.train.poll() is None, "the hung job must still be running"
        assert (inc.trigger, inc.status, inc.verdict) == ("stall", "analyzed", "mismatch"), inc
        assert inc.open and not inc.transient
        assert inc.report is not None and inc.report.stalled_collective is not None
        seq = inc.report.stalled_collective.seq
        (f,) = [f for f in inc.report.findings if f.kind == FindingKind.OP_MISMATCH]
        assert (
            f.seq == seq
            and f.detail == f"different ops at seq {seq}: all_reduce on 0, barrier on 1"
        )
        # The trigger line names the same collective and the same two ops.
        assert f"stalled at seq {seq}: " in inc.reason, inc.reason
        assert "different ops at that seq: all_reduce on 0, barrier on 1;" in inc.reason
        s = j.summary()
        assert s is not None and s.state == "live", s


@pytest.mark.timeout(150)
def test_crash_opens_an_incident_with_the_exception(server: dict[str, str], tmp_path: Path) -> None:
    with live_job(server, tmp_path, "crash") as j:
        inc = j.analyzed()
        assert j.finished() != 0  # torchrun reports the failed rank
        assert inc.trigger == "crash", inc
        # The rank that died first, and why; rank 0 only lost its peer.
        assert inc.reason.startswith("rank 1 crashed"), inc.reason
        # The verdict opens with the crash too, worded by the analyzer.
        assert inc.summary.startswith("Rank 1 crashed ("), inc.summary
        assert "corrupt sample in batch 10" in inc.summary, inc.summary
        assert "A stall was reported" not in inc.summary, inc.summary
        assert "RuntimeError: rank 1: corrupt sample in batch 10" in inc.reason, inc.reason
        assert inc.report is not None
        assert inc.report.evidence[1].exceptions == [
            "thread MainThread: RuntimeError: rank 1: corrupt sample in batch 10"
        ]
        # The culprit in the structured fields every consumer reads.
        assert (inc.verdict, inc.lagging_ranks) == ("crash", [1]), inc.summary
        [first] = [f for f in inc.report.findings if f.kind == FindingKind.RANK_CRASHED]
        assert first.ranks == [1]
        # The survivor's FR is in the incident even when it died before the
        # agent asked (gloo fails its collective when the peer's socket closes):
        # its hook wrote it as it died. The summary says where each stood.
        assert 0 in inc.report.ranks_loaded, inc.report.ranks_missing
        dead, alive = inc.report.evidence[1].last_entered, inc.report.evidence[0].last_entered
        assert dead is not None and alive is not None, inc.report.evidence
        assert f"In FR, rank 1 last entered all_reduce #{dead.seq} in group 0; " in inc.summary
        # Rank 0 steps on into the next all_reduce, which rank 1 never reached
        # (measured: #16 against #15); were torchrun to stop it first, it would
        # stand where rank 1 did. Either way the summary says which.
        assert alive.group == "0" and alive.seq in (dead.seq, dead.seq + 1), (alive, dead)
        beyond = ", which rank 1 never reached" if alive.seq > dead.seq else ""
        assert f"rank 0 had entered all_reduce #{alive.seq} in group 0{beyond}." in inc.summary
        # FR's "no culprit visible" reading is about a hang: not after a crash.
        assert "not visible in FR" not in inc.summary, inc.summary
        j.ended()
        # The incident ends at the coordinator's next tick after the job does.
        (only,) = j.wait(
            "the crash incident to end",
            lambda: _if_all(j.unresolved(), lambda i: i.status == "ended"),
            timeout=10,
        )
        assert only.id == inc.id and not only.open
        s = j.summary()
        assert s is not None and s.oldest_inflight_age_s is None and s.open_incident is None


@pytest.mark.timeout(150)
def test_dead_loader_thread_is_in_the_incident(server: dict[str, str], tmp_path: Path) -> None:
    """Rank 1's data-loader thread dies; its main thread waits in queue.get()."""
    with live_job(server, tmp_path, "loader") as j:
        inc = j.analyzed()
        assert (inc.trigger, inc.verdict, inc.lagging_ranks) == ("stall", "hang", [1]), inc
        assert inc.report is not None
        raised = "thread data-loader: ValueError: corrupt record 12 in shard-0003.bin"
        assert inc.report.evidence[1].exceptions == [raised]
        assert inc.report.evidence[0].exceptions == []
        (f,) = [f for f in inc.report.findings if f.kind == FindingKind.THREAD_EXCEPTION]
        assert f.ranks == [1] and f.detail == f"rank 1: uncaught exception in {raised}"
        assert inc.report.stalled_collective is not None
        seq = inc.report.stalled_collective.seq
        assert f"stalled at seq {seq} (all_reduce): ranks 0 waiting, ranks 1 not entered" in (
            inc.reason
        )


@pytest.mark.timeout(150)
def test_slow_evaluation_raises_nothing(server: dict[str, str], tmp_path: Path) -> None:
    """Rank 0 evaluates (busy on a CPU) for 9 s while rank 1 waits in a barrier,
    with a 5 s stall timeout: work, not a hang. A stall whose laggard is busy is
    paged only at the bound for busy ranks, 3 stall timeouts (15 s).

    The start-up can show one too: rank 1 in DDP's first collective (seq 1)
    while rank 0, slower to start on a loaded machine, still works towards it.
    That one is the group's first collective, whose timeout is the start-up
    grace (seen in a full suite run: timeout_s 60 at seq 1, polled 4 s after
    the ranks were found)."""
    grace = DetectSection().startup_grace
    with live_job(server, tmp_path, "slow-eval", EVAL_S="9") as j:
        saw_barrier = False
        while j.train.poll() is None:
            got = j.http.get(f"/api/jobs/{j.job_id}/ranks")
            if got.status_code == 200:
                for st in schemas.JobRanks.model_validate(got.json()).stalled:
                    # Rank 0 busy in every stall this job shows, never over timeout.
                    if st.busy_ranks != [0]:
                        continue
                    assert not st.over_timeout, st
                    if st.seq == 1:
                        assert st.timeout_s == max(grace, 3 * STALL_TIMEOUT_S), st
                    else:  # the barrier after 20 DDP steps
                        saw_barrier = True
                        assert st.timeout_s == 3 * STALL_TIMEOUT_S, st
            time.sleep(0.5)
        assert j.train.returncode == 0, j.output()
        s = j.ended()
        assert j.incidents() == []
        assert saw_barrier, "the evaluation never showed as a busy rank's stall"
        assert s.open_incident is None and s.stalled_groups == 0 and s.oldest_inflight_age_s is None


def _numbers(g: schemas.RankGroupState) -> tuple[object, ...]:
    """A group's numbers, compact: pytest cuts a long message (CI, stop 52,
    lost rank 1's)."""
    return (g.group, g.last_enqueued, g.last_completed, g.collectives_enqueued,
            g.collectives_completed, g.in_flight_seq)  # fmt: skip


@pytest.mark.timeout(150)
def test_pipeline_stages_are_never_behind_for_their_p2p(
    server: dict[str, str], tmp_path: Path
) -> None:
    """Three healthy stages: the middle one does twice the sends/receives, and
    gloo's counters count them; the heat map must still show everyone in step."""
    with live_job(server, tmp_path, "pipeline", nproc=3) as j:
        seen_p2p = False
        samples = 0
        while j.train.poll() is None:
            got = j.http.get(f"/api/jobs/{j.job_id}/ranks")
            if got.status_code == 200:
                ranks = schemas.JobRanks.model_validate(got.json()).ranks
                running = [r for r in ranks if r.process_state == "running"]
                if len(running) == 3:
                    samples += 1
                    seen_p2p |= all(r.p2p for r in running)
                    # In step within the one collective a poll can straddle.
                    assert all(r.lag <= 1 for r in running), [
                        (r.rank, r.lag, [_numbers(g) for g in r.groups]) for r in ranks
                    ]
            time.sleep(0.5)
        assert j.train.returncode == 0, j.output()
        assert samples >= 3 and seen_p2p, (samples, seen_p2p)
        j.ended()
        assert j.unresolved() == []
