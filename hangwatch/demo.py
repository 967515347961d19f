"""`hangwatch demo`: the whole loop on loopback, with a real gloo job that hangs.

It starts a coordinator (unless `--coordinator` points at one), one agent and
N real gloo ranks under the hook, injects a hang-zoo scenario, waits for the
coordinator's incident and prints its verdict. `--scenario healthy` must end
with no incident. Nothing here is simulated: the verdict comes from the same
coordinator, agent and analyzer a real job uses.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hangwatch import config as cfg
from hangwatch.formats import ServerInfo
from hangwatch.testing.backends import BACKENDS

EXIT_NO_INCIDENT = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # what a shell reports for SIGINT
SCENARIOS = (
    "skip",
    "compute",
    "frozen",
    "two",
    "mismatch",
    "subgroup",
    "order",
    "wrap",
    "gil",
    "p2p",
    "healthy",
)
# How long a scenario FR cannot see trains on, at most, waiting for the
# coordinator to learn its rhythm: 5 moves take ~3 s at the 0.5 s poll.
GATE_WAIT_S = 30.0
# Shorter than the server's defaults so the demo answers in seconds; an
# explicit flag or HANGWATCH_* variable still wins.
DEMO_DEFAULTS: dict[str, float] = {
    "stall_timeout": 3.0,
    "poll_interval": 0.5,
    "dump_deadline": 10.0,
    "agent_lost_timeout": 10.0,
}


def add_parser(subparsers: Any) -> None:
    p = cfg.add_command(
        subparsers,
        cfg.DEMO,
        help="Run a real gloo job on loopback that hangs, and watch hangwatch diagnose it.",
        description=(
            "Start a coordinator, an agent and N real gloo ranks on loopback, inject a hang "
            "from the hang zoo, wait for the incident and print its verdict."
        ),
        func=run,
        defaults=DEMO_DEFAULTS,
    )
    p.add_argument(
        "--scenario", choices=SCENARIOS, default="skip", help="Hang to inject (default: skip)."
    )
    p.add_argument("--ranks", type=int, default=4, help="Number of ranks (default: 4).")
    p.add_argument(
        "--backend",
        choices=BACKENDS,
        default="gloo",
        help="Collective backend of the demo job: gloo (default); hwhooks, a compiled CPU "
        "backend with the completion and abort hooks of torch 2.15's default NCCL, recorded "
        "by torch's FlightRecorderHook as that NCCL is (torch >= 2.15 and a C++ compiler; "
        "built once, about 40 s); or hwstore, the same without completion hooks, as any "
        "backend written in Python.",
    )
    p.add_argument(
        "--collective-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="torch's own collective timeout in the job (default: 600 s, so hangwatch "
        "answers first). Short, on --backend hwhooks, torch's watchdog fires first and runs "
        "its abort hooks, as 2.15's default NCCL does: the path where hangwatch turns one "
        "rank's abort into every rank's dump. Pair it with a long --stall-timeout.",
    )
    p.add_argument(
        "--json", action="store_true", help="Print the report plus incident fields as JSON."
    )
    p.add_argument(
        "--keep", action="store_true", help="Leave the coordinator and dashboard up until Ctrl-C."
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        help="Seconds to wait for the verdict (default: 120).",
    )


@dataclass(kw_only=True)
class Coordinator:
    grpc: str
    http: str
    proc: subprocess.Popen[bytes] | None


def _say(quiet: bool, msg: str) -> None:
    if not quiet:
        print(f"hangwatch demo: {msg}", file=sys.stderr, flush=True)


def _explicit(ns: argparse.Namespace, name: str) -> bool:
    return cfg.explicitly_set(ns, name)


def _config(ns: argparse.Namespace) -> cfg.Config:
    overrides: dict[str, Any] = {k: v for k, v in DEMO_DEFAULTS.items() if not _explicit(ns, k)}
    if not _explicit(ns, "job_id"):
        overrides["job_id"] = f"demo-{ns.scenario}-{os.getpid()}"
    return cfg.for_command(cfg.DEMO, ns, os.environ, **overrides)


def _stop(proc: subprocess.Popen[bytes], grace: float = 10.0) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _start_server(conf: cfg.Config, data_dir: Path, logs: Path) -> Coordinator:
    (data_dir / ServerInfo.FILE).unlink(missing_ok=True)
    cmd = [
        sys.executable, "-m", "hangwatch", "server",
        "--grpc-port", "0", "--http-port", "0", "--data-dir", str(data_dir),
        "--stall-timeout", str(conf.detect.stall_timeout), "--dump-deadline", str(conf.detect.dump_deadline),
        "--agent-lost-timeout", str(conf.detect.agent_lost_timeout), "--log-level", conf.job.log_level,
    ]  # fmt: skip
    log = (logs / "server.log").open("wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"coordinator exited with {proc.returncode}: {_tail(logs / 'server.log')}"
            )
        info = ServerInfo.read(data_dir)
        if info is not None:
            return Coordinator(grpc=info.grpc, http=info.http, proc=proc)
        time.sleep(0.1)
    _stop(proc)
    raise RuntimeError(f"coordinator did not start within 60 s: {_tail(logs / 'server.log')}")


def _ask_coordinator(conf: cfg.Config) -> str:
    """Ask a running coordinator where its dashboard is, and adopt its stall
    timeout: that one decides, not the demo's default (Health carries both)."""
    import grpc

    from hangwatch.wire import pb, rpc

    with grpc.insecure_channel(conf.agent.coordinator) as ch:
        health = rpc.CoordinatorStub(ch).Health(pb.HealthRequest(), timeout=10)
    url = getattr(health, "dashboard_url", "")
    if not url:
        raise RuntimeError(f"coordinator {conf.agent.coordinator} did not report its dashboard URL")
    if health.stall_timeout_s > 0:
        conf.detect.stall_timeout = float(health.stall_timeout_s)
    return str(url)


def _tail(path: Path, limit: int = 2000) -> str:
    try:
        return path.read_bytes()[-limit:].decode(errors="replace")
    except OSError:
        return ""


class Api:
    def __init__(self, base: str, token: str | None) -> None:
        self.base = base.rstrip("/")
        self.token = token

    def get(self, path: str, **params: str) -> Any:
        url = self.base + path + ("?" + urllib.parse.urlencode(params) if params else "")
        req = urllib.request.Request(url)
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read())


def _incident_ids(api: Api, job: str) -> set[str]:
    try:
        return {str(i["id"]) for i in api.get("/api/incidents", job=job)}
    except (urllib.error.URLError, OSError):
        return set()


def _new_incidents(api: Api, job: str, before: set[str]) -> list[dict[str, Any]]:
    """The job's incidents this run caused: a shared coordinator keeps older ones."""
    try:
        items = api.get("/api/incidents", job=job)
    except (urllib.error.URLError, OSError):
        return []
    return [i for i in items if str(i["id"]) not in before]


def _wait_incident(
    api: Api, job: str, timeout: float, alive: Any, before: set[str]
) -> dict[str, Any] | None:
    """Poll until this run's first incident is analysed (or failed); None on timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive()
        items = _new_incidents(api, job, before)
        # Analysed, or already past it: a transient stall resolves, a stopped job ends.
        done = [i for i in items if i["status"] in ("analyzed", "failed", "resolved", "ended")]
        if done:
            first = min(done, key=lambda i: i["created"])
            detail: dict[str, Any] = api.get(f"/api/incidents/{first['id']}")
            return detail
        time.sleep(0.2)
    return None


def _open_gate_when_armed(api: Api, job: str, gate: Path, alive: Any, quiet: bool) -> None:
    """Create `gate` once the coordinator's jobs list says the rhythm rule is
    armed for `job` (JobSummary.quiet_rule). A coordinator too old to say, or
    one that has not seen 5 moves within GATE_WAIT_S, opens it anyway: the
    bound still pages the hang, later."""
    deadline = time.monotonic() + GATE_WAIT_S
    rule: str | None = None  # "rhythm", "bound", or None: not known
    while rule != "rhythm" and time.monotonic() < deadline:
        alive()
        row: dict[str, Any]
        try:
            row = next((r for r in api.get("/api/jobs") if r.get("job") == job), {})
        except (urllib.error.URLError, OSError):
            row = {}
        if row and "quiet_rule" not in row:
            break  # a coordinator that predates the field: it cannot say
        rule = row.get("quiet_rule")
        if rule != "rhythm":
            time.sleep(0.2)
    if rule != "rhythm":
        _say(
            quiet,
            "the coordinator has not said it saw the job's rhythm; injecting the fault anyway",
        )
    gate.touch()


def run(ns: argparse.Namespace) -> int:
    try:
        return _run(ns)
    except KeyboardInterrupt:
        # The ExitStack has already stopped the ranks, the agent and our coordinator.
        print("hangwatch demo: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _run(ns: argparse.Namespace) -> int:
    from hangwatch.testing import backends
    from hangwatch.testing.launch import JobFailed, launch_job
    from hangwatch.testing.scenarios import get_scenario

    why = backends.unsupported_reason(ns.backend)
    if why is not None:
        print(f"hangwatch demo: --backend {ns.backend} cannot run here: {why}", file=sys.stderr)
        return EXIT_USAGE
    if ns.backend == backends.HWHOOKS:
        from hangwatch.testing import hookbackend

        # Here, once, not in every rank at once against the ranks' start-up timeout.
        _say(ns.json, "readying the hwhooks backend (built once per torch version, about 40 s)")
        hookbackend.build()
    try:
        conf = _config(ns)
        scenario = get_scenario(ns.scenario).for_backend(ns.backend)
        scenario.check_world(ns.ranks)
        token = conf.auth.resolved_token()
    except (ValueError, OSError) as e:
        print(f"hangwatch demo: {e}", file=sys.stderr)
        return EXIT_USAGE
    quiet = ns.json
    work = Path(tempfile.mkdtemp(prefix="hangwatch-demo-"))
    data_dir = Path(conf.serve.data_dir) if _explicit(ns, "data_dir") else work / "data"
    run_dir = Path(conf.agent.run_dir) if _explicit(ns, "run_dir") else work / "run"
    logs = work / "logs"
    for d in (data_dir, run_dir, logs):
        d.mkdir(parents=True, exist_ok=True)

    with ExitStack() as stack:
        if _explicit(ns, "coordinator"):
            coord = Coordinator(grpc=conf.agent.coordinator, http=_ask_coordinator(conf), proc=None)
        else:
            coord = _start_server(conf, data_dir, logs)
            if not ns.keep and coord.proc is not None:
                stack.callback(_stop, coord.proc)
        _say(quiet, f"coordinator grpc={coord.grpc} dashboard={coord.http}")

        child_env = {
            cfg.env_var("run_dir"): str(run_dir),
            cfg.env_var("job_id"): conf.job.job_id,
            cfg.env_var("coordinator"): coord.grpc,
        }
        agent_cmd = [
            sys.executable, "-m", "hangwatch", "agent",
            "--coordinator", coord.grpc, "--run-dir", str(run_dir), "--job-id", conf.job.job_id,
            "--poll-interval", str(conf.agent.poll_interval), "--log-level", conf.job.log_level,
        ]  # fmt: skip
        agent_log = (logs / "agent.log").open("wb")
        agent = subprocess.Popen(
            agent_cmd, stdout=agent_log, stderr=subprocess.STDOUT, env={**os.environ, **child_env}
        )
        stack.callback(_stop, agent)

        def alive() -> None:
            if agent.poll() is not None:
                raise RuntimeError(
                    f"agent exited with {agent.returncode}: {_tail(logs / 'agent.log')}"
                )
            if coord.proc is not None and coord.proc.poll() is not None:
                raise RuntimeError(f"coordinator exited: {_tail(logs / 'server.log')}")

        _say(
            quiet,
            f"launching {ns.ranks} {ns.backend} ranks, scenario {scenario.name!r}: "
            f"{scenario.description}",
        )
        api = Api(coord.http, token)
        # A shared coordinator (--coordinator, same --job-id) may hold incidents
        # of earlier runs: only ones that appear after this point are ours.
        before = _incident_ids(api, conf.job.job_id)
        # A hang FR cannot see is paged by the no-progress rule, on the stall
        # timeout only once the coordinator has seen the job's rhythm (else
        # after the 60 s start-up grace): its ranks train on until then.
        gate = None if scenario.fr_visible else work / "fault_gate"
        try:
            job = launch_job(
                scenario,
                ns.ranks,
                workdir=work / "job",
                attach=True,
                extra_env=child_env,
                backend=ns.backend,
                collective_timeout=ns.collective_timeout,
                fault_gate=gate,
            )
        except JobFailed as e:
            print(f"hangwatch demo: the training job failed to start: {e}", file=sys.stderr)
            return EXIT_NO_INCIDENT
        stack.enter_context(job)
        # The incident page exists only while the coordinator runs: the
        # demo's own one stops on exit unless --keep.
        page = coord.proc is None or ns.keep
        try:
            result = _observe(ns, conf, scenario, job, api, alive, quiet, before, page, gate)
        except RuntimeError as e:
            print(f"hangwatch demo: {e}", file=sys.stderr)
            return EXIT_NO_INCIDENT
        if ns.keep and coord.proc is not None:
            _say(quiet, f"coordinator left running: dashboard {coord.http} (Ctrl-C to stop)")
            stack.callback(_wait_then_stop, coord.proc)
    if not ns.keep:
        shutil.rmtree(work, ignore_errors=True)
    return result


def _observe(
    ns: argparse.Namespace,
    conf: cfg.Config,
    scenario: Any,
    job: Any,
    api: Api,
    alive: Any,
    quiet: bool,
    before: set[str],
    page: bool,
    gate: Path | None,
) -> int:
    world = ns.ranks
    if scenario.name == "healthy":
        job.wait(timeout=ns.timeout)
        job.check_no_crash()
        # A healthy job must not raise an alarm, even after the stall timeout.
        time.sleep(conf.detect.stall_timeout + 2 * conf.agent.poll_interval)
        items = _new_incidents(api, conf.job.job_id, before)
        if ns.json:
            print(
                json.dumps(
                    {
                        "scenario": "healthy",
                        "incidents": items,
                        "stall_timeout_s": conf.detect.stall_timeout,
                    }
                )
            )
        elif items:
            print(f"FALSE ALARM: {len(items)} incident(s) on a healthy job", file=sys.stderr)
        else:
            print("healthy job: every rank finished, no incident raised.")
        return EXIT_NO_INCIDENT if items else 0

    if gate is not None:
        _open_gate_when_armed(api, conf.job.job_id, gate, alive, quiet)
    fault_unix = job.wait_fault_injected(timeout=60)
    _say(
        quiet,
        f"fault injected; waiting for the verdict (stall timeout {conf.detect.stall_timeout:g} s)",
    )
    incident = _wait_incident(api, conf.job.job_id, ns.timeout, alive, before)
    if incident is None:
        raise RuntimeError(f"no incident within {ns.timeout:g} s")
    detection_s = incident["updated"] - fault_unix
    report = incident.get("report") or {}
    out = dict(report)
    out.update(
        incident_id=incident["id"],
        injected_ranks=scenario.guilty_ranks(world),
        detection_s=round(detection_s, 3),
        incident_created_unix=incident["created"],
        incident_analysed_unix=incident["updated"],
        stall_timeout_s=conf.detect.stall_timeout,
        ranks_dumped=incident["ranks_dumped"],
        ranks_unreachable={str(k): v for k, v in incident["ranks_unreachable"].items()},
    )
    if ns.json:
        print(json.dumps(out))
    else:
        _print_human(out, incident, api.base if page else None)
    return 0


def _print_human(out: dict[str, Any], incident: dict[str, Any], dashboard: str | None) -> None:
    from rich.console import Console

    from hangwatch.analyzer.render import render
    from hangwatch.analyzer.report import Report

    console = Console()
    if out.get("schema"):
        render(Report.from_dict({k: v for k, v in out.items() if k in _REPORT_KEYS}), console)
    else:
        console.print(
            f"[bold]incident {incident['id']}[/]: {incident.get('error') or incident['status']}"
        )
    console.print(
        f"injected ranks {out['injected_ranks']}, detected in {out['detection_s']:.1f} s "
        f"(stall timeout {out['stall_timeout_s']:g} s); dumped {out['ranks_dumped']}, "
        f"unreachable {out['ranks_unreachable'] or 'none'}"
    )
    if dashboard is not None:
        console.print(f"incident page: {dashboard}/incidents/{incident['id']}")
    else:
        console.print("add --keep to leave the dashboard up and open the incident page")


_REPORT_KEYS = (
    "schema", "verdict", "summary", "stalled_collective", "lagging_ranks", "findings", "ranks_loaded",
    "ranks_missing", "errors", "groups", "waits_for", "evidence", "basis", "stack_diagnosis",
)  # fmt: skip


def _wait_then_stop(proc: subprocess.Popen[bytes]) -> None:
    try:
        proc.wait()
    except KeyboardInterrupt:
        _stop(proc)
