"""The survivors' FR when the launcher terminates them (hangwatch.termdump), on real gloo ranks.

Rank 0 blocks in an all_reduce rank 1 never enters; SIGTERM (what torchrun
sends the survivors when a rank dies) must leave rank 0's FR in the run
directory and still end it by SIGTERM, although its main thread never returns
to Python to run a signal handler.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
from hangwatch.analyzer.parse import parse_dump_bytes

from hangwatch import formats, termdump
from tests.agent.live_ranks import start_job

pytestmark = pytest.mark.torch

STEPS = 5


@pytest.mark.timeout(90)
def test_sigterm_on_a_rank_blocked_in_a_collective_dumps_its_fr_then_ends_it(
    tmp_path: Path,
) -> None:
    job = start_job(tmp_path, mode="hang", extra=("--steps", str(STEPS)))
    try:
        job.wait_ready()
        pid = job.pid(0)
        job.procs[0].send_signal(signal.SIGTERM)
        # Ended by SIGTERM itself (what the launcher expects), within the dump's bound.
        rc = job.procs[0].wait(termdump.TERM_DUMP_S + 10)
        assert rc == -signal.SIGTERM, job.output()
        dumped = sorted((job.run_dir / "fr").glob(f"hw_exit_*_pid_{pid}_rank_0"))
        assert [p.name for p in dumped] == [
            formats.exit_dump_name(formats.GENERIC_INSTANCE, 0, pid)
        ]
        doc = parse_dump_bytes(dumped[0].read_bytes())
        ops = [e["profiling_name"] for e in doc["entries"]]
        # Every collective it made before blocking (3 groups a step), in order.
        assert sum("all_reduce" in op for op in ops) >= 3 * STEPS, ops
        # Not the watchdog's file name: the agent must not read it as torch's timeout.
        assert not formats.is_full_fr_name(dumped[0].name)
    finally:
        job.close()


@pytest.mark.timeout(30)
def test_a_job_with_its_own_sigterm_handler_keeps_it() -> None:
    code = (
        "import signal, sys\n"
        "from hangwatch import termdump\n"
        "mine = lambda s, f: None\n"
        "signal.signal(signal.SIGTERM, mine)\n"
        "assert termdump.install(lambda: []) is False\n"
        "assert signal.getsignal(signal.SIGTERM) is mine\n"
        "assert signal.set_wakeup_fd(-1) == -1\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20)
    assert r.returncode == 0, r.stderr
