"""The one Jinja2 environment: autoescape on for every template, whatever its name.

Everything a dump carries (frame names, file names, group descriptions,
profiling names, stacks) is attacker-controlled text as far as the browser is
concerned, so escaping is never opt-in.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jinja2
from hangwatch.analyzer.text import collective_text, group_desc, seq_text
from hangwatch.server.web.fmt import age, when

from hangwatch import __version__
from hangwatch.rankspec import format_ranks

HERE = Path(__file__).resolve().parent
TEMPLATES = HERE / "templates"
STATIC = HERE / "static"


def _ranks(ranks: list[int] | tuple[int, ...] | None, limit: int = 0) -> str:
    return format_ranks(ranks or [], limit=limit)


@functools.cache
def environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES)),
        autoescape=True,  # every template, including ones not named *.html
        undefined=jinja2.StrictUndefined,
        trim_blocks=False,
        lstrip_blocks=False,
    )
    env.filters["ranks"] = _ranks
    env.filters["when"] = when
    env.filters["age"] = age
    env.filters["seq"] = seq_text  # FR's -1 (nothing yet) reads "none"
    env.filters["gdesc"] = group_desc  # an unnamed group's "undefined" reads ""
    env.globals["collective"] = collective_text
    env.globals["version"] = __version__
    return env


@functools.cache
def static_text(name: str) -> str:
    return (STATIC / name).read_text(encoding="utf-8")
