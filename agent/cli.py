"""`hangwatch agent`: the node sidecar (one per node)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from hangwatch import config as config_mod
from hangwatch.lifecycle import ShutdownSignals, configure_logging, subcommand_main


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    config_mod.add_command(
        subparsers,
        config_mod.AGENT,
        help="Node sidecar: poll local ranks' flight recorders, report to the coordinator.",
        description=(
            "Watch every rank on this node (found through <run-dir>/hook/*.json, written by "
            "the hook), stream their FR progress to the coordinator and collect incident "
            "bundles on its command. First SIGTERM/SIGINT: clean shutdown; second: exit now."
        ),
        func=run,
    )


def run(ns: argparse.Namespace) -> int:
    try:
        # Fail now, with a clear message (an unreadable token file, a bad interval).
        cfg = config_mod.for_command(config_mod.AGENT, ns)
    except ValueError as e:
        sys.stderr.write(f"hangwatch agent: {e}\n")
        return 2
    configure_logging(cfg.job.log_level)
    from hangwatch.agent.service import EXIT_BOUND_S, Agent

    agent = Agent(cfg)
    logging.getLogger("hangwatch.agent").info(
        "agent %s: job %s, run dir %s, coordinator %s, poll every %gs",
        cfg.agent.node_id,
        cfg.job.job_id,
        os.path.abspath(cfg.agent.run_dir),
        cfg.agent.coordinator,
        cfg.agent.poll_interval,
    )
    with ShutdownSignals("hangwatch agent", agent.stop, exit_bound_s=EXIT_BOUND_S):
        agent.run()
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m hangwatch.agent.cli [OPTIONS]`, the same as `hangwatch agent`."""
    return subcommand_main(config_mod.AGENT, add_parser, argv)


if __name__ == "__main__":
    sys.exit(main())
