"""docs/configuration.md is exactly what `python -m hangwatch.config` prints."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import module_output

from hangwatch import config, env

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(30)
def test_configuration_doc_is_generated_output() -> None:
    out = module_output("hangwatch.config")
    doc = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert doc == out, (
        "docs/configuration.md is stale: run `python -m hangwatch.config > docs/configuration.md`"
    )


@pytest.mark.timeout(10)
def test_every_setting_is_documented_with_flag_and_env() -> None:
    doc = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    for f in config.FIELDS:
        md = f.metadata
        assert f"`{md['env']}`" in doc, f.name
        if md["flag"]:
            assert f"`{md['flag']}`" in doc, f.name
        # The env name is a constant of hangwatch/env.py, not spelled anew.
        assert getattr(env, md["env"], None) == md["env"], f"{md['env']} is not in hangwatch/env.py"


@pytest.mark.timeout(10)
def test_secrets_have_no_flag() -> None:
    for f in config.FIELDS:
        if f.metadata["secret"]:
            assert f.metadata["flag"] is None, (
                f"{f.name} is secret but has a CLI flag (shows in ps)"
            )


@pytest.mark.timeout(30)
def test_every_commands_help_shows_real_defaults() -> None:
    """--help never prints a dataclass sentinel where a default is computed at run
    time, and a flag with a fixed set of values lists them in the usage line."""
    import argparse

    for command in ("server", "agent", "run", "demo", "analyze"):
        p = argparse.ArgumentParser(prog=command)
        config.add_arguments(p, command)
        text = p.format_help()
        assert "MISSING" not in text, (command, text)
    p = argparse.ArgumentParser(prog="agent")
    config.add_arguments(p, "agent")
    text = " ".join(p.format_help().split())
    assert "default the host name" in text
    assert "--on-hang {observe,abort}" in text
    with pytest.raises(SystemExit):
        p.parse_args(["--on-hang", "sometimes"])
