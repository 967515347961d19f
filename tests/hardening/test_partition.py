"""A network partition between one node's agent and the coordinator, during a hang.

What is partitioned, exactly: node B's agent runs inside its own network
namespace and reaches the coordinator only over a veth pair; the partition
takes the host end of that pair down (both directions cut, nothing else on
the host touched). All three gloo ranks run on the host (ranks 0 and 1 are
node A's, rank 2 is node B's: its hook writes into node B's run dir, which
only node B's agent watches), so training itself is not partitioned; only
node B's observability is. The coordinator listens on the veth's host
address with a bearer token, as a non-loopback coordinator must.

Promise: while node B is cut off, a hang on node A is blamed on the rank that
caused it, and node B's rank is reported unobserved (finding
`agent-unreachable`), not guilty. After the link heals, node B's agent
reconnects by itself.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.hardening.trainjob import TrainJob
from tests.hardening.util import all_connected, finished_incidents, ranks_view, wait_for
from tests.support.chaos import CoordinatorProc, FaultUnavailable, NetnsLink, two_node_agents

pytestmark = [pytest.mark.torch]

JOB = "chaos-partition"
TOKEN = "partition-test-token"
LOST_S = 3.0


@pytest.mark.timeout(150)
def test_partitioned_agent_is_unobserved_not_blamed(tmp_path: Path) -> None:
    link = NetnsLink("p")
    try:
        link.create()
    except FaultUnavailable as e:
        pytest.skip(f"cannot create a network namespace here (needs root/CAP_NET_ADMIN): {e}")
    coord = CoordinatorProc(
        tmp_path / "data", host=link.host_ip, token=TOKEN, stall_timeout=2.0,
        dump_deadline=8.0, agent_lost_timeout=LOST_S,
    )  # fmt: skip
    runs, agents = two_node_agents(coord, tmp_path, JOB, token=TOKEN, netns=link.name)
    job = TrainJob(tmp_path, world=3, run_dirs=[runs[0], runs[0], runs[1]], job_id=JOB, culprit=1)
    try:
        coord.start()
        for a in agents:
            a.start()
        job.start()
        wait_for(lambda: all_connected(coord, JOB, [0, 1, 2]), 40, "all ranks observed")
        agents_of = {r["rank"]: r["agent_id"] for r in ranks_view(coord, JOB).values()}
        assert agents_of == {0: "node-a", 1: "node-a", 2: "node-b"}, agents_of

        link.partition()
        t_cut = time.monotonic()
        wait_for(lambda: not ranks_view(coord, JOB)[2]["observed"], 15, "rank 2 unobserved")
        print(f"rank 2 unobserved {time.monotonic() - t_cut:.2f}s after the partition")
        job.hang()
        [inc] = wait_for(lambda: finished_incidents(coord, JOB), 40, "the incident")
        assert inc["verdict"] == "hang", inc["summary"]
        assert 1 in inc["lagging_ranks"], inc["summary"]
        assert sorted(inc["ranks_dumped"]) == [0, 1], inc
        assert inc["ranks_unreachable"]["2"].startswith("agent unreachable"), inc
        findings = {f["kind"]: f for f in inc["report"]["findings"]}
        assert findings["agent-unreachable"]["ranks"] == [2], findings
        assert "unobserved (agent unreachable)" in inc["summary"], inc["summary"]
        for a in agents:
            a.check()  # the partitioned agent kept running, buffering

        link.heal()
        t_heal = time.monotonic()
        wait_for(lambda: ranks_view(coord, JOB)[2]["observed"], 20, "node B back after healing")
        print(f"node B observed again {time.monotonic() - t_heal:.2f}s after healing")

        assert inc["lagging_ranks"] == [1], inc["summary"]
        assert "not blamed" in inc["summary"], inc["summary"]
    finally:
        job.close()
        for a in agents:
            a.stop()
        coord.stop()
        link.destroy()
