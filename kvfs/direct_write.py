"""Bulk writes past FUSE: the writer encodes, the daemon adopts (the mirror of kvfs.direct's reads).

`write_file(path, data)` asks the mount how new files in the directory are encoded and where to stage them
(`getxattr(dir, user.kvfs.staging)`), encodes the object in this process with the same format and codec
choice as the daemon (kvfs.openfile.EncodingPolicy, kvfs.format), writes it into the staging directory, and
asks the mount to adopt it under the file's name (`setxattr(dir, user.kvfs.adopt)`). The daemon verifies it,
places it and names it in one index transaction: readers see no file or the whole file.

Where that cannot work — not a kvfs mount, a mount that offers no direct writes, no rights on the tier
directories (another user), a codec this process lacks (QAT hardware), a full staging filesystem — the file
is written through the mount instead, under a temporary name renamed into place, as before.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import errno
import os
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence

from . import codecs
from . import format as fmt
from . import lossy as lossy_modes
from .openfile import EncodingPolicy
from .staging import (MAX_BATCH, XA_ADOPT, XA_STAGING, XATTR_SIZE_MAX, AdoptRequest, Offer, crash_point,
                      staged_name)

XA_DTYPE = "user.kvfs.dtype"
XA_SHAPE = "user.kvfs.shape"
XA_LOSSY = "user.kvfs.lossy"
OFFER_TTL_S = 1.0
IOV_MAX = 1024
# errnos that mean "not this way here": write through the mount instead
_NOT_OFFERED = {errno.ENODATA, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ERANGE}
_NO_RIGHTS = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.ENOENT}

Buffer = bytes | bytearray | memoryview
_offers: dict[str, tuple[float, Offer]] = {}  # directory → (expiry, offer)


def write_file(path: str | os.PathLike, data: Buffer | Sequence[Buffer], *, dtype: str | None = None,
               shape: str | bytes | None = None, xattrs: Mapping[str, bytes] | None = None, mode: int = 0o666,
               exclusive: bool = False, threads: int = 1, shed: bool = False) -> bool:
    """Write a whole file into a kvfs mount, atomically (readers see the old file, or none, or all of it).
    Returns True when it went past FUSE (encoded here, adopted by the daemon), False when written through
    the mount (always for an empty file: there is no object to move).

    data: one buffer or a sequence of buffers (concatenated). dtype, shape: user.kvfs.dtype and
    user.kvfs.shape of the new file (they guide the codec). xattrs: other user.* attributes it is created
    with. mode: permission bits before the umask. exclusive: FileExistsError if the name exists (otherwise
    it is replaced, as by rename). threads: frames encoded in parallel. shed: a save the caller can do
    without: while the mount's mover is behind (user.kvfs.congested) the adoption is refused with EBUSY
    instead of waiting for room, and nothing is written.
    Raises OSError as a write through the mount would (ENOSPC when no tier has room, …)."""
    f = _prepare(FileToWrite(path, data, dtype, shape, xattrs, mode, exclusive))
    offer = staging_offer(f.directory) if f.size else None  # an empty file has no object
    if offer is not None:
        staged = _stage(offer, f.parts, f.attrs, threads)
        if staged is None and (offer := staging_offer(f.directory, fresh=True)) is not None:
            staged = _stage(offer, f.parts, f.attrs, threads)  # the offer may have changed (a remount)
        if staged is not None:
            crash_point("writer-staged")
            try:
                os.setxattr(f.directory, XA_ADOPT, f.request(staged, shed).encode())
                return True
            except OSError as e:
                _unlink_quietly(staged)
                _raise_unless_not_offered(e, f.path)
    write_through_mount(f.path, f.parts, f.attrs, f.mode, f.exclusive)
    return False


@dataclasses.dataclass
class FileToWrite:
    """One file for write_files: what write_file takes for it."""

    path: str | os.PathLike
    data: Buffer | Sequence[Buffer]
    dtype: str | None = None
    shape: str | bytes | None = None
    xattrs: Mapping[str, bytes] | None = None
    mode: int = 0o666
    exclusive: bool = False


def write_files(files: Sequence[FileToWrite], *, threads: int = 1,
                shed: bool = False) -> list[bool | OSError]:
    """Write several whole files, each atomically, as write_file would, with one adoption request per
    directory (up to MAX_BATCH files, one daemon request and one index transaction) instead of one per file.
    Returns what write_file would for each file, in order: True (past FUSE), False (through the mount), or
    the OSError it would have raised (FileExistsError, EBUSY when shed, ENOSPC, …). The daemon adopts a batch
    whole or not at all; a batch it refuses is written again file by file, so each file gets its own answer."""
    prepared = [_prepare(f) for f in files]
    results: list[bool | OSError | None] = [None] * len(files)
    by_directory: dict[str, list[int]] = {}
    for i, f in enumerate(prepared):
        if f.size:  # an empty file has no object: write_file, below
            by_directory.setdefault(f.directory, []).append(i)
    for directory, indices in by_directory.items():
        offer = staging_offer(directory)
        staged = [(i, path) for i in indices if offer is not None
                  and (path := _stage(offer, prepared[i].parts, prepared[i].attrs, threads)) is not None]
        for batch in _batches([(i, path, prepared[i].request(path, shed).encode()) for i, path in staged]):
            crash_point("writer-staged")
            try:
                os.setxattr(directory, XA_ADOPT, b"\n\n".join(request for _, _, request in batch))
                for i, _, _ in batch:
                    results[i] = True
            except OSError as e:
                _unlink_quietly(*(path for _, path, _ in batch))
                if e.errno == errno.EBUSY and shed:  # shed: the whole batch, as it would be file by file
                    for i, _, _ in batch:
                        results[i] = OSError(errno.EBUSY, os.strerror(errno.EBUSY), prepared[i].path)
    for i, f in enumerate(files):
        if results[i] is None:  # not offered, not staged here, or in a refused batch: alone, as write_file
            try:
                results[i] = write_file(f.path, f.data, dtype=f.dtype, shape=f.shape, xattrs=f.xattrs,
                                        mode=f.mode, exclusive=f.exclusive, threads=threads, shed=shed)
            except OSError as e:
                results[i] = e
    return results  # type: ignore[return-value]


@dataclasses.dataclass
class _Prepared:
    path: str
    directory: str
    name: str
    parts: list[memoryview]
    attrs: dict[str, bytes]
    mode: int  # after the umask
    exclusive: bool

    @property
    def size(self) -> int:
        return sum(len(p) for p in self.parts)

    def request(self, staged: str, shed: bool) -> AdoptRequest:
        return AdoptRequest(os.path.basename(staged), os.fsencode(self.name), self.mode, self.exclusive,
                            tuple((k.encode(), v) for k, v in self.attrs.items()), shed)


def _prepare(f: FileToWrite) -> _Prepared:
    data = f.data
    parts = [memoryview(p).cast("B") for p in ([data] if isinstance(data, (bytes, bytearray, memoryview)) else data)]
    attrs = {k: bytes(v) for k, v in (f.xattrs or {}).items()}
    if f.dtype is not None:
        attrs[XA_DTYPE] = f.dtype.encode()
    if f.shape is not None:
        attrs[XA_SHAPE] = f.shape.encode() if isinstance(f.shape, str) else bytes(f.shape)
    path = os.fspath(f.path)
    directory, name = os.path.split(os.path.abspath(path))
    return _Prepared(path, directory, name, parts, attrs, f.mode & ~_umask() & 0o7777, f.exclusive)


def _batches(requests: list[tuple[int, str, bytes]]) -> Iterator[list[tuple[int, str, bytes]]]:
    """Requests grouped into setxattr values the kernel takes (XATTR_SIZE_MAX) and the daemon allows."""
    batch: list[tuple[int, str, bytes]] = []
    size = 0
    for item in requests:
        if batch and (size + 2 + len(item[2]) > XATTR_SIZE_MAX or len(batch) == MAX_BATCH):
            yield batch
            batch, size = [], 0
        size += len(item[2]) + (2 if batch else 0)
        batch.append(item)
    if batch:
        yield batch


def _raise_unless_not_offered(e: OSError, path: str) -> None:
    """A refused adoption: raised as the write's error, unless it means "write through the mount"."""
    if e.errno == errno.EEXIST:
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), path) from None
    if e.errno not in _NOT_OFFERED | {errno.EACCES, errno.EPERM}:
        raise OSError(e.errno, f"adopting the staged object: {e.strerror}", path) from None


def staging_offer(directory: str, fresh: bool = False) -> Offer | None:
    """The mount's direct-write offer for new files in `directory`, or None (not kvfs, or not offered).
    Kept for OFFER_TTL_S: one FUSE request fewer per file for a writer that saves many."""
    now = time.monotonic()
    cached = _offers.get(directory)
    if cached is not None and cached[0] > now and not fresh:
        return cached[1]
    try:
        value = os.getxattr(directory, XA_STAGING)
    except OSError as e:
        if e.errno in _NOT_OFFERED:
            return None
        raise
    try:
        offer = Offer.decode(value)
    except ValueError:
        return None  # another protocol version: the mount still takes writes
    if len(_offers) > 4096:
        _offers.clear()
    _offers[directory] = (now + OFFER_TTL_S, offer)
    return offer


def encode_object(parts: Sequence[memoryview], offer: Offer, attrs: Mapping[str, bytes],
                  threads: int = 1) -> list[bytes]:
    """The object of a file holding `parts`, encoded as the daemon would for a new file in the offer's
    directory: [header + frame table, payload, …]."""
    policy = _policy(offer, attrs)
    frames = list(_encoded_frames(parts, policy, offer.frame_size, threads))
    out, _ = fmt.build_object(policy.header(sum(len(p) for p in parts), offer.frame_size), frames)
    return out


def _encoded_frames(parts: Sequence[memoryview], policy: EncodingPolicy, frame_size: int,
                    threads: int) -> Iterator[fmt.EncodedFrame]:
    """The frames encoded, in order; the first alone (it chooses the codec), the others by `threads`."""
    jobs = ((frame, i * frame_size) for i, frame in enumerate(_frames(parts, frame_size)))
    first = next(jobs, None)
    if first is None:
        return
    yield policy.encode(*first)
    if threads > 1:
        with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="kvfs-encode") as pool:
            yield from pool.map(lambda job: policy.encode(*job), jobs)
    else:
        for job in jobs:
            yield policy.encode(*job)


def _policy(offer: Offer, attrs: Mapping[str, bytes]) -> EncodingPolicy:
    codec = None if offer.codec == "auto" else codecs.by_name(offer.codec)  # KeyError: not in this process
    dtype = attrs.get(XA_DTYPE, offer.dtype.encode()).decode()
    lossy = lossy_modes.parse(attrs.get(XA_LOSSY, offer.lossy.encode()))
    shape = attrs.get(XA_SHAPE)
    return EncodingPolicy(codec, dtype, shape.strip() if shape else None, lossy)


def _stage(offer: Offer, parts: Sequence[memoryview], attrs: Mapping[str, bytes], threads: int) -> str | None:
    """Encode and write the object into the staging directory; its path, or None where this writer cannot
    (no rights there, the staging filesystem full, a codec not available here)."""
    if not os.access(offer.staging, os.W_OK | os.X_OK):
        return None  # another user than the daemon's: asked before encoding, which would be wasted
    try:
        policy = _policy(offer, attrs)
    except (KeyError, ValueError):
        return None  # e.g. codec qat without the library here: the daemon encodes it
    staged = os.path.join(offer.staging, staged_name())
    try:
        fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as e:
        if e.errno in _NO_RIGHTS:
            return None
        raise
    try:
        _encode_into(fd, parts, policy, offer.frame_size, threads)
    except BaseException as e:
        os.close(fd)
        _unlink_quietly(staged)
        if isinstance(e, (codecs.CodecError, KeyError, ValueError)) or isinstance(e, OSError) and e.errno in _NO_RIGHTS:
            return None
        raise
    os.close(fd)
    return staged


def _encode_into(fd: int, parts: Sequence[memoryview], policy: EncodingPolicy, frame_size: int,
                 threads: int) -> None:
    """Encode the object into fd, the payloads written by this thread's stage writer while the next frames
    are encoded (the codec and pwrite both run without the GIL), the header and frame table last."""
    size = sum(len(p) for p in parts)
    writer = _stage_writer()
    pending: list[concurrent.futures.Future] = []
    frames: list[fmt.EncodedFrame] = []
    data_offset = offset = 0
    try:
        for frame in _encoded_frames(parts, policy, frame_size, threads):
            if not frames:  # the first frame chose the codec: the header's size is known from here on
                data_offset = offset = policy.header(size, frame_size).data_offset
            frames.append(frame)
            if frame.payload:
                pending.append(writer.submit(_pwrite_all, fd, frame.payload, offset))
                offset += len(frame.payload)
    finally:
        done, _ = concurrent.futures.wait(pending)  # no write may outlive the descriptor
    for future in done:
        future.result()
    header = policy.header(size, frame_size)
    if header.data_offset != data_offset:
        raise AssertionError("the header's size changed while encoding")
    head, _ = fmt.build_object(header, frames)
    crash_point("writer-writing")  # payloads written, the header not yet
    _pwrite_all(fd, head[0], 0)


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


_writers = threading.local()  # each writing thread has its own stage writer: threads do not queue on one


def _stage_writer() -> concurrent.futures.ThreadPoolExecutor:
    writer = getattr(_writers, "pool", None)
    if writer is None:
        writer = _writers.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvfs-stage")
    return writer


def _forget_writers() -> None:
    global _writers
    _writers = threading.local()  # a forked child has none of its parent's threads


os.register_at_fork(after_in_child=_forget_writers)


def _frames(parts: Sequence[memoryview], frame_size: int) -> Iterator[memoryview]:
    """The data cut into frames: views into the parts, copied only where a frame spans two of them."""
    pending: list[memoryview] = []
    have = 0
    for part in parts:
        while len(part):
            if not pending and len(part) >= frame_size:
                yield part[:frame_size]
                part = part[frame_size:]
                continue
            take = min(frame_size - have, len(part))
            pending.append(part[:take])
            have += take
            part = part[take:]
            if have == frame_size:
                yield memoryview(b"".join(pending))
                pending, have = [], 0
    if pending:
        yield memoryview(b"".join(pending))


def _write_all(fd: int, parts: list[bytes]) -> None:
    views = [v for v in (memoryview(p).cast("B") for p in parts) if len(v)]
    while views:
        n = os.writev(fd, views[:IOV_MAX])
        while n and views:
            if n >= len(views[0]):
                n -= len(views[0])
                views.pop(0)
            else:
                views[0] = views[0][n:]
                n = 0


def write_through_mount(path: str, parts: Iterable[Buffer], xattrs: Mapping[str, bytes], mode: int = 0o644,
                        exclusive: bool = False) -> None:
    """An ordinary write, atomic: a temporary name in the same directory, renamed into place. The xattrs are
    set before the data: kvfs reads user.kvfs.dtype and user.kvfs.shape to choose how to encode frames."""
    if exclusive and os.path.lexists(path):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), path)
    directory, name = os.path.split(path)
    tmp = os.path.join(directory, f".{name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    try:
        for key, value in xattrs.items():
            try:
                os.setxattr(fd, key, value)
            except OSError as e:  # a plain directory (no user xattrs, or no kvfs): the data is what matters
                if e.errno not in (errno.ENOTSUP, errno.EOPNOTSUPP, errno.EINVAL, errno.EPERM):
                    raise
        _write_all(fd, list(parts))
        os.close(fd)
        fd = -1
        os.rename(tmp, path)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        _unlink_quietly(tmp)
        raise


def _umask() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022


def _unlink_quietly(*paths: str) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
