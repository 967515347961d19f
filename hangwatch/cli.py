"""`hangwatch` console script: one entry point, one subcommand per module.

Each command module exposes `add_parser(subparsers)`, which registers its
parser and sets `func` to a `run(ns) -> int`.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from hangwatch import __version__

COMMAND_MODULES = (
    "hangwatch.analyzer.cli",  # analyze
    "hangwatch.server.cli",  # server
    "hangwatch.agent.cli",  # agent
    "hangwatch.runner",  # run
    "hangwatch.demo",  # demo
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hangwatch",
        description="Find the rank and the collective a distributed PyTorch job is stuck on.",
    )
    parser.add_argument("--version", action="version", version=f"hangwatch {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    if not getattr(ns, "func", None):
        parser.print_help()
        return 2
    return int(ns.func(ns) or 0)


if __name__ == "__main__":
    sys.exit(main())
