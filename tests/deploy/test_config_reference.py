"""docs/configuration.md is exactly what `python -m hangwatch.config_reference` prints."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import module_output

from hangwatch import config
from hangwatch.config import Config

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(30)
def test_configuration_doc_is_generated_output() -> None:
    out = module_output("hangwatch.config_reference")
    doc = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert doc == out, (
        "docs/configuration.md is stale: run `python -m hangwatch.config_reference > docs/configuration.md`"
    )


@pytest.mark.timeout(10)
def test_every_setting_is_documented_with_flag_and_env() -> None:
    doc = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    for f in config.FIELDS:
        assert f"`{config.env_of(f)}`" in doc, f.name
        if flag := config.flag_of(f):
            assert f"`{flag}`" in doc, f.name


@pytest.mark.timeout(10)
def test_secrets_have_no_flag() -> None:
    for f in config.FIELDS:
        if f.metadata["secret"]:
            assert config.flag_of(f) is None, f"{f.name} is secret but has a CLI flag (shows in ps)"


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
    # The demo starts its own coordinator unless given one: its help says so,
    # not the agent's fixed default address.
    p = argparse.ArgumentParser(prog="demo")
    config.add_arguments(p, "demo")
    text = " ".join(p.format_help().split())
    assert "unset, the demo starts a coordinator of its own" in text
    assert "127.0.0.1:7451" not in text
    with pytest.raises(SystemExit):
        p.parse_args(["--on-hang", "sometimes"])


# Every flag and variable a release has documented: renaming a field would rename
# its flag and its variable, so this list, not the field names, is the contract.
KNOWN_SETTINGS = {
    "job_id": ("job", "--job-id", "HANGWATCH_JOB_ID"),
    "log_level": ("job", "--log-level", "HANGWATCH_LOG_LEVEL"),
    "token_file": ("auth", "--token-file", "HANGWATCH_TOKEN_FILE"),
    "token": ("auth", None, "HANGWATCH_TOKEN"),
    "insecure": ("auth", "--insecure", "HANGWATCH_INSECURE"),
    "tls_cert": ("auth", "--tls-cert", "HANGWATCH_TLS_CERT"),
    "tls_key": ("auth", "--tls-key", "HANGWATCH_TLS_KEY"),
    "tls_ca": ("auth", "--tls-ca", "HANGWATCH_TLS_CA"),
    "max_message_bytes": ("auth", "--max-message-bytes", "HANGWATCH_MAX_MESSAGE_BYTES"),
    "host": ("serve", "--host", "HANGWATCH_HOST"),
    "grpc_port": ("serve", "--grpc-port", "HANGWATCH_GRPC_PORT"),
    "http_port": ("serve", "--http-port", "HANGWATCH_HTTP_PORT"),
    "data_dir": ("serve", "--data-dir", "HANGWATCH_DATA_DIR"),
    "incidents_dir": ("serve", "--incidents-dir", "HANGWATCH_INCIDENTS_DIR"),
    "store": ("serve", "--store", "HANGWATCH_STORE"),
    "store_password_file": ("serve", "--store-password-file", "HANGWATCH_STORE_PASSWORD_FILE"),
    "store_password": ("serve", None, "HANGWATCH_STORE_PASSWORD"),
    "analyzer_memory_mb": ("serve", "--analyzer-memory-mb", "HANGWATCH_ANALYZER_MEMORY_MB"),
    "public_url": ("serve", "--public-url", "HANGWATCH_PUBLIC_URL"),
    "stall_timeout": ("detect", "--stall-timeout", "HANGWATCH_STALL_TIMEOUT"),
    "startup_grace": ("detect", "--startup-grace", "HANGWATCH_STARTUP_GRACE"),
    "dump_deadline": ("detect", "--dump-deadline", "HANGWATCH_DUMP_DEADLINE"),
    "full_dump_max_ranks": ("detect", "--full-dump-max-ranks", "HANGWATCH_FULL_DUMP_MAX_RANKS"),
    "tail_context": ("detect", "--tail-context", "HANGWATCH_TAIL_CONTEXT"),
    "agent_lost_timeout": ("detect", "--agent-lost-timeout", "HANGWATCH_AGENT_LOST_TIMEOUT"),
    "notify_url": ("respond", "--notify-url", "HANGWATCH_NOTIFY_URL"),
    "on_hang": ("respond", "--on-hang", "HANGWATCH_ON_HANG"),
    "abort_grace": ("respond", "--abort-grace", "HANGWATCH_ABORT_GRACE"),
    "exclude_command": ("respond", "--exclude-command", "HANGWATCH_EXCLUDE_COMMAND"),
    "exclude_timeout": ("respond", "--exclude-timeout", "HANGWATCH_EXCLUDE_TIMEOUT"),
    "exclude_repeat_offenders_only": (
        "respond",
        "--exclude-repeat-offenders-only",
        "HANGWATCH_EXCLUDE_REPEAT_OFFENDERS_ONLY",
    ),
    "repeat_offender_incidents": (
        "respond",
        "--repeat-offender-incidents",
        "HANGWATCH_REPEAT_OFFENDER_INCIDENTS",
    ),
    "repeat_offender_window": (
        "respond",
        "--repeat-offender-window",
        "HANGWATCH_REPEAT_OFFENDER_WINDOW",
    ),
    "coordinator": ("agent", "--coordinator", "HANGWATCH_COORDINATOR"),
    "run_dir": ("agent", "--run-dir", "HANGWATCH_RUN_DIR"),
    "poll_interval": ("agent", "--poll-interval", "HANGWATCH_POLL_INTERVAL"),
    "node_id": ("agent", "--node-id", "HANGWATCH_NODE_ID"),
    "max_buffered": ("agent", "--max-buffered", "HANGWATCH_MAX_BUFFERED"),
    "keep_bundles": ("agent", "--keep-bundles", "HANGWATCH_KEEP_BUNDLES"),
    "pyspy": ("agent", "--pyspy", "HANGWATCH_PYSPY"),
    "progress_relay": ("agent", "--progress-relay", "HANGWATCH_PROGRESS_RELAY"),
    "relay_window": ("relay", "--relay-window", "HANGWATCH_RELAY_WINDOW"),
    "fr_buffer_size": ("hook", "--fr-buffer-size", "HANGWATCH_FR_BUFFER_SIZE"),
}


@pytest.mark.timeout(10)
def test_every_released_flag_and_variable_still_names_its_setting() -> None:
    derived = {
        f.name: (config.SECTION_OF[f.name], config.flag_of(f), config.env_of(f))
        for f in config.FIELDS
    }
    assert derived == KNOWN_SETTINGS
    # Field names are unique across sections: one name, one setting.
    assert len(config.FIELDS) == len(config.SECTION_OF)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", sorted(KNOWN_SETTINGS))
def test_each_flag_and_variable_sets_its_field(name: str) -> None:
    """Through the real parsers of every command that shows the flag, and through
    the environment: both land in the field of the section the list names."""
    import argparse

    section, flag, var = KNOWN_SETTINGS[name]
    f = next(f for f in config.FIELDS if f.name == name)
    kind = str(f.type)
    raw = {"bool": "1", "int": "7", "float": "7.5"}.get(kind.split(" ")[0], "")
    if name == "on_hang":
        raw = "abort"
    elif kind.startswith("tuple"):
        raw = "http://a.example/hook"
    elif not raw:
        raw = "x-value"
    from_env = config.from_sources(None, {var: raw})
    expected = getattr(getattr(from_env, section), name)
    assert expected != config.Config.of().value(name), f"{var}={raw!r} changed nothing"
    for command in sorted(f.metadata["commands"]):
        if flag is None:
            continue
        p = argparse.ArgumentParser()
        config.add_arguments(p, command)
        argv = [flag] if kind.startswith("bool") else [flag, raw]
        got = config.from_sources(p.parse_args(argv), {})
        assert getattr(getattr(got, section), name) == expected, command
    assert isinstance(Config.of(), Config)
