"""`hangwatch analyze DUMP_DIR`: diagnose flight-recorder dumps offline.

Exit status: 0 whenever the analysis ran (whatever it found); 2 when the
input is unusable (no such path, no loadable dump), with one line on stderr.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "analyze",
        help="Diagnose flight-recorder dumps (a directory or an incident bundle).",
        description="Find the rank and the collective a job is stuck on, from its FR dumps.",
    )
    p.add_argument(
        "dump_dir",
        metavar="DUMP_DIR",
        help="directory with one FR dump per rank, or an incident bundle",
    )
    p.add_argument(
        "--world-size",
        default=None,
        metavar="N",
        help="number of ranks; ranks without a dump are reported missing",
    )
    p.add_argument(
        "--prefix", default=None, help="only read dump files whose name starts with this"
    )
    p.add_argument(
        "--json", action="store_true", help="print the hangwatch.report/1 JSON document only"
    )
    p.add_argument(
        "--selected-ranks",
        default=None,
        metavar="RANKS",
        help="load only these ranks, e.g. 0,3,5-7",
    )
    p.add_argument(
        "--group", default=None, metavar="NAME", help="analyze one process group (by name, e.g. 0)"
    )
    p.add_argument(
        "--html",
        default=None,
        metavar="PATH",
        help="also write a self-contained HTML report to PATH",
    )
    p.add_argument(
        "--trace",
        default=None,
        metavar="PATH",
        help="also write the ranks' timelines to PATH as Chrome/Perfetto trace-event JSON",
    )
    p.set_defaults(func=run)
    return p


def _fail(msg: str) -> int:
    sys.stderr.write(f"hangwatch analyze: {msg}\n")
    return 2


def _world_size(value: str | int | None) -> int | None:
    """--world-size: a positive int up to formats.MAX_RANKS, checked before
    anything is sized by it."""
    from hangwatch import formats

    if value is None:
        return None
    text = str(value).strip()
    if not text.lstrip("-").isdigit() or len(text) > 12:
        raise ValueError(f"--world-size must be a whole number, not {text[:40]!r}")
    n = int(text)
    if n <= 0:
        raise ValueError("--world-size must be positive")
    if n > formats.MAX_RANKS:
        raise ValueError(f"--world-size {n} is over the maximum of {formats.MAX_RANKS} ranks")
    return n


def run(ns: argparse.Namespace) -> int:
    # Arguments are checked before pandas is imported: a bad one fails fast.
    from hangwatch.analyzer.discovery import parse_ranks

    path = Path(ns.dump_dir)
    if not path.exists():
        return _fail(f"no such file or directory: {path}")
    try:
        world_size = _world_size(ns.world_size)
    except ValueError as e:
        return _fail(str(e))
    try:
        selected = parse_ranks(ns.selected_ranks) if ns.selected_ranks else None
    except ValueError as e:
        return _fail(f"bad --selected-ranks: {e}")
    from hangwatch.analyzer.diagnose import analyze
    from hangwatch.analyzer.loader import load_dumps

    on_progress = None
    if not ns.json:
        from hangwatch.analyzer.render import load_progress_bar

        on_progress = load_progress_bar()
    try:
        loaded = load_dumps(
            path,
            prefix=ns.prefix,
            world_size=world_size,
            selected_ranks=selected,
            on_progress=on_progress,
        )
    except OSError as e:
        return _fail(f"cannot read {path}: {e.strerror or e}")
    if not loaded.ranks_loaded and not loaded.rank_meta:
        why = (
            f"; {len(loaded.errors)} file(s) could not be read, first: {loaded.errors[0].file}: {loaded.errors[0].error}"
            if loaded.errors
            else ""
        )
        return _fail(f"no loadable flight-recorder dumps under {path}{why}")
    if ns.group is not None and ns.group not in loaded.groups:
        from hangwatch.analyzer.text import group_sort_key

        return _fail(
            f"no group named {ns.group!r}; groups: "
            f"{', '.join(sorted(loaded.groups, key=group_sort_key)) or 'none'}"
        )
    report = analyze(loaded, world_size=world_size, group=ns.group)

    if ns.html:
        # The HTML report is the dashboard's incident page; the `hangwatch`
        # entry point, where the roles meet, supplies it (the analyzer is a
        # library and imports no UI of the coordinator's).
        write_html = getattr(ns, "write_html", None)
        if write_html is None:
            return _fail("--html is not available here: run it as `hangwatch analyze`")
        try:
            write_html(report, ns.html, f"hangwatch: {path.name}")
        except ImportError as e:
            return _fail(f"--html is not available: {e}")

    if getattr(ns, "trace", None):
        from hangwatch.analyzer.trace import build_trace, write_trace

        try:
            write_trace(build_trace(loaded, report), ns.trace)
        except OSError as e:
            return _fail(f"cannot write {ns.trace}: {e.strerror or e}")

    if ns.json:
        sys.stdout.write(report.to_json() + "\n")
        return 0
    from hangwatch.analyzer.render import render
    from rich.console import Console

    render(report, Console())
    if ns.html:
        Console(stderr=True).print(f"[dim]HTML report written to {ns.html}[/dim]")
    if getattr(ns, "trace", None):
        Console(stderr=True).print(f"[dim]Trace written to {ns.trace} (opens in Perfetto)[/dim]")
    return 0
