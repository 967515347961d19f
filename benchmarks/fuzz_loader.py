"""Coverage-guided fuzzing (atheris/libFuzzer) of the FR dump parser and loader.

    python benchmarks/fuzz_loader.py --seconds 120 [--corpus-out tests/fuzz_corpus/loader]

Each input is one rank's dump file, bytes exactly as a hostile or broken
writer could leave them. The contract under test: `parse_dump_bytes` returns
a normalized dump or raises `DumpFormatError` (one line), and `load_dumps` +
`analyze` on a directory holding that file beside a good dump report the bad
file in `errors` and still diagnose. Any other exception is a finding:
libFuzzer stops and writes the input to `crash-*` in the working dir.

Seeds are the golden hang-zoo dumps (pickle and JSON). When the run ends,
the inputs that added coverage are merged (libFuzzer `-merge=1`) into
`--corpus-out`, capped in number and size, for `tests/hardening` to replay.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GOLDEN = REPO / "tests" / "golden"
MAX_KEEP = 60
MAX_KEEP_BYTES = 64 * 1024


def check_dump(data: bytes, workdir: Path, *, full: bool = True) -> None:
    """The loader's contract on one input; raises on a violation. With
    `full=False` (the fuzz loop: ~100x faster) only the parser runs; the
    replay test takes every kept input through the directory loader and
    the analyzer too."""
    from hangwatch.analyzer import analyze, load_dumps
    from hangwatch.analyzer.parse import parse_dump_bytes
    from hangwatch.analyzer.sniff import DumpFormatError

    refused = False
    try:
        d = parse_dump_bytes(data)
    except DumpFormatError as e:
        if "\n" in str(e) or not str(e):
            raise AssertionError(f"DumpFormatError must be one non-empty line: {e!r}") from e
        refused = True
    else:
        if not isinstance(d.get("entries"), list):
            raise AssertionError("parsed dump without an entries list")
    if not full:
        return
    for p in workdir.iterdir():
        p.unlink()
    (workdir / "fr_trace_rank_0").write_bytes(data)
    shutil.copyfile(GOLDEN / "skip" / "rank_1" / "fr_trace_rank_1", workdir / "fr_trace_rank_1")
    loaded = load_dumps(workdir, workers=1)
    if 1 not in loaded.ranks_loaded:
        raise AssertionError("a bad neighbour stopped a good dump from loading")
    if refused and 0 in loaded.ranks_loaded:
        raise AssertionError("the loader took a dump the parser refuses")
    analyze(loaded)


def seeds() -> list[Path]:
    return sorted(p for p in GOLDEN.rglob("fr_trace_rank_*") if p.is_file())


def _fuzz(argv: list[str]) -> None:
    import atheris

    with atheris.instrument_imports(include=["hangwatch"]):
        import hangwatch.analyzer.loader
        import hangwatch.analyzer.parse

        import hangwatch.safepickle  # noqa: F401
    work = Path(tempfile.mkdtemp(prefix="fuzz-loader-"))

    def one(data: bytes) -> None:
        check_dump(data, work, full=False)

    atheris.Setup(argv, one)
    atheris.Fuzz()


def main() -> int:
    return fuzzer_main(Path(__file__), __doc__, _fuzz, seeds)


def fuzzer_main(
    script: Path,
    doc: str | None,
    fuzz: Callable[[list[str]], None],
    seed_files: Callable[[], list[Path]],
) -> int:
    """A fuzzer script's command line: `--child ARGS` is the libFuzzer process `run` starts
    (it calls `fuzz`); anything else parses the options and runs it over `seed_files()`."""
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        fuzz([sys.argv[0], *sys.argv[2:]])
        return 0
    p = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--seconds", type=int, default=120)
    p.add_argument("--corpus-out", type=Path, default=None)
    p.add_argument("--workdir", type=Path, default=None, help="Keep the live corpus here.")
    a = p.parse_args()
    return run(script, a.seconds, a.corpus_out, a.workdir, seed_files())


def keep_corpus(live: Path, artifacts: Path, out: Path) -> int:
    """Copy what the run found into `out`: every crash/oom/timeout artifact,
    and the smallest inputs libFuzzer added (seeds are in the repo already),
    capped in number and size so the replay test stays quick."""
    out.mkdir(parents=True, exist_ok=True)
    found = [p for p in live.iterdir() if not p.name.startswith("seed-")]
    small = sorted(
        (p for p in found if p.stat().st_size <= MAX_KEEP_BYTES), key=lambda p: p.stat().st_size
    )
    keep = small[:MAX_KEEP] + sorted(artifacts.iterdir())
    for p in keep:
        shutil.copyfile(p, out / p.name)
    return len(keep)


def run(
    script: Path,
    seconds: int,
    corpus_out: Path | None,
    workdir: Path | None,
    seed_files: list[Path],
) -> int:
    """Shared by both fuzzers: seed, fuzz for `seconds`, merge into `corpus_out`."""
    work = workdir or Path(tempfile.mkdtemp(prefix=f"{script.stem}-"))
    live = work / "corpus"
    live.mkdir(parents=True, exist_ok=True)
    for i, s in enumerate(seed_files):
        shutil.copyfile(s, live / f"seed-{i}")
    artifacts = work / "artifacts"
    artifacts.mkdir(exist_ok=True)
    cmd = [
        sys.executable, str(script), "--child", str(live), f"-max_total_time={seconds}",
        f"-artifact_prefix={artifacts}/", "-rss_limit_mb=4096", "-timeout=20", "-print_final_stats=1",
    ]  # fmt: skip
    rc = subprocess.call(cmd)
    crashes = sorted(artifacts.iterdir())
    print(f"{script.name}: exit {rc}; live corpus {len(list(live.iterdir()))} inputs; "
          f"artifacts {[c.name for c in crashes]}")  # fmt: skip
    if corpus_out is not None:
        kept = keep_corpus(live, artifacts, corpus_out)
        print(f"kept {kept} inputs in {corpus_out}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
