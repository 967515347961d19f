"""`hwhooks`: a compiled CPU backend that keeps ProcessGroupNCCL2's contract with torch's hooks.

torch 2.15's default `nccl` (ProcessGroupNCCL2) does not record itself: torch's
`FlightRecorderHook` records it, retires each entry from the backend's
**completion hook** (with the backend's own duration), and on a collective
timeout the backend runs its **abort hooks**, from which torch writes the
rank's dump and marks the backend unhealthy. A backend written in Python
cannot have either hook (`PyBackend` cannot override them), so `hwstore`
(`hangwatch.testing.storebackend`) only ever shows the degraded
no-completion path. This one is C++ (`hookbackend.cpp`, shipped in the
package), built on first use with torch's cpp_extension and cached per torch
version and source, so a CI run builds it once.

It keeps, as torch's hooks see them: asynchronous work on a worker "stream",
completion hooks with durations, abort hooks, a watchdog that fails work past
the group's timeout, and NCCL's behaviour after a peer's abort (a rank that
arrives at a collective its peers abandoned never completes it). Ops:
all_reduce (sum, avg, product, min, max), broadcast, all_gather(_into_tensor),
reduce_scatter(_tensor), barrier, send/recv, their coalesced forms and
batch_isend_irecv.

Register it with `register()` before `init_process_group(BACKEND_NAME)`.
Importing this module does not import torch.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import Any

from hangwatch import env

BACKEND_NAME = "hwhooks"
SOURCE = Path(__file__).with_name("hookbackend.cpp")
_ext: Any = None


def cache_root() -> Path:
    """The folder that holds built extensions (kept between runs)."""
    if os.environ.get(env.HANGWATCH_EXT_CACHE):
        return Path(os.environ[env.HANGWATCH_EXT_CACHE])
    base = Path(os.environ.get(env.XDG_CACHE_HOME) or Path.home() / ".cache")
    return base / "hangwatch" / "ext"


def _build_tag() -> str:
    import torch

    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
    version = torch.__version__.replace("+", "_").replace(".", "_")
    return f"torch{version}_{digest}"


def unsupported_reason() -> str | None:
    """Why the backend cannot be built or recorded here, or None.

    Feature probes, not version checks: torch's FlightRecorderHook and the
    Backend hook API, a C++ compiler and ninja (cpp_extension needs both).
    """
    from hangwatch.testing import storebackend

    reason = storebackend.unsupported_reason()
    if reason is not None:
        return reason
    import torch._C._distributed_c10d as c

    if not hasattr(c.Backend, "supports_completion_hooks"):
        return "this torch's c10d Backend has no completion hooks"
    cxx = os.environ.get(env.CXX, "c++")
    if shutil.which(cxx) is None:
        return f"no C++ compiler ({cxx!r} is not on PATH) to build the {BACKEND_NAME} backend"
    from torch.utils import cpp_extension

    if not cpp_extension.is_ninja_available():
        return f"ninja is not installed (pip install ninja) to build the {BACKEND_NAME} backend"
    return None


def build(*, verbose: bool = False) -> Any:
    """The compiled extension module, built on first use and cached.

    Several ranks starting at once build it once: cpp_extension takes a lock
    file in the build folder, and the others load what the first one built.
    About 40 s on 2 cores the first time, a fraction of a second after.
    """
    global _ext
    if _ext is not None:
        return _ext
    from torch.utils import cpp_extension

    tag = _build_tag()
    out = cache_root() / tag
    out.mkdir(parents=True, exist_ok=True)
    _ext = cpp_extension.load(
        name=f"hangwatch_hwhooks_{tag}",
        sources=[str(SOURCE)],
        build_directory=str(out),
        extra_cflags=["-O2"],
        verbose=verbose,
    )
    return _ext


def register(name: str = BACKEND_NAME) -> str:
    """Build if needed and register the backend with torch (idempotent). Returns its name."""
    import torch.distributed as dist

    if name.lower() not in dist.Backend.backend_list:
        dist.Backend.register_backend(name, build().create, devices=["cpu"])
    return name


if __name__ == "__main__":  # `python -m hangwatch.testing.hookbackend [-v]`: build it now
    import sys

    why = unsupported_reason()
    if why is not None:
        raise SystemExit(f"{BACKEND_NAME}: {why}")
    build(verbose="-v" in sys.argv[1:])
    print(f"{BACKEND_NAME}: built in {cache_root() / _build_tag()}")
