"""Reading our own JSON files safely: one error type, one line, the field named.

Every file format reads through these helpers, so a file that is truncated,
of the wrong type or hostile ends in one `FormatError` (a ValueError) naming
the file's schema and the field, never in a KeyError or TypeError traceback
from deep inside a reader. A missing optional field takes its default; a
present field of the wrong type is an error, not silently coerced (a string
"3" where a rank belongs is someone else's file, not ours).
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable, Mapping
from enum import StrEnum
from typing import Any, NoReturn, TypeVar

SCHEMA_KEY = "schema"
T = TypeVar("T")


class FormatError(ValueError):
    """One of our files cannot be read; the message is one line."""


def fail(schema: str, msg: str) -> NoReturn:
    raise FormatError(f"{schema}: {msg}")


def document(d: Any, schema: str) -> Mapping[str, Any]:
    """`d` as a JSON object of this schema.

    A document without a schema tag is accepted (the previous release wrote
    some untagged); one tagged with another schema, or another version of
    this one, is refused: its fields may mean something else.
    """
    if not isinstance(d, dict):
        fail(schema, f"expected a JSON object, got {_kind(d)}")
    tag = d.get(SCHEMA_KEY)
    if tag is not None and tag != schema:
        fail(schema, f"the file says schema {_short(tag)}")
    return d


def loads(data: bytes | str, schema: str, limit: int) -> Any:
    """Parsed JSON, refusing more than `limit` bytes and any malformed text."""
    if len(data) > limit:
        fail(schema, f"{len(data)} bytes is over the {limit}-byte limit")
    try:
        return json.loads(data)
    except RecursionError:
        fail(schema, "nested too deeply")
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError alike
        fail(schema, f"not JSON ({str(e).splitlines()[0][:200]})")


def read_file(path: str | os.PathLike[str], schema: str, limit: int) -> Any:
    """`loads` of a file, reading at most `limit` + 1 bytes of it."""
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        if stat.S_ISREG(st.st_mode) and st.st_size > limit:
            fail(schema, f"{st.st_size} bytes is over the {limit}-byte limit")
        # Sized by the file, not the limit: read(n) allocates n bytes first,
        # and 4,096 metas at a 16 MiB limit each cost half a second.
        want = st.st_size + 1 if stat.S_ISREG(st.st_mode) else limit + 1
        data = f.read(min(want, limit + 1))
    return loads(data, schema, limit)


def _kind(v: Any) -> str:
    return "null" if v is None else type(v).__name__


def _short(v: Any) -> str:
    return repr(v)[:80]


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _wrong(schema: str, key: str, want: str, v: Any) -> NoReturn:
    fail(schema, f"field {key!r} should be {want}, got {_kind(v)} {_short(v)}")


def _required(d: Mapping[str, Any], key: str, schema: str, v: T | None, want: str) -> T:
    """`v`, the field as its opt_ reader read it with no default: missing and
    null are both errors, told apart."""
    if key not in d:
        fail(schema, f"required field {key!r} is missing")
    if v is None:
        _wrong(schema, key, want, None)
    return v


def _opt_typed(
    d: Mapping[str, Any], key: str, schema: str, default: T | None, kind: type[T], want: str
) -> T | None:
    v = d.get(key, default)
    if v is None:
        return None
    if not isinstance(v, kind):
        _wrong(schema, key, want, v)
    return v


def req_int(d: Mapping[str, Any], key: str, schema: str, *, minimum: int | None = None) -> int:
    return _required(d, key, schema, opt_int(d, key, schema, None, minimum=minimum), "an integer")


def opt_int(
    d: Mapping[str, Any], key: str, schema: str, default: int | None, *, minimum: int | None = None
) -> int | None:
    v = d.get(key, default)
    if v is None:
        return None
    if not _is_int(v):
        _wrong(schema, key, "an integer", v)
    if minimum is not None and v < minimum:
        fail(schema, f"field {key!r} is {v}, below {minimum}")
    return int(v)


def opt_float(d: Mapping[str, Any], key: str, schema: str, default: float | None) -> float | None:
    v = d.get(key, default)
    if v is None:
        return None
    if not (_is_int(v) or isinstance(v, float)):
        _wrong(schema, key, "a number", v)
    return float(v)


def req_str(d: Mapping[str, Any], key: str, schema: str) -> str:
    return _required(d, key, schema, opt_str(d, key, schema, None), "a string")


def opt_str(d: Mapping[str, Any], key: str, schema: str, default: str | None) -> str | None:
    return _opt_typed(d, key, schema, default, str, "a string")


def opt_bool(d: Mapping[str, Any], key: str, schema: str, default: bool | None) -> bool | None:
    return _opt_typed(d, key, schema, default, bool, "true or false")


def opt_object(d: Mapping[str, Any], key: str, schema: str) -> dict[str, Any] | None:
    """A free-form JSON object (None when absent)."""
    return _opt_typed(d, key, schema, None, dict, "an object")


def str_map(d: Mapping[str, Any], key: str, schema: str) -> dict[str, str]:
    """An object of strings ({} when absent)."""
    v = opt_object(d, key, schema) or {}
    for k, x in v.items():
        if not isinstance(x, str):
            _wrong(schema, f"{key}.{k}", "a string", x)
    return dict(v)


def object_list(d: Mapping[str, Any], key: str, schema: str) -> list[Mapping[str, Any]]:
    """A list of objects ([] when absent)."""
    v = _opt_typed(d, key, schema, None, list, "a list") or []
    for i, x in enumerate(v):
        if not isinstance(x, dict):
            _wrong(schema, f"{key}[{i}]", "an object", x)
    return v


def int_list(d: Mapping[str, Any], key: str, schema: str) -> list[int]:
    """A list of integers ([] when absent)."""
    v = _opt_typed(d, key, schema, None, list, "a list of integers") or []
    # type() is, not isinstance: bool is an int subclass, and this runs per member.
    if not all(type(x) is int for x in v):
        bad = next(x for x in v if type(x) is not int)
        _wrong(schema, f"{key}[]", "an integer", bad)
    return v


def str_list(d: Mapping[str, Any], key: str, schema: str) -> list[str]:
    """A list of strings ([] when absent)."""
    v = _opt_typed(d, key, schema, None, list, "a list of strings") or []
    if not all(isinstance(x, str) for x in v):
        _wrong(schema, key, "a list of strings", v)
    return v


# The same, with a default that also stands in for an explicit null.
def get_int(
    d: Mapping[str, Any], key: str, schema: str, default: int, *, minimum: int | None = None
) -> int:
    v = opt_int(d, key, schema, default, minimum=minimum)
    return default if v is None else v


def get_float(d: Mapping[str, Any], key: str, schema: str, default: float) -> float:
    v = opt_float(d, key, schema, default)
    return default if v is None else v


def get_str(d: Mapping[str, Any], key: str, schema: str, default: str = "") -> str:
    v = opt_str(d, key, schema, default)
    return default if v is None else v


E = TypeVar("E", bound=StrEnum)


def known(enum: type[E], value: str) -> E | str:
    """The enum member spelled `value`, or the text itself when this release
    does not know it (a newer writer's code)."""
    try:
        return enum(value)
    except ValueError:
        return value


def each(
    d: Mapping[str, Any],
    key: str,
    schema: str,
    parse: Callable[[Mapping[str, Any], str], T],
) -> tuple[T, ...]:
    """`parse` of every object in the list `key`; an error names the item (`groups[2]`)."""
    out = []
    for i, item in enumerate(object_list(d, key, schema)):
        try:
            out.append(parse(item, schema))
        except FormatError as e:
            raise FormatError(
                f"{schema}: {key}[{i}]: {str(e).removeprefix(schema + ': ')}"
            ) from None
    return tuple(out)
