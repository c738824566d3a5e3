"""File operations on chunk files: exists, write atomically with xattrs. Reads and writes are kvfs.direct's:
past FUSE where the mount offers it (the writer encodes, kvfs adopts), through the mount otherwise."""

from __future__ import annotations

import errno
import os

from kvfs import direct

XA_DTYPE = "user.kvfs.dtype"
XA_SHAPE = "user.kvfs.shape"
XA_LOSSY = "user.kvfs.lossy"
XA_BLOCKS = "user.kvfs.blocks"  # the chunk's vLLM blocks (kvfs/events.py): what kvfs's KV events announce
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
    try:
        direct.write_through_mount(path, parts, xattrs, 0o644)
    except OSError as e:  # a shared kvfs L4: another node published this chunk meanwhile (immutable)
        if e.errno != errno.EXDEV or not exists(path):
            raise
        return None
    return "mount"
