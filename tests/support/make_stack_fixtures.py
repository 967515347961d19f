"""Capture real stacks for the stack-diagnosis tests: `python -m tests.support.make_stack_fixtures DIR`.

Each case is a real process put in a known state (the plan below is the
ground truth); its stack is taken the way the agent takes it (`py-spy dump
--locals`, cut down by `hangwatch.agent.stackargs.keep_peer_args`) and
written to DIR/<case>.txt. The p2p cases are the hang zoo's p2p scenario
(real gloo ranks): ranks 0 and 1 recv from each other, 2 and 3 from 0 and 1.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hangwatch.agent.stackargs import keep_peer_args

from hangwatch.testing.launch import launch_job

# case -> a Python program that prints "ready" and then stays in that state.
PROGRAMS = {
    "sleeping": "import time\nprint('ready', flush=True)\ntime.sleep(3600)\n",
    "event": "import threading\nprint('ready', flush=True)\nthreading.Event().wait(3600)\n",
    "compute": (
        "print('ready', flush=True)\nx = 0\nwhile True:\n    x = (x * 31 + 7) % 1_000_003\n"
    ),
    "data-loader": (
        "import time, torch\n"
        "from torch.utils.data import DataLoader, Dataset\n"
        "class Stuck(Dataset):\n"
        "    def __len__(self): return 8\n"
        "    def __getitem__(self, i): time.sleep(3600)\n"
        "if __name__ == '__main__':\n"
        "    print('ready', flush=True)\n"
        "    next(iter(DataLoader(Stuck(), num_workers=1)))\n"
    ),
    # Compiled code running, not compiling: it sleeps in a graph break of a
    # function torch.compile already compiled (dynamo's eval_frame on the stack,
    # its convert_frame not).
    "compiled-run": (
        "import time, torch\n"
        "@torch.compile(backend='eager')\n"
        "def step(x):\n"
        "    y = x * 2\n"
        "    print('ready', flush=True)\n"
        "    time.sleep(3600)\n"
        "    return y\n"
        "step(torch.ones(2))\n"
    ),
}

# Three processes compile the same model with one fresh inductor cache: the
# ones that want a build another holds wait in filelock's poll (torch 2.13).
COMPILE_RANK = (
    "import os, sys, torch\n"
    "m = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)], torch.nn.GELU())\n"
    "torch.compile(m)(torch.randn(8, 64)).sum().backward()\n"
)


def pyspy_peer_stacks(pid: int) -> str:
    exe = Path(sys.executable).with_name("py-spy")
    out = subprocess.run(
        [str(exe), "dump", "--locals", "--pid", str(pid)],
        capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    return keep_peer_args(out.stdout)


def capture_program(name: str, code: str, out: Path) -> None:
    with tempfile.TemporaryDirectory() as d:
        script = Path(d) / "state.py"
        script.write_text(code)
        p = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE)
        try:
            assert p.stdout is not None and p.stdout.readline().strip() == b"ready"
            time.sleep(1.0)  # into the state (the data loader needs its worker up)
            (out / f"{name}.txt").write_text(pyspy_peer_stacks(p.pid))
        finally:
            p.kill()
            p.wait()
            if p.stdout is not None:
                p.stdout.close()


def capture_p2p(out: Path) -> None:
    with tempfile.TemporaryDirectory() as d, launch_job("p2p", 4, workdir=Path(d)) as job:
        job.wait_fault_injected()
        time.sleep(1.0)
        for r, pid in enumerate(job.pids):
            (out / f"p2p-rank{r}.txt").write_text(pyspy_peer_stacks(pid))


def capture_compile_lock(out: Path, timeout_s: float = 120.0) -> None:
    """The first py-spy dump of a process waiting in filelock under torch._inductor."""
    with tempfile.TemporaryDirectory() as d:
        script = Path(d) / "compile.py"
        script.write_text(COMPILE_RANK)
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(Path(d) / "cache")}
        procs = [
            subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.DEVNULL)
            for _ in range(3)
        ]
        try:
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                for p in procs:
                    if p.poll() is not None:
                        continue
                    with contextlib.suppress(subprocess.CalledProcessError):
                        text = pyspy_peer_stacks(p.pid)
                        if "filelock" in text and "torch/_inductor/" in text:
                            (out / "compile-lock.txt").write_text(text)
                            return
                time.sleep(0.2)
            raise RuntimeError("no process was seen waiting on inductor's lock")
        finally:
            for p in procs:
                p.kill()
                p.wait()


def main() -> int:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for name, code in PROGRAMS.items():
        capture_program(name, code, out)
    capture_p2p(out)
    capture_compile_lock(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
