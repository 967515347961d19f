"""The collective backends a test job can run on, and what each stands for.

* `gloo`: records itself into the generic recorder; completion tracked
  (`retired`), no send/recv records.
* `hwstore` (`storebackend`, Python): recorded by torch's FlightRecorderHook
  with no completion hooks, the degraded path every backend written in Python
  takes: entries retired at issue, completion unknown.
* `hwhooks` (`hookbackend`, compiled C++): recorded by the hook through
  completion and abort hooks, the path torch 2.15's default NCCL
  (ProcessGroupNCCL2) takes: entries complete with durations, a timeout runs
  the abort hooks (torch's own dump, the unhealthy mark).

Importing this module does not import torch.
"""

from __future__ import annotations

GLOO = "gloo"
HWSTORE = "hwstore"
HWHOOKS = "hwhooks"
BACKENDS = (GLOO, HWSTORE, HWHOOKS)
# Backends whose recorder cannot say whether a collective finished.
COMPLETION_UNKNOWN = frozenset({HWSTORE})


def register(name: str) -> str:
    """Make `name` usable by init_process_group; returns the name to pass it."""
    if name == HWSTORE:
        from hangwatch.testing import storebackend

        return storebackend.register()
    if name == HWHOOKS:
        from hangwatch.testing import hookbackend

        return hookbackend.register()
    if name != GLOO:
        raise ValueError(f"unknown test backend {name!r}; known: {', '.join(BACKENDS)}")
    return name


def unsupported_reason(name: str) -> str | None:
    """Why `name` cannot run with this torch and toolchain, or None."""
    if name == HWSTORE:
        from hangwatch.testing import storebackend

        return storebackend.unsupported_reason()
    if name == HWHOOKS:
        from hangwatch.testing import hookbackend

        return hookbackend.unsupported_reason()
    return None


def is_hooked(name: str) -> bool:
    """Recorded by torch's FlightRecorderHook (into an instance named after it)."""
    return name != GLOO


if __name__ == "__main__":  # `python -m hangwatch.testing.backends NAME`: ready it or say why not
    import sys

    for n in sys.argv[1:] or BACKENDS:
        why = unsupported_reason(n)
        if why is None and n == HWHOOKS:
            from hangwatch.testing import hookbackend

            hookbackend.build()
        print(f"{n}: {why or 'ok'}")
