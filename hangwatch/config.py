"""The one Config: every setting, its CLI flag, its HANGWATCH_* env var and its help.

Precedence is CLI flag > environment variable > default. `docs/configuration.md`
is generated from this module (`python -m hangwatch.config`) and a test keeps
the two in step. Secrets are never flags: the token comes from a file or the
environment so it never shows in `ps`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import socket
import string
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from hangwatch import env
from hangwatch.addresses import check_hostport, check_http_url, is_loopback

SERVER = "server"
AGENT = "agent"
DEMO = "demo"
RUN = "run"
HOOK = "hook"

# --on-hang values.
OBSERVE = "observe"
ABORT = "abort"
ON_HANG = (OBSERVE, ABORT)
# The placeholders --exclude-command may use.
EXCLUDE_FIELDS = ("host", "node", "ranks", "incident")


def _opt(
    flag: str | None,
    envvar: str,
    help: str,
    commands: Iterable[str],
    *,
    secret: bool = False,
    help_for: Mapping[str, str] | None = None,
    choices: Iterable[str] | None = None,
) -> dict[str, Any]:
    return {
        "flag": flag,
        "env": envvar,
        "help": help,
        "commands": frozenset(commands),
        "secret": secret,
        # A command's own wording where one field means different things to each.
        "help_for": dict(help_for or {}),
        # The only values the flag takes (argparse lists them in the usage line).
        "choices": tuple(choices) if choices is not None else None,
    }


@dataclass(kw_only=True)
class Config:
    job_id: str = field(
        default="default",
        metadata=_opt(
            "--job-id",
            env.HANGWATCH_JOB_ID,
            "Job identifier shared by agents and coordinator.",
            [AGENT, DEMO, RUN, HOOK],
        ),
    )
    host: str = field(
        default="127.0.0.1",
        metadata=_opt(
            "--host",
            env.HANGWATCH_HOST,
            "Address the coordinator binds (gRPC and HTTP). Non-loopback needs a token or --insecure.",
            [SERVER],
        ),
    )
    grpc_port: int = field(
        default=7451,
        metadata=_opt(
            "--grpc-port",
            env.HANGWATCH_GRPC_PORT,
            "Coordinator gRPC port; 0 picks a free port and prints it.",
            [SERVER],
        ),
    )
    http_port: int = field(
        default=7450,
        metadata=_opt(
            "--http-port",
            env.HANGWATCH_HTTP_PORT,
            "Dashboard/API HTTP port; 0 picks a free port and prints it.",
            [SERVER],
        ),
    )
    data_dir: str = field(
        default="./hangwatch-data",
        metadata=_opt(
            "--data-dir",
            env.HANGWATCH_DATA_DIR,
            "Coordinator state: SQLite incident store and incident bundles.",
            [SERVER, DEMO],
        ),
    )
    stall_timeout: float = field(
        default=10.0,
        metadata=_opt(
            "--stall-timeout",
            env.HANGWATCH_STALL_TIMEOUT,
            "Seconds a group may sit with some members in a collective others have not entered before an incident starts.",
            [SERVER, DEMO],
        ),
    )
    startup_grace: float = field(
        default=60.0,
        metadata=_opt(
            "--startup-grace",
            env.HANGWATCH_STARTUP_GRACE,
            "Seconds a group's first collective may wait for members that have entered none yet"
            " (ranks start at their own pace: imports, checkpoint loads) before an incident"
            " starts; the stall timeout when that is longer.",
            [SERVER],
        ),
    )
    dump_deadline: float = field(
        default=15.0,
        metadata=_opt(
            "--dump-deadline",
            env.HANGWATCH_DUMP_DEADLINE,
            "Seconds the coordinator waits for every rank's dump before analysing what arrived.",
            [SERVER, DEMO],
        ),
    )
    full_dump_max_ranks: int = field(
        default=256,
        metadata=_opt(
            "--full-dump-max-ranks",
            env.HANGWATCH_FULL_DUMP_MAX_RANKS,
            "Incidents of up to this many ranks collect every rank's full FR dump at once. Larger"
            " ones collect FR tails first (one stream per node) and then the full dumps of the"
            " lagging ranks; the rest stay on the nodes.",
            [SERVER],
        ),
    )
    tail_context: int = field(
        default=8,
        metadata=_opt(
            "--tail-context",
            env.HANGWATCH_TAIL_CONTEXT,
            "Finished FR entries per process group kept before a rank's oldest unfinished one"
            " when an incident collects tails.",
            [SERVER],
        ),
    )
    agent_lost_timeout: float = field(
        default=10.0,
        metadata=_opt(
            "--agent-lost-timeout",
            env.HANGWATCH_AGENT_LOST_TIMEOUT,
            "Seconds without a report before an agent's ranks are marked unobserved.",
            [SERVER, DEMO],
        ),
    )
    token_file: str | None = field(
        default=None,
        metadata=_opt(
            "--token-file",
            env.HANGWATCH_TOKEN_FILE,
            "File holding the shared bearer token (or set HANGWATCH_TOKEN).",
            [SERVER, AGENT, DEMO, RUN],
        ),
    )
    token: str | None = field(
        default=None,
        metadata=_opt(
            None,
            env.HANGWATCH_TOKEN,
            "Shared bearer token. Environment only: never a CLI flag.",
            [SERVER, AGENT, DEMO, RUN],
            secret=True,
        ),
    )
    insecure: bool = field(
        default=False,
        metadata=_opt(
            "--insecure",
            env.HANGWATCH_INSECURE,
            "Allow binding a non-loopback address without a token.",
            [SERVER],
        ),
    )
    tls_cert: str | None = field(
        default=None,
        metadata=_opt(
            "--tls-cert",
            env.HANGWATCH_TLS_CERT,
            "PEM certificate: the server's own, or the agent's client cert for mTLS.",
            [SERVER, AGENT],
            help_for={
                SERVER: "PEM certificate the coordinator serves gRPC with (TLS).",
                AGENT: "PEM client certificate the agent presents to the coordinator (mTLS).",
            },
        ),
    )
    tls_key: str | None = field(
        default=None,
        metadata=_opt(
            "--tls-key",
            env.HANGWATCH_TLS_KEY,
            "PEM private key matching --tls-cert.",
            [SERVER, AGENT],
        ),
    )
    tls_ca: str | None = field(
        default=None,
        metadata=_opt(
            "--tls-ca",
            env.HANGWATCH_TLS_CA,
            "PEM CA bundle: agents verify the server with it; a server given one requires client certs.",
            [SERVER, AGENT],
        ),
    )
    max_message_bytes: int = field(
        default=8 * 1024 * 1024,
        metadata=_opt(
            "--max-message-bytes",
            env.HANGWATCH_MAX_MESSAGE_BYTES,
            "Largest gRPC message accepted; bundles travel in chunks below it.",
            [SERVER, AGENT],
        ),
    )
    analyzer_memory_mb: int = field(
        default=8192,
        metadata=_opt(
            "--analyzer-memory-mb",
            env.HANGWATCH_ANALYZER_MEMORY_MB,
            "Address-space cap of the coordinator's analyzer process, MiB: a hostile bundle fails its own analysis, never the coordinator (0 = no cap).",
            [SERVER],
        ),
    )
    notify_url: tuple[str, ...] = field(
        default=(),
        metadata=_opt(
            "--notify-url",
            env.HANGWATCH_NOTIFY_URL,
            "Webhook the coordinator POSTs each incident change to (JSON, with a Slack-style"
            " `text`); repeat the flag, or separate URLs by commas in the variable. Credentials"
            " in the URL are sent, never logged.",
            [SERVER],
        ),
    )
    public_url: str | None = field(
        default=None,
        metadata=_opt(
            "--public-url",
            env.HANGWATCH_PUBLIC_URL,
            "Dashboard address people can open, for the links in notifications (default: the"
            " HTTP address the coordinator bound, with the host name for a wildcard address).",
            [SERVER],
        ),
    )
    on_hang: str = field(
        default=OBSERVE,
        metadata=_opt(
            "--on-hang",
            env.HANGWATCH_ON_HANG,
            "observe or abort. abort: once a hang's dumps are stored and analysed, end the job's"
            " ranks (SIGTERM, then SIGKILL) so its launcher restarts it.",
            [SERVER, AGENT],
            help_for={
                SERVER: "observe (record only) or abort: once an incident's dumps are stored and"
                " its verdict is a hang, tell the job's agents to end its ranks (SIGTERM, then"
                " SIGKILL after --abort-grace) so the launcher restarts the job.",
                AGENT: "observe or abort: abort lets the coordinator have this agent end its"
                " node's ranks after a hang; observe refuses (the coordinator needs abort too).",
            },
            choices=ON_HANG,
        ),
    )
    abort_grace: float = field(
        default=10.0,
        metadata=_opt(
            "--abort-grace",
            env.HANGWATCH_ABORT_GRACE,
            "With --on-hang abort: seconds between SIGTERM and SIGKILL.",
            [SERVER],
        ),
    )
    exclude_command: str | None = field(
        default=None,
        metadata=_opt(
            "--exclude-command",
            env.HANGWATCH_EXCLUDE_COMMAND,
            "Command run on the coordinator host for each node of a hang's lagging ranks, e.g."
            " 'kubectl cordon {host}'. Split like a shell line once at start, then each word"
            " filled in from {host}, {node}, {ranks}, {incident}; never run by a shell.",
            [SERVER],
        ),
    )
    exclude_timeout: float = field(
        default=30.0,
        metadata=_opt(
            "--exclude-timeout",
            env.HANGWATCH_EXCLUDE_TIMEOUT,
            "Seconds one --exclude-command run may take before it is killed.",
            [SERVER],
        ),
    )
    coordinator: str = field(
        default="127.0.0.1:7451",
        metadata=_opt(
            "--coordinator",
            env.HANGWATCH_COORDINATOR,
            "HOST:PORT of the coordinator's gRPC endpoint.",
            [AGENT, DEMO, RUN],
        ),
    )
    run_dir: str = field(
        default="./hangwatch-run",
        metadata=_opt(
            "--run-dir",
            env.HANGWATCH_RUN_DIR,
            "Node-local directory shared by hook and agent: rank-info files, worker sockets, FR dump files, bundles.",
            [AGENT, RUN, HOOK, DEMO],
        ),
    )
    poll_interval: float = field(
        default=1.0,
        metadata=_opt(
            "--poll-interval",
            env.HANGWATCH_POLL_INTERVAL,
            "Seconds between the agent's FR progress polls.",
            [AGENT, DEMO],
        ),
    )
    node_id: str = field(
        default_factory=socket.gethostname,
        metadata=_opt(
            "--node-id", env.HANGWATCH_NODE_ID, "Name this agent reports for its node.", [AGENT]
        ),
    )
    max_buffered: int = field(
        default=10_000,
        metadata=_opt(
            "--max-buffered",
            env.HANGWATCH_MAX_BUFFERED,
            "Most FR entries/events an agent holds while the coordinator is unreachable; oldest dropped first.",
            [AGENT],
        ),
    )
    keep_bundles: int = field(
        default=20,
        metadata=_opt(
            "--keep-bundles",
            env.HANGWATCH_KEEP_BUNDLES,
            "Incident bundles an agent keeps in its run dir, newest first; older ones are deleted"
            " (a bundle still being uploaded never is).",
            [AGENT],
        ),
    )
    fr_buffer_size: int = field(
        default=2000,
        metadata=_opt(
            "--fr-buffer-size",
            env.HANGWATCH_FR_BUFFER_SIZE,
            "Default TORCH_FR_BUFFER_SIZE the hook sets when the job has none.",
            [RUN, HOOK],
        ),
    )
    pyspy: str = field(
        default="py-spy",
        metadata=_opt(
            "--pyspy",
            env.HANGWATCH_PYSPY,
            "py-spy executable used when a rank cannot dump its own stacks.",
            [AGENT],
        ),
    )
    log_level: str = field(
        default="info",
        metadata=_opt(
            "--log-level",
            env.HANGWATCH_LOG_LEVEL,
            "Logging level: debug, info, warning, error.",
            [SERVER, AGENT, DEMO, RUN, HOOK],
        ),
    )

    def validate(self, command: str) -> None:
        """Refuse, with one line naming the setting, a config `command` cannot run with.

        The one place the CLIs' rules live; raises ValueError.
        """
        positive = {
            SERVER: (
                "stall_timeout",
                "startup_grace",
                "dump_deadline",
                "agent_lost_timeout",
                "exclude_timeout",
            ),
            AGENT: ("poll_interval",),
            DEMO: ("stall_timeout", "poll_interval"),
        }.get(command, ())
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(
                    f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}"
                )
        if command == SERVER:
            for url in self.notify_url:
                check_http_url(url, "--notify-url")
            if self.public_url:
                check_http_url(self.public_url, "--public-url", credentials=False)
        if command in (AGENT, DEMO, RUN) and self.coordinator:
            check_hostport(self.coordinator, "--coordinator")
        if self.on_hang not in ON_HANG:
            raise ValueError(f"--on-hang must be one of {', '.join(ON_HANG)}, got {self.on_hang!r}")
        if command == SERVER:
            if self.abort_grace < 0:
                raise ValueError(f"--abort-grace must be 0 or more, got {self.abort_grace}")
            self.exclude_argv()
        if command in (SERVER, AGENT):
            try:
                token = self.resolved_token()
            except OSError as e:
                raise ValueError(f"cannot read the token: {e}") from e
            if command == SERVER and not is_loopback(self.host) and not token and not self.insecure:
                raise ValueError(
                    f"refusing to bind non-loopback host {self.host} without a token "
                    f"(set {env.HANGWATCH_TOKEN} or --token-file, or pass --insecure)"
                )

    def exclude_argv(self) -> tuple[str, ...]:
        """--exclude-command split into words once; () when unset. Raises
        ValueError on an unbalanced quote or a placeholder other than
        EXCLUDE_FIELDS (no attributes, indexes, conversions or formats)."""
        if not self.exclude_command or not self.exclude_command.strip():
            return ()
        try:
            argv = tuple(shlex.split(self.exclude_command))
        except ValueError as e:
            raise ValueError(f"--exclude-command: {e}") from e
        for word in argv:
            try:
                parts = list(string.Formatter().parse(word))
            except ValueError as e:
                raise ValueError(f"--exclude-command word {word!r}: {e}") from e
            for _text, name, spec, conv in parts:
                if name is None:
                    continue
                if name not in EXCLUDE_FIELDS or spec or conv:
                    raise ValueError(
                        f"--exclude-command word {word!r}: placeholders are "
                        + ", ".join("{" + f + "}" for f in EXCLUDE_FIELDS)
                        + " ({{ and }} for literal braces)"
                    )
        return argv

    def resolved_token(self) -> str | None:
        """The token from the env var or the token file; the env var wins."""
        if self.token:
            return self.token.strip() or None
        if self.token_file:
            with open(self.token_file, encoding="utf-8") as f:
                tok = f.read().strip()
            if not tok:
                raise ValueError(f"token file {self.token_file} is empty")
            return tok
        return None


FIELDS: tuple[dataclasses.Field[Any], ...] = dataclasses.fields(Config)


def _field_type(f: dataclasses.Field[Any]) -> str:
    return str(f.type).replace("'", "")


def _convert(f: dataclasses.Field[Any], raw: str) -> Any:
    t = _field_type(f)
    if t.startswith("bool"):
        v = raw.strip().lower()
        if v in ("1", "true", "yes", "on"):
            return True
        if v in ("0", "false", "no", "off", ""):
            return False
        raise ValueError(f"{f.metadata['env']}={raw!r} is not a boolean")
    if t.startswith("tuple"):
        return tuple(u.strip() for u in raw.split(",") if u.strip())
    if t.startswith("int"):
        return int(raw)
    if t.startswith("float"):
        return float(raw)
    return raw


def add_arguments(
    parser: argparse.ArgumentParser,
    command: str,
    defaults: Mapping[str, Any] | None = None,
) -> None:
    """Add the flags of every Config field the command uses.

    `defaults`: the command's own defaults where they differ from Config's
    (the demo's short timeouts), so --help shows the value really in force.
    """
    for f in FIELDS:
        md = f.metadata
        if command not in md["commands"] or md["flag"] is None:
            continue
        default = (defaults or {}).get(f.name, f.default)
        if default is dataclasses.MISSING:  # computed at run time (a default_factory)
            default = "the host name" if f.name == "node_id" else None
        shown = "" if md["secret"] or default in (None, "", False) else f"; default {default}"
        help_text = f"{md['help_for'].get(command, md['help'])} [env {md['env']}{shown}]"
        if _field_type(f).startswith("bool"):
            parser.add_argument(
                md["flag"], dest=f.name, action="store_true", default=None, help=help_text
            )
        elif _field_type(f).startswith("tuple"):
            parser.add_argument(
                md["flag"], dest=f.name, action="append", default=None, metavar="URL",
                help=help_text,
            )  # fmt: skip
        elif md["choices"]:
            parser.add_argument(
                md["flag"], dest=f.name, default=None, choices=md["choices"], help=help_text
            )
        else:
            parser.add_argument(
                md["flag"], dest=f.name, default=None, metavar=f.name.upper(), help=help_text
            )


def from_sources(
    ns: argparse.Namespace | None = None,
    environ: Mapping[str, str] | None = None,
    **overrides: Any,
) -> Config:
    """Build a Config: explicit overrides > CLI namespace > environment > defaults."""
    environ = os.environ if environ is None else environ
    kwargs: dict[str, Any] = {}
    for f in FIELDS:
        md = f.metadata
        if f.name in overrides:
            kwargs[f.name] = overrides[f.name]
            continue
        cli_val = getattr(ns, f.name, None) if ns is not None else None
        raw: Any = cli_val if cli_val is not None else environ.get(md["env"])
        if raw is None:
            continue
        if isinstance(raw, list):  # a repeatable flag: each use may itself be a list
            kwargs[f.name] = tuple(v for item in raw for v in _convert(f, str(item)))
            continue
        kwargs[f.name] = raw if isinstance(raw, bool) else _convert(f, str(raw))
    return Config(**kwargs)


def explicitly_set(
    ns: argparse.Namespace | None, name: str, environ: Mapping[str, str] | None = None
) -> bool:
    """Whether a setting came from its flag or its env var rather than the default."""
    environ = os.environ if environ is None else environ
    f = next(f for f in FIELDS if f.name == name)
    return (ns is not None and getattr(ns, name, None) is not None) or f.metadata["env"] in environ


def markdown() -> str:
    """The configuration reference, generated (docs/configuration.md)."""
    lines = [
        "# Configuration reference",
        "",
        "Generated by `python -m hangwatch.config > docs/configuration.md`; a test fails when",
        "this file and `hangwatch/config.py` disagree. Precedence: CLI flag > environment > default.",
        "",
        "| Setting | CLI flag | Environment variable | Default | Used by | Meaning |",
        "|---|---|---|---|---|---|",
    ]
    for f in FIELDS:
        md = f.metadata
        if f.default is not dataclasses.MISSING:
            default = "(unset)" if f.default in (None, ()) else f"`{f.default}`"
        else:
            default = "(host name)" if f.name == "node_id" else "(computed)"
        flag = f"`{md['flag']}`" if md["flag"] else "(env only)"
        used = ", ".join(sorted(md["commands"]))
        lines.append(f"| `{f.name}` | {flag} | `{md['env']}` | {default} | {used} | {md['help']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(markdown())
