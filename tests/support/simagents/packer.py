"""The simulated nodes' tail decoding, in a process of its own.

Each real agent decodes its own node's tails on its node
(`hangwatch.agent.uploader.node_columns`). A fleet process stands for ~1,000
nodes; decoding all of theirs on a thread of it held the GIL away from the
simulated agents and slowed their DUMP fan-out (45 s at 16,384 ranks). So a
fleet process hands the work to one child (a plain subprocess: fleet
processes are daemonic and cannot start multiprocessing children), which runs
the agent's own decoder (`hangwatch.analyzer.packed.pack`).

Frames on the pipes, no pickle: a request is a count, then per tail its rank,
name and bytes; an answer is a length (0: nothing decoded) and the bytes.
"""

from __future__ import annotations

import contextlib
import os
import struct
import subprocess
import sys
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import IO

_U32 = struct.Struct("<I")
_ROOT = Path(__file__).resolve().parents[3]


def _read_exact(f: IO[bytes], n: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise EOFError(f"pipe closed after {len(data)} of {n} bytes")
    return data


def _u32(f: IO[bytes]) -> int:
    (v,) = _U32.unpack(_read_exact(f, _U32.size))
    return v


class Packer:
    """One child decoding nodes' tails in order; `submit` returns a future."""

    def __init__(self) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-c", "from tests.support.simagents.packer import serve; serve()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=_ROOT,
            # The repository first, the caller's path after it (an install
            # made with --target lives there).
            env={
                **os.environ,
                "PYTHONPATH": os.pathsep.join(
                    p for p in (str(_ROOT), os.environ.get("PYTHONPATH", "")) if p
                ),
            },
        )
        # Writers queue their future and write under one lock (answers come
        # back in that order); the reader takes futures under another, never
        # held across pipe I/O: a writer blocked on a full pipe while holding
        # the reader's lock once stopped both ends (the child blocked writing).
        self._write_lock = threading.Lock()
        self._lock = threading.Lock()
        self._waiting: list[Future[bytes | None]] = []
        self._reader = threading.Thread(target=self._read, name="sim-packer", daemon=True)
        self._reader.start()

    def submit(self, tails: list[tuple[int, str, bytes]]) -> Future[bytes | None]:
        fut: Future[bytes | None] = Future()
        frame = [_U32.pack(len(tails))]
        for rank, name, data in tails:
            raw = name.encode()
            frame += [_U32.pack(rank), _U32.pack(len(raw)), raw, _U32.pack(len(data)), data]
        assert self._proc.stdin is not None
        with self._write_lock:
            with self._lock:
                self._waiting.append(fut)
            self._proc.stdin.write(b"".join(frame))
            self._proc.stdin.flush()
        return fut

    def _read(self) -> None:
        out = self._proc.stdout
        assert out is not None
        try:
            while True:
                n = _u32(out)
                data = _read_exact(out, n) if n else None
                with self._lock:
                    fut = self._waiting.pop(0)
                fut.set_result(data)
        except (EOFError, OSError, ValueError) as e:
            with self._lock:
                waiting, self._waiting = self._waiting, []
            for fut in waiting:
                fut.set_exception(RuntimeError(f"simulated packer stopped: {e}"))

    def close(self) -> None:
        """Stop the child now: nodes still queued are not needed any more
        (their futures fail), and finishing them could take minutes."""
        self._proc.kill()
        self._proc.wait(timeout=30)
        if self._proc.stdin is not None:
            with contextlib.suppress(OSError):
                self._proc.stdin.close()
        self._reader.join(timeout=30)


def serve() -> None:
    """The child: frames in on stdin, decoded members out on stdout, until EOF."""
    from hangwatch.analyzer import packed

    inp, out = sys.stdin.buffer, sys.stdout.buffer
    while True:
        head = inp.read(_U32.size)
        if not head:
            return
        (n,) = _U32.unpack(head)
        tails = []
        try:
            for _ in range(n):
                rank = _u32(inp)
                name = _read_exact(inp, _u32(inp)).decode()
                tails.append((rank, name, _read_exact(inp, _u32(inp))))
        except EOFError:
            return  # the fleet process stopped mid-request: nobody waits for it
        got = packed.pack(tails) or b""
        out.write(_U32.pack(len(got)) + got)
        out.flush()
