"""One directory of a tier spread over several (kvfs/tiers/spread.py): its health and its own accounting.

A member is *up*, *full* or *down*:
- full: the disk answered ENOSPC (it holds less than the configured capacity) or EROFS (remounted
  read-only, e.g. by ext4 after errors). New objects go elsewhere until a deletion there frees room or
  FULL_RETRY_S passes; its objects still read.
- down: its breaker is open after EIO (FAILURES in a row), or at once when its filesystem vanished
  (unmounted under the mount). Its calls fail fast with MemberDown (EIO), except one probe every PROBE_S;
  the first that succeeds brings it back.

"Vanished" is seen by an identity marker: a file holding a random id, written when the directory is first
used. A filesystem unmounted under a live mount shows the directory beneath it, which has no marker (or
another one): nothing is read from or written to it then. The id also names the member in placement, so
an object's place does not depend on the order directories are listed in.

Accounting (bytes and objects held) is seeded by the spread tier's first scan and kept by its puts and
deletions. Deletions asked while down are remembered and done when the member is back.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import threading
import time
from pathlib import Path

from ..ratelimit import Throttle
from .base import Tier
from .breaker import Breaker, TierDown
from .directory import DirectoryTier

log = logging.getLogger(__name__)

MARKER = ".kvfs-directory"  # at the top of the directory: scans only look into shard directories
FAILURES = 3  # I/O errors in a row that take a member down
PROBE_S = 5.0  # a down member is tried again this often
FULL_RETRY_S = 5.0  # a member that said ENOSPC is offered new objects again after this (or a deletion there)
FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)  # the disk takes no more: not a failure


class MemberDown(TierDown):
    """A directory of a spread tier is down: its objects are unavailable (EIO), the others' are served."""

    def __init__(self, member: "Member") -> None:
        OSError.__init__(self, errno.EIO, f"{member.root} is down ({member.breaker.reason}); its files are "
                                          "unavailable until it answers again")
        self.directory = str(member.root)


class Member(DirectoryTier):
    def __init__(self, tier_name: str, root: Path, capacity: int, persistent: bool) -> None:
        Tier.__init__(self, f"{tier_name} {root}", capacity, persistent)
        self.root = Path(root)
        self.breaker = Breaker(self.name, FAILURES, PROBE_S)
        self.identity = ""
        self.opened = False  # False: it could not be used at start; it stays down until the next start
        self.full_until = 0.0
        self.full_reason = ""
        self.pending: set[str] = set()  # object ids to delete once the member answers again
        self.seeded = False
        self.written_files = self.written_bytes = self.read_bytes = self.failures = 0
        self._lock = threading.Lock()
        self._full_log = Throttle()  # under steady pressure a full disk fills again after every deletion
        try:
            self.identity = self._open()
            self.opened = True
        except OSError as e:
            self.failures += 1
            self.breaker.trip(f"unusable at start: {e.strerror or e}")

    def _open(self) -> str:
        """Create the directory if needed; read its identity marker, writing one into a directory without."""
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)
        marker = self.root / MARKER
        try:
            return marker.read_text().strip()
        except FileNotFoundError:
            pass
        identity = secrets.token_hex(16)
        tmp = marker.with_name(MARKER + ".tmp")
        with open(tmp, "w") as f:
            f.write(identity + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, marker)
        return identity

    # -- health ----------------------------------------------------------------------------------------
    @property
    def state(self) -> str:
        if self.breaker.state == "open":
            return "down"
        return "full" if time.monotonic() < self.full_until else "up"

    def admit(self) -> None:
        """Raise MemberDown unless a call may go out (up, or a probe is due)."""
        if not self.opened:
            raise MemberDown(self)
        try:
            self.breaker.admit()
        except TierDown:
            raise MemberDown(self) from None

    def usable(self) -> bool:
        """A call would be let through now (for the trio thread: no I/O)."""
        return self.opened and self.breaker.available()

    def check(self) -> None:
        """Raise MemberDown (taking the member down) unless the directory is still this member: its marker
        readable and ours. Cheap: one small read."""
        try:
            ours = (self.root / MARKER).read_text().strip() == self.identity
        except FileNotFoundError:
            ours = False
        except OSError as e:
            self.failed(e)
            raise MemberDown(self) from None
        if not ours:
            self.failures += 1
            self.breaker.trip("its filesystem vanished: the directory's marker is gone")
            raise MemberDown(self)

    def failed(self, e: OSError) -> None:
        """Account a failed call: ENOSPC or EROFS makes the member full for a while, any other error counts
        towards its breaker."""
        if e.errno in FULL_ERRNOS:
            if self.state == "up" and self._full_log.due():
                log.warning("%s takes no new objects for now (%s at %d MiB of %d MiB): they go to the other "
                            "directories", self.name, e.strerror, self.used_bytes >> 20, self.capacity >> 20)
            self.full_until = time.monotonic() + FULL_RETRY_S
            self.full_reason = e.strerror or str(e)
            return
        if isinstance(e, (MemberDown, FileNotFoundError)):
            return
        self.failures += 1
        self.breaker.failure(e.strerror or str(e))

    def succeeded(self, wrote: bool = False) -> None:
        """A call went through: close the breaker. When it was down, or after a write (it takes writes again),
        the deletions asked while it could not are done too."""
        back = self.breaker.state == "open"
        self.breaker.success()
        if (back or wrote) and self.pending:
            self._delete_pending()

    def _delete_pending(self) -> None:
        with self._lock:
            pending, self.pending = self.pending, set()
        for oid in pending:
            try:
                self.remove(oid)
            except OSError:
                with self._lock:
                    self.pending.add(oid)
                return

    def status(self) -> dict:
        """Per-directory figures for .kvfs/stats."""
        state = self.state
        return {"path": str(self.root), "state": state,
                "reason": {"down": self.breaker.reason, "full": self.full_reason}.get(state),
                "capacity_bytes": self.capacity, "used_bytes": self.used_bytes, "files": self.files,
                "written_files": self.written_files, "written_bytes": self.written_bytes,
                "read_bytes": self.read_bytes, "failures": self.failures,
                "breaker_opened": self.breaker.opened, "pending_deletions": len(self.pending)}

    # -- accounting (worker threads) ---------------------------------------------------------------------
    def room(self) -> int:
        """What this member adds to the tier's capacity: all of its own while it takes new objects; only
        what it holds while full or down (so the mover makes room elsewhere instead of counting on it)."""
        return self.capacity if self.state == "up" and self.opened else min(self.used_bytes, self.capacity)

    def reserve(self, size: int) -> bool:
        """Count a new object of `size` bytes (its put is about to start), if the member has room for it."""
        with self._lock:
            if self.used_bytes + size > self.capacity:
                return False
            self.used_bytes += size
            self.files += 1
            return True

    def settle(self, reserved: int, size: int | None) -> None:
        """A put ended: `size` bytes written, or None when it failed."""
        with self._lock:
            if size is None:
                self.used_bytes -= reserved
                self.files -= 1
            else:
                self.used_bytes += size - reserved
                self.written_files += 1
                self.written_bytes += size

    def seed(self, used: int, files: int) -> None:
        with self._lock:
            self.used_bytes, self.files, self.seeded = used, files, True

    def forget_later(self, object_id: str) -> None:
        with self._lock:
            self.pending.add(object_id)

    def remove(self, object_id: str) -> int | None:
        """Delete an object held here; its size, or None when it is not here."""
        path = self._path(object_id)
        try:
            size = path.stat().st_size
            os.unlink(path)
        except FileNotFoundError:
            return None
        with self._lock:  # never below zero: an object put by an earlier run before the first scan
            self.used_bytes = max(0, self.used_bytes - size)
            self.files = max(0, self.files - 1)
        self.full_until = 0.0  # room was freed: worth trying again
        return size
