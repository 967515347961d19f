"""A real demo incident reaches a real webhook, through a real `hangwatch server`.

One coordinator process with three webhooks (one answering, one that holds
every request, one nobody listens on) and a token; `hangwatch demo` runs a
real 4-rank gloo job under the hook against it. The verdict must reach the
answering webhook within seconds, with the scenario's ground-truth lagging
ranks, and the two bad webhooks must not delay the incident. The token and
the webhooks' secrets must appear neither in what was sent nor in the log.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from hangwatch.config import env_var
from hangwatch.testing.scenarios import get_scenario
from tests.live.conftest import STALL_TIMEOUT, coordinator_process
from tests.support.webhook import closed_port_url, receiver

pytestmark = [pytest.mark.torch, pytest.mark.slow]

WORLD = 4
TOKEN = "tok-6f1c0a9e2b7d4e58"


def _incidents(http: str, job: str) -> list[dict[str, Any]]:
    req = urllib.request.Request(
        f"{http}/api/incidents?job={job}", headers={"Authorization": f"Bearer {TOKEN}"}
    )
    with urllib.request.urlopen(req, timeout=5) as r:
        items: list[dict[str, Any]] = json.load(r)
    return items


def _reap(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:  # only when the test failed before the demo ended
        proc.kill()
        proc.wait(10)


@pytest.mark.timeout(200)
def test_demo_incident_reaches_the_webhook_within_seconds(tmp_path: Path) -> None:
    sc = get_scenario("skip")
    (tmp_path / "data").mkdir()
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    hold = threading.Event()
    down = closed_port_url("/down/DOWNSECRET")
    job = f"notify-{os.getpid()}"
    with contextlib.ExitStack() as stack:
        good = stack.enter_context(receiver(path="/services/T1/GOODSECRET"))
        slow = stack.enter_context(receiver(hold=hold))
        info = stack.enter_context(coordinator_process(
            tmp_path / "data",
            "--notify-url", f"http://hw:PWSECRET@{good.url.removeprefix('http://')}",
            "--notify-url", slow.url,
            "--notify-url", down,
            "--token-file", str(token_file),
        ))  # fmt: skip
        environ = {k: v for k, v in os.environ.items() if not k.startswith("HANGWATCH_")}
        environ[env_var("run_dir")] = str(tmp_path / "run")
        environ[env_var("poll_interval")] = "0.5"
        environ[env_var("token")] = TOKEN  # the demo hands its agent the environment
        demo = subprocess.Popen(
            [sys.executable, "-m", "hangwatch", "demo", "--scenario", "skip",
             "--ranks", str(WORLD), "--coordinator", info["grpc"], "--job-id", job,
             "--stall-timeout", str(STALL_TIMEOUT), "--json", "--timeout", "90"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environ,
        )  # fmt: skip
        stack.callback(_reap, demo)
        seen_analyzed: float | None = None
        while demo.poll() is None and seen_analyzed is None:
            items = _incidents(info["http"], job)
            if any(i["status"] != "collecting" for i in items):
                seen_analyzed = time.time()
            else:
                time.sleep(0.05)
        out, err = demo.communicate(timeout=150)
        assert demo.returncode == 0, err[-4000:]
        report = json.loads(out)
        got = good.wait(lambda r: any(x.body["event"] == "incident.analyzed" for x in r), 10)
        log_text = (Path(info["data"]) / "server.log").read_text()
        # The held webhook was asked, and is still answering nothing.
        assert slow.arrived >= 1 and slow.received == []
    assert seen_analyzed is not None
    iid = report["incident_id"]
    analyzed = next(x for x in got if x.body["event"] == "incident.analyzed")
    body = analyzed.body
    assert body["incident"]["id"] == iid
    assert body["incident"]["lagging_ranks"] == sc.lagging_ranks(WORLD) == report["lagging_ranks"]
    assert body["incident"]["verdict"] == sc.verdict
    assert body["incident"]["url"] == f"{info['http']}/incidents/{iid}"
    # Within seconds of the verdict: no later than 2 s after a 20 Hz poll of the API saw it.
    assert analyzed.at - seen_analyzed < 2.0, analyzed.at - seen_analyzed
    # Opened came first, to the same webhook.
    assert [x.body["event"] for x in got][:2] == ["incident.opened", "incident.analyzed"]
    # The held webhook (and its retries) did not slow the incident down.
    assert report["detection_s"] < STALL_TIMEOUT + 10, (report["detection_s"], err[-2000:])
    # Basic auth from the URL's userinfo; no secret in any body or the log.
    assert analyzed.headers["Authorization"].startswith("Basic ")
    for x in got:
        assert TOKEN not in x.raw.decode() and "PWSECRET" not in x.raw.decode()
    for secret in (TOKEN, "PWSECRET", "GOODSECRET", "/services/"):
        assert secret not in log_text
    assert "#3 http://127.0.0.1:" in log_text  # the one nobody listens on, named by number
