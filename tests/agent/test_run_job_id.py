"""`hangwatch run` and the node's agent agree on one job id (issue 24).

A real agent announces itself in `<run_dir>/agent.json` as it starts; `hangwatch
run` given no job id takes the agent's and says where it came from, and given
another one says, once, under which id the ranks will really be reported.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from hangwatch.agent.service import Agent

from hangwatch import formats
from hangwatch.config import Config, env_var

PRINT_JOB = f"import os; print(os.environ[{env_var('job_id')!r}])"


def _run(run_dir: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("HANGWATCH_")}
    return subprocess.run(
        [sys.executable, "-m", "hangwatch", "run", "--run-dir", str(run_dir), *flags,
         "--", sys.executable, "-c", PRINT_JOB],
        capture_output=True, text=True, timeout=50, env=environ,
    )  # fmt: skip


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[Agent]:
    """A real agent for job `myjob`; its coordinator is unreachable, which an
    agent survives (it buffers and retries), so nothing else is needed."""
    a = Agent(
        Config.of(
            run_dir=str(tmp_path / "run"),
            coordinator="127.0.0.1:1",
            job_id="myjob",
            node_id="node-x",
        )
    )
    a.start()
    try:
        yield a
    finally:
        a.shutdown()


@pytest.mark.timeout(60)
def test_run_without_a_job_id_takes_the_agents(agent: Agent, tmp_path: Path) -> None:
    info = formats.AgentInfo.load(tmp_path / "run")
    assert (info.job_id, info.node_id, info.pid) == ("myjob", "node-x", os.getpid())
    r = _run(tmp_path / "run")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "myjob"
    assert r.stderr.count("job id 'myjob', from the agent on this node") == 1, r.stderr


@pytest.mark.timeout(60)
def test_run_with_another_job_id_keeps_it_and_says_so_once(agent: Agent, tmp_path: Path) -> None:
    r = _run(tmp_path / "run", "--job-id", "other")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "other"
    assert r.stderr.count("reports job 'myjob'") == 1, r.stderr
    # The same id is silent.
    r = _run(tmp_path / "run", "--job-id", "myjob")
    assert (r.returncode, r.stdout.strip(), r.stderr) == (0, "myjob", "")


@pytest.mark.timeout(60)
def test_an_agent_that_is_gone_is_not_followed(tmp_path: Path) -> None:
    a = Agent(Config.of(run_dir=str(tmp_path / "run"), coordinator="127.0.0.1:1", job_id="myjob"))
    a.start()
    a.shutdown()
    # Its file is gone with it; one left behind by a killed agent names a
    # process that is not running, and is ignored too.
    assert not (tmp_path / "run" / formats.AGENT_FILE).exists()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    formats.AgentInfo(
        job_id="myjob", node_id="n", coordinator="c:1", pid=int(dead.stdout), proc_starttime=1
    ).write(tmp_path / "run")
    r = _run(tmp_path / "run")
    assert (r.returncode, r.stdout.strip(), r.stderr) == (0, "default", "")
    # A damaged file is named, not trusted.
    (tmp_path / "run" / formats.AGENT_FILE).write_text("{not json")
    r = _run(tmp_path / "run")
    assert r.returncode == 0 and r.stdout.strip() == "default"
    assert "ignoring agent.json" in r.stderr, r.stderr
