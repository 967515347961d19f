"""The hwhooks test backend itself: every op it claims, on real ranks, recorded as NCCL2 is.

A harness test: the hang zoo and the NCCL2-path tests trust what this backend
does, so its ops and its completion records are checked here first.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import REPO_ROOT, skip_unless_backend

pytestmark = [pytest.mark.torch]


@pytest.mark.timeout(180)
def test_every_op_completes_right_and_torch_records_each_as_completed() -> None:
    skip_unless_backend("hwhooks")
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
         str(REPO_ROOT / "tests" / "support" / "hookbackend_ops.py")],
        capture_output=True, text=True, timeout=150, cwd=REPO_ROOT,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    seen = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert sorted(s["rank"] for s in seen) == [0, 1, 2]
    names = set().union(*(s["names"] for s in seen))
    # torch's hook names each op after the dispatcher op, prefixed with the backend.
    assert {"hwhooks:all_reduce", "hwhooks:broadcast", "hwhooks:barrier"} <= names, names
    assert any("send" in n for n in names) and any("recv" in n for n in names), names
