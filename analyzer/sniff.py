"""Tell a flight-recorder dump's encoding from its first bytes and decode it.

torch writes dumps as pickle or as JSON, under any file name: content decides,
never the extension. Only the safe unpickler runs (hangwatch.safepickle).
"""

from __future__ import annotations

import json
from typing import Any

from hangwatch.safepickle import UnsafePickleError, safe_loads


class DumpFormatError(ValueError):
    """The bytes are not a usable flight-recorder dump; the message says why."""


def sniff_and_decode(data: bytes) -> Any:
    """Decode by content: JSON text or a pickle stream; anything else is refused."""
    head = data[:64].lstrip()
    if not head:
        raise DumpFormatError("empty file")
    if head[:1] in (b"{", b"["):
        try:
            return json.loads(data)
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise DumpFormatError(f"invalid JSON: {_short(e)}") from e
    if data[:1] == b"\x80" or data[:1] in (b"(", b"}", b"]"):
        try:
            return safe_loads(data)
        except UnsafePickleError as e:
            raise DumpFormatError(f"unsafe pickle: {e}") from e
        except ValueError as e:
            raise DumpFormatError(str(e)) from e
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        raise DumpFormatError("a PNG image, not a flight-recorder dump")
    raise DumpFormatError("neither pickle nor JSON: not a flight-recorder dump")


def _short(e: BaseException) -> str:
    s = str(e).splitlines()[0] if str(e) else type(e).__name__
    return s[:200]
