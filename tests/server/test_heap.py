"""server.heap in a fresh interpreter: what glibc does with a large block after it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from hangwatch.server.heap import ENV_VAR

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or os.confstr("CS_GNU_LIBC_VERSION") is None,
    reason="glibc's allocator only",
)

# A block freed after glibc first maps one raises its moving threshold to that
# block's size: from then on a 256 KiB array comes from the heap, as a
# coordinator's per-tick arrays do once anything larger was freed. Then the
# setting, then one 256 KiB block: how much more is mapped (mallinfo2.hblkhd).
PROBE = textwrap.dedent(
    """
    import ctypes, json, sys
    from hangwatch.server.heap import map_large_blocks

    class Info(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in (
            "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"
        ).split()]

    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = Info
    big = bytearray(8 << 20)
    del big
    said = map_large_blocks(int(sys.argv[1]))
    before = libc.mallinfo2().hblkhd
    block = bytearray(256 << 10)
    print(json.dumps({"said": said, "mapped": libc.mallinfo2().hblkhd - before}))
    """
)


def _probe(threshold_kb: int, env: dict[str, str] | None = None) -> dict[str, object]:
    base = {k: v for k, v in os.environ.items() if k != ENV_VAR}
    res = subprocess.run(
        [sys.executable, "-c", PROBE, str(threshold_kb)],
        capture_output=True,
        text=True,
        env={**base, **(env or {})},
        timeout=60,
        check=True,
    )
    out: dict[str, object] = json.loads(res.stdout)
    return out


@pytest.mark.timeout(90)
def test_a_large_block_is_mapped_after_a_larger_one_was_freed() -> None:
    got = _probe(64)
    assert got["said"] == "blocks of 64 KiB and more are mapped and unmapped on their own (mallopt)"
    assert isinstance(got["mapped"], int) and got["mapped"] >= 256 << 10, got


@pytest.mark.timeout(90)
def test_without_it_glibc_serves_the_block_from_its_heap() -> None:
    """The control: what the coordinator did before (0 leaves glibc as it is)."""
    got = _probe(0)
    assert got["said"] == "glibc's moving mmap threshold left as it is (--mmap-threshold-kb 0)"
    assert got["mapped"] == 0, got


@pytest.mark.timeout(90)
def test_an_operators_malloc_variable_wins() -> None:
    """glibc's own variable, set to 16 MiB: the setting leaves it, and glibc
    keeps a 256 KiB block in the heap as the operator asked."""
    got = _probe(64, {ENV_VAR: str(16 << 20)})
    assert got["said"] == f"mmap threshold left to {ENV_VAR}={16 << 20} from the environment"
    assert got["mapped"] == 0, got
