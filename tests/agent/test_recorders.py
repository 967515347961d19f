"""Every flight recorder a rank writes to, read by the hook, the agent and the analyzer.

The hook-recorded tests run a real 2-rank job on the `hwstore` backend
(asynchronous, not gloo), which torch 2.15 records through FlightRecorderHook
exactly as it records its default NCCL, plus one gloo subgroup, so each rank
writes to two recorder instances. They skip, naming the missing feature, on
a torch without the hook (2.13/2.14).
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hangwatch.agent import collector, endpoint
from hangwatch.agent.ranks import poll_rank
from hangwatch.analyzer import analyze_path
from helpers import skip_unless_backend

from hangwatch import env, formats, hook, hook_protocol
from hangwatch.testing.scenarios import get_scenario
from tests.agent.live_ranks import Job, socket_of, start_job

# --- env, the torchtitan way (no torch needed) ------------------------------------


def _env_state(tmp_path: Path) -> hook._State:
    return hook._State(
        run_dir=str(tmp_path / "run"), job_id="j", force_thread_server=False, owner_pid=0
    )


@pytest.mark.timeout(10)
def test_unset_env_gets_both_names_and_logs_nothing_yet(tmp_path: Path) -> None:
    st = _env_state(tmp_path)
    environ: dict[str, str] = {}
    hook.set_env_defaults(st, environ, 2000)
    prefix = hook_protocol.fr_dump_prefix(st.run_dir)
    for name in env.DUMP_ON_TIMEOUT_NAMES:
        assert environ[name] == "1"
    for name in env.DUMP_FILE_NAMES:
        assert environ[name] == prefix
    assert st.env.watchdog_prefix == prefix
    # Decided, not yet said: a launcher or a worker process never becomes a rank.
    assert st.env.pending and not st.announced
    assert not Path(st.run_dir).exists()


@pytest.mark.timeout(10)
def test_a_value_the_job_set_is_kept_under_either_name(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    st = _env_state(tmp_path)
    environ = {
        env.TORCH_NCCL_DEBUG_INFO_TEMP_FILE: "/data/fr/rank_",
        env.TORCH_NCCL_DUMP_ON_TIMEOUT: "0",
        env.TORCH_FR_BUFFER_SIZE: "500",
    }
    hook.set_env_defaults(st, environ, 2000)
    # Setting the 2.15 name would shadow the job's value under the old one.
    assert env.TORCH_FR_DUMP_TEMP_FILE not in environ
    assert env.TORCH_FR_DUMP_ON_TIMEOUT not in environ
    assert environ[env.TORCH_FR_BUFFER_SIZE] == "500"
    assert st.env.watchdog_prefix == "/data/fr/rank_"
    assert env.TORCH_FR_BUFFER_SIZE not in st.env.set
    with caplog.at_level(logging.INFO, logger="hangwatch.hook"):
        hook.announce(st)
    text = caplog.text
    assert "keeping the job's TORCH_NCCL_DEBUG_INFO_TEMP_FILE=/data/fr/rank_" in text
    assert "keeping the job's TORCH_FR_BUFFER_SIZE=500" in text
    assert "turned dump-on-timeout off" in text
    assert Path(st.run_dir, formats.FR_DIR).is_dir()


@pytest.mark.timeout(10)
def test_a_default_a_parent_hook_set_is_not_announced_as_the_job_s(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """torchrun's own hook sets the defaults; its workers inherit them. A worker
    says nothing about them, but still names a value the job really set."""
    launcher, worker = _env_state(tmp_path), _env_state(tmp_path)
    environ: dict[str, str] = {env.TORCH_INCLUDE_STACK_TRACE: "0"}  # the job's own choice
    hook.set_env_defaults(launcher, environ, 2000)
    with caplog.at_level(logging.INFO, logger="hangwatch.hook"):
        hook.set_env_defaults(worker, environ, 2000)
        hook.announce(worker)
    assert "keeping the job's TORCH_FR_BUFFER_SIZE" not in caplog.text
    assert "keeping the job's TORCH_FR_DUMP_TEMP_FILE" not in caplog.text
    assert f"keeping the job's {env.TORCH_INCLUDE_STACK_TRACE}=0" in caplog.text
    assert environ[env.TORCH_FR_BUFFER_SIZE] == "2000"


@pytest.mark.timeout(60)
def test_attach_outside_a_rank_is_silent_and_writes_nothing(tmp_path: Path) -> None:
    """The launcher, data-loader and compile workers: env only, no log line, no files."""
    run_dir = tmp_path / "run"
    code = (
        "import logging, os; logging.basicConfig(level=logging.DEBUG)\n"
        "import hangwatch\n"
        f"r = hangwatch.attach(run_dir={str(run_dir)!r})\n"
        "print('OK', r.ok, os.environ['TORCH_FR_DUMP_ON_TIMEOUT'])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=50, check=True
    )
    assert out.stdout.strip() == "OK True 1"
    assert "hangwatch" not in out.stderr, out.stderr
    assert not run_dir.exists()


# --- a hook-recorded backend, live -------------------------------------------------


def _hang_job(tmp_path_factory: pytest.TempPathFactory, backend: str) -> Iterator[Job]:
    """`backend` default group + a gloo subgroup; after 5 steps rank 1 stops, rank 0 blocks."""
    skip_unless_backend(backend)
    job = start_job(tmp_path_factory.mktemp(backend), mode="hang", backend=backend)
    try:
        job.wait_ready()
        yield job
    finally:
        job.close()


@pytest.fixture(scope="module")
def hooked_job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Job]:
    """Without completion hooks (hwstore)."""
    yield from _hang_job(tmp_path_factory, "hwstore")


@pytest.mark.torch
@pytest.mark.timeout(90)
def test_rank_info_names_each_recorder_and_its_groups(hooked_job: Job) -> None:
    info = hooked_job.rankinfo()
    recs0 = {r["instance"]: r for r in info[0]["recorders"]}
    assert set(recs0) == {"hwstore", "gloo"}
    assert recs0["hwstore"]["kind"] == "hooked"
    assert recs0["hwstore"]["completion"] == "unknown"
    assert recs0["hwstore"]["status_offset"] == 1
    assert recs0["gloo"]["kind"] == "generic" and recs0["gloo"]["completion"] == "tracked"
    # Each instance numbers its own groups: the gloo subgroup is gloo's pg 0.
    assert recs0["gloo"]["groups"] == ["1"]
    assert recs0["hwstore"]["groups"][0] == "0"
    # Rank 1 is in no gloo group: it writes to one instance only.
    assert [r["instance"] for r in info[1]["recorders"]] == ["hwstore"]


@pytest.mark.torch
@pytest.mark.timeout(90)
def test_status_poll_reads_every_instance_in_microseconds_of_cpp(hooked_job: Job) -> None:
    info = hooked_job.rankinfo()[0]
    doc = json.loads(endpoint.call(socket_of(info), hook_protocol.STATUS, timeout=2))
    assert doc["schema"] == formats.FRSTATUS
    by = {r["instance"]: r for r in doc["recorders"]}
    assert set(by) == {"hwstore", "gloo"}
    hw = by["hwstore"]["dump"]["pg_status"]["0"]
    # The hook counts op_id from 0 and never records completion here.
    assert hw["last_completed_collective"] == "-1"
    assert int(hw["last_enqueued_collective"]) >= 5
    assert by["gloo"]["dump"]["pg_status"]["0"]["last_completed_collective"] == "5"


@pytest.mark.torch
@pytest.mark.timeout(90)
def test_agent_sees_what_each_rank_entered_and_that_completion_is_unknown(
    hooked_job: Job,
) -> None:
    trackers = hooked_job.trackers()
    # The first poll learns what is in flight, the second fetches its entries (op names).
    events = []
    for _ in range(2):
        now = time.monotonic()
        for t in trackers.values():
            events += poll_rank(t, now, entries_after_s=0.0).events
    # torch 2.15 answers its health check; the hooked backend is healthy (no event).
    assert all(t.health_supported for t in trackers.values()) and events == []
    p0 = {g.group: g for g in trackers[0].progress_pb(now).groups}
    p1 = {g.group: g for g in trackers[1].progress_pb(now).groups}
    # Default group: 5 all_reduces each, then rank 0 entered a sixth; rank 1 did not.
    assert (p0["0"].last_enqueued, p1["0"].last_enqueued) == (6, 5)
    assert p0["0"].completion_unknown and p1["0"].completion_unknown
    assert p0["0"].oldest_in_flight.seq == 6 and p0["0"].oldest_in_flight.op == "all_reduce"
    # The gloo subgroup is read from gloo's instance, with real completion.
    assert not p0["1"].completion_unknown
    assert (p0["1"].last_enqueued, p0["1"].last_completed) == (5, 5)


@pytest.mark.torch
@pytest.mark.timeout(120)
def test_bundle_has_one_file_per_instance_and_the_analyzer_merges_them(
    hooked_job: Job, tmp_path: Path
) -> None:
    trackers = hooked_job.trackers()
    now = time.monotonic()
    for t in trackers.values():
        poll_rank(t, now, entries_after_s=0.0)
    bundles = {
        r: collector.collect_rank(
            t, run_dir=str(hooked_job.run_dir), incident_id="inc1", pyspy="py-spy", gpu={}
        )
        for r, t in trackers.items()
    }
    assert {"fr_hwstore_rank_0", "fr_trace_rank_0"} <= set(bundles[0].files)
    assert "fr_hwstore_rank_1" in bundles[1].files
    assert not bundles[0].failure and not bundles[1].failure
    report = analyze_path(Path(bundles[0].directory).parent, world_size=2)
    assert report.verdict == "hang", report.summary
    assert report.lagging_ranks == [1]
    st = report.stalled_collective
    assert st is not None and (st.group, st.seq, st.op) == ("0", 6, "all_reduce")
    assert "completion-unknown" in {f.kind for f in report.findings}
    groups = {g.group for g in report.groups}
    assert {"0", "1"} <= groups  # the gloo instance's group is in the same view


@pytest.mark.torch
@pytest.mark.timeout(120)
def test_raw_torch_dumps_of_a_hooked_backend_are_never_healthy(tmp_path: Path) -> None:
    """torch's own dumps, no hangwatch metadata: a healthy job is "unknown", a skip a hang."""
    from hangwatch.testing.launch import launch_job

    skip_unless_backend("hwstore")
    for name in ("healthy", "skip"):
        sc = get_scenario(name).for_backend("hwstore")
        with launch_job(
            sc,
            2,
            workdir=tmp_path / name,
            snapshot_after=1.0,
            snapshot_layout="plain",
            include_frames=False,
            backend="hwstore",
        ) as job:
            snap = job.wait_snapshots(timeout=30)
        report = analyze_path(snap, world_size=2)
        assert report.verdict == ("unknown" if name == "healthy" else "hang"), report.summary
        if name == "skip":
            assert report.lagging_ranks == [1]


@pytest.mark.torch
@pytest.mark.timeout(90)
def test_torchs_own_dump_to_file_is_picked_up_as_a_watchdog_dump(hooked_job: Job) -> None:
    """torch 2.15's fr_dump_file writes <TORCH_FR_DUMP_TEMP_FILE><rank> from C++ (what
    its watchdog tooling calls); the agent must notice the file and report it."""
    from hangwatch.agent.service import Agent

    from hangwatch.config import Config
    from hangwatch.wire import pb

    info = hooked_job.rankinfo()[0]
    prefix = info["dump_prefixes"]["watchdog"]
    assert prefix == hook_protocol.fr_dump_prefix(str(hooked_job.run_dir))
    answer = endpoint.call(socket_of(info), "fr_dump_file?backend=hwstore", timeout=5)
    assert b"initiated" in answer, answer
    agent = Agent(Config.of(run_dir=str(hooked_job.run_dir), coordinator="127.0.0.1:1"))
    try:
        deadline = time.monotonic() + 20
        seen: list[tuple[int, int, str]] = []
        while time.monotonic() < deadline and not seen:
            agent.scan_watchdog(time.monotonic())
            seen += [(ev.kind, ev.rank, ev.detail) for ev in agent.events.take(100)]
            time.sleep(0.2)
    finally:
        agent.client.close()
    assert (pb.EVENT_KIND_WATCHDOG_DUMP, 0, "fr_trace_rank_0") in seen, seen
    dump = Path(prefix + "0").read_bytes()
    from hangwatch.analyzer.decode import decode_dump
    from hangwatch.analyzer.sniff import sniff_and_decode

    parsed = decode_dump(sniff_and_decode(dump))
    assert parsed.backend == "hwstore" and parsed.hooked and not parsed.completion_known


@pytest.mark.torch
@pytest.mark.timeout(90)
def test_a_rank_leaving_normally_leaves_its_final_numbers_and_is_finished(
    hooked_job: Job,
) -> None:
    """Ends the shared job (keep it the last test of `hooked_job`): rank 1 leaves
    through Python's exit; its hook writes what its recorders held, and the agent
    reads that as the rank's last numbers and reports the rank finished. Rank 0,
    still blocked in #6, is then killed: no exit handlers, so not finished."""
    from hangwatch.wire import pb

    trackers = hooked_job.trackers()
    (hooked_job.run_dir / "stop").touch()
    assert hooked_job.procs[1].wait(30) == 0, hooked_job.output()
    doc = json.loads(Path(trackers[1].final_status_path).read_bytes())
    assert doc["schema"] == formats.FRSTATUS
    assert {r["instance"] for r in doc["recorders"]} == {"hwstore"}
    # This tracker never polled the rank while it lived, and its endpoint is
    # gone: every number it reports comes from the file.
    now = time.monotonic()
    t1 = trackers[1]
    assert poll_rank(t1, now, entries_after_s=0.0).events == [
        (pb.EVENT_KIND_RANK_EXITED, 1, "process gone")
    ]
    p1 = t1.progress_pb(now)
    assert p1.finished and {g.group: g.last_enqueued for g in p1.groups}["0"] == 5
    hooked_job.procs[0].kill()
    hooked_job.procs[0].wait(10)
    t0 = trackers[0]
    poll_rank(t0, now, entries_after_s=0.0)
    assert t0.state == pb.PROCESS_STATE_GONE and not t0.progress_pb(now).finished
    assert not Path(t0.final_status_path).exists()


@pytest.mark.torch
@pytest.mark.timeout(90)
def test_health_check_is_asked_where_torch_has_it(
    hang_job: Job, caplog: pytest.LogCaptureFixture
) -> None:
    """2.15 answers c10d_health_check (healthy: no event); older torch 404s: asked once."""
    from hangwatch.agent import ranks

    caplog.set_level(logging.DEBUG, logger="hangwatch.agent")
    t = hang_job.trackers()[0]
    # What is tested is how the answer is read, not how soon it comes: the
    # agent's 0.5 s deadline was missed once in a full run on 2 loaded cores,
    # which leaves health_supported None (asked again 5 s later).
    events = ranks.check_health(t, time.monotonic(), timeout=30.0)
    assert events == []
    import torch._C._distributed_c10d as c

    has = hook_protocol.HEALTH_CHECK in c._get_handler_names()
    # Why it was left unknown, if it was: the agent's debug line names the error.
    assert t.health_supported is has, caplog.text


# --- a hook-recorded backend with completion hooks (2.15's default NCCL) ------------


@pytest.fixture(scope="module")
def nccl2_job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Job]:
    """With completion hooks (hwhooks, NCCL2's contract)."""
    yield from _hang_job(tmp_path_factory, "hwhooks")


@pytest.mark.torch
@pytest.mark.timeout(120)
def test_a_backend_with_completion_hooks_is_tracked_end_to_end(nccl2_job: Job) -> None:
    # The rank-info file: what the backend says (supports_completion_hooks).
    recs0 = {r["instance"]: r for r in nccl2_job.rankinfo()[0]["recorders"]}
    assert recs0["hwhooks"]["kind"] == "hooked"
    assert recs0["hwhooks"]["completion"] == "tracked"
    # torch's own counters: the hook retires at completion, so they advance.
    info = nccl2_job.rankinfo()[0]
    doc = json.loads(endpoint.call(socket_of(info), hook_protocol.STATUS, timeout=2))
    hw = {r["instance"]: r for r in doc["recorders"]}["hwhooks"]["dump"]["pg_status"]["0"]
    assert int(hw["last_completed_collective"]) >= 4
    # The agent's progress: completion known, rank 0 in #6 which rank 1 never entered.
    trackers = nccl2_job.trackers()
    for _ in range(2):
        now = time.monotonic()
        for t in trackers.values():
            poll_rank(t, now, entries_after_s=0.0)
    p0 = {g.group: g for g in trackers[0].progress_pb(now).groups}
    p1 = {g.group: g for g in trackers[1].progress_pb(now).groups}
    assert not p0["0"].completion_unknown and not p1["0"].completion_unknown
    assert (p0["0"].last_enqueued, p0["0"].last_completed) == (6, 5)
    assert (p1["0"].last_enqueued, p1["0"].last_completed) == (5, 5)
    # The bundle and the analyzer: a hang on rank 1, and no completion caveat.
    bundles = {
        r: collector.collect_rank(
            t, run_dir=str(nccl2_job.run_dir), incident_id="inc2", pyspy="py-spy", gpu={}
        )
        for r, t in trackers.items()
    }
    assert "fr_hwhooks_rank_0" in bundles[0].files and "fr_hwhooks_rank_1" in bundles[1].files
    report = analyze_path(Path(bundles[0].directory).parent, world_size=2)
    assert (report.verdict, report.lagging_ranks) == ("hang", [1]), report.summary
    st = report.stalled_collective
    assert st is not None and (st.group, st.seq, st.op) == ("0", 6, "all_reduce")
    assert "completion-unknown" not in {f.kind for f in report.findings}
