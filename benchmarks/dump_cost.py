"""What one incident's FR dump costs the rank it is taken in.

    python benchmarks/dump_cost.py [--runs 5] [--entries 200] [--json]

Each run is a fresh interpreter holding a one-rank gloo group that has
recorded `--entries` all_reduces (a rank that never used torch.compile), and
takes the dump an incident takes: the FR pickle with call sites. Two ways, each
in its own runs:

- `torch` (the anchor): torch's own reader with stack traces, as a dump was
  taken before hangwatch answered the symbolizer's inductor lookup itself;
- `hangwatch`: `hangwatch.recorders.dump`, what the hook's endpoint calls.

Per run: the dump's CPU time (the process's user+system time around the call),
the RSS it added, and the modules it imported; then a second dump (the next
incident) the same way. Prints medians and each way's ratio to the anchor
measured in the same invocation. Run it with each torch (2.13, 2.15).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import textwrap
from typing import Any

CHILD = textwrap.dedent(
    """
    import json, os, resource, sys
    import torch, torch.distributed as dist
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%(port)d", rank=0, world_size=1)
    t = torch.ones(1024)
    for _ in range(%(entries)d):
        dist.all_reduce(t)
    from hangwatch import recorders
    (rec,) = recorders.discover()
    if %(way)r == "torch":
        read = recorders._reader(rec.kind, rec.instance, pickle=True)
        def dump():
            return read(includeCollectives=True, includeStackTraces=True, onlyActive=False)
    else:
        def dump():
            return recorders.dump(rec, pickle=True)

    def rss():
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) << 10

    def cpu():
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    out = []
    for _ in range(2):
        mods, mem, t0 = len(sys.modules), rss(), cpu()
        size = len(dump())
        out.append({"cpu_ms": (cpu() - t0) * 1e3, "rss_mb": (rss() - mem) / 2**20,
                    "modules": len(sys.modules) - mods, "bytes": size})
    dist.destroy_process_group()
    print(json.dumps(out))
    """
)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def one(way: str, entries: int) -> list[dict[str, float]]:
    env = {**os.environ, "TORCH_FR_BUFFER_SIZE": str(max(entries, 2000))}
    script = CHILD % {"port": _port(), "entries": entries, "way": way}
    r = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env
    )
    if r.returncode != 0:
        raise SystemExit(f"{way} run failed:\n{r.stderr[-3000:]}")
    out: list[dict[str, float]] = json.loads(r.stdout.strip().splitlines()[-1])
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--entries", type=int, default=200)
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    import torch

    runs: dict[str, list[list[dict[str, float]]]] = {"torch": [], "hangwatch": []}
    for _ in range(a.runs):  # interleaved: the machine's noise hits both alike
        for way in runs:
            runs[way].append(one(way, a.entries))
    result: dict[str, Any] = {"torch": torch.__version__, "entries": a.entries, "runs": a.runs}
    for which, i in (("first_dump", 0), ("second_dump", 1)):
        med = {
            way: {
                k: statistics.median(r[i][k] for r in rs) for k in ("cpu_ms", "rss_mb", "modules")
            }
            for way, rs in runs.items()
        }
        anchor = med["torch"]["cpu_ms"]
        med["hangwatch"]["cpu_ratio_to_torch"] = (
            med["hangwatch"]["cpu_ms"] / anchor if anchor else 0
        )
        result[which] = med
    if a.json:
        print(json.dumps(result, indent=1))
    else:
        print(f"torch {result['torch']}, {a.entries} FR entries, median of {a.runs} runs")
        for which in ("first_dump", "second_dump"):
            for way in ("torch", "hangwatch"):
                m = result[which][way]
                print(
                    f"{which:<12} {way:<10} cpu {m['cpu_ms']:8.1f} ms  rss +{m['rss_mb']:6.1f} MB"
                    f"  modules +{m['modules']:4.0f}"
                )
            print(
                f"{'':<12} hangwatch/torch cpu ratio {result[which]['hangwatch']['cpu_ratio_to_torch']:.3f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
