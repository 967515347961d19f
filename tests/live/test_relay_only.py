"""An agent behind a relay needs no connection to the coordinator, live.

A real coordinator, a real `hangwatch relay` and a real agent whose
`--coordinator` is a port nothing listens on, over a real 4-rank gloo job
that hangs. Every call the agent makes (Register, its clock exchange,
progress, the DUMP command, the uploads, CompleteDump) can reach the
coordinator only through the relay: the incident completes, with every rank
dumped and the scenario's verdict, only if none of them went straight; the
relay then stops on SIGTERM and exits 0. Expectations come from the
scenario's ground truth, never from the analyzer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hangwatch.config import env_var
from hangwatch.testing.launch import launch_job
from hangwatch.testing.ports import free_port
from hangwatch.testing.scenarios import get_scenario
from tests.hardening.util import wait_for
from tests.support.chaos import AgentProc, CoordinatorProc, RelayProc

pytestmark = [pytest.mark.torch, pytest.mark.slow]

WORLD = 4
SCENARIO = "skip"
STALL_TIMEOUT = 3.0


def _analysed(coord: CoordinatorProc, job_id: str) -> dict[str, Any] | None:
    rows = coord.api(f"/api/incidents?job={job_id}")
    done = [r for r in rows if r["status"] in ("analyzed", "resolved", "ended", "failed")]
    return coord.api(f"/api/incidents/{done[0]['id']}") if done else None


@pytest.mark.timeout(180)
def test_an_agent_that_cannot_reach_the_coordinator_is_served_whole_by_its_relay(
    tmp_path: Path,
) -> None:
    job_id = "relay-only"
    nowhere = f"127.0.0.1:{free_port()}"  # the agent's coordinator: nothing listens there
    sc = get_scenario(SCENARIO).for_backend("gloo")
    with (
        CoordinatorProc(tmp_path / "data", stall_timeout=STALL_TIMEOUT) as coord,
        RelayProc(coordinator=coord.grpc, log_path=tmp_path / "relay.log") as relay,
    ):
        agent = AgentProc(
            coordinator=nowhere, run_dir=tmp_path / "run", job_id=job_id, node_id="n0",
            log_path=tmp_path / "agent.log", extra_args=("--progress-relay", relay.grpc),
        )  # fmt: skip
        agent.start()
        try:
            child_env = {
                env_var("run_dir"): str(tmp_path / "run"),
                env_var("job_id"): job_id,
                env_var("coordinator"): nowhere,
            }
            with launch_job(sc, WORLD, workdir=tmp_path / "job", attach=True, extra_env=child_env):
                inc = wait_for(lambda: _analysed(coord, job_id), 90, "the incident")
            agent.check()
        except AssertionError as e:
            raise AssertionError(f"{e}\n--- agent.log\n{agent.log()[-6000:]}") from e
        finally:
            agent.stop()
        m = relay.metrics()
        # SIGTERM: the relay stops within its bound and exits 0.
        assert relay.stop(grace=15) == 0, relay.log()[-4000:]
        rep = inc["report"]
        assert rep is not None, inc
        assert rep["verdict"] == sc.verdict, rep["summary"]
        assert rep["lagging_ranks"] == sc.lagging_ranks(WORLD), rep["summary"]
        expected = sc.stalled(WORLD, sc.default_steps)
        assert expected is not None
        st = rep["stalled_collective"]
        assert (st["group"], st["seq"], st["op"]) == (expected.group, expected.seq, expected.op)
        # Every rank's evidence arrived, through the relay: there was no other way.
        assert sorted(inc["ranks_dumped"]) == list(range(WORLD)), inc
        assert not inc["ranks_unreachable"], inc

        def carried(method: str) -> float:
            return m[("hangwatch_relay_calls_carried_total", (("method", method),))]

        assert carried("Register") >= 1, m
        assert carried("Health") >= 1, m  # the clock exchange
        assert carried("UploadFiles") + carried("UploadBundle") >= 1, m
        assert carried("CompleteDump") >= 1, m
        assert m[("hangwatch_relay_commands_forwarded_total", ())] >= 1, m  # the DUMP
        assert m[("hangwatch_relay_reports_forwarded_total", ())] > 0, m
        failed = {k: v for k, v in m.items() if k[0] == "hangwatch_relay_calls_failed_total"}
        assert not any(failed.values()), failed
        # Nothing failed through the relay, so nothing was tried straight (each
        # is logged: a call, the progress stream or the commands call passed
        # over to the coordinator, or a call the sender had to retry).
        log = agent.log()
        for failed_so in ("through relay", "progress relay", "buffering and retrying"):
            assert failed_so not in log, log[-4000:]
