"""Rate limits for the log: a failure that repeats on every request (a full disk fails every move, a store
that stopped answering fails every commit) is said once a period, with its count, not once per request."""

from __future__ import annotations

import time

WARN_EVERY_S = 60.0


class Throttle:
    """`due()` is True at most once per `period_s` (the first call included)."""

    def __init__(self, period_s: float = WARN_EVERY_S) -> None:
        self.period_s = period_s
        self._last = -float("inf")

    def due(self) -> bool:
        now = time.monotonic()
        if now - self._last < self.period_s:
            return False
        self._last = now
        return True
