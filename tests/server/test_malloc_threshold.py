"""The coordinator pins glibc's mmap threshold: a big block freed must not make
the next ones come from the heap (server.runtime.pin_mmap_threshold).

Each case runs in its own interpreter: the setting is per process, and glibc's
dynamic threshold moves only once a mapped block is freed."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys

import pytest
from hangwatch.server.runtime import MMAP_THRESHOLD_ENV

pytestmark = pytest.mark.skipif(
    not hasattr(ctypes.CDLL(None), "mallinfo2"), reason="needs glibc 2.33 or later (mallinfo2)"
)

# Frees a mapped 1 MiB block (glibc then raises its threshold to 1 MiB unless
# it is pinned), then asks for 512 KiB: mapped for itself, or from the heap?
_PROBE = r"""
import ctypes, json, sys
from hangwatch.server.runtime import pin_mmap_threshold

pinned = pin_mmap_threshold() if sys.argv[1] == "pin" else False

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split())]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
libc.free(libc.malloc(1 << 20))
before = libc.mallinfo2().hblks
block = libc.malloc(512 * 1024)
mapped = libc.mallinfo2().hblks - before
libc.free(block)
print(json.dumps({"pinned": pinned, "mapped": mapped}))
"""


def _probe(mode: str, env_value: str | None = None) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if k != MMAP_THRESHOLD_ENV}
    if env_value is not None:
        env[MMAP_THRESHOLD_ENV] = env_value
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, mode],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.timeout(120)
def test_pinned_a_big_block_is_mapped_even_after_a_bigger_one_was_freed() -> None:
    assert _probe("pin") == {"pinned": True, "mapped": 1}


@pytest.mark.timeout(120)
def test_unpinned_glibc_serves_it_from_the_heap() -> None:
    # What the pin is for: the same sequence without it.
    assert _probe("none") == {"pinned": False, "mapped": 0}


@pytest.mark.timeout(120)
def test_the_operators_setting_is_left_alone() -> None:
    # 4 MiB set by the operator: nothing pinned, 512 KiB comes from the heap.
    assert _probe("pin", env_value=str(4 << 20)) == {"pinned": False, "mapped": 0}
