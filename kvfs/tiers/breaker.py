"""A circuit breaker for a remote tier: after repeated failures the tier is marked down and calls fail at once
(no network, no waiting for a timeout), except one probe every `probe_s` seconds; the first success closes it.

Thread-safe: failures and successes are recorded in worker threads, admission is asked on the trio thread.
State changes are logged once each (a significant event), never per request.
"""

from __future__ import annotations

import errno
import logging
import threading
import time

log = logging.getLogger(__name__)


class TierDown(OSError):
    """The tier is marked down: fail fast (EIO) instead of waiting for it."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(errno.EIO, f"{name} is down ({reason}); not asked until the next probe")


class Breaker:
    def __init__(self, name: str, failures: int = 3, probe_s: float = 5.0) -> None:
        self.name = name
        self.threshold = failures
        self.probe_s = probe_s
        self._lock = threading.Lock()
        self._failures = 0  # consecutive
        self._open = False
        self._next_probe = 0.0
        self._reason = ""
        self.opened = 0  # times it opened, for stats

    @property
    def state(self) -> str:
        return "open" if self._open else "closed"

    def available(self) -> bool:
        """True when a call would be let through now (closed, or a probe is due)."""
        with self._lock:
            return not self._open or time.monotonic() >= self._next_probe

    def admit(self) -> None:
        """Raise TierDown unless the call may go out; while open, one call per probe_s goes out as the probe."""
        with self._lock:
            if not self._open:
                return
            now = time.monotonic()
            if now < self._next_probe:
                raise TierDown(self.name, self._reason)
            self._next_probe = now + self.probe_s

    def success(self) -> None:
        with self._lock:
            self._failures = 0
            if not self._open:
                return
            self._open = False
        log.info("%s answers again: circuit closed", self.name)

    def failure(self, reason: str) -> None:
        with self._lock:
            self._failures += 1
            self._reason = reason
            if self._open:
                self._next_probe = time.monotonic() + self.probe_s
                return
            if self._failures < self.threshold:
                return
            self._open = True
            self.opened += 1
            self._next_probe = time.monotonic() + self.probe_s
        log.warning("%s is down after %d failures in a row (%s): circuit open, failing fast, probing every %g s",
                    self.name, self.threshold, reason, self.probe_s)

    def trip(self, reason: str) -> None:
        """Open now: a failure that will not go away by itself (the filesystem vanished, read-only)."""
        with self._lock:
            self._failures = max(self._failures, self.threshold)
            self._reason = reason
            self._next_probe = time.monotonic() + self.probe_s
            if self._open:
                return
            self._open = True
            self.opened += 1
        log.warning("%s is down (%s): circuit open, failing fast, probing every %g s", self.name, reason,
                    self.probe_s)

    @property
    def reason(self) -> str:
        return self._reason

    def stats(self) -> dict:
        with self._lock:
            return {"breaker": "open" if self._open else "closed", "breaker_opened": self.opened,
                    "consecutive_failures": self._failures}
