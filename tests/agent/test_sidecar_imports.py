"""The node agent stays light: cutting an FR tail must not load pandas or numpy."""

from __future__ import annotations

import pickle
import subprocess
import sys

import pytest


@pytest.mark.timeout(60)
def test_cutting_a_tail_loads_no_dataframe_stack() -> None:
    dump = {
        "version": "2.10",
        "pg_config": {},
        "entries": [
            {"process_group": ("0", "default_pg"), "state": "completed", "record_id": i}
            for i in range(40)
        ],
    }
    code = (
        "import sys\n"
        "import hangwatch.agent.service\n"
        "from hangwatch import frtail\n"
        "out = frtail.tail_bytes(sys.stdin.buffer.read(), context=2)\n"
        "assert out is not None\n"
        "heavy = sorted(m for m in ('pandas', 'numpy') if m in sys.modules)\n"
        "print(','.join(heavy))\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        input=pickle.dumps(dump, protocol=2),
        capture_output=True,
        timeout=50,
        check=False,
    )
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    assert r.stdout.decode().strip() == "", "the agent imported " + r.stdout.decode()
