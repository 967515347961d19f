"""Replay the inputs the atheris fuzzers kept (tests/fuzz_corpus) through the full loader.

Each loader input goes through `parse_dump_bytes` and then, as one rank of a
two-rank dump directory, through `load_dumps` and `analyze`; each bundle
input is laid out as rank 0 of a bundle and loaded and analysed. The
contract is the fuzzers' own (benchmarks/fuzz_loader.py, fuzz_bundle.py): a
clean per-file error or a result, never an exception, and the good rank
always loads. Crashes the fuzzers found are kept here after the fix, as
regressions.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CORPUS = REPO / "tests" / "fuzz_corpus"


# The replay runs in a child limited to this much address space, so that an
# input that makes the parser allocate gigabytes fails cleanly there instead
# of taking the CI machine down, and is reported.
ADDRESS_SPACE = 3 << 30
CHILD = r"""
import json, resource, sys
from pathlib import Path
resource.setrlimit(resource.RLIMIT_AS, (int(sys.argv[3]), int(sys.argv[3])))
sys.path.insert(0, sys.argv[1])
kind, work = sys.argv[2], Path(sys.argv[4])
from hangwatch.analyzer.parse import parse_dump_bytes
from hangwatch.analyzer.sniff import DumpFormatError
import fuzz_loader, fuzz_bundle
out = {}
for p in sorted(Path(sys.argv[5]).iterdir()):
    data = p.read_bytes()
    try:
        if kind == "loader":
            try:
                parse_dump_bytes(data)
            except DumpFormatError as e:
                if "more memory" in str(e):
                    out[p.name] = "memory-bomb"
                    continue
            d = work / p.name
            d.mkdir()
            fuzz_loader.check_dump(data, d, full=True)
        else:
            fuzz_bundle.check_bundle(data, work / p.name)
        out[p.name] = "ok"
    except Exception as e:
        out[p.name] = f"{type(e).__name__}: {e}"[:500]
print(json.dumps(out))
"""


def _replay(kind: str, tmp_path: Path) -> dict[str, str]:
    src = CORPUS / kind
    n = sum(1 for p in src.iterdir() if p.is_file())
    assert n >= 5, f"the {kind} corpus is missing"
    r = subprocess.run(
        [sys.executable, "-c", CHILD, str(REPO / "benchmarks"), kind, str(ADDRESS_SPACE),
         str(tmp_path), str(src)],
        capture_output=True, text=True, timeout=110, cwd=REPO,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    results: dict[str, str] = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(results) == n
    return results


def _verdict(results: dict[str, str]) -> None:
    # "memory-bomb": a few KB whose memo index or length makes CPython's C
    # unpickler allocate gigabytes. Under an address-space cap that is a clean
    # per-file error, and the coordinator always analyses in a capped child
    # (server/incidents/analysis.py; tests/server/test_isolated_analysis.py), so that is
    # the contract here too.
    broken = {k: v for k, v in results.items() if v not in ("ok", "memory-bomb")}
    assert not broken, broken


@pytest.mark.timeout(120)
def test_loader_corpus_replays_cleanly(tmp_path: Path) -> None:
    _verdict(_replay("loader", tmp_path))


@pytest.mark.timeout(120)
def test_bundle_corpus_replays_cleanly(tmp_path: Path) -> None:
    _verdict(_replay("bundle", tmp_path))
