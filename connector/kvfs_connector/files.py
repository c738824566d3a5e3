"""File operations on chunk files: exists, write atomically with xattrs. Reads and writes are kvfs.direct's:
past FUSE where the mount offers it (the writer encodes, kvfs adopts), through the mount otherwise."""

from __future__ import annotations

import errno
import os
import threading
import time

from kvfs import direct

XA_DTYPE = "user.kvfs.dtype"
XA_SHAPE = "user.kvfs.shape"
XA_LOSSY = "user.kvfs.lossy"
XA_BLOCKS = "user.kvfs.blocks"  # the chunk's vLLM blocks (kvfs/events.py): what kvfs's KV events announce
XA_PREFETCH = "user.kvfs.prefetch"  # the hot/cold API (kvfs/hotcold.py): promote in the background
XA_IDLE = "user.kvfs.idle"  # the idle policy: not read for N seconds, down a tier
XA_CONGESTED = "user.kvfs.congested"  # 1 while kvfs's mover is behind: saves are shed (back-pressure)
XA_SHED = "user.kvfs.shed"  # report N skipped saves: kvfs counts them (saves_shed, kvfs_saves_shed_total)
CONGESTION_RECHECK_S = 0.25


class Congestion:
    """Whether the mount's mover is behind, asked at most every CONGESTION_RECHECK_S (one getxattr)."""

    def __init__(self, mount: str) -> None:
        self.mount = mount
        self._lock = threading.Lock()
        self._checked_at = -CONGESTION_RECHECK_S
        self._congested = False

    def __call__(self) -> bool:
        now = time.monotonic()
        with self._lock:
            if now - self._checked_at >= CONGESTION_RECHECK_S:
                self._checked_at = now
                try:
                    self._congested = os.getxattr(self.mount, XA_CONGESTED) == b"1"
                except OSError:
                    self._congested = False  # not kvfs, or an older one: no back-pressure signal
            return self._congested

    def report_shed(self, count: int = 1) -> None:
        """Tell kvfs `count` saves were skipped, so its stats and metrics count every shed save (best effort)."""
        try:
            os.setxattr(self.mount, XA_SHED, str(count).encode())
        except OSError:
            pass


def exists(path: str) -> bool:
    """True if the chunk file is there. ENOENT is False; other errors (dead mount) propagate."""
    try:
        os.stat(path)
        return True
    except FileNotFoundError:
        return False


def request(path: str, name: str, value: bytes) -> bool:
    """A hot/cold request on a chunk file; False where it cannot be made (gone, or not a kvfs mount). A hint:
    never worth failing a request for."""
    try:
        os.setxattr(path, name, value)
        return True
    except OSError:
        return False


def write_atomic_many(writes: list[tuple[str, list, dict[str, bytes]]], direct_writes: bool = False,
                      shed: bool = False) -> list[str | None | OSError]:
    """write_atomic for each (path, parts, xattrs), in order, its OSError in its place instead of raised.
    Direct writes of one directory are adopted together (kvfs.direct.write_files: one request to the daemon
    and one index transaction for the lot)."""
    if not direct_writes:
        return [_outcome(write_atomic, path, parts, xattrs, False, shed) for path, parts, xattrs in writes]
    out: list[str | None | OSError] = [None] * len(writes)
    todo = []
    for i, (path, _, _) in enumerate(writes):
        if not exists(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            todo.append(i)
    batch = [direct.FileToWrite(writes[i][0], writes[i][1], xattrs=writes[i][2], mode=0o644, exclusive=True)
             for i in todo]
    for i, went in zip(todo, direct.write_files(batch, shed=shed)):
        if isinstance(went, FileExistsError):
            out[i] = None
        else:
            out[i] = went if isinstance(went, OSError) else "direct" if went else "mount"
    return out


def _outcome(fn, *args) -> str | None | OSError:
    try:
        return fn(*args)
    except OSError as e:
        return e


def write_atomic(path: str, parts: list, xattrs: dict[str, bytes], direct_writes: bool = False,
                 shed: bool = False) -> str | None:
    """Write `parts` as the file `path`, atomically; None if the file exists already, else how it went:
    "direct" (encoded here and adopted by kvfs: kvfs.direct.write_file) or "mount" (a temporary name renamed
    into place, through the mount or on a plain directory).

    Readers see either no file or the whole file. The xattrs go with the file: kvfs reads user.kvfs.dtype and
    user.kvfs.shape to choose how to encode the file's frames. shed: a direct write is refused (OSError
    EBUSY) rather than wait while kvfs's mover is behind."""
    if exists(path):
        return None
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if direct_writes:
        try:
            went = direct.write_file(path, parts, xattrs=xattrs, mode=0o644, exclusive=True, shed=shed)
            return "direct" if went else "mount"
        except FileExistsError:
            return None
    try:
        direct.write_through_mount(path, parts, xattrs, 0o644)
    except OSError as e:  # a shared kvfs L4: another node published this chunk meanwhile (immutable)
        if e.errno != errno.EXDEV or not exists(path):
            raise
        return None
    return "mount"
