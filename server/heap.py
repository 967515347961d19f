"""The coordinator process's heap: large blocks get memory maps of their own.

Why: the straggler monitor scores each tick with numpy arrays of one value per
(group, rank) reading, 160 KB each at 4,096 ranks in 5 groups (1.3 MB at
32,768). glibc maps a block that large only until the first mapped block is
freed; from then on its threshold follows the largest block freed (up to 32
MiB), and the tick's arrays come from the heap. The holes they leave are kept
apart by small long-lived blocks allocated between ticks, so glibc cannot give
them back, and they stay resident as free heap: 11 MB of it at 4,096 ranks,
against 3 MB just after registration (mallinfo2; docs/benchmarks.md, "The
coordinator maps its large blocks itself").

A fixed threshold maps every block of `threshold_kb` or more and unmaps it when
freed, so a tick's arrays are resident only while it is scored: 1.5 KB a rank
less on the healthy 4,096-rank job (0.9 at 16,384), and scoring's CPU within
the noise of interleaved runs. Set here rather than left to glibc's
environment variable so that it is the default; a variable an operator set wins.
"""

from __future__ import annotations

import ctypes
import os
from typing import Final

# glibc's own variable for the same setting: set by an operator, it stands.
ENV_VAR: Final = "MALLOC_MMAP_THRESHOLD_"
# mallopt's parameter number for the threshold (glibc's malloc.h).
_M_MMAP_THRESHOLD: Final = -3


def map_large_blocks(threshold_kb: int) -> str:
    """Fix this process's mmap threshold at `threshold_kb` KiB (glibc's
    M_MMAP_THRESHOLD); 0 leaves glibc's moving threshold. Returns what was done,
    in words for the log: a C library without mallopt, or one that refuses the
    value, is left as it was, and says so."""
    if threshold_kb <= 0:
        return "glibc's moving mmap threshold left as it is (--mmap-threshold-kb 0)"
    if os.environ.get(ENV_VAR):
        return f"mmap threshold left to {ENV_VAR}={os.environ[ENV_VAR]} from the environment"
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return "mmap threshold left as it is: this C library has no mallopt"
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    if mallopt(_M_MMAP_THRESHOLD, threshold_kb * 1024) != 1:
        return f"mmap threshold left as it is: mallopt refused {threshold_kb} KiB"
    return f"blocks of {threshold_kb} KiB and more are mapped and unmapped on their own (mallopt)"
