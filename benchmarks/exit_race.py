"""A rank exiting while the agent polls it: how often does the exit abort?

    python benchmarks/exit_race.py [--runs 20]

Each run starts a process with the rank's FR endpoint (torch's C++ worker
server and hangwatch's handlers, `hook_endpoint.start`), lets it live 0.5 s
and exit, while 4 threads here call its status handler as fast as they can.
At exit the process removes its socket as the hook does, then waits either
nothing (the anchor: the hook before) or `hook.EXIT_DRAIN_S` (the hook now).
A worker-server thread still waiting for the GIL when finalization starts is
ended by pthread_exit and the process aborts ("FATAL: exception not
rethrown"). Prints the aborts of each.
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import tempfile
import threading
import time

from hangwatch.agent import endpoint

from hangwatch import hook_protocol
from hangwatch.hook import EXIT_DRAIN_S

_CHILD = r"""
import atexit, contextlib, os, sys, time
import torch  # noqa: F401
from hangwatch import hook_endpoint
path, drain = sys.argv[1], float(sys.argv[2])
hook_endpoint.start(path, force_thread=False, recorders=lambda: ())
print("up", flush=True)
time.sleep(0.5)
def _exit():
    with contextlib.suppress(OSError):
        os.unlink(path)
    time.sleep(drain)
atexit.register(_exit)
"""


def _aborts(runs: int, drain: float, tmp: str) -> int:
    n = 0
    for i in range(runs):
        path = f"{tmp}/rank{i}.sock"
        p = subprocess.Popen(
            [sys.executable, "-c", _CHILD, path, str(drain)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        assert p.stdout is not None
        p.stdout.readline()
        stop = time.monotonic() + 10

        def poll() -> None:
            while p.poll() is None and time.monotonic() < stop:  # noqa: B023
                with contextlib.suppress(endpoint.EndpointError, TimeoutError):
                    endpoint.call(path, hook_protocol.STATUS, timeout=1)  # noqa: B023

        threads = [threading.Thread(target=poll) for _ in range(4)]
        for t in threads:
            t.start()
        p.wait(30)
        for t in threads:
            t.join()
        n += p.returncode != 0
    return n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=20)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="hangwatch-exit-") as tmp:
        anchor = _aborts(args.runs, 0.0, tmp)
        now = _aborts(args.runs, EXIT_DRAIN_S, tmp)
    print(f"aborted exits, {args.runs} runs each, 4 clients polling the status handler")
    print(f"  no drain (anchor)            {anchor} of {args.runs}")
    print(f"  drain {EXIT_DRAIN_S * 1000:.0f} ms (the hook now)  {now} of {args.runs}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
