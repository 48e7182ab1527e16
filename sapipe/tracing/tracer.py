"""A cheap in-process event log of the runtime (forward starts, collectives, waits).

Disabled by default; when enabled, every event is a tuple (time_ns, kind, fields). The
tests use it to check ordering (a stale all-reduce outlives the next forward's start);
the scheduler's Chrome-trace writer consumes the same events.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

Event = tuple[int, str, dict[str, Any]]


class Tracer:
    """Bounded event log: keeps the most recent ``capacity`` events."""

    def __init__(self, enabled: bool = False, capacity: int = 200_000):
        self.enabled = enabled
        self._events: collections.deque[Event] = collections.deque(maxlen=capacity)
        self._lock = threading.Lock()  # comm completions are recorded from comm threads

    def record(self, kind: str, at_ns: int | None = None, **fields: Any) -> None:
        """Log ``kind`` now (or at ``at_ns``, a ``time.perf_counter_ns()`` reading)."""
        if self.enabled:
            event = (time.perf_counter_ns() if at_ns is None else at_ns, kind, fields)
            with self._lock:
                self._events.append(event)

    def events(self) -> list[Event]:
        with self._lock:
            return list(self._events)

    def clear(self) -> None:
        with self._lock:
            self._events.clear()
