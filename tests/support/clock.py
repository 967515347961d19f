"""A monotonic clock that moves only when a test says so: the coordinator's
`clock` seam (`JobRegistry(clock=...)`, `Coordinator(config, clock=...)`)."""

from __future__ import annotations


class FakeClock:
    """Monotonic seconds that move only when the test says so."""

    def __init__(self, start: float = 5_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
