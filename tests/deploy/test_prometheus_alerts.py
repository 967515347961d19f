"""The alert path, end to end: a real Prometheus scrapes a real coordinator during a hang.

`promtool check rules` passes on every rules file in deploy/prometheus. Then a
real `ServerRuntime` (gRPC, HTTP, SQLite, a token) is started on port 0, and
Debian's `prometheus` binary is started with the scrape config that
docs/operations.md tells operators to use (only the target and the token file
put in), the shipped rules file itself, and 1 s scrape and evaluation
intervals. Agents speaking the real wire protocol make a rank skip a
collective and upload their dumps; the coordinator analyses the incident as a
hang. Read back through Prometheus's own HTTP API: `HangwatchHang` fires with
the training job and the verdict as labels, every rule evaluates without
error against the live coordinator, no other alert is active, and the alert
clears once the job makes progress again.

A renamed metric or label that HangwatchHang uses, a rule Prometheus rejects or
cannot evaluate, or a scrape config in the docs that loses the coordinator's
`job` label fails here (test_monitoring.py checks every rule's names statically).
"""

from __future__ import annotations

import re
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import yaml
from hangwatch.server.runtime import ServerRuntime

from hangwatch.formats import ServerInfo
from hangwatch.wire import rpc
from tests.deploy.conftest import require_tool
from tests.server.conftest import hang_rank_2, make_config, two_nodes

ROOT = Path(__file__).resolve().parents[2]
RULES_DIR = ROOT / "deploy" / "prometheus"
RULES = RULES_DIR / "hangwatch-rules.yml"
OPERATIONS = ROOT / "docs" / "operations.md"

JOB = "alert-path"
TOKEN = "alert-path-test-token"
DEADLINE_S = 30.0


@pytest.mark.timeout(60)
def test_promtool_checks_every_rules_file() -> None:
    promtool = require_tool("promtool", "prometheus")
    files = sorted(p for p in RULES_DIR.iterdir() if p.suffix in {".yml", ".yaml"})
    assert RULES in files
    out = subprocess.run(
        [promtool, "check", "rules", *map(str, files)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    for f in files:
        assert f"Checking {f}\n  SUCCESS:" in out.stdout, out.stdout


@pytest.mark.timeout(60)
def test_relay_down_fires_for_the_gone_relay_only(tmp_path: Path) -> None:
    """`promtool test rules` on the shipped rules: of two relays that carried
    reports, the one whose stream closed fires after its 2 minutes, named by
    its label; the one still streaming does not."""
    doc = yaml.safe_load(RULES.read_text(encoding="utf-8"))
    rule = next(r for g in doc["groups"] for r in g["rules"] if r["alert"] == "HangwatchRelayDown")
    gone = "rack1:7452"
    annotations = {
        k: v.replace("{{ $labels.relay }}", gone) for k, v in rule["annotations"].items()
    }
    fired = {"exp_labels": {"severity": "warning", "relay": gone}, "exp_annotations": annotations}
    series = [
        {"series": f'hangwatch_relay_streams{{relay="{gone}"}}', "values": "1 1 0 0 0 0 0 0 0 0"},
        {"series": 'hangwatch_relay_streams{relay="rack2:7452"}', "values": "1 1 1 1 1 1 1 1 1 1"},
    ]
    checks = [
        {"eval_time": "1m30s", "alertname": "HangwatchRelayDown", "exp_alerts": []},
        {"eval_time": "4m", "alertname": "HangwatchRelayDown", "exp_alerts": [fired]},
    ]
    _promtool_test(tmp_path / "relay_down_test.yml", series, checks)


@pytest.mark.timeout(60)
def test_relay_backlog_fires_for_reports_turned_away_only(tmp_path: Path) -> None:
    """`promtool test rules` on the shipped rules: a relay that turned reports
    away for backlog fires, and clears 5 minutes after its count stops
    growing; reports lost when a relay's stream broke (its agents resend in
    full) and a relay at 0 do not."""
    doc = yaml.safe_load(RULES.read_text(encoding="utf-8"))
    rule = next(
        r for g in doc["groups"] for r in g["rules"] if r["alert"] == "HangwatchRelayBacklog"
    )
    name = "hangwatch_relay_reports_not_forwarded_total"
    behind = {"instance": "rack1:7453", "job": "hangwatch-relay", "reason": "backlog"}
    series = [
        # 30 s apart: 0 for 2 minutes, then 4 reports turned away, then none more.
        {"series": f'{name}{{instance="rack1:7453",job="hangwatch-relay",reason="backlog"}}',
         "values": "0 0 0 0 4 4 4 4 4 4 4 4 4 4 4 4 4 4 4 4 4 4"},
        {"series": f'{name}{{instance="rack1:7453",job="hangwatch-relay",reason="upstream_lost"}}',
         "values": "0 0 9 9 9 9 9 9 9 9 9 9 9 9 9 9 9 9 9 9 9 9"},
        {"series": f'{name}{{instance="rack2:7453",job="hangwatch-relay",reason="backlog"}}',
         "values": "0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0"},
    ]  # fmt: skip
    fired = {
        "exp_labels": {"severity": "warning", **behind},
        "exp_annotations": rule["annotations"],
    }
    checks = [
        {"eval_time": "1m30s", "alertname": "HangwatchRelayBacklog", "exp_alerts": []},
        {"eval_time": "3m", "alertname": "HangwatchRelayBacklog", "exp_alerts": [fired]},
        {"eval_time": "9m", "alertname": "HangwatchRelayBacklog", "exp_alerts": []},
    ]
    _promtool_test(tmp_path / "relay_backlog_test.yml", series, checks)


def _promtool_test(path: Path, series: list[Any], checks: list[Any]) -> None:
    """`promtool test rules` on the shipped rules file: `series` (30 s apart)
    must fire exactly the alerts `checks` expects, when it expects them."""
    path.write_text(
        yaml.safe_dump(
            {
                "rule_files": [str(RULES)],
                "evaluation_interval": "30s",
                "tests": [{"interval": "30s", "input_series": series, "alert_rule_test": checks}],
            }
        )
    )
    out = subprocess.run(
        [require_tool("promtool", "prometheus"), "test", "rules", str(path)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def documented_scrape_config() -> dict[str, Any]:
    """The scrape config in docs/operations.md, "Monitoring"."""
    section = OPERATIONS.read_text(encoding="utf-8").split("\n## Monitoring\n", 1)[1]
    block = re.search(r"```yaml\n(.*?)```", section, re.S)
    assert block, "no yaml block in docs/operations.md's Monitoring section"
    (job,) = yaml.safe_load(block.group(1))["scrape_configs"]
    assert isinstance(job, dict)
    return job


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def bearer(channel: grpc.Channel, token: str) -> grpc.Channel:
    """The channel with the token on every call, as the real agent sends it."""

    class Auth(
        grpc.UnaryUnaryClientInterceptor,
        grpc.UnaryStreamClientInterceptor,
        grpc.StreamUnaryClientInterceptor,
    ):
        def _with(self, details: Any) -> Any:
            md = [*(details.metadata or ()), ("authorization", f"Bearer {token}")]
            return details._replace(metadata=md)

        def intercept_unary_unary(self, cont: Any, details: Any, request: Any) -> Any:
            return cont(self._with(details), request)

        def intercept_unary_stream(self, cont: Any, details: Any, request: Any) -> Any:
            return cont(self._with(details), request)

        def intercept_stream_unary(self, cont: Any, details: Any, requests: Any) -> Any:
            return cont(self._with(details), requests)

    return grpc.intercept_channel(channel, Auth())


@dataclass
class Prometheus:
    url: str
    config: Path
    log: Path
    proc: subprocess.Popen[bytes]

    def log_tail(self, n: int = 40) -> str:
        lines = self.log.read_text(encoding="utf-8", errors="replace").splitlines()
        return "\n".join(lines[-n:])

    def api(self, path: str) -> Any:
        r = httpx.get(self.url + path, timeout=5)
        r.raise_for_status()
        body = r.json()
        assert body["status"] == "success", body
        return body["data"]

    def wait(self, what: str, probe: Callable[[], tuple[bool, Any]]) -> Any:
        """Poll `probe` (-> done, what was seen) until done or DEADLINE_S passed."""
        end = time.monotonic() + DEADLINE_S
        seen: Any = None
        while time.monotonic() < end:
            assert self.proc.poll() is None, f"prometheus exited:\n{self.log_tail()}"
            done, seen = probe()
            if done:
                return seen
            time.sleep(0.2)
        targets = self.api("/api/v1/targets")["activeTargets"]
        raise AssertionError(
            f"timed out after {DEADLINE_S}s waiting for {what}; last seen: {seen}\n"
            f"targets: {[(t['scrapeUrl'], t['health'], t['lastError']) for t in targets]}\n"
            f"prometheus log:\n{self.log_tail()}"
        )


@pytest.fixture(scope="module")
def token_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("token") / "hangwatch-token"
    path.write_text(TOKEN + "\n", encoding="utf-8")
    path.chmod(0o600)
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, token_file: Path) -> Iterator[ServerInfo]:
    conf = make_config(
        tmp_path_factory.mktemp("coord"),
        stall_timeout=0.3,
        dump_deadline=30.0,
        token_file=str(token_file),
        # One incident makes its culprit's host a repeat offender, so the one
        # hang below fires that rule too.
        repeat_offender_incidents=1,
    )
    rt = ServerRuntime(conf, threading.Event())
    info = rt.start()
    try:
        yield info
    finally:
        rt.shutdown()


def start_prometheus(binary: str, workdir: Path, target: str, token_file: Path) -> Prometheus:
    """Prometheus with the documented scrape job aimed at `target`, on a free port."""
    scrape = documented_scrape_config()
    scrape["static_configs"] = [{"targets": [target]}]
    scrape["authorization"]["credentials_file"] = str(token_file)
    config = workdir / "prometheus.yml"
    config.write_text(
        yaml.safe_dump(
            {
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                "rule_files": [str(RULES)],  # the shipped file, unchanged
                "scrape_configs": [scrape],
            }
        ),
        encoding="utf-8",
    )
    for attempt in range(2):
        port = free_port()  # closed again: another process may take it first, hence the retry
        log = workdir / f"prometheus-{attempt}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [
                    binary,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={workdir / f'tsdb-{attempt}'}",
                    f"--web.listen-address=127.0.0.1:{port}",
                    "--log.level=info",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        prom = Prometheus(f"http://127.0.0.1:{port}", config, log, proc)
        end = time.monotonic() + DEADLINE_S
        while time.monotonic() < end and proc.poll() is None:
            try:
                if httpx.get(prom.url + "/-/ready", timeout=2).status_code == 200:
                    return prom
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        stop(proc)
        if attempt == 0 and "address already in use" in prom.log_tail():
            continue
        raise AssertionError(f"prometheus did not become ready:\n{prom.log_tail()}")
    raise AssertionError("unreachable")


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@pytest.fixture(scope="module")
def prometheus_binary() -> str:
    return require_tool("prometheus", "prometheus")


@pytest.fixture(scope="module")
def prometheus(
    prometheus_binary: str,  # first: no coordinator is started where it is missing
    tmp_path_factory: pytest.TempPathFactory,
    server: ServerInfo,
    token_file: Path,
) -> Iterator[Prometheus]:
    binary = prometheus_binary
    target = server.http.removeprefix("http://")
    prom = start_prometheus(binary, tmp_path_factory.mktemp("prometheus"), target, token_file)
    try:
        yield prom
    finally:
        stop(prom.proc)


def alerts(prom: Prometheus) -> list[dict[str, Any]]:
    return list(prom.api("/api/v1/alerts")["alerts"])


@pytest.mark.timeout(120)
def test_a_hang_fires_the_hang_alert_in_a_real_prometheus(
    prometheus: Prometheus, server: ServerInfo
) -> None:
    prom = prometheus
    check = subprocess.run(
        [require_tool("promtool", "prometheus"), "check", "config", str(prom.config)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert check.returncode == 0, check.stdout + check.stderr

    # The coordinator is scraped, with the token, before anything happens.
    def scraped() -> tuple[bool, Any]:
        targets = prom.api("/api/v1/targets")["activeTargets"]
        return any(t["health"] == "up" for t in targets), targets

    prom.wait("the coordinator to be scraped", scraped)

    with grpc.insecure_channel(server.grpc) as raw:
        stub = rpc.CoordinatorStub(bearer(raw, TOKEN))
        a, b = two_nodes(stub, JOB)
        try:
            # Rank 2 never enters collective 4; the others wait in it.
            hang_rank_2(a, b, seq=4)

            def firing() -> tuple[bool, Any]:
                seen = alerts(prom)
                return any(
                    x["labels"]["alertname"] == "HangwatchHang" and x["state"] == "firing"
                    for x in seen
                ), seen

            seen = prom.wait("HangwatchHang to fire", firing)
            (hang,) = (x for x in seen if x["labels"]["alertname"] == "HangwatchHang")
            # The training job and the verdict survive the scrape as the rule's labels.
            assert hang["labels"] == {
                "alertname": "HangwatchHang",
                "job": JOB,
                "verdict": "hang",
                "severity": "page",
            }, hang
            assert hang["annotations"]["summary"] == f"Job {JOB} is hung (hang)"

            # The culprit's host is a repeat offender at a threshold of one.
            def offender() -> tuple[bool, Any]:
                seen = alerts(prom)
                return any(
                    x["labels"]["alertname"] == "HangwatchRepeatOffenderHost"
                    and x["state"] == "firing"
                    for x in seen
                ), seen

            seen = prom.wait("HangwatchRepeatOffenderHost to fire", offender)
            (rep,) = (x for x in seen if x["labels"]["alertname"] == "HangwatchRepeatOffenderHost")
            assert rep["annotations"]["summary"] == "1 host(s) keep holding the culprit of hangs"
            # Nothing else is pending or firing: the other rules stay quiet on a plain hang.
            assert {x["labels"]["alertname"] for x in seen} == {
                "HangwatchHang",
                "HangwatchRepeatOffenderHost",
            }, seen

            # Every rule evaluates against the live coordinator without error.
            shipped = yaml.safe_load(RULES.read_text(encoding="utf-8"))
            names = {r["alert"] for g in shipped["groups"] for r in g["rules"]}
            groups = prom.api("/api/v1/rules")["groups"]
            rules = {r["name"]: r for g in groups for r in g["rules"]}
            assert set(rules) == names
            for name, rule in rules.items():
                assert rule["health"] == "ok" and not rule.get("lastError"), (name, rule)
                assert not rule["lastEvaluation"].startswith("0001-"), (name, rule)

            # The job moves on: the incident resolves and the alert clears.
            a.progress({0: (4, 4), 1: (4, 4)})
            b.progress({2: (4, 4), 3: (4, 4)})

            def cleared() -> tuple[bool, Any]:
                seen = alerts(prom)
                return not any(x["labels"]["alertname"] == "HangwatchHang" for x in seen), seen

            prom.wait("HangwatchHang to clear", cleared)
        finally:
            a.close()
            b.close()
