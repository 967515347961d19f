"""server.heap in a fresh interpreter: what glibc keeps resident, and what a trim gives back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from hangwatch.server.heap import HeapTrim

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or os.confstr("CS_GNU_LIBC_VERSION") is None,
    reason="glibc's allocator only",
)

# A coordinator's straggler tick in miniature. Freeing one mapped 8 MiB block
# raises glibc's moving threshold, so 40 arrays of 256 KiB then come from the
# heap, each followed by a small block that outlives them (as the registry's
# and gRPC's do between ticks). The arrays are freed, and the RSS read: after
# the free, a second time, and after a trim where the probe is asked for one.
PROBE = textwrap.dedent(
    """
    import json, os, sys
    from hangwatch.server.heap import HeapTrim

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    big = bytearray(8 << 20)
    del big
    start = rss()
    arrays, kept = [], []
    for _ in range(40):
        arrays.append(bytearray(256 << 10))
        kept.append(bytes(1000))
    held = rss()
    del arrays
    out = {"held": held - start, "freed": rss() - start, "again": rss() - start}
    if sys.argv[1] == "trim":
        out["trimmed"] = HeapTrim()()
        out["after_trim"] = rss() - start
    print(json.dumps(out))
    """
)
MIB = 1 << 20


def _probe(mode: str) -> dict[str, int]:
    res = subprocess.run(
        [sys.executable, "-c", PROBE, mode],
        capture_output=True,
        text=True,
        env={k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")},
        timeout=60,
        check=True,
    )
    out: dict[str, int] = json.loads(res.stdout)
    return out


@pytest.mark.timeout(90)
def test_a_ticks_freed_arrays_stay_resident_until_trimmed() -> None:
    got = _probe("trim")
    assert got["held"] >= 9 * MIB, got  # the 10 MiB of arrays were written
    # The control: freed, and still resident, read twice.
    assert got["freed"] >= 8 * MIB and got["again"] >= 8 * MIB, got
    assert got["trimmed"] is True, got
    assert got["after_trim"] <= 2 * MIB, got


def test_this_c_library_has_a_trim_and_says_so() -> None:
    assert HeapTrim().describe() == "free pages given back after each straggler tick (malloc_trim)"
