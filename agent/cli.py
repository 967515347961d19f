"""`hangwatch agent`: the node sidecar (one per node)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from types import FrameType

from hangwatch import config as config_mod


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser(
        "agent",
        help="Node sidecar: poll local ranks' flight recorders, report to the coordinator.",
        description=(
            "Watch every rank on this node (found through <run-dir>/hook/*.json, written by "
            "the hook), stream their FR progress to the coordinator and collect incident "
            "bundles on its command. First SIGTERM/SIGINT: clean shutdown; second: exit now."
        ),
    )
    config_mod.add_arguments(p, config_mod.AGENT)
    p.set_defaults(func=run)


def run(ns: argparse.Namespace) -> int:
    try:
        cfg = config_mod.from_sources(ns, os.environ)
        cfg.resolved_token()  # fail now, with a clear message, on an unreadable token file
    except (ValueError, OSError) as e:
        sys.stderr.write(f"hangwatch agent: {e}\n")
        return 2
    if cfg.poll_interval <= 0:
        sys.stderr.write(f"hangwatch agent: --poll-interval must be > 0, got {cfg.poll_interval}\n")
        return 2
    logging.basicConfig(
        level=cfg.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from hangwatch.agent.service import Agent

    agent = Agent(cfg)

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        if agent.stop.is_set():
            # Second signal: stop now, with the signal's own default action.
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        agent.stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    logging.getLogger("hangwatch.agent").info(
        "agent %s: job %s, run dir %s, coordinator %s, poll every %gs",
        cfg.node_id,
        cfg.job_id,
        os.path.abspath(cfg.run_dir),
        cfg.coordinator,
        cfg.poll_interval,
    )
    agent.run()
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m hangwatch.agent.cli [OPTIONS]`, the same as `hangwatch agent`."""
    parser = argparse.ArgumentParser(prog="hangwatch")
    add_parser(parser.add_subparsers(dest="command"))
    ns = parser.parse_args(["agent", *(sys.argv[1:] if argv is None else argv)])
    return int(ns.func(ns))


if __name__ == "__main__":
    sys.exit(main())
