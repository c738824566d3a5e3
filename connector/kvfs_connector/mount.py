"""Is the kvfs mount usable? A missing or dead mount is a miss, logged once per change, never a crash."""

from __future__ import annotations

import errno
import logging
import os
import threading
import time

log = logging.getLogger("vllm.kvfs_connector")  # under vLLM's logger: its handlers and level
RECHECK_S = 5.0


class MountGuard:
    def __init__(self, path: str, require_mount: bool) -> None:
        self.path = os.path.abspath(path)
        self.require_mount = require_mount
        self._lock = threading.Lock()
        self._checked_at = -RECHECK_S
        self._usable = False
        self._reason: str | None = None

    def usable(self) -> bool:
        """Cheap: re-checks at most every RECHECK_S seconds."""
        now = time.monotonic()
        if now - self._checked_at < RECHECK_S:
            return self._usable
        with self._lock:
            if now - self._checked_at >= RECHECK_S:
                self._set(self._probe())
                self._checked_at = now
        return self._usable

    def failed(self, err: OSError) -> None:
        """An operation on the mount failed. Only errors that mean the mount itself is gone switch the
        connector to misses; EIO (one damaged file, which kvfs drops) or ENOSPC stay per file."""
        if err.errno in (errno.ENOTCONN, errno.ENODEV, errno.ESTALE):
            with self._lock:
                self._set(f"{os.strerror(err.errno)} on {self.path}")
                self._checked_at = time.monotonic()

    def _probe(self) -> str | None:
        try:
            st = os.stat(self.path)
        except OSError as e:
            return f"{self.path}: {e.strerror}"
        if not os.path.isdir(self.path):
            return f"{self.path} is not a directory"
        if self.require_mount and not os.path.ismount(self.path):
            return f"{self.path} is not a mount point (is kvfs mounted?)"
        del st
        return None

    def _set(self, reason: str | None) -> None:
        if reason == self._reason and self._checked_at >= 0:
            self._usable = reason is None
            return
        if reason is None:
            log.info("kvfs connector: using %s", self.path)
        else:
            log.warning("kvfs connector: %s; acting as a miss until it is back", reason)
        self._reason = reason
        self._usable = reason is None
