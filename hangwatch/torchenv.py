"""torch's flight-recorder environment, the torchtitan way: set what the job left unset,
keep what it set, and say which, once.

torch reads each setting under two names, the 2.15 one first
(TORCH_FR_DUMP_ON_TIMEOUT before TORCH_NCCL_DUMP_ON_TIMEOUT; for the dump
file, TORCH_FR_DUMP_TEMP_FILE before TORCH_NCCL_DEBUG_INFO_TEMP_FILE).
Setting only one name could shadow a value the job gave under the other, so
a pair is set whole or not at all.

The decisions are only *logged* once the process turns out to be a rank (its
first process group): the launcher, data-loader and compile workers inherit
the environment and attach the hook too, and must stay silent.
"""

from __future__ import annotations

import logging
import re
from collections.abc import MutableMapping, Sequence
from dataclasses import dataclass, field

from hangwatch import env

log = logging.getLogger("hangwatch.hook")


@dataclass(kw_only=True)
class EnvDecisions:
    """What apply_defaults did to the environment, and what is worth saying about it."""

    # name -> value hangwatch set (the job had set neither name of the pair).
    set: dict[str, str] = field(default_factory=dict)
    # (level, message), logged by announce().
    pending: list[tuple[int, str]] = field(default_factory=list)
    # Problems that make the hook's result not ok.
    reasons: list[str] = field(default_factory=list)
    # The dump-on-timeout file prefix torch will really use (the job's, when it set one).
    watchdog_prefix: str = ""

    def announce(self) -> None:
        for level, msg in self.pending:
            log.log(level, "hangwatch: %s", msg)
        self.pending.clear()


def apply_defaults(
    environ: MutableMapping[str, str], *, dump_prefix: str, buffer_size: int
) -> EnvDecisions:
    d = EnvDecisions()
    _default(d, environ, env.TORCH_FR_BUFFER_SIZE, str(buffer_size))
    if _torch_older_than(2, 7):
        # Older torch knows only the NCCL-era name; newer torch warns that it is deprecated.
        _default(d, environ, env.TORCH_NCCL_TRACE_BUFFER_SIZE, str(buffer_size))
    _default(d, environ, env.TORCH_INCLUDE_STACK_TRACE, "1")
    _default_pair(d, environ, env.DUMP_ON_TIMEOUT_NAMES, "1")
    _default_pair(d, environ, env.DUMP_FILE_NAMES, dump_prefix)
    on_timeout = environ.get(env.TORCH_FR_DUMP_ON_TIMEOUT) or environ.get(
        env.TORCH_NCCL_DUMP_ON_TIMEOUT
    )
    if on_timeout in ("0", "false"):
        d.pending.append(
            (
                logging.WARNING,
                "the job turned dump-on-timeout off: torch writes no dump when a collective "
                "times out, and hangwatch relies on its own status polls and dumps",
            )
        )
    # torch's own precedence (env.DUMP_FILE_NAMES order).
    d.watchdog_prefix = (
        environ.get(env.TORCH_FR_DUMP_TEMP_FILE)
        or environ.get(env.TORCH_NCCL_DEBUG_INFO_TEMP_FILE)
        or dump_prefix
    )
    if environ.get(env.TORCH_FR_BUFFER_SIZE) == "0":
        msg = (
            f"{env.TORCH_FR_BUFFER_SIZE}=0 disables the flight recorder; hangwatch sees no progress"
        )
        d.pending.append((logging.WARNING, msg))
        d.reasons.append(msg)
    return d


def _torch_older_than(major: int, minor: int) -> bool:
    # The installed distribution's metadata: importing torch here would cost
    # seconds in every process the launcher starts.
    from importlib import metadata

    try:
        version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        return False
    m = re.match(r"(\d+)\.(\d+)", version)
    if m is None:
        return False
    return (int(m.group(1)), int(m.group(2))) < (major, minor)


def _ours(environ: MutableMapping[str, str]) -> set[str]:
    """The torch variables an earlier hook in this process tree gave its default."""
    return {n for n in environ.get(env.HANGWATCH_TORCH_DEFAULTS, "").split(",") if n}


def _mark_ours(environ: MutableMapping[str, str], names: Sequence[str]) -> None:
    environ[env.HANGWATCH_TORCH_DEFAULTS] = ",".join(sorted(_ours(environ) | set(names)))


def _default(d: EnvDecisions, environ: MutableMapping[str, str], name: str, value: str) -> None:
    current = environ.get(name)
    if current is None:
        environ[name] = value
        d.set[name] = value
        _mark_ours(environ, [name])
        d.pending.append((logging.INFO, f"set {name}={value}"))
    elif name not in _ours(environ):
        d.pending.append(
            (logging.INFO, f"keeping the job's {name}={current} (hangwatch default {value})")
        )
    # else: a parent's hook set it (torchrun's, for its workers): nothing to say


def _default_pair(
    d: EnvDecisions, environ: MutableMapping[str, str], names: Sequence[str], value: str
) -> None:
    given = [(n, environ[n]) for n in names if n in environ]
    if given:
        theirs = [(n, v) for n, v in given if n not in _ours(environ)]
        if theirs:
            kept = ", ".join(f"{n}={v}" for n, v in theirs)
            d.pending.append(
                (logging.INFO, f"keeping the job's {kept} (hangwatch default {value})")
            )
        return
    for n in names:
        environ[n] = value
        d.set[n] = value
    _mark_ours(environ, names)
    d.pending.append((logging.INFO, "set " + " and ".join(f"{n}={value}" for n in names)))
