"""torch 2.15's default NCCL as torch records it, on the compiled hwhooks backend.

hwhooks keeps ProcessGroupNCCL2's contract with torch's hooks (completion
hooks with durations, abort hooks from a watchdog, a late rank never
completes a collective its peers abandoned). Two paths only it can show:

* the seed's path: torch's own collective timeout fires first (hangwatch's
  stall timeout far away); the abort hook tells the agent, and the
  coordinator dumps every rank, ranks whose own collectives never timed out
  included, and ranks that died after torch's dump (what they left on disk);
* the late arrival: each rank's dump is torch's own abort-hook file, written
  at its own failure; the rank that entered seconds after its peers had
  timed out must be named, and nobody else.

Both skip, saying why, where torch has no FlightRecorderHook or no compiler.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hangwatch.config import env_var
from hangwatch.testing.backends import HWHOOKS
from tests.helpers import skip_unless_backend
from tests.live.conftest import coordinator_process
from tests.support.hookevents import first_abort_unix

pytestmark = [pytest.mark.torch, pytest.mark.slow]

COLLECTIVE_TIMEOUT_S = 3.0
# The bound: the incident opens this soon after torch's first abort.
AFTER_ABORT_S = 3.0


@pytest.mark.timeout(300)
def test_torch_timeout_first_gives_one_incident_with_every_rank_and_the_culprit(
    tmp_path: Path,
) -> None:
    skip_unless_backend(HWHOOKS)
    run_dir = tmp_path / "run"
    (tmp_path / "coord").mkdir()
    with coordinator_process(tmp_path / "coord", "--stall-timeout", "300") as coord:
        environ = {k: v for k, v in os.environ.items() if not k.startswith("HANGWATCH_")}
        environ[env_var("run_dir")] = str(run_dir)
        environ[env_var("poll_interval")] = "0.5"
        r = subprocess.run(
            [sys.executable, "-m", "hangwatch", "demo", "--scenario", "skip", "--ranks", "3",
             "--coordinator", coord["grpc"], "--backend", HWHOOKS, "--collective-timeout",
             str(COLLECTIVE_TIMEOUT_S), "--json", "--timeout", "90"],
            capture_output=True, text=True, timeout=200, env=environ,
        )  # fmt: skip
    assert r.returncode == 0, f"demo failed ({r.returncode}):\n{r.stderr[-4000:]}"
    out = json.loads(r.stdout)
    # hangwatch's own stall rule (300 s) never fired: torch's abort did.
    assert out["stall_timeout_s"] == 300
    assert (out["verdict"], out["lagging_ranks"]) == ("hang", [1]), out["summary"]
    st = out["stalled_collective"]
    assert (st["group"], st["op"], st["missing_ranks"]) == ("0", "all_reduce", [1])
    # Every rank's dump, rank 1's included although its own collectives never timed out.
    assert out["ranks_dumped"] == [0, 1, 2], out["ranks_unreachable"]
    after = out["incident_created_unix"] - first_abort_unix(run_dir)
    print(
        f"incident {after:.3f}s after torch's first abort; analysed {out['detection_s']:.3f}s after the fault"
    )
    assert 0 <= after <= AFTER_ABORT_S, f"incident {after:.2f}s after torch's first abort"


_LATE_JOB = """
import os, sys, time
from datetime import timedelta
import torch, torch.distributed as dist
from hangwatch.testing import backends

dist.init_process_group(backends.register(sys.argv[1]), timeout=timedelta(seconds=float(sys.argv[2])))
rank = dist.get_rank()
for _ in range(10):
    dist.all_reduce(torch.ones(4))
if rank == 1:
    time.sleep(float(sys.argv[3]))  # past the others' timeout: they abandon all_reduce #11
try:
    dist.all_reduce(torch.ones(4))
    raise SystemExit(f"rank {rank}: all_reduce #11 completed; it must time out")
except dist.DistBackendError as e:
    print(f"rank {rank}: {e}", flush=True)
# torch writes its abort-hook dump asynchronously: wait for it before leaving.
dump = os.environ["TORCH_FR_DUMP_TEMP_FILE"] + str(rank)
deadline = time.monotonic() + 30
while not (os.path.exists(dump) and os.path.getsize(dump) > 0) and time.monotonic() < deadline:
    time.sleep(0.05)
dist.destroy_process_group()
"""


@pytest.mark.timeout(240)
def test_torchs_own_abort_dumps_name_the_late_rank_and_nobody_else(tmp_path: Path) -> None:
    skip_unless_backend(HWHOOKS)
    late_s = 8.0
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    script = tmp_path / "late_job.py"
    script.write_text(_LATE_JOB)
    e = dict(os.environ)
    e.update(TORCH_FR_DUMP_TEMP_FILE=str(dumps / "fr_dump_"), TORCH_FR_BUFFER_SIZE="200")
    # torchrun, not bare ranks: its agent holds the store (hwhooks' transport)
    # while the early ranks leave, as it does for a real job.
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
         str(script), HWHOOKS, str(COLLECTIVE_TIMEOUT_S), str(late_s)],
        env=e, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert r.returncode == 0, f"job failed ({r.returncode}):\n{r.stderr[-4000:]}"
    assert sorted(f.name for f in dumps.iterdir()) == [f"fr_dump_{r}" for r in range(3)]

    from hangwatch.analyzer import analyze_path

    report = analyze_path(dumps)
    assert (report.verdict, report.lagging_ranks) == ("hang", [1]), report.summary
    sc = report.stalled_collective
    assert sc is not None and (sc.group, sc.seq, sc.op) == ("0", 11, "all_reduce")
    late = [f for f in report.findings if f.kind == "late-arrival"]
    assert [f.ranks for f in late] == [[1]]
    # Its lateness is in the evidence: about late_s, less what the others
    # spent between #10 and #11 (milliseconds).
    lateness = float(late[0].detail.split("s after the others")[0].split()[-1])
    assert late_s - 1.0 < lateness < late_s + 1.0, late[0].detail
