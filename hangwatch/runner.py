"""`hangwatch run [OPTIONS] -- COMMAND...`: run a training command with the hook attached.

No edit of the training script: the command runs with the `_autoattach`
directory first on PYTHONPATH and HANGWATCH_AUTOATTACH=1, so every Python
process it starts (torchrun's workers included) runs `hangwatch.attach()`
before the script. The command replaces this process (exec), so signals and
the exit status are the command's own.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping

from hangwatch import config as config_mod
from hangwatch import env
from hangwatch.lifecycle import subcommand_main


def autoattach_dir() -> str:
    """The directory holding the `sitecustomize` shim."""
    from hangwatch import _autoattach

    return os.path.dirname(os.path.abspath(_autoattach.__file__))


def child_environ(cfg: config_mod.Config, environ: Mapping[str, str]) -> dict[str, str]:
    """The environment the command runs with."""
    out = dict(environ)
    shim = autoattach_dir()
    parts = [p for p in out.get(env.PYTHONPATH, "").split(os.pathsep) if p and p != shim]
    out[env.PYTHONPATH] = os.pathsep.join([shim, *parts])
    out[env.HANGWATCH_AUTOATTACH] = "1"
    out[config_mod.env_var("run_dir")] = os.path.abspath(cfg.agent.run_dir)
    out[config_mod.env_var("job_id")] = cfg.job.job_id
    out[config_mod.env_var("fr_buffer_size")] = str(cfg.hook.fr_buffer_size)
    out[config_mod.env_var("log_level")] = cfg.job.log_level
    return out


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = config_mod.add_command(
        subparsers,
        config_mod.RUN,
        help="Run a training command with the hangwatch hook attached (no script edit).",
        description=__doc__,
        func=run,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "cmd",
        nargs=argparse.REMAINDER,
        metavar="-- COMMAND",
        help="The command to run, after `--` (e.g. `-- torchrun --nproc-per-node 8 train.py`).",
    )


def run(ns: argparse.Namespace) -> int:
    cmd = list(ns.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        sys.stderr.write(
            "hangwatch run: no command given (usage: hangwatch run [OPTIONS] -- COMMAND...)\n"
        )
        return 2
    try:
        cfg = config_mod.for_command(config_mod.RUN, ns)
    except ValueError as e:
        sys.stderr.write(f"hangwatch run: {e}\n")
        return 2
    os.makedirs(os.path.abspath(cfg.agent.run_dir), exist_ok=True)
    child_env = child_environ(cfg, os.environ)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvpe(cmd[0], cmd, child_env)
    except OSError as e:
        # execvpe's error names the last PATH entry it tried, as bytes; say what
        # the user typed and why, as a shell would (127: not found, 126: not runnable).
        why = e.strerror or type(e).__name__
        sys.stderr.write(f"hangwatch run: cannot run {cmd[0]}: {why}\n")
        return 127 if isinstance(e, FileNotFoundError) else 126
    return 0  # not reached: exec replaced the process


def main(argv: list[str] | None = None) -> int:
    """`python -m hangwatch.runner [OPTIONS] -- COMMAND...`, the same as `hangwatch run`."""
    return subcommand_main(config_mod.RUN, add_parser, argv)


if __name__ == "__main__":
    sys.exit(main())
