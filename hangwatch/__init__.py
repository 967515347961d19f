"""hangwatch: find the rank and the collective a distributed PyTorch job is stuck on."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

__all__ = ["__version__", "attach"]


def attach(**kwargs: Any) -> Any:
    """Turn on the flight recorder and expose it to the node agent.

    One line in a training script: `import hangwatch; hangwatch.attach()`.
    Never raises into the caller; see `hangwatch.hook`.
    """
    from hangwatch.hook import attach as _attach

    return _attach(**kwargs)
