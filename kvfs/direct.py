"""Bulk reads past FUSE: names and metadata through the mount, the encoded object read from its tier directly.

A FUSE data path served by a Python daemon tops out near 1 GB/s on this class of machine (docs/fuse.md),
below what an engine loading KV wants. So, as DeepSeek 3FS does, a reader may ask the mount where a file's
object lies (`getxattr user.kvfs.object`, which the daemon answers only for committed files in a local tier
directory, and counts as a read: LRU, hits and promotion stay right), open that object itself, and decode
it in its own process with the documented format (docs/format.md): every frame verified by its checksums.

Why this is safe:
- objects are immutable and never reused (a commit writes a new id, temp name + rename), so an object
  opened by path is a complete snapshot of the file; a move or a new commit unlinks the old object only
  after the index switch, and an already open descriptor keeps reading the complete old bytes;
- filesystem permissions apply twice: getxattr needs read access through the mount, and the tier
  directories are 0700, so only the daemon's user (or root) can open objects directly;
- anything unexpected — no answer, a vanished or unreadable object, a size or checksum mismatch — falls
  back to an ordinary read through the mount, where the daemon verifies again, drops a corrupt file and
  answers EIO. Corruption is handled in one place; this module never returns unverified bytes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import errno
import os
import threading

import numpy as np

from . import format as fmt
from .codecs import kernel
# writes: the mirror of these reads
from .direct_write import FileToWrite, write_file, write_files, write_through_mount  # noqa: F401

XA_OBJECT = "user.kvfs.object"
VALUE_MAX = 4096
PROBE = 64 << 10  # header + table of up to ~1800 frames in one read
READ_CHUNK = 8 << 20
LOCATE_TRIES = 3  # objects that keep moving under a reader are read through the mount

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.getxattr.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t]
_libc.getxattr.restype = ctypes.c_ssize_t
_NO_ANSWER = {errno.ENODATA, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ERANGE}


@dataclasses.dataclass(frozen=True)
class Location:
    """Where the daemon says a file's object is: `<tier> <stored bytes> <logical size> <path>`."""

    tier: str
    stored_bytes: int
    size: int
    path: str

    def encode(self) -> bytes:
        return f"{self.tier} {self.stored_bytes} {self.size} {self.path}".encode()

    @classmethod
    def decode(cls, value: bytes) -> "Location":
        tier, stored, size, path = value.decode().split(" ", 3)  # the path last: it may hold spaces
        return cls(tier, int(stored), int(size), path)


class Unavailable(Exception):
    """The direct path cannot serve this file now; read it through the mount."""


class Moved(Unavailable):
    """The object named is gone: a move or a new commit replaced it after the location was asked."""


def locate(path: str | os.PathLike) -> Location | None:
    """The object of a file in a kvfs mount, or None when the daemon offers none (not kvfs, not committed,
    not in a local tier). One getxattr call with a buffer large enough for any answer: the daemon counts
    each call as a read, so probing for the size first would count twice."""
    buf = ctypes.create_string_buffer(VALUE_MAX)
    n = _libc.getxattr(os.fsencode(path), XA_OBJECT.encode(), buf, VALUE_MAX)
    if n < 0:
        err = ctypes.get_errno()
        if err in _NO_ANSWER:
            return None
        raise OSError(err, os.strerror(err), str(path))
    try:
        return Location.decode(buf.raw[:n])
    except ValueError:
        return None


def read_object(loc: Location, offset: int = 0, length: int | None = None,
                into=None) -> bytearray | memoryview:
    """Bytes [offset, offset+length) of the file whose object `loc` names, decoding only the frames they
    touch; into the start of `into` where given (any writable buffer: a reused one spares the page faults of
    a fresh one, a pinned one lets a GPU copy it without staging), and then a view of it is returned. Raises Unavailable (object gone or unreadable) or fmt.CorruptObject (never
    returns those bytes)."""
    try:
        fd = os.open(loc.path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        gone = Moved if e.errno == errno.ENOENT else Unavailable
        raise gone(f"{loc.path}: {e.strerror}") from e
    try:
        size = os.fstat(fd).st_size
        if size != loc.stored_bytes:
            raise fmt.CorruptObject(f"object is {size} bytes, the index says {loc.stored_bytes}")
        header, table, frames = _layout(fd, loc)
        end = header.raw_size if length is None else min(header.raw_size, offset + length)
        out = _buffer(max(0, end - offset), into)
        if len(out):
            _decode_range(fd, header, table, frames, offset, end, memoryview(out))
        return out
    finally:
        os.close(fd)


def _buffer(size: int, into: bytearray | None) -> bytearray | memoryview:
    if into is None:
        return bytearray(size)
    if len(into) < size:
        raise ValueError(f"buffer of {len(into)} bytes for {size}")
    return memoryview(into)[:size]


def _layout(fd: int, loc: Location) -> tuple[fmt.Header, memoryview, list[fmt.FrameEntry]]:
    """The object's header, its frame table as stored (for the kernel) and parsed (both verified)."""
    header, table, entries = read_head(fd, loc.stored_bytes)
    if header.raw_size != loc.size:
        raise Unavailable(f"object holds {header.raw_size} bytes, the file has {loc.size}")
    if header.sealing is not None:
        raise Unavailable("sealed object (encryption at rest): the mount, which holds the key, opens it")
    return header, table, entries


def read_head(fd: int, object_size: int, probe: int = PROBE) -> tuple[fmt.Header, memoryview, list[fmt.FrameEntry]]:
    """An open object's header, its frame table as stored and parsed, both verified (CorruptObject). One read
    of `probe` bytes, and a second where the table is longer."""
    head = os.pread(fd, probe, 0)
    header = fmt.parse_header(head)
    if header.data_offset > len(head):
        head = os.pread(fd, header.data_offset, 0)
    if len(head) < header.data_offset:
        raise fmt.CorruptObject("object shorter than its frame table")
    table = memoryview(head)[header.size:header.size + header.n_frames * fmt.FRAME_ENTRY.size]
    return header, table, fmt.parse_table(header, memoryview(head)[header.size:], object_size)


def _decode_range(fd: int, header: fmt.Header, table: memoryview, frames: list[fmt.FrameEntry], start: int,
                  end: int, out: memoryview) -> None:
    F = header.frame_size
    first, stop = -(-start // F), end // F  # the frames wholly inside [start, end)
    if end == header.raw_size:
        stop = header.n_frames  # the last frame may be short
    if first >= stop:  # no whole frame: a part of one or two
        for i in range(start // F, -(-end // F)):
            _decode_part(fd, i, frames[i], F, start, end, out)
        return
    if start < first * F:
        _decode_part(fd, first - 1, frames[first - 1], F, start, end, out)
    _decode_frames(fd, table, frames, first, stop, out[first * F - start:min(end, stop * F) - start])
    if stop * F < end:
        _decode_part(fd, stop, frames[stop], F, start, end, out)


def _decode_frames(fd: int, table: memoryview, frames: list[fmt.FrameEntry], first: int, stop: int,
                   dest: memoryview) -> None:
    """Whole frames [first, stop) into dest, as runs decoded by the kernel without the GIL; a frame it does
    not decode (another codec or transform) is decoded here, and the run goes on after it."""
    E = fmt.FRAME_ENTRY.size
    at = ctypes.c_int64()
    out = np.frombuffer(dest, dtype=np.uint8)
    base = out.ctypes.data
    done = 0
    i = first
    while i < stop:
        run = table[i * E:stop * E]
        src = np.frombuffer(run, dtype=np.uint8)
        rc = kernel.lib.kvfs_read_frames(fd, src.ctypes.data, stop - i, base + done, len(dest) - done,
                                         ctypes.byref(at))
        for entry in frames[i:i + at.value]:
            done += entry.raw_len
        i += at.value
        if rc == kernel.READ_OK:
            return
        if rc != kernel.UNSUPPORTED:
            _raise_kernel_error(rc, i)
        entry = frames[i]
        _decode_whole(fd, entry, dest[done:done + entry.raw_len])
        done += entry.raw_len
        i += 1


def _raise_kernel_error(rc: int, frame: int) -> None:
    if rc == kernel.ERR_IO:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    if rc == kernel.ERR_NOMEM:
        raise MemoryError("kvfs.direct: no memory for a frame's payload")
    what = {kernel.ERR_SHORT: "object shorter than its frame table says",
            kernel.ERR_PAYLOAD: "payload checksum mismatch", kernel.ERR_DECODE: "does not decode",
            kernel.ERR_RAW: "raw checksum mismatch"}.get(rc)
    if what is None:
        raise ValueError(f"kvfs_read_frames: bad arguments ({rc})")
    raise fmt.CorruptObject(f"frame {frame}: {what}")


def _decode_whole(fd: int, entry: fmt.FrameEntry, dest: memoryview) -> None:
    if entry.is_hole:
        dest[:] = bytes(len(dest))
    elif entry.codec == 0 and entry.transform == 0:
        _read_stored_frame(fd, entry, dest)  # stored raw: read in place, one checksum
    else:  # decoded straight into the buffer where the codec can
        fmt.decode_frame_into(entry, _pread_scratch(fd, entry.offset, entry.stored_len), dest)


def _decode_part(fd: int, i: int, entry: fmt.FrameEntry, F: int, start: int, end: int, out: memoryview) -> None:
    """The part of frame i inside [start, end): the whole frame decoded, then the part copied."""
    lo, hi = max(start, i * F), min(end, i * F + entry.raw_len)
    if lo >= hi:
        return
    payload = b"" if entry.is_hole else _pread_exact(fd, entry.offset, entry.stored_len)
    out[lo - start:hi - start] = memoryview(fmt.decode_frame(entry, payload)).cast("B")[lo - i * F:hi - i * F]


def _read_stored_frame(fd: int, entry: fmt.FrameEntry, dest: memoryview) -> None:
    if entry.stored_len != entry.raw_len:
        raise fmt.CorruptObject("stored frame length differs from its raw length")
    _pread_into(fd, entry.offset, dest)
    digest = fmt.xxh3(dest)
    if digest != entry.stored_xxh3 or digest != entry.raw_xxh3:
        raise fmt.CorruptObject("frame payload checksum mismatch")


_local = threading.local()


def _pread_scratch(fd: int, offset: int, length: int) -> memoryview:
    """Like _pread_exact, into this thread's reused buffer (a fresh MB buffer costs a page fault per 4 KiB).
    Valid until the thread's next call."""
    buf = getattr(_local, "buf", None)
    if buf is None or len(buf) < length:
        buf = _local.buf = bytearray(max(length, 1 << 20))
    view = memoryview(buf)[:length]
    _pread_into(fd, offset, view)
    return view


def _pread_exact(fd: int, offset: int, length: int) -> bytearray:
    buf = bytearray(length)
    _pread_into(fd, offset, memoryview(buf))
    return buf


def _pread_into(fd: int, offset: int, dest: memoryview) -> None:
    done = 0
    while done < len(dest):
        n = os.preadv(fd, [dest[done:done + READ_CHUNK]], offset + done)
        if n == 0:
            raise fmt.CorruptObject("object shorter than its frame table says")
        done += n


def read_through_mount(path: str | os.PathLike, expected_size: int | None = None,
                       into: bytearray | None = None) -> bytearray | memoryview:
    """An ordinary read of the whole file (large requests; FUSE splits them into max_read pieces)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        if expected_size is not None and size != expected_size:
            raise OSError(errno.EBADMSG, f"file is {size} bytes, expected {expected_size}", str(path))
        buf = _buffer(size, into)
        view = memoryview(buf)
        done = 0
        while done < size:
            n = os.readv(fd, [view[done:done + READ_CHUNK]])
            if n == 0:
                raise OSError(errno.EBADMSG, "file shrank while reading", str(path))
            done += n
        return buf
    finally:
        os.close(fd)


def read_file(path: str | os.PathLike, expected_size: int | None = None,
              into: bytearray | None = None) -> tuple[bytearray | memoryview, bool]:
    """The whole verified content of a file in a kvfs mount (in `into` where given), and whether it came
    past FUSE.

    Any other file (another filesystem, a file being written) is read the ordinary way. Raises OSError as
    a read would (ENOENT, EIO for a corrupt file, EBADMSG when the size is not `expected_size`)."""
    loc = locate(path)
    for _ in range(LOCATE_TRIES):
        if loc is None or (expected_size is not None and loc.size != expected_size):
            break
        try:
            return read_object(loc, into=into), True
        except Moved:
            moved = locate(path)  # a move (promotion, demotion) unlinked it meanwhile: ask where it is now
            if moved == loc:
                break
            loc = moved
        except (Unavailable, fmt.CorruptObject):
            break  # the mount decides: the daemon reads the object again and answers data or EIO
    return read_through_mount(path, expected_size, into), False
