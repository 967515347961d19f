"""Attach hangwatch at interpreter start-up when `hangwatch run` asked for it.

`hangwatch run` puts this directory first on PYTHONPATH and sets
HANGWATCH_AUTOATTACH=1, so every Python process of the job runs this file
before the training script. attach() does not import torch: it sets FR
environment defaults and waits for torch.distributed to be imported, so the
torchrun launcher and helper processes pay almost nothing.

Whatever `sitecustomize` the environment had before (a later entry on
sys.path) still runs afterwards. Nothing here may raise.
"""

from __future__ import annotations


def _attach() -> None:
    import os

    from hangwatch import env

    if os.environ.get(env.HANGWATCH_AUTOATTACH, "") not in ("1", "true", "yes"):
        return
    import logging

    from hangwatch import config as config_mod
    from hangwatch import hook

    cfg = config_mod.from_sources(None, os.environ)
    logger = logging.getLogger("hangwatch")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[%(name)s pid %(process)d] %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(cfg.job.log_level.upper())
        logger.propagate = False
    hook.attach()


def _chain() -> None:
    """Import the next `sitecustomize` on sys.path, the one this file shadows."""
    import importlib
    import os
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    me = sys.modules.get(__name__)
    saved = list(sys.path)
    try:
        sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
        sys.modules.pop("sitecustomize", None)
        importlib.import_module("sitecustomize")
    except ImportError as e:
        if e.name != "sitecustomize":
            raise
    finally:
        sys.path[:] = saved
        if me is not None and "sitecustomize" not in sys.modules:
            sys.modules["sitecustomize"] = me


try:
    _attach()
except Exception as exc:  # never break the interpreter start-up
    import sys as _sys

    _sys.stderr.write(f"hangwatch: auto-attach failed: {type(exc).__name__}: {exc}\n")
try:
    _chain()
except Exception as exc:
    import sys as _sys

    _sys.stderr.write(f"hangwatch: chained sitecustomize failed: {type(exc).__name__}: {exc}\n")
