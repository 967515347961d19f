"""--on-hang abort and --exclude-command on a real hung job, end to end.

Real programs: `hangwatch server`, `hangwatch agent`, and
`hangwatch run -- torchrun --max-restarts 1` around a 3-rank gloo DDP job
with uneven batches (tests/live/uneven_ddp.py). The job hangs, the
coordinator collects and analyses it, runs the exclusion command (a real
script that records its argv) for the lagging rank's node, then has the
agent end every rank; torchrun restarts the job, whose second attempt
finishes. Nothing here is simulated but the node being "excluded".
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from hangwatch import formats
from hangwatch.config import env_var
from tests.live.conftest import coordinator_process, stop_job

pytestmark = [pytest.mark.torch, pytest.mark.slow]

HERE = Path(__file__).resolve().parent
JOB = "uneven-ddp"
NODE = "node-a"
RANKS = (0, 1, 2)


def _get(http: str, path: str) -> object:
    with urllib.request.urlopen(f"{http}{path}", timeout=5) as r:
        return json.load(r)


def _start(argv: list[str], log: Path, environ: dict[str, str]) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, env=environ, start_new_session=True
        )


def _stop(p: subprocess.Popen[bytes]) -> int:
    return stop_job(p)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.timeout(240)
def test_abort_ends_a_hung_ddp_job_after_its_bundle_is_stored(tmp_path: Path) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()
    argv_log = tmp_path / "exclude.jsonl"
    exclude = shlex.join(
        [sys.executable, str(HERE / "record_argv.py"), str(argv_log),
         "{host}", "node={node}", "ranks={ranks}", "hangwatch-{incident}"]
    )  # fmt: skip
    environ = {k: v for k, v in os.environ.items() if not k.startswith("HANGWATCH_")}
    run_dir = tmp_path / "run"
    logs = {n: tmp_path / f"{n}.log" for n in ("agent", "train")}
    procs: dict[str, subprocess.Popen[bytes]] = {}

    def logs_text() -> str:
        return "\n".join(
            f"--- {n}\n{p.read_text(errors='replace')[-4000:]}"
            for n, p in {**logs, "coordinator": tmp_path / "coord" / "server.log"}.items()
            if p.exists()
        )

    (tmp_path / "coord").mkdir()
    with coordinator_process(
        tmp_path / "coord", "--on-hang", "abort", "--abort-grace", "5",
        "--exclude-command", exclude, "--exclude-timeout", "20",
    ) as coord:  # fmt: skip
        try:
            procs["agent"] = _start(
                [sys.executable, "-m", "hangwatch", "agent", "--coordinator", coord["grpc"],
                 "--run-dir", str(run_dir), "--job-id", JOB, "--node-id", NODE,
                 "--poll-interval", "0.2", "--on-hang", "abort"],
                logs["agent"], environ,
            )  # fmt: skip
            procs["train"] = _start(
                [sys.executable, "-m", "hangwatch", "run", "--run-dir", str(run_dir),
                 "--job-id", JOB, "--",
                 sys.executable, "-m", "torch.distributed.run", "--standalone",
                 "--nproc-per-node", str(len(RANKS)), "--max-restarts", "1", "--monitor-interval", "0.2",
                 str(HERE / "uneven_ddp.py"), str(marks)],
                logs["train"], environ,
            )  # fmt: skip
            # The restarted attempt is even and finishes: torchrun exits 0.
            rc = procs["train"].wait(180)
            assert rc == 0, f"training exited {rc}\n{logs_text()}"
        finally:
            for name in ("train", "agent"):
                if name in procs:
                    _stop(procs[name])

        listed = _get(coord["http"], f"/api/incidents?job={JOB}")
        assert isinstance(listed, list)
        details = [_get(coord["http"], f"/api/incidents/{i['id']}") for i in listed]
    # A loaded machine can make an attempt's start look like a stall: such an
    # incident resolves by itself (or ends with the attempt) and nothing is
    # done about it.
    acted = [d for d in details if {a["status"] for a in d["actions"]} != {"skipped"}]
    assert len(acted) == 1, f"{details}\n{logs_text()}"
    for d in details:
        if d is not acted[0]:
            assert d["status"] in ("resolved", "ended"), d
            assert d["verdict"] not in ("hang", "mismatch") or d["status"] == "resolved", d
            assert [a["kind"] for a in d["actions"]] == ["exclude", "abort"], d["actions"]
    inc = acted[0]
    assert inc["verdict"] in ("hang", "mismatch"), inc["summary"]
    iid = inc["id"]
    assert inc["lagging_ranks"] == [1], inc["summary"]

    # The bundle was complete before anything was signalled: every rank dumped.
    assert inc["ranks_dumped"] == list(RANKS) and inc["ranks_unreachable"] == {}
    bundle = Path(coord["data"]) / "incidents" / iid
    assert (bundle / formats.INCIDENT_FILE).is_file()
    for r in RANKS:
        files = {p.name for p in (bundle / f"rank_{r}").iterdir()}
        assert any(formats.is_full_fr_name(n) for n in files), files
        assert {"meta.json", "stacks.txt"} <= files, files

    by_kind = {a["kind"]: a for a in inc["actions"]}
    assert [a["kind"] for a in inc["actions"]] == ["exclude", "abort"], inc["actions"]

    # The exclusion ran once, for the lagging rank's node, as argv words.
    ex = by_kind["exclude"]
    assert ex["status"] == "done" and ex["returncode"] == 0, ex
    assert ex["node"] == NODE and ex["output"].startswith("cordoned "), ex
    lines = [json.loads(x) for x in argv_log.read_text().splitlines()]
    assert len(lines) == 1
    assert lines[0]["argv"] == [ex["host"], f"node={NODE}", "ranks=1", f"hangwatch-{iid}"]
    assert lines[0]["token"] is None

    # Every first-attempt rank was ended by SIGTERM within 30 s of the incident.
    ab = by_kind["abort"]
    assert ab["status"] == "done", ab
    first = {r: int((marks / f"attempt0.rank{r}").read_text()) for r in RANKS}
    assert {o["rank"]: o["pid"] for o in ab["ranks"]} == first, ab
    for o in ab["ranks"]:
        assert o["outcome"] == "terminated" and o["signals"] == ["SIGTERM"], o
        assert not _alive(o["pid"])
    assert ab["finished"] - inc["created"] < 30, (ab["finished"] - inc["created"], ab)
    # The launcher restarted the job: a second attempt of every rank ran.
    assert all((marks / f"attempt1.rank{r}").exists() for r in RANKS)
    assert time.time() > ab["finished"]
    assert environ.get(env_var("on_hang")) is None
