"""A real CPU collective backend that torch records the way it records 2.15's default NCCL.

torch 2.15 attaches its backend-agnostic `FlightRecorderHook` to every group
whose backend does not record itself (gloo and legacy NCCL do). This backend
is what the tests use to exercise that path without a GPU:

* it moves data through the job's own c10d store (TCPStore), never through
  gloo, so nothing lands in the gloo recorder instance;
* every collective completes **asynchronously**: the call returns a Work built
  from a future that a worker thread completes once every peer's contribution
  has arrived, exactly as an NCCL call returns before its kernel finishes. On
  such a backend the hook marks entries `retired` at return, long before
  completion; hangwatch must not take that for "done".

Ops match across ranks by (backend-local op counter, op name), so a rank that
skips a collective, or calls another op at the same position, leaves its peers
blocked, the way a real hang does. Supported: all_reduce (SUM, MAX, MIN),
broadcast, all_gather, all_gather_into_tensor, barrier, send and recv.

Register it with `register()` before `init_process_group(BACKEND_NAME)`.
The job's processes need nothing else.
"""

from __future__ import annotations

import io
import queue
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

BACKEND_NAME = "hwstore"
# How often a blocked worker wakes to check for shutdown.
_POLL = timedelta(seconds=1)


def register(name: str = BACKEND_NAME) -> str:
    """Register the backend with torch (idempotent). Returns its name."""
    import torch.distributed as dist

    if name.lower() not in dist.Backend.backend_list:
        dist.Backend.register_backend(name, _create, devices=["cpu"])
    return name


def pending_collectives() -> list[dict[str, object]]:
    """Collectives this process submitted to the backend and that have not finished,
    per group: {"group", "seq", "op"}, oldest first."""
    import torch
    import torch.distributed as dist

    cls = _make_class()
    out: list[dict[str, object]] = []
    for pg, name in dist.distributed_c10d._world.pg_names.items():
        try:
            b = pg._get_backend(torch.device("cpu"))
        except RuntimeError:  # torch: this group has no CPU backend; none of ours
            continue
        if isinstance(b, cls):
            with b._lock:
                out += [
                    {"group": str(name), "seq": s, "op": op} for s, op in sorted(b.pending.items())
                ]
    return out


def _create(store: Any, rank: int, size: int, timeout: timedelta) -> Any:
    return _make_class()(store, rank, size, timeout)


_CLASS: Any = None
# (work, its future, its collective seq or None for p2p)
_Item = tuple[Callable[[], Any], Any, "int | None"]


def _make_class() -> Any:
    """The Backend subclass, built on first use so importing this module needs no torch."""
    global _CLASS
    if _CLASS is not None:
        return _CLASS
    import torch
    import torch.distributed as dist
    from torch._C._distributed_c10d import Backend as C10dBackend

    # Private binding, absent from torch's type stubs.
    _create_work_from_future: Callable[[Any], Any] = (
        torch._C._distributed_c10d._create_work_from_future  # type: ignore[attr-defined]
    )

    def _to_bytes(t: torch.Tensor) -> bytes:
        buf = io.BytesIO()
        torch.save(t.detach().contiguous().clone(), buf)
        return buf.getvalue()

    def _from_bytes(b: bytes) -> torch.Tensor:
        # Peers are this job's own ranks; weights_only refuses anything but tensors.
        return torch.load(io.BytesIO(b), weights_only=True)

    # Pairs, not a dict: opts.reduceOp is a boxed ReduceOp; its `.op` compares equal to these.
    reducers: list[tuple[Any, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]] = [
        (dist.ReduceOp.SUM, torch.add),
        (dist.ReduceOp.MAX, torch.maximum),
        (dist.ReduceOp.MIN, torch.minimum),
    ]

    class StoreBackend(C10dBackend):  # type: ignore[misc]
        def __init__(self, store: Any, rank: int, size: int, timeout: timedelta) -> None:
            super().__init__(rank, size)
            self._store = store
            self._rank = rank
            self._size = size
            self._seq = 0
            self._p2p: dict[tuple[int, int], int] = {}
            self._lock = threading.Lock()
            self._q: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
            self._closed = threading.Event()
            # seq -> op of collectives submitted and not finished: the harness's
            # ground truth of what this rank is blocked in (FR cannot say here).
            self.pending: dict[int, str] = {}
            self._worker = threading.Thread(
                target=self._run, name=f"{BACKEND_NAME}-worker", daemon=True
            )
            self._worker.start()

        # The name torch's trampoline calls; the hook keys its recorder instance on it.
        def getBackendName(self) -> str:
            return BACKEND_NAME

        # --- machinery ----------------------------------------------------

        def _run(self) -> None:
            while True:
                item = self._q.get()
                if item is None:
                    return
                fn, fut, seq = item
                try:
                    result = fn()
                except Exception as e:  # surfaces in the caller's wait()
                    fut.set_exception(e)
                    continue
                if seq is not None:
                    with self._lock:
                        self.pending.pop(seq, None)
                fut.set_result(result)

        def _submit(self, fn: Callable[[], Any], seq: int | None = None) -> Any:
            fut: torch.futures.Future[Any] = torch.futures.Future()
            self._q.put((fn, fut, seq))
            return _create_work_from_future(fut)

        def _next(self, op: str) -> str:
            with self._lock:
                self._seq += 1
                self.pending[self._seq] = op
                return f"c/{self._seq}/{op}"

        @staticmethod
        def _seq_of(base: str) -> int:
            return int(base.split("/")[1])

        def _wait_key(self, key: str) -> bytes:
            while not self._closed.is_set():
                try:
                    self._store.wait([key], _POLL)
                except Exception as e:  # the store raises on its poll timeout
                    if "timeout" in str(e).lower() or "timed out" in str(e).lower():
                        continue
                    raise
                return bytes(self._store.get(key))
            raise RuntimeError(f"{BACKEND_NAME}: backend shut down while waiting for {key}")

        def _exchange(self, base: str, payload: bytes | None, sources: list[int]) -> list[bytes]:
            if payload is not None:
                self._store.set(f"{base}/{self._rank}", payload)
            out = [self._wait_key(f"{base}/{r}") for r in sources]
            # The last reader frees the round's keys; the store must not grow
            # with the job's length.
            if int(self._store.add(f"{base}/read", 1)) == self._size:
                for r in range(self._size):
                    self._store.delete_key(f"{base}/{r}")
                self._store.delete_key(f"{base}/read")
            return out

        # --- collectives ---------------------------------------------------

        def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> Any:
            base = self._next("all_reduce")
            red = next((fn for op, fn in reducers if op == opts.reduceOp.op), None)
            if red is None:
                raise ValueError(f"{BACKEND_NAME}: unsupported reduce op {opts.reduceOp}")

            def run() -> list[torch.Tensor]:
                for t in tensors:
                    parts = self._exchange(base, _to_bytes(t), list(range(self._size)))
                    acc = _from_bytes(parts[0])
                    for p in parts[1:]:
                        acc = red(acc, _from_bytes(p))
                    t.copy_(acc)
                return tensors

            return self._submit(run, self._seq_of(base))

        def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> Any:
            base = self._next("broadcast")
            root = int(opts.rootRank)

            def run() -> list[torch.Tensor]:
                for t in tensors:
                    mine = _to_bytes(t) if self._rank == root else b""
                    parts = self._exchange(base, mine, list(range(self._size)))
                    if self._rank != root:
                        t.copy_(_from_bytes(parts[root]))
                return tensors

            return self._submit(run, self._seq_of(base))

        def allgather(
            self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any
        ) -> Any:
            base = self._next("all_gather")

            def run() -> list[torch.Tensor]:
                parts = self._exchange(base, _to_bytes(inputs[0]), list(range(self._size)))
                for out, p in zip(outputs[0], parts, strict=True):
                    out.copy_(_from_bytes(p))
                return outputs[0]

            return self._submit(run, self._seq_of(base))

        def _allgather_base(self, output: torch.Tensor, inp: torch.Tensor, opts: Any) -> Any:
            base = self._next("all_gather_into_tensor")

            def run() -> list[torch.Tensor]:
                parts = self._exchange(base, _to_bytes(inp), list(range(self._size)))
                output.copy_(torch.cat([_from_bytes(p).reshape(-1) for p in parts]).view_as(output))
                return [output]

            return self._submit(run, self._seq_of(base))

        # torch 2.15 routes all_gather_into_tensor here; older torch uses _allgather_base.
        def all_gather_single(self, output: torch.Tensor, inp: torch.Tensor, opts: Any) -> Any:
            return self._allgather_base(output, inp, opts)

        def barrier(self, opts: Any) -> Any:
            base = self._next("barrier")

            def run() -> list[torch.Tensor]:
                self._exchange(base, b"1", list(range(self._size)))
                return []

            return self._submit(run, self._seq_of(base))

        # --- point to point --------------------------------------------------

        def _p2p_key(self, src: int, dst: int) -> str:
            with self._lock:
                n = self._p2p.get((src, dst), 0) + 1
                self._p2p[(src, dst)] = n
            return f"p/{src}/{dst}/{n}"

        def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Any:
            key = self._p2p_key(self._rank, dst)
            data = _to_bytes(tensors[0])

            def run() -> list[torch.Tensor]:
                self._store.set(key, data)
                return tensors

            return self._submit(run)

        def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Any:
            key = self._p2p_key(src, self._rank)

            def run() -> list[torch.Tensor]:
                tensors[0].copy_(_from_bytes(self._wait_key(key)))
                self._store.delete_key(key)
                return tensors

            return self._submit(run)

        def shutdown(self) -> None:
            self._closed.set()
            self._q.put(None)

    _CLASS = StoreBackend
    return _CLASS


def unsupported_reason() -> str | None:
    """Why this torch cannot record the backend through FlightRecorderHook, or None.

    A feature probe, not a version check: the hook and the per-backend
    recorder instances arrived together (torch 2.15).
    """
    try:
        import torch._C._distributed_c10d as c
        import torch.distributed.distributed_c10d as c10d
    except ImportError as e:
        return f"torch.distributed is not available: {e}"
    if not hasattr(c, "FlightRecorderHook"):
        return "this torch has no FlightRecorderHook (hook-recorded backends arrived in torch 2.15)"
    if not hasattr(c10d._world, "pg_flight_recorder_hooks"):
        return "this torch does not attach FlightRecorderHook to process groups"
    return None
