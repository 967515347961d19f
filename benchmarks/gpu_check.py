"""The GPU check: real NCCL on one GPU, NCCL2 and legacy, read by hangwatch live and offline.

    python benchmarks/gpu_check.py [--timeout 5] [--out F]     # needs one CUDA GPU, torch >= 2.15

A world of one per backend (`nccl`, which torch 2.15 makes ProcessGroupNCCL2,
and `nccl` with TORCH_DIST_USE_NCCL2=0, the legacy one), each in a fresh
process under `hangwatch.attach()`:

1. a few all_reduces finish: the device backend's `supports_completion_hooks`,
   the recorder the hook found (rank-info file: kind, completion), and the
   entries' states and durations in the dump;
2. `torch.cuda._sleep` holds the stream, and an all_reduce queued behind it
   passes a short NCCL timeout: while it waits, the hook's status poll
   (the agent's live read) shows it in flight; torch's watchdog then times it
   out, runs its abort hooks and writes `<TORCH_FR_DUMP_TEMP_FILE><rank>`;
3. `hangwatch analyze` reads that dump (offline).

Prints one JSON object per backend and exits 1 if a check failed. Takes
about a minute a backend; well under the 10 minutes a device run allows.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

_CHILD = r"""
import json, os, sys, time
from datetime import timedelta
import torch, torch.distributed as dist
import hangwatch
from hangwatch import hook_protocol
from hangwatch.agent import endpoint

run_dir, timeout = sys.argv[1], float(sys.argv[2])
out = {}
res = hangwatch.attach(run_dir=run_dir)
out["attach_ok"] = bool(res.ok)
dist.init_process_group("nccl", timeout=timedelta(seconds=timeout), device_id=torch.device("cuda:0"))
pg = dist.distributed_c10d._get_default_group()
b = pg._get_backend(torch.device("cuda"))
out["backend_class"] = type(b).__name__
out["supports_completion_hooks"] = bool(getattr(b, "supports_completion_hooks", False))
out["supports_abort_hooks"] = bool(getattr(pg, "supports_abort_hooks", False))
x = torch.ones(1 << 20, device="cuda")
for _ in range(5):
    dist.all_reduce(x)
torch.cuda.synchronize()
time.sleep(1.0)
info = json.loads(open(hook_protocol.rankinfo_path(run_dir, os.getpid())).read())
out["recorders"] = [{k: r[k] for k in ("instance", "kind", "completion")} for r in info["recorders"]]
from hangwatch import recorders
recs = recorders.discover()
trace = recorders.dump(recs[0], pickle=False, stacks=False)
doc = json.loads(trace)
out["states"] = sorted({e.get("state") for e in doc.get("entries", [])})
out["durations_ms"] = [e.get("duration_ms") for e in doc.get("entries", [])][:5]
out["pg_status"] = doc.get("pg_status")
torch.cuda._sleep(int(2e10))  # ~10 s of GPU time on a recent GPU: past the timeout
work = dist.all_reduce(x, async_op=True)
time.sleep(1.0)
status = json.loads(endpoint.call(info["socket"], hook_protocol.STATUS, timeout=5))
out["live_status"] = status
print("GPUCHECK " + json.dumps(out), flush=True)
try:
    work.wait()
    print("GPUCHECK-WAIT completed", flush=True)
except Exception as e:
    print("GPUCHECK-WAIT " + type(e).__name__, flush=True)
time.sleep(30)  # NCCL's error handling may end the process first; that is fine
"""


def check(backend: str, timeout: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="hw-gpu-") as d:
        run_dir = Path(d) / "run"
        e = dict(os.environ)
        if backend == "nccl-legacy":
            e["TORCH_DIST_USE_NCCL2"] = "0"
        e.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", LOCAL_RANK="0")
        from hangwatch.testing.ports import free_port

        e["MASTER_PORT"] = str(free_port())
        t0 = time.time()
        r = subprocess.run(
            [sys.executable, "-c", _CHILD, str(run_dir), str(timeout)],
            env=e, capture_output=True, text=True, timeout=240,
        )  # fmt: skip
        out: dict[str, Any] = {"backend": backend, "exit": r.returncode, "wall_s": time.time() - t0}
        for line in r.stdout.splitlines():
            if line.startswith("GPUCHECK "):
                out.update(json.loads(line[len("GPUCHECK ") :]))
            elif line.startswith("GPUCHECK-WAIT "):
                out["wait"] = line.split(" ", 1)[1]
        dumps = (
            sorted(p.name for p in (run_dir / "fr").glob("*")) if (run_dir / "fr").is_dir() else []
        )
        out["dump_files"] = dumps
        out["stderr_tail"] = r.stderr[-1500:]
        if dumps:
            from hangwatch.analyzer import analyze_path

            rep = analyze_path(run_dir / "fr", world_size=1)
            out["offline"] = {"verdict": rep.verdict, "summary": rep.summary,
                              "kinds": sorted({f.kind for f in rep.findings})}  # fmt: skip
        out["checks"] = {
            "completion_hooks": out.get("supports_completion_hooks") is (backend == "nccl"),
            "entries_complete": out.get("states") == ["completed"],
            "abort_dump_written": any(n.startswith("fr_trace_rank_") for n in dumps),
            "read_offline": "offline" in out and out["offline"]["verdict"] != "healthy",
            "read_live": bool(out.get("live_status")),
        }
        return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--timeout", type=float, default=5.0, help="NCCL collective timeout (s)")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args()
    results = [check(b, a.timeout) for b in ("nccl", "nccl-legacy")]
    for res in results:
        print(json.dumps({k: v for k, v in res.items() if k != "stderr_tail"}, default=str))
    if a.out:
        a.out.write_text(json.dumps(results, indent=2, default=str))
    sys.exit(0 if all(all(r["checks"].values()) for r in results) else 1)


if __name__ == "__main__":
    main()
