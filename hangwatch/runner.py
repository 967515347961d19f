"""`hangwatch run [OPTIONS] -- COMMAND...`: run a training command with the hook attached.

No edit of the training script: the command runs with the `_autoattach`
directory first on PYTHONPATH and HANGWATCH_AUTOATTACH=1, so every Python
process it starts (torchrun's workers included) runs `hangwatch.attach()`
before the script. The command replaces this process (exec), so signals and
the exit status are the command's own.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Mapping

from hangwatch import config as config_mod
from hangwatch import env, formats, hook_protocol
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


def node_agent(run_dir: str) -> formats.AgentInfo | None:
    """The agent running on this node for `run_dir`, if its agent.json is current."""
    try:
        info = formats.AgentInfo.load(run_dir)
    except FileNotFoundError:
        return None
    except (OSError, formats.FormatError) as e:
        sys.stderr.write(f"hangwatch run: ignoring {formats.AGENT_FILE} in {run_dir}: {e}\n")
        return None
    alive = hook_protocol.proc_starttime(info.pid)
    if alive is None or (info.proc_starttime and alive != info.proc_starttime):
        return None  # left behind by an agent that is gone
    return info


def agree_on_job_id(cfg: config_mod.Config, *, given: bool) -> config_mod.Config:
    """The job id the ranks report: the one given, else the node's agent's.

    The agent reports every rank it finds under its own job id; ranks started
    under another id used to say so only in the agent's log. Said once, here."""
    agent = node_agent(cfg.agent.run_dir)
    if agent is None or agent.job_id == cfg.job.job_id:
        return cfg
    if not given:
        sys.stderr.write(
            f"hangwatch run: job id {agent.job_id!r}, from the agent on this node "
            f"(pid {agent.pid}, reporting to {agent.coordinator})\n"
        )
        return dataclasses.replace(cfg, job=dataclasses.replace(cfg.job, job_id=agent.job_id))
    sys.stderr.write(
        f"hangwatch run: this job's id is {cfg.job.job_id!r}, but the agent on this node "
        f"(pid {agent.pid}) reports job {agent.job_id!r}: its ranks will be reported under "
        f"{agent.job_id!r}; give both the same --job-id\n"
    )
    return cfg


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
        cfg = agree_on_job_id(cfg, given=config_mod.explicitly_set(ns, "job_id"))
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
