"""What the agent keeps of `py-spy dump --locals`: frames and p2p peers, never a local's value."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from hangwatch.agent.stackargs import keep_peer_args

# A fake torch.distributed recv frame (its path is what the filter looks at),
# called with a secret in the caller's locals and in its own arguments.
PROGRAM = """
import sys, time
sys.path.insert(0, sys.argv[1])
from torch.distributed.distributed_c10d import recv
token = "s3cr3t-token"
print("ready", flush=True)
recv(None, src=3, group=None, note="s3cr3t-arg")
"""
RECV = "def recv(tensor, src=None, group=None, tag=0, note=''):\n    import time\n    time.sleep(3600)\n"


@pytest.mark.timeout(60)
def test_only_peer_arguments_survive(tmp_path: Path) -> None:
    # A stand-in torch package first on the child's path: no real torch needed.
    pkg = tmp_path / "torch" / "distributed"
    pkg.mkdir(parents=True)
    for d in (tmp_path / "torch", pkg):
        (d / "__init__.py").write_text("")
    (pkg / "distributed_c10d.py").write_text(RECV)
    p = subprocess.Popen([sys.executable, "-c", PROGRAM, str(tmp_path)], stdout=subprocess.PIPE)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == b"ready"
        time.sleep(0.3)
        spy = Path(sys.executable).with_name("py-spy")
        raw = subprocess.run(
            [str(spy), "dump", "--locals", "--pid", str(p.pid)],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout  # fmt: skip
    finally:
        p.kill()
        p.wait()
        if p.stdout is not None:
            p.stdout.close()
    assert "s3cr3t" in raw  # py-spy shows it ...
    kept = keep_peer_args(raw)
    assert "s3cr3t" not in kept  # ... the bundle never does
    assert "Process " not in kept and "Python v" not in kept  # no command line
    lines = kept.splitlines()
    assert lines[0].startswith("Thread ") and "(idle)" in lines[0]
    assert lines[1].strip().startswith("recv (") and "torch/distributed/" in lines[1]
    assert [x.strip() for x in lines[2:6]] == ["Arguments:", "src: 3", "group: None", "tag: 0"]
    assert lines[6].strip().startswith("<module> (")
