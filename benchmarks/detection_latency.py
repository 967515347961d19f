"""Detection latency over the hang zoo: from the injected stall to the stored verdict.

    python benchmarks/detection_latency.py --ranks 8 [--stall-timeout 3] [--repeat 1]

One coordinator process serves every run; each run is `hangwatch demo
--coordinator ... --json` (a real agent and real gloo ranks). `detection_s` is
measured by the demo from the ranks' own fault-injection timestamps to the
incident's verdict time (same host, so the clocks agree). Prints one JSON
object with per-scenario values, p50/p90 and the excess over the stall timeout.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hangwatch.formats import ServerInfo

SCENARIOS = ("skip", "compute", "frozen", "two", "mismatch", "subgroup", "order", "gil")


def _start_server(data: Path, stall_timeout: float) -> tuple[subprocess.Popen[bytes], str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "hangwatch", "server", "--grpc-port", "0", "--http-port", "0",
         "--data-dir", str(data), "--stall-timeout", str(stall_timeout), "--log-level", "warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    for _ in range(600):
        info = ServerInfo.read(data)
        if info is not None:
            return proc, info.grpc
        if proc.poll() is not None:
            raise SystemExit(f"coordinator exited with {proc.returncode}")
        time.sleep(0.1)
    raise SystemExit("coordinator did not start")


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--stall-timeout", type=float, default=3.0)
    ap.add_argument("--poll-interval", type=float, default=0.5)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ns = ap.parse_args()

    data = Path(tempfile.mkdtemp(prefix="hangwatch-latency-"))
    proc, grpc_addr = _start_server(data, ns.stall_timeout)
    runs: list[dict[str, object]] = []
    try:
        for _ in range(ns.repeat):
            for name in ns.scenarios.split(","):
                environ = {k: v for k, v in os.environ.items() if not k.startswith("HANGWATCH_")}
                environ["HANGWATCH_POLL_INTERVAL"] = str(ns.poll_interval)
                t0 = time.monotonic()
                r = subprocess.run(
                    [sys.executable, "-m", "hangwatch", "demo", "--scenario", name, "--ranks", str(ns.ranks),
                     "--coordinator", grpc_addr, "--stall-timeout", str(ns.stall_timeout), "--json"],
                    capture_output=True, text=True, timeout=300, env=environ,
                )  # fmt: skip
                if r.returncode != 0:
                    runs.append({"scenario": name, "error": r.stderr.strip().splitlines()[-1:]})
                    continue
                out = json.loads(r.stdout)
                runs.append(
                    {
                        "scenario": name,
                        "detection_s": out["detection_s"],
                        "verdict": out["verdict"],
                        "right_ranks": out["lagging_ranks"] == out["injected_ranks"],
                        "wall_s": round(time.monotonic() - t0, 1),
                    }
                )
                print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    det = sorted(float(x["detection_s"]) for x in runs if "detection_s" in x)  # type: ignore[arg-type]
    q = statistics.quantiles(det, n=10) if len(det) >= 2 else det * 9
    result = {
        "ranks": ns.ranks,
        "stall_timeout_s": ns.stall_timeout,
        "poll_interval_s": ns.poll_interval,
        "runs": runs,
        "p50_s": round(statistics.median(det), 2) if det else None,
        "p90_s": round(q[8], 2) if det else None,
        "p50_over_timeout_s": round(statistics.median(det) - ns.stall_timeout, 2) if det else None,
        "p90_over_timeout_s": round(q[8] - ns.stall_timeout, 2) if det else None,
    }
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
