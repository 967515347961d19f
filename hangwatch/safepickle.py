"""Unpickling that can never run code.

Flight-recorder pickles hold only builtin containers and scalars, so an
unpickler that refuses *every* global loads them completely while making the
classic `__reduce__` exploits (os.system, eval, subprocess) inert: the only
route from a pickle to a callable is `find_class`, and it always raises here.
The subclass keeps the C unpickler's speed.
"""

from __future__ import annotations

import io
import pickle


class UnsafePickleError(ValueError):
    """The pickle asked for a global (class, function); we never resolve one."""


class _NoGlobalsUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> object:
        raise UnsafePickleError(f"pickle references the global {module}.{name}; refused")

    def persistent_load(self, pid: object) -> object:
        raise UnsafePickleError("pickle uses persistent ids; refused")


def safe_loads(data: bytes) -> object:
    """Load a pickle made only of builtin values; refuse anything else.

    Raises UnsafePickleError for any global reference and ValueError for a
    malformed stream (including nesting too deep to rebuild).
    """
    try:
        # The C unpickler reads protocol<4 streams op by op through the file's
        # read(); a BufferedReader lets it peek the whole buffer at once,
        # which makes this as fast as pickle.loads (3x faster than BytesIO).
        stream = io.BufferedReader(io.BytesIO(data), buffer_size=max(len(data), 1) + 1)
        return _NoGlobalsUnpickler(stream).load()
    except UnsafePickleError:
        raise
    except RecursionError as e:
        raise ValueError("pickle nests too deeply") from e
    except MemoryError as e:
        raise ValueError("pickle asks for more memory than is available") from e
    except Exception as e:
        # UnpicklingError, EOFError, IndexError, TypeError, KeyError ... from a
        # corrupt stream all mean the same to a caller: not a usable pickle.
        raise ValueError(f"corrupt pickle: {type(e).__name__}: {_one_line(e)}") from e


def _one_line(e: BaseException) -> str:
    text = str(e).splitlines()[0] if str(e) else ""
    return text[:200]


__all__ = ["UnsafePickleError", "safe_loads"]
