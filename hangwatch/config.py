"""Every setting, grouped by concern: its CLI flag, its HANGWATCH_* variable, its help.

Each setting is spelled once, as a field of one section; its flag is `--` and its
name with dashes (`stall_timeout` -> `--stall-timeout`), its variable `HANGWATCH_`
and its name in capitals. Secrets are never flags: the token comes from a file or
the environment so it never shows in `ps`. `Config` holds one instance of each
section (torchtitan's JobConfig shape); each command reads the sections it needs
and shows the flags whose `commands` name it. Precedence is CLI flag >
environment variable > default. `docs/configuration.md` is generated from this
module's fields (`python -m hangwatch.config_reference`) and a test keeps the two in step.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import socket
import string
import urllib.parse
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from hangwatch.addresses import check_hostport, check_http_url, is_loopback

SERVER = "server"
AGENT = "agent"
DEMO = "demo"
RUN = "run"
HOOK = "hook"
RELAY = "relay"

# --on-hang values.
OBSERVE = "observe"
ABORT = "abort"
ON_HANG = (OBSERVE, ABORT)
# The placeholders --exclude-command may use.
EXCLUDE_FIELDS = ("host", "node", "ranks", "incident")
ENV_PREFIX = "HANGWATCH_"


def _opt(
    help: str,
    commands: Iterable[str],
    *,
    secret: bool = False,
    help_for: Mapping[str, str] | None = None,
    default_for: Mapping[str, str] | None = None,
    choices: Iterable[str] | None = None,
) -> dict[str, Any]:
    return {
        "help": help,
        "commands": frozenset(commands),
        # A secret has no flag: it would show in `ps`.
        "secret": secret,
        # A command's own wording where one field means different things to each.
        "help_for": dict(help_for or {}),
        # What --help says the default is, where a command has its own (in words).
        "default_for": dict(default_for or {}),
        # The only values the flag takes (argparse lists them in the usage line).
        "choices": tuple(choices) if choices is not None else None,
    }


@dataclass(kw_only=True)
class JobSection:
    """Which job, and how loudly: every command."""

    job_id: str = field(
        default="default",
        metadata=_opt(
            "Job identifier shared by agents and coordinator.",
            [AGENT, DEMO, RUN, HOOK],
        ),
    )
    log_level: str = field(
        default="info",
        metadata=_opt(
            "Logging level: debug, info, warning, error.",
            [SERVER, AGENT, DEMO, RUN, HOOK, RELAY],
        ),
    )


@dataclass(kw_only=True)
class AuthSection:
    """Who may talk to the coordinator, and how: the token, TLS, the message cap."""

    token_file: str | None = field(
        default=None,
        metadata=_opt(
            "File holding the shared bearer token (or set HANGWATCH_TOKEN).",
            [SERVER, AGENT, DEMO, RUN, RELAY],
        ),
    )
    token: str | None = field(
        default=None,
        metadata=_opt(
            "Shared bearer token. Environment only: never a CLI flag.",
            [SERVER, AGENT, DEMO, RUN, RELAY],
            secret=True,
        ),
    )
    insecure: bool = field(
        default=False,
        metadata=_opt(
            "Allow binding a non-loopback address without a token.",
            [SERVER, RELAY],
        ),
    )
    tls_cert: str | None = field(
        default=None,
        metadata=_opt(
            "PEM certificate: a server's own (coordinator, relay), or the agent's client cert for mTLS.",
            [SERVER, AGENT, RELAY],
            help_for={
                SERVER: "PEM certificate the coordinator serves gRPC with (TLS).",
                AGENT: "PEM client certificate the agent presents to its coordinator and relay.",
                RELAY: "PEM certificate the relay serves with and presents upstream (TLS, mTLS).",
            },
        ),
    )
    tls_key: str | None = field(
        default=None,
        metadata=_opt(
            "PEM private key matching --tls-cert.",
            [SERVER, AGENT, RELAY],
        ),
    )
    tls_ca: str | None = field(
        default=None,
        metadata=_opt(
            "PEM CA bundle: agents verify the server with it; a server given one requires client certs.",
            [SERVER, AGENT, RELAY],
            help_for={
                RELAY: "PEM CA bundle: the relay verifies the coordinator with it (TLS), and"
                " asks its agents for certificates it signed (mTLS)."
            },
        ),
    )
    max_message_bytes: int = field(
        default=8 * 1024 * 1024,
        metadata=_opt(
            "Largest gRPC message accepted; bundles travel in chunks below it.",
            [SERVER, AGENT, RELAY],
        ),
    )

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


@dataclass(kw_only=True)
class ServeSection:
    """Where the coordinator listens and keeps its state."""

    host: str = field(
        default="127.0.0.1",
        metadata=_opt(
            "Address the coordinator binds (gRPC and HTTP). Non-loopback needs a token or --insecure.",
            [SERVER, RELAY],
            help_for={
                RELAY: "Address the relay binds for agents. Non-loopback needs a token or --insecure."
            },
        ),
    )
    grpc_port: int = field(
        default=7451,
        metadata=_opt(
            "Coordinator gRPC port; 0 picks a free port and prints it.",
            [SERVER, RELAY],
            help_for={
                RELAY: "The relay's gRPC port for agents' progress; 0 picks a free port and prints it."
            },
        ),
    )
    http_port: int = field(
        default=7450,
        metadata=_opt(
            "Dashboard/API HTTP port; 0 picks a free port and prints it.",
            [SERVER, RELAY],
            help_for={RELAY: "The relay's port for /metrics, /healthz, /readyz; 0: a free one."},
        ),
    )
    data_dir: str = field(
        default="./hangwatch-data",
        metadata=_opt(
            "Coordinator state: SQLite incident store and incident bundles.",
            [SERVER, DEMO],
        ),
    )
    incidents_dir: str | None = field(
        default=None,
        metadata=_opt(
            "Where incident bundles are written (default: incidents/ in --data-dir). Coordinators"
            " sharing a --store can share one on a shared filesystem: then any of their"
            " dashboards serves every incident's bundle.",
            [SERVER],
        ),
    )
    store: str | None = field(
        default=None,
        metadata=_opt(
            "Incident store shared by many jobs' coordinators: a postgresql://user@host:port/db"
            " URL, without a password (see --store-password-file). Default: SQLite in"
            " --data-dir. Bundles stay in --data-dir either way.",
            [SERVER],
        ),
    )
    store_password_file: str | None = field(
        default=None,
        metadata=_opt(
            "File holding the --store database's password (or set HANGWATCH_STORE_PASSWORD;"
            " without either, libpq's PGPASSFILE / PGPASSWORD apply).",
            [SERVER],
        ),
    )
    store_password: str | None = field(
        default=None,
        metadata=_opt(
            "The --store database's password. Environment only: never a CLI flag.",
            [SERVER],
            secret=True,
        ),
    )
    analyzer_memory_mb: int = field(
        default=8192,
        metadata=_opt(
            "Address-space cap of the coordinator's analyzer process, MiB: a hostile bundle fails its own analysis, never the coordinator (0 = no cap).",
            [SERVER],
        ),
    )
    public_url: str | None = field(
        default=None,
        metadata=_opt(
            "Dashboard address people can open, for the links in notifications (default: the"
            " HTTP address the coordinator bound, with the host name for a wildcard address).",
            [SERVER],
        ),
    )

    def resolved_store_password(self) -> str | None:
        """The store's password from the env var or the password file; the env
        var wins; None leaves it to libpq (PGPASSFILE, PGPASSWORD)."""
        if self.store_password:
            return self.store_password
        if self.store_password_file:
            with open(self.store_password_file, encoding="utf-8") as f:
                pw = f.read().strip()
            if not pw:
                raise ValueError(f"store password file {self.store_password_file} is empty")
            return pw
        return None


@dataclass(kw_only=True)
class DetectSection:
    """When the coordinator calls a hang, and how much it collects."""

    stall_timeout: float = field(
        default=10.0,
        metadata=_opt(
            "Seconds a group may sit with some members in a collective others have not entered before an incident starts.",
            [SERVER, DEMO],
        ),
    )
    startup_grace: float = field(
        default=60.0,
        metadata=_opt(
            "Seconds a group's first collective may wait for members that have entered none yet"
            " (ranks start at their own pace: imports, checkpoint loads) before an incident"
            " starts; the stall timeout when that is longer.",
            [SERVER],
        ),
    )
    dump_deadline: float = field(
        default=15.0,
        metadata=_opt(
            "Seconds the coordinator waits for every rank's dump before analysing what arrived.",
            [SERVER, DEMO],
        ),
    )
    full_dump_max_ranks: int = field(
        default=256,
        metadata=_opt(
            "Incidents of up to this many ranks collect every rank's full FR dump at once. Larger"
            " ones collect FR tails first (one stream per node) and then the full dumps of the"
            " lagging ranks; the rest stay on the nodes.",
            [SERVER],
        ),
    )
    tail_context: int = field(
        default=8,
        metadata=_opt(
            "Finished FR entries per process group kept before a rank's oldest unfinished one"
            " when an incident collects tails.",
            [SERVER],
        ),
    )
    agent_lost_timeout: float = field(
        default=10.0,
        metadata=_opt(
            "Seconds without a report before an agent's ranks are marked unobserved.",
            [SERVER, DEMO],
        ),
    )


@dataclass(kw_only=True)
class RespondSection:
    """What the coordinator does about a hang besides recording it."""

    notify_url: tuple[str, ...] = field(
        default=(),
        metadata=_opt(
            "Webhook the coordinator POSTs each incident change to (JSON, with a Slack-style"
            " `text`); repeat the flag, or separate URLs by commas in the variable. Credentials"
            " in the URL are sent, never logged.",
            [SERVER],
        ),
    )
    on_hang: str = field(
        default=OBSERVE,
        metadata=_opt(
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
            "With --on-hang abort: seconds between SIGTERM and SIGKILL.",
            [SERVER],
        ),
    )
    exclude_command: str | None = field(
        default=None,
        metadata=_opt(
            "Command run on the coordinator host for each node of a hang's lagging ranks, e.g."
            " 'kubectl cordon {host}'. Split like a shell line once at start, then each word"
            " filled in from {host}, {node}, {ranks}, {incident}; never run by a shell.",
            [SERVER],
        ),
    )
    exclude_timeout: float = field(
        default=30.0,
        metadata=_opt(
            "Seconds one --exclude-command run may take before it is killed.",
            [SERVER],
        ),
    )
    exclude_repeat_offenders_only: bool = field(
        default=False,
        metadata=_opt(
            "Run --exclude-command only for hosts that are repeat offenders once this"
            " incident is counted (--repeat-offender-incidents); other hosts get a skipped"
            " record saying so.",
            [SERVER],
        ),
    )
    repeat_offender_incidents: int = field(
        default=3,
        metadata=_opt(
            "A host that held the culprit of this many incidents, of any jobs sharing this"
            " store, within --repeat-offender-window is a repeat offender: /api/hosts,"
            " /metrics and a host.repeat-offender webhook event say so.",
            [SERVER],
        ),
    )
    repeat_offender_window: float = field(
        default=7 * 24 * 3600.0,
        metadata=_opt(
            "Seconds of incident history --repeat-offender-incidents counts over (default a week).",
            [SERVER],
        ),
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


@dataclass(kw_only=True)
class AgentSection:
    """The node agent: where it reports, what it watches, what it keeps."""

    coordinator: str = field(
        default="127.0.0.1:7451",
        metadata=_opt(
            "HOST:PORT of the coordinator's gRPC endpoint.",
            [AGENT, DEMO, RUN, RELAY],
            help_for={
                RELAY: "HOST:PORT of the coordinator's gRPC endpoint the relay forwards progress to.",
                DEMO: "HOST:PORT of a running coordinator's gRPC endpoint to report to (its"
                " stall timeout is used); unset, the demo starts a coordinator of its own.",
            },
            default_for={DEMO: "a coordinator of its own, on free ports"},
        ),
    )
    run_dir: str = field(
        default="./hangwatch-run",
        metadata=_opt(
            "Node-local directory shared by hook and agent: rank-info files, worker sockets, FR dump files, bundles.",
            [AGENT, RUN, HOOK, DEMO],
        ),
    )
    poll_interval: float = field(
        default=1.0,
        metadata=_opt(
            "Seconds between the agent's FR progress polls.",
            [AGENT, DEMO, SERVER],
            help_for={
                SERVER: "The agents' poll interval, in seconds: the straggler monitor scores"
                " one instant per interval (set it to what the agents use).",
            },
        ),
    )
    node_id: str = field(
        default_factory=socket.gethostname,
        metadata=_opt(
            "Name this agent reports for its node.",
            [AGENT],
        ),
    )
    max_buffered: int = field(
        default=10_000,
        metadata=_opt(
            "Most FR entries/events an agent holds while the coordinator is unreachable; oldest dropped first.",
            [AGENT],
        ),
    )
    keep_bundles: int = field(
        default=20,
        metadata=_opt(
            "Incident bundles an agent keeps in its run dir, newest first; older ones are deleted"
            " (a bundle still being uploaded never is).",
            [AGENT],
        ),
    )
    pyspy: str = field(
        default="py-spy",
        metadata=_opt(
            "py-spy executable used when a rank cannot dump its own stacks.",
            [AGENT],
        ),
    )
    progress_relay: str = field(
        default="",
        metadata=_opt(
            "HOST:PORT of a relay (`hangwatch relay`) for every call to the coordinator:"
            " progress, commands, registration, events, uploads; unset, the coordinator."
            " They go straight to the coordinator for a minute after the relay fails.",
            [AGENT],
        ),
    )


@dataclass(kw_only=True)
class RelaySection:
    """A progress relay: many agents' reports, one stream to the coordinator."""

    relay_window: float = field(
        default=0.25,
        metadata=_opt(
            "Seconds a relay gathers reports before sending them as one batch: detection waits up"
            " to this much longer, and the coordinator's gRPC work falls with the reports a batch.",
            [RELAY],
        ),
    )


@dataclass(kw_only=True)
class HookSection:
    """The hook inside each rank."""

    fr_buffer_size: int = field(
        default=2000,
        metadata=_opt(
            "Default TORCH_FR_BUFFER_SIZE the hook sets when the job has none.",
            [RUN, HOOK],
        ),
    )


@dataclass(kw_only=True)
class Config:
    """Every section, once. Build one with `Config.of(name=value, ...)` (tests, the
    demo) or `from_sources` (the CLIs)."""

    job: JobSection = field(default_factory=JobSection)
    auth: AuthSection = field(default_factory=AuthSection)
    serve: ServeSection = field(default_factory=ServeSection)
    detect: DetectSection = field(default_factory=DetectSection)
    respond: RespondSection = field(default_factory=RespondSection)
    agent: AgentSection = field(default_factory=AgentSection)
    relay: RelaySection = field(default_factory=RelaySection)
    hook: HookSection = field(default_factory=HookSection)

    @classmethod
    def of(cls, **settings: Any) -> Config:
        """A Config from settings named as fields (`stall_timeout=2.0`), each put in
        its section; an unknown name is a TypeError, as for a dataclass."""
        parts: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
        for name, value in settings.items():
            if name not in SECTION_OF:
                raise TypeError(f"unknown setting {name!r}")
            parts[SECTION_OF[name]][name] = value
        return cls(**{s: SECTIONS[s](**kw) for s, kw in parts.items()})

    def value(self, name: str) -> Any:
        """A setting by its field name, whichever section holds it."""
        return getattr(getattr(self, SECTION_OF[name]), name)

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
                "repeat_offender_incidents",
                "repeat_offender_window",
            ),
            AGENT: ("poll_interval",),
            RELAY: ("relay_window",),
            DEMO: ("stall_timeout", "poll_interval"),
        }.get(command, ())
        for name in positive:
            if self.value(name) <= 0:
                raise ValueError(
                    f"--{name.replace('_', '-')} must be positive, got {self.value(name)}"
                )
        if command == SERVER:
            for url in self.respond.notify_url:
                check_http_url(url, "--notify-url")
            if self.serve.public_url:
                check_http_url(self.serve.public_url, "--public-url", credentials=False)
            if self.serve.store:
                check_store_url(self.serve.store)
                try:
                    self.serve.resolved_store_password()
                except OSError as e:
                    raise ValueError(f"cannot read the store password: {e}") from e
        if command in (AGENT, DEMO, RUN, RELAY) and self.agent.coordinator:
            check_hostport(self.agent.coordinator, "--coordinator")
        if command == AGENT and self.agent.progress_relay:
            check_hostport(self.agent.progress_relay, "--progress-relay")
        if command == RELAY and self.auth.tls_ca and not self.auth.tls_cert:  # see hangwatch.tls
            raise ValueError(
                "--tls-ca: agents dial a relay over TLS; give it --tls-cert, --tls-key"
            )
        if self.respond.on_hang not in ON_HANG:
            raise ValueError(
                f"--on-hang must be one of {', '.join(ON_HANG)}, got {self.respond.on_hang!r}"
            )
        if command == SERVER:
            if self.respond.abort_grace < 0:
                raise ValueError(f"--abort-grace must be 0 or more, got {self.respond.abort_grace}")
            self.respond.exclude_argv()
        if command in (SERVER, AGENT, RELAY):
            try:
                token = self.auth.resolved_token()
            except OSError as e:
                raise ValueError(f"cannot read the token: {e}") from e
            if (
                command in (SERVER, RELAY)
                and not is_loopback(self.serve.host)
                and not token
                and not self.auth.insecure
            ):
                raise ValueError(
                    f"refusing to bind non-loopback host {self.serve.host} without a token "
                    f"(set {env_var('token')} or --token-file, or pass --insecure)"
                )


def check_store_url(url: str) -> None:
    """Refuse a --store that is no postgresql:// URL, or one carrying a password
    (it would show in `ps` and in logs). The error never repeats the password."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("postgresql", "postgres") or not (parts.netloc or parts.path):
        raise ValueError(
            "--store must be a postgresql://user@host:port/database URL "
            "(leave it unset for SQLite in --data-dir)"
        )
    query = urllib.parse.parse_qs(parts.query)
    if parts.password is not None or "password" in query:
        raise ValueError(
            f"--store must not carry a password: set {env_var('store_password')} or "
            "--store-password-file (or libpq's PGPASSFILE / PGPASSWORD)"
        )


# Section attribute -> its dataclass, in the order the reference lists them.
SECTIONS: dict[str, type[Any]] = {
    "job": JobSection,
    "auth": AuthSection,
    "serve": ServeSection,
    "detect": DetectSection,
    "respond": RespondSection,
    "agent": AgentSection,
    "relay": RelaySection,
    "hook": HookSection,
}
# Every setting, flat: field names are unique across sections (a test checks it).
FIELDS: tuple[dataclasses.Field[Any], ...] = tuple(
    f for section in SECTIONS.values() for f in dataclasses.fields(section)
)
SECTION_OF: dict[str, str] = {
    f.name: attr for attr, section in SECTIONS.items() for f in dataclasses.fields(section)
}


def flag_of(f: dataclasses.Field[Any]) -> str | None:
    """`--stall-timeout` for `stall_timeout`; None for a secret (environment only)."""
    return None if f.metadata["secret"] else "--" + f.name.replace("_", "-")


def env_of(f: dataclasses.Field[Any]) -> str:
    """`HANGWATCH_STALL_TIMEOUT` for `stall_timeout`."""
    return ENV_PREFIX + f.name.upper()


def env_var(name: str) -> str:
    """The variable of the setting `name` (a KeyError for a name that is no setting:
    callers that hand a setting to a child process spell it by its field name)."""
    return env_of(_BY_NAME[name])


_BY_NAME: dict[str, dataclasses.Field[Any]] = {f.name: f for f in FIELDS}


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
        raise ValueError(f"{env_of(f)}={raw!r} is not a boolean")
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
    """Add the flags of every setting the command uses.

    `defaults`: the command's own defaults where they differ from Config's
    (the demo's short timeouts), so --help shows the value really in force.
    """
    for f in FIELDS:
        md = f.metadata
        flag = flag_of(f)
        if command not in md["commands"] or flag is None:
            continue
        default = (defaults or {}).get(f.name, md["default_for"].get(command, f.default))
        if default is dataclasses.MISSING:  # computed at run time (a default_factory)
            default = "the host name" if f.name == "node_id" else None
        shown = "" if md["secret"] or default in (None, "", False) else f"; default {default}"
        help_text = f"{md['help_for'].get(command, md['help'])} [env {env_of(f)}{shown}]"
        if _field_type(f).startswith("bool"):
            parser.add_argument(
                flag, dest=f.name, action="store_true", default=None, help=help_text
            )
        elif _field_type(f).startswith("tuple"):
            parser.add_argument(
                flag, dest=f.name, action="append", default=None, metavar="URL", help=help_text
            )
        elif md["choices"]:
            parser.add_argument(
                flag, dest=f.name, default=None, choices=md["choices"], help=help_text
            )
        else:
            parser.add_argument(
                flag, dest=f.name, default=None, metavar=f.name.upper(), help=help_text
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
        if f.name in overrides:
            kwargs[f.name] = overrides[f.name]
            continue
        cli_val = getattr(ns, f.name, None) if ns is not None else None
        raw: Any = cli_val if cli_val is not None else environ.get(env_of(f))
        if raw is None:
            continue
        if isinstance(raw, list):  # a repeatable flag: each use may itself be a list
            kwargs[f.name] = tuple(v for item in raw for v in _convert(f, str(item)))
            continue
        kwargs[f.name] = raw if isinstance(raw, bool) else _convert(f, str(raw))
    return Config.of(**kwargs)


def add_command(
    subparsers: Any,
    command: str,
    *,
    help: str,
    description: str | None,
    func: Callable[[argparse.Namespace], int],
    defaults: Mapping[str, Any] | None = None,
    **parser_kw: Any,
) -> argparse.ArgumentParser:
    """`hangwatch COMMAND`: its parser, with the flags of every setting the command
    uses (`defaults`: as for add_arguments); `func(ns)` runs it."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        command, help=help, description=description, **parser_kw
    )
    add_arguments(p, command, defaults)
    p.set_defaults(func=func)
    return p


def for_command(
    command: str,
    ns: argparse.Namespace | None,
    environ: Mapping[str, str] | None = None,
    **overrides: Any,
) -> Config:
    """`from_sources`, then `validate(command)`: a ValueError names the setting."""
    conf = from_sources(ns, environ, **overrides)
    conf.validate(command)
    return conf


def explicitly_set(
    ns: argparse.Namespace | None, name: str, environ: Mapping[str, str] | None = None
) -> bool:
    """Whether a setting came from its flag or its env var rather than the default."""
    environ = os.environ if environ is None else environ
    return (ns is not None and getattr(ns, name, None) is not None) or env_var(name) in environ
