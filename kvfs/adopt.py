"""The daemon's side of direct writes: offer a staging directory, verify and adopt staged objects.

A writer (kvfs/direct_write.py) encodes a file's object in its own process and stages it in the fastest
tier's staging directory; `setxattr(dir, user.kvfs.adopt)` asks the daemon to make it a file of that
directory. The daemon's part is metadata and a check, never an encode:

1. verify the staged object (in a worker thread, or inline for a memory tier where only the head is read): a
   plain file of the requester (or root's), its header and frame table (checksums, sizes, every entry's
   bounds against the object's length, a layout exactly as the format lays objects out, known codecs and
   transforms, no sealing, the mount's frame size). The payloads are not read: every read checks a frame's
   payload xxh3 before decoding it and its raw xxh3 after, as for any object, so a payload that lies is
   answered with EIO and its file dropped, as for on-disk corruption (adopt_verify "checksums" also hashes
   every payload here, "decode" also decodes every frame). Anything else is refused with EBADMSG (EINVAL,
   EACCES: the log says why) and the staged file removed: a refused object is never served.
2. reserve an inode (no name: nlink 0), place the object (Mover.place: capacity, demotion, waiting or
   ENOSPC, as for any commit), rename it into the tier (or copy it into a slower one);
3. one index transaction names the inode, points it at the object and drops the file the name had.

A batch (several requests in one setxattr, kvfs/staging.py) goes through the same steps together: every
object verified and moved in one worker hop per tier, every name in one index transaction. It is adopted
whole or not at all: a refused member refuses the batch, and the writer retries its files one by one.

A crash anywhere leaves a staged file (removed once abandoned: kvfs/staging.py), or an object with an
nlink-0 row, both removed by reconcile at the next start: never a partial file under a name.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import logging
import mmap
import os
import stat
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import trio

from . import codecs, direct, events
from .frontend import api as fuse
from . import format as fmt
from . import lossy as lossy_modes
from .codecs import transforms
from .index import object_id
from .openfile import summary_codec
from .staging import AdoptRequest, Offer, crash_point, decode_batch
from .store import ObjectRef, Layout
from .tiers import DirectoryTier, Tier


class MountState(Protocol):
    """What adoption uses of the mount (kvfs/frontend/ops's Operations has it): adoption does not import the
    request handlers, which import it."""

    config: object
    store: object
    index: object
    hotcold: object
    counters: object


log = logging.getLogger(__name__)

READ_PIECE = 4 << 20  # copies of a staged object into a slower tier
HEAD_PROBE = 4096  # bytes read for a staged object's header and frame table (more when its table is longer)
SWEEP_INTERVAL_S = 60.0
RESERVE_BATCH = 32
XA_DTYPE, XA_SHAPE, XA_LOSSY = b"user.kvfs.dtype", b"user.kvfs.shape", b"user.kvfs.lossy"


class Shed(OSError):
    """A sheddable adoption refused while the mover is congested: counted, not logged (there may be many)."""

    def __init__(self) -> None:
        super().__init__(errno.EBUSY, "the mover is behind: sheddable saves are refused")


class AdoptRefused(Exception):
    """A staged object or request that cannot be adopted: answered with `errno`, the reason logged."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.errno = code
        self.reason = reason


@dataclasses.dataclass(frozen=True)
class Verified:
    header: fmt.Header
    entries: list[fmt.FrameEntry]
    stored_bytes: int



def open_staged(path: Path, uid: int) -> tuple[int, int]:
    """Open a staged object to adopt it: (fd, size). Only a plain file with one link, the requester's (or
    any, for root): a hard link or symlink could let its writer change the object after the check."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise AdoptRefused(errno.ENOENT, "no such staged object") from None
    except OSError as e:  # ELOOP: a symlink
        raise AdoptRefused(errno.EACCES, f"staged object cannot be opened: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            raise AdoptRefused(errno.EACCES, "staged object is not a plain file with one link")
        if uid != 0 and st.st_uid != uid:
            raise AdoptRefused(errno.EACCES, f"staged object belongs to uid {st.st_uid}, not the requester {uid}")
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size


@dataclasses.dataclass
class Adoption:
    """One file of an adopt request, as it goes through the steps."""

    req: AdoptRequest
    staged: Path
    xattrs: list[tuple[bytes, bytes]] = dataclasses.field(default_factory=list)
    fd: int = -1
    size: int = 0
    mode: int = 0
    gid: int = 0
    ino: int = 0  # reserved inode, 0 until then
    placed: Tier | None = None
    move: "Callable[[], None] | None" = None  # into the placed tier, once verified
    verified: Verified | None = None
    replaced: int | None = None  # the inode the name pointed at


def verify_and_move(files: list[Adoption], frame_size: int, verify: str) -> None:
    """Verify every staged object (AdoptRefused EBADMSG at the first that fails), then move each into its
    tier: one worker-thread hop for the lot, or none (the caller's choice). `verify` is the mount's
    adopt_verify (config.ADOPT_VERIFY)."""
    for f in files:
        try:
            f.verified = _verify_object(f.fd, f.size, frame_size, verify)
        except fmt.CorruptObject as e:
            raise AdoptRefused(errno.EBADMSG, f"staged object {f.req.staged} refused: {e}") from None
    for f in files:
        f.move()


def _verify_object(fd: int, size: int, frame_size: int, verify: str) -> Verified:
    """The staged object's header and frame table, verified (CorruptObject otherwise). Its payloads are read
    only with adopt_verify "checksums" or "decode": every read checks them anyway (docs/direct.md)."""
    header, _, entries = direct.read_head(fd, size, HEAD_PROBE)
    if header.frame_size != frame_size:
        raise fmt.CorruptObject(f"frame size {header.frame_size}, the mount's is {frame_size}")
    if header.flags:
        raise fmt.CorruptObject(f"header flags {header.flags:#x} (reserved: 0)")
    if header.sealing is not None:
        raise fmt.CorruptObject("a sealed header (only the daemon seals objects)")
    _check_layout(header, entries, size)
    if verify != "table":
        _check_payloads(fd, size, entries, verify == "decode")
    return Verified(header, entries, size)


def _check_layout(header: fmt.Header, entries: list[fmt.FrameEntry], size: int) -> None:
    """Payloads back to back after the table, in frame order, filling the object exactly: nothing hidden
    between or after them; every codec and transform one this daemon decodes."""
    offset = header.data_offset
    for i, e in enumerate(entries):
        if e.is_hole:
            if e.stored_len:
                raise fmt.CorruptObject(f"frame {i}: a hole with a payload")
            continue
        if e.offset != offset or e.stored_len == 0:
            raise fmt.CorruptObject(f"frame {i}: payload not where the format puts it")
        if e.codec not in codecs.REGISTRY or e.transform not in transforms.NAMES:
            raise fmt.CorruptObject(f"frame {i}: codec {e.codec} / transform {e.transform} unknown here")
        if e.codec == codecs.NoneCodec.id and e.stored_len != e.raw_len:
            raise fmt.CorruptObject(f"frame {i}: stored raw with another length")
        if e.is_sealed:
            raise fmt.CorruptObject(f"frame {i}: sealed (only the daemon seals objects)")
        offset += e.stored_len
    if offset != size:
        raise fmt.CorruptObject(f"{size} bytes, its frames account for {offset}")


def _check_payloads(fd: int, size: int, entries: list[fmt.FrameEntry], decode: bool) -> None:
    """Every payload's xxh3, read into a reused buffer (cheaper than faulting in a mapping); with decode,
    each frame also decoded through a mapping and its raw xxh3 checked."""
    if size == 0:
        return
    if decode:
        with mmap.mmap(fd, size, prot=mmap.PROT_READ) as mapped:
            problem = _first_bad_frame(mapped, entries)
    else:
        problem = _first_bad_payload(fd, entries)
    if problem:
        raise fmt.CorruptObject(problem)


_buffers = threading.local()  # one read buffer per worker thread


def _first_bad_payload(fd: int, entries: list[fmt.FrameEntry]) -> str | None:
    longest = max((e.stored_len for e in entries), default=0)
    buf = getattr(_buffers, "buf", None)
    if buf is None or len(buf) < longest:
        buf = _buffers.buf = bytearray(longest)
    with memoryview(buf) as view:
        for i, e in enumerate(entries):
            if e.is_hole:
                continue
            with view[:e.stored_len] as payload:
                if os.preadv(fd, [payload], e.offset) != e.stored_len:
                    return f"frame {i}: short read"
                if fmt.xxh3(payload) != e.stored_xxh3:
                    return f"frame {i}: payload checksum mismatch"
    return None


def _first_bad_frame(mapped: mmap.mmap, entries: list[fmt.FrameEntry]) -> str | None:
    """What is wrong with the first frame that does not decode to its raw checksum, or None. Every view of
    the mapping is released on return (the mapping cannot close while one is exported)."""
    with memoryview(mapped) as view:
        for i, e in enumerate(entries):
            if e.is_hole:
                continue
            with view[e.offset:e.offset + e.stored_len] as payload:
                try:
                    fmt.decode_frame(e, payload)  # payload and raw checksums
                except fmt.CorruptObject as err:
                    return f"frame {i}: {err}"
    return None


def _rename_staged(tier: DirectoryTier, staged: Path, oid: str, fd: int, size: int) -> None:
    """A staged object placed in the staging tier: renamed into place (no bytes move). The rename goes by
    name, so what was renamed must then be the file checked through `fd`, still `size` bytes long: otherwise
    its writer swapped or resized it meanwhile, and it is refused (the caller's undo deletes it)."""
    tier.adopt_staged(staged, oid)
    checked, placed = os.fstat(fd), os.lstat(tier.local_path(oid))
    if (placed.st_dev, placed.st_ino) != (checked.st_dev, checked.st_ino) or checked.st_size != size:
        raise AdoptRefused(errno.EACCES, f"staged object {staged.name} was replaced or resized while it was adopted")


def _put_from_staged(tier: Tier, staged: Path, oid: str, fd: int, size: int) -> None:
    """A staged object placed in another tier than the staging one: copied there from `fd` (the file that was
    checked, whatever its name points at now), then the staged file dropped."""
    def pieces():
        offset = 0
        while piece := os.pread(fd, READ_PIECE, offset):
            yield piece
            offset += len(piece)
    written = tier.put(oid, pieces(), tier.persistent)
    if written != size:
        raise OSError(errno.EIO, f"staged object changed while it was copied ({written} of {size} bytes)")
    staged.unlink(missing_ok=True)


class Adopter:
    """Direct writes for one mount: the offer (getxattr), adoption (setxattr), and the staging sweep."""

    def __init__(self, ops: MountState) -> None:
        self.ops = ops
        self.config = ops.config
        self._staging_made: Path | None = None
        self._spare: list[int] = []  # reserved inode ids (kvfs/index.py reserve_inodes)

    def staging_tier(self) -> DirectoryTier | None:
        """The fastest tier, when it is a local directory this mount may write to and direct writes are on."""
        if not self.config.direct_writes:
            return None
        tier = self.ops.store.order[0]
        if not isinstance(tier, DirectoryTier) or tier.fenced is not None or tier.disowned or tier.sealed:
            return None  # a sealed tier: writers hold no key, so they write through the mount
        return tier

    def offer(self, ino: int) -> bytes:
        """The answer to getxattr(dir, user.kvfs.staging): how new files there are encoded, and where to stage."""
        tier = self.staging_tier()
        if tier is None or self.ops.store.tenants.of_inode(self.ops.index, ino) is not None:
            raise fuse.FUSEError(fuse.ENOATTR)  # a tenant's files are sealed with its key, which writers lack
        if self._staging_made != tier.staging_dir or not tier.staging_dir.is_dir():
            self._staging_made = tier.make_staging_dir()
        lossy = self.ops.index.get_xattr(ino, XA_LOSSY)
        return Offer(self.config.frame_size, self.config.codec, self.config.dtype,
                     lossy.decode() if lossy is not None else self.config.lossy, str(self._staging_made)).encode()

    async def adopt(self, parent: int, value: bytes, ctx) -> None:
        tier = self.staging_tier()
        if tier is None:
            raise AdoptRefused(errno.EOPNOTSUPP, "this mount offers no direct writes")
        try:
            files = [Adoption(req, tier.staging_dir / req.staged) for req in decode_batch(value)]
        except (ValueError, UnicodeDecodeError) as e:
            raise AdoptRefused(errno.EINVAL, f"malformed adopt request: {e}") from None
        try:
            await self._adopt(parent, files, tier, ctx)
        except BaseException:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(_unlink_quietly, *[f.staged for f in files])
            raise

    async def _adopt(self, parent: int, files: list[Adoption], tier: DirectoryTier, ctx) -> None:
        """Reserve inodes and room, then verify and move the objects in a worker-thread hop, then name them."""
        ops = self.ops
        if any(f.req.shed for f in files) and ops.mover.congested():  # back-pressure: saves it can do without
            ops.counters.saves_shed += len(files)
            raise Shed()
        if ops.store.tenants.of_inode(ops.index, parent) is not None:
            raise AdoptRefused(errno.EOPNOTSUPP, "a tenant directory: its files are sealed with the tenant's key")
        for f in files:
            f.xattrs = self._checked_xattrs(f.req.xattrs)
            self._check_directory(parent, f.req.name)
            self._target(parent, f.req)  # refuse early what the final check would refuse
        try:
            for f in files:
                f.fd, f.size = open_staged(f.staged, ctx.uid)
            await self._place_and_name(parent, files, tier, ctx)
        finally:
            for f in files:
                if f.fd >= 0:
                    os.close(f.fd)
        crash_point("adopt-named")
        for f in files:
            await self._named(parent, f)

    async def _place_and_name(self, parent: int, files: list[Adoption], tier: DirectoryTier, ctx) -> None:
        ops = self.ops
        try:
            for f in files:
                f.mode, f.gid = ops._new_owner(parent, stat.S_IFREG | (f.req.mode & 0o7777), ctx)
                f.ino = self._reserved_inode()
            crash_point("adopt-reserved")
            for f in files:
                f.placed = await ops.mover.place(f.size, None, False)
                if f.placed.sealed:  # L2 full, and the tier below seals: a writer's plain object cannot go there
                    raise AdoptRefused(errno.EOPNOTSUPP, f"{f.placed.name} holds sealed objects only")
                oid = object_id(f.ino, 1)
                f.move = (functools.partial(_rename_staged, tier, f.staged, oid, f.fd, f.size) if f.placed is tier
                          else functools.partial(_put_from_staged, f.placed, f.staged, oid, f.fd, f.size))
            verify = self.config.adopt_verify
            for placed, group in _by_tier(files):
                if placed is tier and verify == "table" and not tier.persistent:
                    # a read of each head and a rename in memory: microseconds, less than a thread hop costs
                    verify_and_move(group, self.config.frame_size, verify)
                else:
                    await ops.store.io(placed.name, verify_and_move, group, self.config.frame_size, verify,
                                       size=sum(f.size for f in group))
            crash_point("adopt-placed")
            for f in files:  # again: a name may have changed while we waited
                f.replaced = self._target(parent, f.req)
            ops.index.adopt_objects([
                dict(ino=f.ino, parent=parent, name=f.req.name, replaced=f.replaced, mode=f.mode, uid=ctx.uid,
                     gid=f.gid, tier=f.placed.name, size=f.verified.header.raw_size, stored_bytes=f.size,
                     codec=summary_codec(f.verified.entries),
                     transform=transforms.NAMES[f.verified.header.transform], xattrs=f.xattrs)
                for f in files])
        except BaseException:
            with trio.CancelScope(shield=True):
                for f in files:
                    if f.ino:
                        await self._undo(f.ino, f.placed, f.size)
            raise

    async def _named(self, parent: int, f: Adoption) -> None:
        """What follows an adopted file's naming: its layout cached, counters, the name it replaced, hot/cold
        requests."""
        ops = self.ops
        ops.store.keep_layout(ObjectRef(f.ino, 1, f.placed.name, f.size), Layout(f.verified.header, f.verified.entries))
        ops.counters.direct_writes += 1
        ops.counters.direct_write_bytes += f.verified.header.raw_size
        if f.replaced is not None:
            await ops.forget_names(f.replaced, [(parent, f.req.name)])
            await ops._maybe_delete(f.replaced)
        ops.mover.publish_later(f.ino)
        await self._requests(f.ino, f.req.xattrs)

    async def _undo(self, ino: int, placed: Tier | None, size: int) -> None:
        """An adoption that did not complete: its inode and, once placed, its charge and object go."""
        ops = self.ops
        row = ops.index.get(ino)
        if row is not None and row["nlink"]:
            return  # named: it completed after all
        ops.index.delete_inode(ino)
        if placed is not None:
            ops.store.release(placed.name, size)
            try:
                await ops.store.io(placed.name, placed.delete, object_id(ino, 1))
            except OSError as e:
                log.warning("removing the object of a failed adoption from %s: %s (reconcile removes it at the "
                            "next start)", placed.name, e)

    def _reserved_inode(self) -> int:
        if not self._spare:
            self._spare = self.ops.index.reserve_inodes(RESERVE_BATCH)
        return self._spare.pop()

    def _check_directory(self, parent: int, name: bytes) -> None:
        """Refuse what create would refuse: a bad name, the virtual .kvfs, a directory that is gone."""
        ops = self.ops
        if not name or b"/" in name or b"\0" in name or name in (b".", b".."):
            raise AdoptRefused(errno.EINVAL, f"{name[:40]!r} is not a file name")
        ops._check_name(name)
        ops._check_mutable_dir(parent, name)
        if ops._row(parent)["nlink"] == 0:
            raise AdoptRefused(errno.ENOENT, "the directory was removed")

    def _target(self, parent: int, req: AdoptRequest) -> int | None:
        """The inode the name points at now, which the adoption replaces; refused where rename over it would
        be. Synchronous: the caller's check and transaction see the same index."""
        ops = self.ops
        target = ops.index.lookup(parent, req.name)
        if target is None:
            return None
        if req.exclusive:
            raise AdoptRefused(errno.EEXIST, "exists")
        row = ops._row(target)
        if stat.S_ISDIR(row["mode"]):
            raise AdoptRefused(errno.EISDIR, "a directory has that name")
        if row["published_key"]:
            raise AdoptRefused(errno.EXDEV, "a published name is the shared store's")
        return target

    def _checked_xattrs(self, xattrs) -> list[tuple[bytes, bytes]]:
        """The user.* attributes the file is created with, validated as setxattr would; hot/cold requests
        (pin, idle, …) are applied after the adoption instead."""
        from .hotcold import REQUEST_XATTRS
        kept = []
        for name, value in xattrs:
            if not name.startswith(b"user.") or len(name) > 255 or len(value) > 64 << 10:
                raise AdoptRefused(errno.EINVAL, f"xattr {name[:40]!r} cannot be set")
            if name in REQUEST_XATTRS:
                continue
            if name == XA_DTYPE and value.decode(errors="replace") not in ("auto", "none", *fmt.DTYPE_ELEMENT_SIZE):
                raise AdoptRefused(errno.EINVAL, f"user.kvfs.dtype={value[:20]!r}")
            if name == XA_SHAPE:
                try:
                    fmt.parse_shape_hint(value)
                except ValueError as e:
                    raise AdoptRefused(errno.EINVAL, f"user.kvfs.shape: {e}") from None
                value = value.strip()
            elif name == XA_LOSSY:
                try:
                    value = lossy_modes.parse(value).describe().encode()
                except ValueError as e:
                    raise AdoptRefused(errno.EINVAL, f"user.kvfs.lossy: {e}") from None
            elif name == events.XA_BLOCKS:
                try:
                    events.parse_record(value)
                except ValueError as e:
                    raise AdoptRefused(errno.EINVAL, f"user.kvfs.blocks: {e}") from None
            elif name.startswith(b"user.kvfs.") and name not in (XA_DTYPE, XA_SHAPE):
                continue  # informational (tier, codec, …): recomputed by kvfs
            kept.append((name, value))
        return kept

    async def _requests(self, ino: int, xattrs) -> None:
        from .hotcold import REQUEST_XATTRS, RequestError
        for name, value in xattrs:
            if name in REQUEST_XATTRS:
                try:
                    await self.ops.hotcold.request(ino, name, value)
                except RequestError as e:
                    log.info("%s=%r on adopted inode %d refused: %s", name.decode(), value[:20], ino, e.strerror)

    async def sweep_periodically(self) -> None:
        """Remove staged objects whose writers are gone (the daemon's nursery runs this)."""
        while True:
            await trio.sleep(SWEEP_INTERVAL_S)
            tier = self.staging_tier()
            if tier is None:
                continue
            try:
                removed = await self.ops.store.io(tier.name, _remove_abandoned, tier)
            except OSError as e:
                log.warning("sweeping %s: %s", tier.staging_dir, e)
                continue
            if removed:
                self.ops.counters.staged_abandoned += removed
                log.info("removed %d abandoned staged objects from %s", removed, tier.staging_dir)


def _remove_abandoned(tier: DirectoryTier) -> int:
    removed = 0
    for stray in list(tier.strays()):
        if stray.name.startswith(tier.staging_dir.name + "/"):
            tier.remove_stray(stray.name)
            removed += 1
    return removed


def _by_tier(files: list[Adoption]) -> list[tuple[Tier, list[Adoption]]]:
    groups: dict[str, tuple[Tier, list[Adoption]]] = {}
    for f in files:
        groups.setdefault(f.placed.name, (f.placed, []))[1].append(f)
    return list(groups.values())


def _unlink_quietly(*paths: Path) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
