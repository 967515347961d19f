"""Shared facts for the deploy-kit tests: the real CLI's flags and the Config's env names."""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
from pathlib import Path

import pytest

from hangwatch import config

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"

# Config "commands" whose settings a process started by that CLI command reads.
# `hangwatch run` passes its environment to the ranks, where the hook reads it.
_READERS = {
    "server": {config.SERVER},
    "agent": {config.AGENT},
    "relay": {config.RELAY},
    "run": {config.RUN, config.HOOK},
}


def require_tool(name: str, package: str | None = None) -> str:
    """Path of a tool the deploy tests run; CI installs them all, so only a developer
    may lack one (skipped here, failed on CI). `package`: the apt package it is in."""
    path = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(f"{name} is missing on CI (.ci/run must install it)")
        hint = f" (apt-get install {package})" if package else ""
        pytest.skip(f"{name} is not installed here{hint}")
    return path


@pytest.fixture(scope="session")
def deploy_dir() -> Path:
    return DEPLOY


@pytest.fixture(scope="session")
def cli_flags() -> dict[str, set[str]]:
    """Option strings each `hangwatch` subcommand accepts, from the real parser."""
    from hangwatch.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {name: set(p._option_string_actions) for name, p in sub.choices.items()}


@pytest.fixture(scope="session")
def config_env() -> dict[str, dataclasses.Field]:
    """HANGWATCH_* name -> Config field."""
    return {config.env_of(f): f for f in config.FIELDS}


@pytest.fixture(scope="session")
def env_for_command(config_env: dict[str, dataclasses.Field]) -> dict[str, set[str]]:
    """CLI command -> the HANGWATCH_* names a process it starts reads."""
    return {
        cmd: {name for name, f in config_env.items() if f.metadata["commands"] & readers}
        for cmd, readers in _READERS.items()
    }


@pytest.fixture(scope="session")
def config_defaults() -> dict[str, object]:
    """HANGWATCH_* name -> default value (fields with a plain default only)."""
    return {
        config.env_of(f): f.default for f in config.FIELDS if f.default is not dataclasses.MISSING
    }
