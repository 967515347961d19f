"""An incident's FR dump loads nothing heavy into a rank.

torch symbolizes each FR entry's call site through
`torch._inductor.codecache`; in a rank that never used torch.compile that
lookup alone imported 822 modules in 1.25 s (sympy, dynamo, inductor). A real
one-rank gloo group in a fresh interpreter: the dump with call sites loads no
module, keeps the frames, and once the job imports torch._inductor itself the
real lookup answers again (the stand-in is gone).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from helpers import free_port

pytestmark = [pytest.mark.torch]

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch, torch.distributed as dist
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d", rank=0, world_size=1)
    dist.all_reduce(torch.ones(4))
    from hangwatch import recorders
    from hangwatch.safepickle import safe_loads
    (rec,) = recorders.discover()
    before = set(sys.modules)
    first = safe_loads(recorders.dump(rec, pickle=True))
    loaded = sorted(set(sys.modules) - before)
    import torch._inductor.codecache as codecache
    real = codecache.PyCodeCache.stack_frames_for_code
    second = safe_loads(recorders.dump(rec, pickle=True))
    dist.destroy_process_group()
    print(json.dumps({
        "loaded": loaded,
        "frames": [f["name"] for f in first["entries"][0]["frames"]],
        "frames_after": [f["name"] for f in second["entries"][0]["frames"]],
        "real_after": sys.modules["torch._inductor.codecache"].PyCodeCache.stack_frames_for_code == real,
        "real_module": getattr(sys.modules["torch._inductor"], "__file__", None) is not None,
    }))
    """
)


@pytest.mark.timeout(120)
def test_a_dump_with_call_sites_imports_nothing_into_the_rank() -> None:
    r = subprocess.run(
        [sys.executable, "-c", SCRIPT % free_port()], capture_output=True, text=True, timeout=100
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["loaded"] == [], out["loaded"][:20]
    assert "all_reduce" in out["frames"], out["frames"]
    assert out["frames_after"] == out["frames"]
    assert out["real_after"] and out["real_module"]
