"""--exclude-command and --on-hang on the coordinator side: a real registry,
a real SQLite store, a real script that records the argv it was run with.
(The end-to-end abort of a real job is tests/live/test_actions_live.py.)"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from hangwatch.analyzer.report import RankEvidence, Report
from hangwatch.server.coordinator import Coordinator
from hangwatch.server.incidents.store import IncidentRow, IncidentStore
from hangwatch.server.integrations import actions
from hangwatch.server.integrations.metrics import Metrics
from hangwatch.server.live.registry import JobRegistry

from hangwatch import config
from hangwatch.wire import pb, rpc
from tests.support.webhook import receiver

from .test_notify import hang_then_resume

JOB = "job"
RECORD = Path(__file__).resolve().parents[1] / "live" / "record_argv.py"
HOSTILE = ["-rf", "a b", "a;b", "$(id)", "../etc", "x/y", "", "a" * 64, "x..y", "-x.y", "x-.y",
           "node_1", "a\nb", "*", "~root", "h\x00"]  # fmt: skip


def _register(reg: JobRegistry, agent: str, host: str, ranks: list[int], world: int = 4) -> None:
    infos = [
        pb.RankInfo(rank=r, local_rank=i, world_size=world, pid=30_000 + r, backend="gloo",
                    groups=[pb.GroupInfo(name="0", desc="default_pg", ranks=list(range(world)))])
        for i, r in enumerate(ranks)
    ]  # fmt: skip
    reg.register(pb.RegisterRequest(job_id=JOB, agent_id=agent, host=host, ranks=infos))


def _runner(
    tmp_path: Path, policy: actions.ActionPolicy, published: list[tuple[str, IncidentRow]]
) -> tuple[actions.ActionRunner, IncidentStore, JobRegistry, str]:
    store = IncidentStore.in_dir(tmp_path / "data")
    reg = JobRegistry()
    row = store.create_incident(
        job_id=JOB, reason="stall", trigger="stall", ranks_expected=[0, 1, 2, 3]
    )
    runner = actions.ActionRunner(
        policy, store=store, registry=reg, metrics=Metrics(),
        publish=lambda ev, r, _rec: published.append((ev, r)),
    )  # fmt: skip
    return runner, store, reg, row.id


def _hang(store: IncidentStore, iid: str, lagging: list[int], verdict: str = "hang") -> Report:
    report = Report(verdict=verdict, summary="test verdict", lagging_ranks=lagging)  # type: ignore[arg-type]
    store.finish_incident(iid, report=report, detection_s=1.0)
    return report


def _wait_actions(store: IncidentStore, iid: str, n: int) -> IncidentRow:
    end = time.monotonic() + 20
    while time.monotonic() < end:
        row = store.get_incident(iid)
        assert row is not None
        if len(row.actions) >= n and all(a.finished is not None for a in row.actions):
            return row
        time.sleep(0.05)
    raise AssertionError(f"no {n} finished actions: {store.get_incident(iid)}")


def _exclude_policy(
    log: Path, *extra: str, timeout: float = 20, **settings: object
) -> actions.ActionPolicy:
    cfg = config.Config.of(
        **settings,
        exclude_command=" ".join(
            [
                sys.executable,
                str(RECORD),
                str(log),
                "{host}",
                "--node={node}",
                "{ranks}",
                "'Reason=hangwatch {incident}'",
                *extra,
            ]
        ),
        exclude_timeout=timeout,
    )
    cfg.validate(config.SERVER)
    return actions.ActionPolicy.from_config(cfg)


@pytest.mark.timeout(60)
def test_exclusion_runs_once_per_node_of_the_lagging_ranks_as_argv_words(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(config.env_var("token"), "s3cret")  # the coordinator's own, never passed on
    log = tmp_path / "argv.jsonl"
    published: list[tuple[str, IncidentRow]] = []
    runner, store, reg, iid = _runner(tmp_path, _exclude_policy(log), published)
    _register(reg, "node-a", "gpu-a.example.org", [0, 1])
    _register(reg, "node-b", "gpu-b", [2, 3])
    try:
        runner.on_analyzed(iid, JOB, reg.now(), _hang(store, iid, [1, 2, 3]))
        row = _wait_actions(store, iid, 2)
    finally:
        runner.close()
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert sorted(x["argv"] for x in lines) == [
        ["gpu-a.example.org", "--node=node-a", "1", f"Reason=hangwatch {iid}"],
        ["gpu-b", "--node=node-b", "2,3", f"Reason=hangwatch {iid}"],
    ]
    assert all(x["token"] is None for x in lines)
    assert [(a.kind, a.status, a.node, a.returncode) for a in row.actions] == [
        ("exclude", "done", "node-a", 0),
        ("exclude", "done", "node-b", 0),
    ]
    assert row.actions[0].output == "cordoned gpu-a.example.org\n"
    assert row.actions[0].argv[0] == sys.executable
    assert [ev for ev, _ in published] == ["incident.action", "incident.action"]


@pytest.mark.timeout(60)
def test_only_repeat_offenders_are_excluded_when_asked(tmp_path: Path) -> None:
    """--exclude-repeat-offenders-only with 2 incidents: the first hang on gpu-b
    is recorded and skipped, saying why; the second makes it a repeat offender
    (this incident counted) and the command runs for it."""
    log = tmp_path / "argv.jsonl"
    policy = _exclude_policy(log, exclude_repeat_offenders_only=True, repeat_offender_incidents=2)
    runner, store, reg, first = _runner(tmp_path, policy, [])
    _register(reg, "node-b", "gpu-b", [2, 3])
    evidence = {2: RankEvidence(rank=2, host="gpu-b", pid=30_002)}
    try:
        for n, iid in enumerate((first, None)):
            if iid is None:
                iid = store.create_incident(
                    job_id=JOB, reason="stall", trigger="stall", ranks_expected=[0, 1, 2, 3]
                ).id
            report = Report(verdict="hang", summary="t", lagging_ranks=[2], evidence=evidence)
            store.finish_incident(iid, report=report, detection_s=1.0)
            runner.on_analyzed(iid, JOB, reg.now(), report)
            [rec] = _wait_actions(store, iid, 1).actions
            if n == 0:
                assert (rec.kind, rec.status) == ("exclude", "skipped")
                assert "gpu-b held the culprit of 1 incidents" in rec.summary, rec.summary
                assert not log.exists()
            else:
                assert (rec.kind, rec.status, rec.host) == ("exclude", "done", "gpu-b")
    finally:
        runner.close()
    [line] = [json.loads(x) for x in log.read_text().splitlines()]
    assert line["argv"][0] == "gpu-b"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("host", HOSTILE)
def test_a_hostile_host_name_is_refused_and_nothing_runs(tmp_path: Path, host: str) -> None:
    assert not actions.valid_host(host)
    log = tmp_path / "argv.jsonl"
    runner, store, reg, iid = _runner(tmp_path, _exclude_policy(log), [])
    reg.register(
        pb.RegisterRequest(job_id=JOB, agent_id="node-a", host=host, ranks=[
            pb.RankInfo(rank=0, world_size=1, pid=30_000, backend="gloo")])
    )  # fmt: skip
    try:
        runner.on_analyzed(iid, JOB, reg.now(), _hang(store, iid, [0]))
        row = _wait_actions(store, iid, 1)
    finally:
        runner.close()
    [rec] = row.actions
    assert rec.status == "failed" and rec.summary.startswith("refused: host"), rec
    assert rec.argv == [] and not log.exists()


def test_valid_host_names() -> None:
    for good in ("vm", "gpu-07", "node7.cluster.example.org", "a" * 63, "10-0-0-1.pods", "x."):
        assert actions.valid_host(good), good


@pytest.mark.parametrize(
    "template",
    ["kubectl cordon {host.__class__}", "x {0}", "x {}", "x {host!r}", "x {host:>9}",
     "x {nodes}", "x 'unterminated", "x {host"],
)  # fmt: skip
def test_bad_exclude_templates_are_refused_at_start(template: str) -> None:
    with pytest.raises(ValueError, match="--exclude-command"):
        config.Config.of(exclude_command=template).validate(config.SERVER)


def test_exclude_template_is_split_once_and_braces_can_be_literal() -> None:
    cfg = config.Config.of(exclude_command="scontrol update 'NodeName={host}' State=DRAIN '{{x}}'")
    assert cfg.respond.exclude_argv() == (
        "scontrol",
        "update",
        "NodeName={host}",
        "State=DRAIN",
        "{{x}}",
    )
    argv = actions.exclude_argv(
        cfg.respond.exclude_argv(), host="h; rm", node="n", ranks=[1], incident="i"
    )
    # A value is one word whatever it holds (the names are checked before this).
    assert argv == ["scontrol", "update", "NodeName=h; rm", "State=DRAIN", "{x}"]
    with pytest.raises(ValueError, match="--on-hang"):
        config.Config.of(on_hang="kill").validate(config.AGENT)


@pytest.mark.timeout(30)
def test_run_bounded_kills_at_the_timeout_and_bounds_the_output() -> None:
    t0 = time.monotonic()
    rc, out, why = actions.run_bounded(
        [sys.executable, "-c", "import time; print('x' * 100000, flush=True); time.sleep(30)"], 1.0
    )
    assert rc is None and "timeout" in why and time.monotonic() - t0 < 10
    assert out == "x" * actions.MAX_OUTPUT_BYTES
    rc, out, why = actions.run_bounded(["/nonexistent/cordon"], 5)
    assert rc is None and why.startswith("cannot run")


@pytest.mark.timeout(60)
def test_a_failing_exclusion_is_recorded_and_the_abort_still_goes_out(tmp_path: Path) -> None:
    policy = actions.ActionPolicy(
        on_hang=config.ABORT, grace_s=0.0, exclude_argv=("/nonexistent/cordon", "{host}")
    )
    runner, store, reg, iid = _runner(tmp_path, policy, [])
    _register(reg, "node-a", "gpu-a", [0, 1], world=2)
    got: list[pb.Command] = []
    seen = threading.Event()
    session = next(a.session_id for a in reg.snapshot(JOB).agents)  # type: ignore[union-attr]

    def agent() -> None:
        while not seen.is_set():
            for c in reg.pending_commands(session, JOB, "node-a"):
                if c.kind == pb.COMMAND_KIND_END_RANKS:
                    got.append(c.to_pb(reg.now()))
                    seen.set()
            time.sleep(0.02)

    th = threading.Thread(target=agent, daemon=True)
    th.start()
    try:
        runner.on_analyzed(iid, JOB, reg.now(), _hang(store, iid, [1]))
        assert seen.wait(20)
        cmd = got[0]
        assert (list(cmd.ranks), list(cmd.pids)) == ([0, 1], [30_000, 30_001])
        answer = pb.DumpResult(job_id=JOB, agent_id="node-a", incident_id=iid, actions=[
            pb.ActionResult(rank=0, pid=30_000, outcome="terminated", signals=["SIGTERM"], exit_s=0.2),
            pb.ActionResult(rank=1, pid=30_001, outcome="pid-reused", detail="started later"),
        ])  # fmt: skip
        assert not runner.on_result(pb.DumpResult(job_id=JOB, agent_id="other", incident_id=iid,
                                                  actions=answer.actions))  # fmt: skip
        assert runner.on_result(answer)
        row = _wait_actions(store, iid, 2)
    finally:
        runner.close()
    ex, ab = row.actions
    assert ex.kind == "exclude" and ex.status == "failed" and "cannot run" in ex.summary
    assert ab.kind == "abort" and ab.status == "partial", ab
    assert [(o.rank, o.outcome, o.signals) for o in ab.ranks] == [
        (0, "terminated", ["SIGTERM"]),
        (1, "pid-reused", []),
    ]
    # Answered: the command is not re-sent on the agent's next stream.
    assert not [c for c in reg.pending_commands(session, JOB, "node-a") if c.incident_id == iid]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("verdict", ["healthy", "no-culprit-visible", "unknown"])
def test_nothing_is_done_unless_the_verdict_is_a_hang(tmp_path: Path, verdict: str) -> None:
    policy = actions.ActionPolicy(on_hang=config.ABORT, exclude_argv=("true", "{host}"))
    runner, store, reg, iid = _runner(tmp_path, policy, [])
    _register(reg, "node-a", "gpu-a", [0, 1], world=2)
    try:
        runner.on_analyzed(iid, JOB, reg.now(), _hang(store, iid, [1], verdict=verdict))
        row = _wait_actions(store, iid, 2)
    finally:
        runner.close()
    assert [(a.kind, a.status) for a in row.actions] == [
        ("exclude", "skipped"),
        ("abort", "skipped"),
    ]
    assert all(verdict in a.summary for a in row.actions)
    session = next(a.session_id for a in reg.snapshot(JOB).agents)  # type: ignore[union-attr]
    assert reg.pending_commands(session, JOB, "node-a") == []


def test_observe_does_nothing(tmp_path: Path) -> None:
    runner, store, reg, iid = _runner(tmp_path, actions.ActionPolicy(), [])
    runner.on_analyzed(iid, JOB, reg.now(), _hang(store, iid, [1]))
    runner.close()
    row = store.get_incident(iid)
    assert row is not None and row.actions == []


@pytest.mark.timeout(60)
def test_each_action_is_published_as_incident_action(
    start_coordinator: Callable[..., Coordinator],
) -> None:
    """Through a real coordinator and a real webhook receiver on loopback."""
    import grpc

    with receiver() as rx:
        c = start_coordinator(notify_url=(rx.url,), exclude_command="true {host}")
        with grpc.insecure_channel(c.grpc_address) as ch:
            iid = hang_then_resume(c, rpc.CoordinatorStub(ch))
        got = rx.wait(lambda r: any(x.body["event"] == "incident.action" for x in r), 20)
    [action] = [r.body for r in got if r.body["event"] == "incident.action"]
    assert action["incident"]["id"] == iid
    assert action["incident"]["action"]["kind"] == "exclude"
    assert action["text"].startswith("[hangwatch] job job-1: exclude ")
