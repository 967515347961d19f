"""Bounded buffers for what the agent could not send yet: oldest dropped first, drops counted."""

from __future__ import annotations

import threading
from collections import deque
from typing import Generic, TypeVar

T = TypeVar("T")


class BoundedQueue(Generic[T]):
    def __init__(self, maxlen: int) -> None:
        if maxlen < 1:
            raise ValueError(f"maxlen must be >= 1, got {maxlen}")
        self._items: deque[T] = deque()
        self._maxlen = maxlen
        self._lock = threading.Lock()
        self.dropped = 0  # total ever dropped, for the wire's `dropped` field

    def put(self, item: T) -> None:
        with self._lock:
            if len(self._items) >= self._maxlen:
                self._items.popleft()
                self.dropped += 1
            self._items.append(item)

    def take(self, n: int) -> list[T]:
        """Remove and return up to n oldest items."""
        with self._lock:
            k = min(n, len(self._items))
            return [self._items.popleft() for _ in range(k)]

    def push_front(self, items: list[T]) -> None:
        """Return unsent items to the head, still within the bound (newest kept)."""
        with self._lock:
            for item in reversed(items):
                if len(self._items) >= self._maxlen:
                    self.dropped += 1
                    continue
                self._items.appendleft(item)

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)
