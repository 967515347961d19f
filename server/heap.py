"""The coordinator process's heap: the free pages a straggler tick leaves go back.

Why: the straggler monitor scores each tick with numpy arrays of one value per
(group, rank) reading, 160 KB each at 4,096 ranks in 5 groups (1.3 MB at
32,768). glibc maps a block that large only until the first mapped block is
freed; from then on its threshold follows the largest block freed (up to 32
MiB), and the tick's arrays come from the heap. Small long-lived blocks
allocated between ticks keep the holes they leave apart, so the heap cannot
shrink, and the holes stay resident as free heap: 11 MB of it at 4,096 ranks,
against 3 MB just after registration (mallinfo2). Right after a tick, while its
holes are whole, `malloc_trim(0)` hands their pages back to the kernel.

Measured on healthy jobs (docs/benchmarks.md, "The coordinator gives back what
a straggler tick leaves"): 1.4 KB a rank less at 4,096 ranks, 0.5 at 16,384;
0.2-0.7 ms a trim, and about 0.006 of a core at 4,096 ranks for the next tick
faulting its pages in again. Fixing glibc's mmap threshold at 64 KiB instead
took as much off, but it mapped every upload chunk too: the coordinator's CPU
through collection grew 10% at 4,096 ranks and 18% at 32,768, its system time
doubled.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable


class HeapTrim:
    """glibc's `malloc_trim(0)`, where the C library has it; nothing elsewhere."""

    def __init__(self) -> None:
        trim: Callable[[int], int] | None
        try:
            fn = ctypes.CDLL(None).malloc_trim
        except (OSError, AttributeError):
            trim = None
        else:
            fn.argtypes = (ctypes.c_size_t,)
            fn.restype = ctypes.c_int
            trim = fn
        self._trim = trim

    def describe(self) -> str:
        """What the process does with its heap, in words for the log."""
        if self._trim is None:
            return "this C library has no malloc_trim: free heap stays with the allocator"
        return "free pages given back after each straggler tick (malloc_trim)"

    def __call__(self) -> bool:
        """Give the heap's free pages back; True when any were."""
        return self._trim is not None and self._trim(0) == 1
