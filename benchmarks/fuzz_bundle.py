"""Coverage-guided fuzzing (atheris/libFuzzer) of the incident-bundle reader.

    python benchmarks/fuzz_bundle.py --seconds 120 [--corpus-out tests/fuzz_corpus/bundle]

An input is one rank's part of a bundle plus the incident file, as four
sections separated by SEP: `meta.json`, `incident.json`, `stacks.txt` and the
FR dump. `write_bundle` lays them out as `rank_0/` of a bundle whose
`rank_1/` is a good golden rank. The contract: `load_dumps` raises nothing
(every per-file problem lands in `errors`), rank 1 still loads, and
`analyze` returns a report. Anything else is a finding (`crash-*` file).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fuzz_loader import GOLDEN, fuzzer_main

from hangwatch.formats import IncidentDoc

SEP = b"\n--8<--\n"
GOOD = GOLDEN / "skip"


def write_bundle(data: bytes, bundle: Path) -> None:
    """Lay the input out as a two-rank bundle (rank 0 fuzzed, rank 1 golden)."""
    parts = [*data.split(SEP, 3), b"", b"", b""][:4]
    meta, incident, stacks, dump = parts
    if bundle.exists():
        shutil.rmtree(bundle)
    r0 = bundle / "rank_0"
    r0.mkdir(parents=True)
    (r0 / "meta.json").write_bytes(meta)
    (bundle / "incident.json").write_bytes(incident)
    (r0 / "stacks.txt").write_bytes(stacks)
    (r0 / "fr_trace_rank_0").write_bytes(dump)
    shutil.copytree(GOOD / "rank_1", bundle / "rank_1")


def check_bundle(data: bytes, bundle: Path) -> None:
    from hangwatch.analyzer import analyze, load_dumps

    write_bundle(data, bundle)
    loaded = load_dumps(bundle, workers=1)
    if 1 not in loaded.ranks_loaded:
        raise AssertionError("a bad neighbour stopped a good rank from loading")
    analyze(loaded)


def seeds(out: Path) -> list[Path]:
    """Golden rank 0 of a few scenarios, with a made-up incident.json."""
    files = []
    incident = IncidentDoc(
        id="x",
        job_id="j",
        reason="r",
        ranks_expected=(0, 1),
        ranks_dumped=(1,),
        ranks_unreachable={0: "agent unreachable"},
    ).to_bytes()
    for name in ("skip", "frozen", "gil", "subgroup"):
        r0 = GOLDEN / name / "rank_0"
        if not (r0 / "meta.json").exists():
            continue
        dump = r0 / "fr_trace_rank_0"
        parts = [
            (r0 / "meta.json").read_bytes(),
            incident,
            (r0 / "stacks.txt").read_bytes() if (r0 / "stacks.txt").exists() else b"",
            dump.read_bytes() if dump.exists() else b"",
        ]
        p = out / f"seed-{name}"
        p.write_bytes(SEP.join(parts))
        files.append(p)
    return files


def _fuzz(argv: list[str]) -> None:
    import atheris

    with atheris.instrument_imports(include=["hangwatch"]):
        import hangwatch.analyzer.diagnose
        import hangwatch.analyzer.loader  # noqa: F401
    bundle = Path(tempfile.mkdtemp(prefix="fuzz-bundle-")) / "b"

    def one(data: bytes) -> None:
        check_bundle(data, bundle)

    atheris.Setup(argv, one)
    atheris.Fuzz()


def main() -> int:
    return fuzzer_main(
        Path(__file__),
        __doc__,
        _fuzz,
        lambda: seeds(Path(tempfile.mkdtemp(prefix="fuzz-bundle-seeds-"))),
    )


if __name__ == "__main__":
    sys.exit(main())
