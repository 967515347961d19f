"""A training script that knows nothing of hangwatch (run under `hangwatch run` by the tests)."""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d_ext

dist.init_process_group("gloo", init_method=f"file://{sys.argv[1]}", rank=0, world_size=1)
for _ in range(12):
    dist.all_reduce(torch.ones(4))
entries = json.loads(c10d_ext._dump_fr_trace_json())["entries"]
print(f"ENTRIES {len(entries)}", flush=True)
print(f"CHAINED {os.environ.get('CHAINED_SITECUSTOMIZE', 'no')}", flush=True)
