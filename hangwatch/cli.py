"""`hangwatch` console script: one entry point, one subcommand per module.

Each command module exposes `add_parser(subparsers)`, which registers its
parser and sets `func` to a `run(ns) -> int`. Only the module of the command
being run is imported: `hangwatch analyze` on a laptop should not pay for
gRPC, the web stack or the demo's imports.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hangwatch import __version__

COMMANDS = {
    "analyze": "hangwatch.analyzer.cli",
    "server": "hangwatch.server.cli",
    "agent": "hangwatch.agent.cli",
    "relay": "hangwatch.server.relay",
    "run": "hangwatch.runner",
    "demo": "hangwatch.demo",
}
COMMAND_MODULES = tuple(COMMANDS.values())


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The full parser, or one with just the `only` command registered."""
    parser = argparse.ArgumentParser(
        prog="hangwatch",
        description="Find the rank and the collective a distributed PyTorch job is stuck on.",
    )
    parser.add_argument("--version", action="version", version=f"hangwatch {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module in COMMANDS.items():
        if only is None or name == only:
            p = importlib.import_module(module).add_parser(sub)
            if name == "analyze" and p is not None:
                p.set_defaults(write_html=_write_html)
    return parser


def _write_html(report: Any, path: str, title: str) -> None:
    """`hangwatch analyze --html`: the dashboard's incident page, as one file."""
    from hangwatch.server.web.offline import render_incident_html

    Path(path).write_text(render_incident_html(report, title=title), encoding="utf-8")


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    first = next((a for a in args if not a.startswith("-")), None)
    parser = build_parser(first if first in COMMANDS else None)
    ns = parser.parse_args(args)
    if not getattr(ns, "func", None):
        parser.print_help()
        return 2
    return int(ns.func(ns) or 0)


if __name__ == "__main__":
    sys.exit(main())
