"""kvfs fsck inside the daemon: the job started through the mount's control channel, and its status.

Control channel (kvfs/frontend/ops serves it; the check itself is kvfs/fsck.py):
- setxattr(MOUNT/.kvfs, "user.kvfs.fsck", b"check" | b"repair") starts a job in the daemon's nursery; EBUSY
  while one runs, EACCES for anyone but the daemon's user or root, EINVAL for another value;
- getxattr of the same name: idle, running, done or failed;
- `.kvfs/fsck`: the current or last job as JSON (progress, findings, repairs, exit status).

Live, the mount keeps serving: objects are read and decoded in worker threads under the store's limiters,
index reads run on the trio thread, whatever looks wrong is looked at again under its inode lock (busy:
skipped this run), files with unsaved data are skipped, and repairs go through the daemon's own paths
(drop_corrupt, store accounting, kernel invalidation).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import time
from typing import Any, AsyncContextManager, Protocol

import trio

from .fsck import EXIT_FAILED, Checker, Host, Report
from .index import Index
from .locks import InodeLocks
from .openfile import FileCorrupt, PublishedGone
from .store import ObjectRef, Store

log = logging.getLogger(__name__)

XA_FSCK = b"user.kvfs.fsck"
MODES = {b"check": False, b"repair": True}  # the value written → repair?
SETTLE_S = 1.0  # deletions that run without the inode lock (unlink, remote batches) finish within this


class Refused(Exception):
    """A control request the daemon does not carry out: errno for the caller, reason for the log."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.errno = code
        self.reason = reason


class Operations(Protocol):
    """What a live fsck uses of the mounted filesystem (kvfs/frontend/ops's Operations, which imports this module)."""

    index: Index
    store: Store
    locks: InodeLocks
    open_files: dict[int, Any]
    nursery: trio.Nursery | None

    async def drop_corrupt(self, err: FileCorrupt) -> None: ...

    async def _maybe_delete(self, ino: int) -> None: ...

    async def forget_names(self, ino: int, names: list[tuple[int, bytes]]) -> None: ...


class LiveHost(Host):
    live = True
    settle_s = SETTLE_S

    def __init__(self, ops: "Operations") -> None:
        super().__init__(ops.index, ops.store)
        self.ops = ops

    def exclusive(self, ino: int) -> AsyncContextManager[bool]:
        return self.ops.locks.holding(ino, wait=False)

    def writing(self, ino: int) -> bool:
        state = self.ops.open_files.get(ino)
        return state is not None and state.modified

    def names_object(self, row) -> bool:
        return True  # an unlinked row is still open or known to the kernel: its object goes at the last release

    async def drop_file(self, ino: int, ref: ObjectRef, reason: str, corrupt: bool) -> None:
        # the path a read takes when it finds the object bad; a missing object is dropped as one that is gone
        # (no quarantine, not counted as a checksum failure)
        error = FileCorrupt(ino, reason) if corrupt else PublishedGone(ino, reason)
        await self.ops.drop_corrupt(error)
        await self.ops._maybe_delete(ino)  # unknown to the kernel and not open: row and object go now

    def charge(self, tier: str, size: int) -> None:
        self.store.charge(self.store.tiers[tier], size)

    def release(self, tier: str, size: int) -> None:
        self.store.release(tier, size)

    def relocated(self, ino: int, ref: ObjectRef) -> None:
        state = self.ops.open_files.get(ino)
        if state is not None:
            state.relocated(ref)

    async def forget_names(self, ino: int, names: list[tuple[int, bytes]]) -> None:
        await self.ops.forget_names(ino, names)


class LiveFsck:
    """The fsck jobs of one mount: one at a time; the last one's report stays readable until the next."""

    def __init__(self, ops: "Operations") -> None:
        self.ops = ops
        self.job_id = 0
        self.state = "idle"  # running, done, failed
        self.report: Report | None = None
        self.error: str | None = None
        self.started_at: float | None = None
        self.finished_at: float | None = None

    def request(self, value: bytes, uid: int) -> None:
        """setxattr(.kvfs, user.kvfs.fsck): start a job, or raise Refused."""
        if uid not in (0, os.getuid()):
            raise Refused(errno.EACCES, f"uid {uid} is neither the daemon's user nor root")
        mode = bytes(value).strip().lower()
        if mode not in MODES:
            raise Refused(errno.EINVAL, "the value must be check or repair")
        if self.state == "running":
            raise Refused(errno.EBUSY, f"fsck {self.job_id} is still running")
        checker = Checker(self.ops.index, self.ops.store, LiveHost(self.ops), MODES[mode])
        self.job_id += 1
        self.state, self.report, self.error = "running", checker.report, None
        self.started_at, self.finished_at = time.time(), None
        log.info("fsck %d started (%s)", self.job_id, mode.decode())
        self.ops.nursery.start_soon(self._run, checker)

    async def _run(self, checker: Checker) -> None:
        try:
            await checker.run()
            self.state = "done"
        except OSError as e:  # a tier failed (a remote store down): the check could not finish
            self.state, self.error = "failed", str(e)
            log.warning("fsck %d could not finish: %s", self.job_id, e)
        except Exception as e:
            self.state, self.error = "failed", f"internal error: {e!r}"
            log.exception("fsck %d failed", self.job_id)
        finally:
            if self.state == "running":  # cancelled: the daemon is unmounting
                self.state, self.error = "failed", "interrupted by unmount"
            self.finished_at = time.time()
        if self.state == "done":
            self._log_outcome(checker.report)

    def _log_outcome(self, report: Report) -> None:
        for f in report.findings:
            log.warning("fsck %d: %s %s in %s%s: %s%s", self.job_id, f.kind, f.object_id or "-", f.tier or "index",
                        f" (inode {f.ino}{', ' + f.path if f.path else ''})" if f.ino else "", f.detail,
                        f"; repaired: {f.repair}" if f.repair else "")
        counts = ", ".join(f"{n} {kind}" for kind, n in report.counts().items() if n) or "nothing found"
        for d in report.directories:
            if d["state"] == "down" or d["unavailable"]:
                counts += f"; {d['tier']} {d['path']} {d['state']}: {d['unavailable']} files not checked"
        log.info("fsck %d done: %d objects (%d bytes) checked, %d busy files skipped; %s; %d repaired",
                 self.job_id, report.objects_checked, report.bytes_checked, report.skipped, counts,
                 report.repaired)

    def status(self) -> bytes:
        """getxattr(.kvfs, user.kvfs.fsck)."""
        return self.state.encode()

    def render(self) -> bytes:
        """The `.kvfs/fsck` file."""
        doc: dict = {"id": self.job_id, "state": self.state}
        if self.report is not None:
            doc.update(started_at=self.started_at, finished_at=self.finished_at, error=self.error,
                       **self.report.to_dict())
            if self.state == "failed":
                doc["exit_status"] = EXIT_FAILED
        return (json.dumps(doc, indent=2) + "\n").encode()
