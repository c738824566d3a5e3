"""File operations on chunk files: exists, write atomically with xattrs. Reads and writes are kvfs.direct's:
past FUSE where the mount offers it (the writer encodes, kvfs adopts), through the mount otherwise."""

from __future__ import annotations

import errno
import os
import uuid

from kvfs import direct

XA_DTYPE = "user.kvfs.dtype"
XA_SHAPE = "user.kvfs.shape"
XA_LOSSY = "user.kvfs.lossy"
XA_PREFETCH = "user.kvfs.prefetch"  # the hot/cold API (kvfs/hotcold.py): promote in the background
XA_IDLE = "user.kvfs.idle"  # the idle policy: not read for N seconds, down a tier


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


def write_atomic(path: str, parts: list, xattrs: dict[str, bytes], direct_writes: bool = False) -> str | None:
    """Write `parts` as the file `path`, atomically; None if the file exists already, else how it went:
    "direct" (encoded here and adopted by kvfs: kvfs.direct.write_file) or "mount" (a temporary name renamed
    into place, through the mount or on a plain directory).

    Readers see either no file or the whole file. The xattrs go with the file: kvfs reads user.kvfs.dtype and
    user.kvfs.shape to choose how to encode the file's frames."""
    if exists(path):
        return None
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if direct_writes:
        try:
            return "direct" if direct.write_file(path, parts, xattrs=xattrs, mode=0o644, exclusive=True) else "mount"
        except FileExistsError:
            return None
    directory = os.path.dirname(path)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        for name, value in xattrs.items():
            try:
                os.setxattr(fd, name, value)
            except OSError as e:  # a plain directory (no user xattrs, or no kvfs): the data is what matters
                if e.errno not in (errno.ENOTSUP, errno.EOPNOTSUPP, errno.EINVAL, errno.EPERM):
                    raise
        for part in parts:
            view = memoryview(part).cast("B")
            while view:
                n = os.write(fd, view)
                view = view[n:]
        os.close(fd)
        fd = -1
        try:
            os.rename(tmp, path)
        except OSError as e:  # a shared kvfs L4: another node published this chunk meanwhile (immutable)
            if e.errno != errno.EXDEV or not exists(path):
                raise
            os.unlink(tmp)
            return None
        return "mount"
    except BaseException:
        if fd >= 0:
            os.close(fd)
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
