"""The FUSE Operations: translate FUSE requests into index and open-file operations (in pyfuse3's calling
convention, for either front end: kvfs/frontend).

Every handler runs under `_guard`, which turns anything unexpected into a logged EIO so no request can
kill the mount. Regular-file content goes through openfile.OpenFile; names and attributes through
index.Index. A virtual read-only directory `.kvfs/` (inodes 2-4) serves live statistics and the fsck
status; setxattr(.kvfs, user.kvfs.fsck) starts an fsck job (kvfs/fsck_live.py).
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import logging
import os
import stat
import time

import trio

from . import crypto, direct, events, quotas
from . import staging
from .adopt import Adopter, AdoptRefused, Shed
from . import lossy as lossy_modes
from . import metrics
from . import format as fmt
from . import stats as stats_mod
from .codecs import by_name, kernel
from .frontend import api as fuse
from .frontend import native_write
from .fsck_live import XA_FSCK, LiveFsck, Refused
from .hotcold import REQUEST_XATTRS, XA_IDLE, XA_PIN, XA_TTL, HotCold, RequestError
from .index import FIRST_USER_INODE, ROOT_INODE, Index, object_id
from .locks import InodeLocks
from .mover import Mover
from .openfile import DirtyBudget, EncodingPolicy, FileCorrupt, OpenFile, PublishedGone
from .pagecache import PageKeeper, forget_pages
from .ratelimit import Throttle
from .store import ObjectRef, Store

log = logging.getLogger(__name__)

KVFS_DIR_INODE = 2
STATS_INODE = 3
FSCK_INODE = 4  # .kvfs/fsck: the current or last fsck job (kvfs/fsck_live.py)
VIRTUAL_INODES = (KVFS_DIR_INODE, STATS_INODE, FSCK_INODE)
KVFS_DIR_NAME = b".kvfs"
STATS_NAME = b"stats"
FSCK_NAME = b"fsck"
NAME_MAX = 255
XATTR_NAME_MAX = 255
XATTR_SIZE_MAX = 64 << 10
INVALIDATE_WAIT_S = 2.0
TIMEOUT = 1.0  # kernel caching of entries and attributes (one daemon owns the namespace)
BLOCK = 4096  # statfs block unit

XA_PREFIX = b"user.kvfs."
XA_DTYPE = b"user.kvfs.dtype"
XA_SHAPE = b"user.kvfs.shape"  # a layout hint from the writer (the connector); recorded in the object header
XA_LOSSY = b"user.kvfs.lossy"  # opt-in lossy mode (kvfs/lossy.py), on files or directories (inherited at create)
# where a file lies and how it is stored: readable by name (getfattr -n, `kvfs stat FILE`), never listed, so
# cp -a and rsync -X do not copy them out (copied back in, a stale tier would be a move request: EINVAL where
# that tier is missing); set or removed, the informational ones succeed and change nothing
INFO_XATTRS = (b"user.kvfs.tier", b"user.kvfs.codec", b"user.kvfs.stored_bytes", b"user.kvfs.transform")
XA_OBJECT = direct.XA_OBJECT.encode()  # where the object lies, for readers past FUSE; readable, not listed
XA_STAGING = staging.XA_STAGING.encode()  # on a directory: the direct-write offer (kvfs/adopt.py)
XA_ADOPT = staging.XA_ADOPT.encode()  # set on a directory: adopt a staged object as a file there
XA_CONGESTED = b"user.kvfs.congested"  # 1 while the mover is behind: writers that can, shed saves (back-pressure)
XA_SHED = b"user.kvfs.shed"  # set to N: a writer reports N saves it skipped while congested (counted, not kept)
SHED_REPORT_MAX = 1 << 20
IGNORED_XATTRS = (*INFO_XATTRS, XA_OBJECT, XA_CONGESTED)  # set/remove succeed and change nothing (cp -a, rsync -X)
SETTABLE_DTYPES = ("auto", "none", *fmt.DTYPE_ELEMENT_SIZE)

# errnos that are answers, not daemon faults: passed through without a traceback
READ_THROUGH_MAX = 64 << 20  # stored bytes; larger files from a remote tier are read frame by frame first
EXPECTED_ERRNOS = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.EROFS, errno.EIO}
SELF_EXPLAINING_ERRNOS = EXPECTED_ERRNOS - {errno.EIO}  # a failed commit's EIO does not say why: the log does
# native reads skip the page cache (FOPEN_DIRECT_IO) when 1; 0 keeps it (docs/frontend.md has both measured)
NATIVE_DIRECT_IO = os.environ.get("KVFS_NATIVE_DIRECT_IO", "0") == "1"
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_TRUNC
# what the codec kernel's kvfs_read_frames decodes (kvfs/codecs/_object.c): codec -> transforms
_KERNEL_DECODES = {0: (0,), 4: (0,), 5: (0,), **({1: (0, 1)} if kernel.ZSTD_IN_KERNEL else {})}
_NATIVE_ERRORS = {-2: "object shorter than its frame table says", -3: "frame payload checksum mismatch",
                  -4: "frame does not decode", -5: "frame raw checksum mismatch"}


def _guard(fn):
    @functools.wraps(fn)
    async def wrapper(self: "Operations", *args, **kwargs):
        try:
            return await fn(self, *args, **kwargs)
        except fuse.FUSEError:
            raise
        except FileCorrupt as e:
            await self.drop_corrupt(e)
            raise fuse.FUSEError(errno.ENOENT if isinstance(e, PublishedGone) else errno.EIO) from None
        except crypto.KeyUnavailable as e:  # the file is kept: listing its key again makes it readable
            self.counters.key_unavailable += 1
            if self.counters.key_unavailable == 1:
                log.warning("%s: %s (EIO; counted in key_unavailable, logged once)", fn.__name__, e.strerror)
            raise fuse.FUSEError(errno.EIO) from None
        except OSError as e:
            if e.errno in EXPECTED_ERRNOS:
                log.debug("%s: %s", fn.__name__, e)
            else:
                self.counters.errors += 1
                log.exception("%s failed", fn.__name__)
            raise fuse.FUSEError(e.errno or errno.EIO) from None
        except Exception:
            self.counters.errors += 1
            log.exception("unexpected error in %s; answered EIO", fn.__name__)
            raise fuse.FUSEError(errno.EIO) from None

    return wrapper


def _err(code: int) -> fuse.FUSEError:
    return fuse.FUSEError(code)


@dataclasses.dataclass
class Handle:
    ino: int
    state: OpenFile | None  # None for the stats file
    flags: int
    snapshot: bytes = b""
    read_seen: bool = False  # its first read was counted as a hit of the tier that served it
    writer: bool = False  # opened for writing (counted in its OpenFile's writers)
    native: bool = False  # its reads are served by the native front end's C threads (fuse.native)


class Operations(fuse.Operations):
    supports_dot_lookup = True
    enable_writeback_cache = False
    enable_acl = False

    def __init__(self, config, index: Index, store: Store, mover: Mover, locks: InodeLocks,
                 counters: stats_mod.Counters) -> None:
        super().__init__()
        self.config = config
        self.index = index
        self.store = store
        self.mover = mover
        self.locks = locks
        self.counters = counters
        mover.open_file = self.open_files_get
        mover.drop_names = self.drop_evicted
        mover.forget_names = self.forget_names
        mover.drop_file = self.drop_file
        self.codec = None if config.codec == "auto" else by_name(config.codec)  # None: chosen per file
        self.nursery: trio.Nursery | None = None  # set by the daemon before the mount goes live
        self.initialized = trio.Event()  # set at the kernel's INIT (daemon: tune the mount after it)
        self.lookups: dict[int, int] = {}
        # inodes whose attributes the kernel may hold as valid: given out (_attrs) since their last write request
        # (the kernel invalidates its copy at every write); only those need an invalidation after a commit
        self.attrs_given: set[int] = set()
        self.open_files: dict[int, OpenFile] = {}
        self.handles: dict[int, Handle] = {}
        self._next_fh = 1
        self.dirty_budget = DirtyBudget(config.max_dirty)
        self._commit_failure_log = Throttle()
        self._dropping: dict[int, trio.Event] = {}  # corrupt inodes being dropped
        self.started = time.monotonic()
        self.qat = None  # the QATzip codec when loaded (its mode is shown in the stats)
        self.shared = None  # kvfs.shared.SharedNamespace when L4 is a shared prefix
        self.events = None  # kvfs.events.EventSource when the mount publishes KV events
        self.hotcold = HotCold(index, store, mover, counters, self.drop_file)  # pin, tier, prefetch, drop, idle
        self.latency = metrics.RequestLatency()  # read/write durations, exported with --metrics-port
        self.fsck = LiveFsck(self)  # fsck jobs started through setxattr on .kvfs
        self.pages = PageKeeper(config.mountpoint, index, config.frame_size, store.order[0].name)  # written pages stay cached
        mover.drop_pages = forget_pages  # until the file is demoted
        self.adopter = Adopter(self)  # direct writes: objects encoded by their writers (kvfs/adopt.py)

    def init(self) -> None:
        """The kernel's INIT request is being answered (pyfuse3 calls this, then replies)."""
        self.initialized.set()

    def open_files_get(self, ino: int) -> OpenFile | None:
        return self.open_files.get(ino)

    # -- attributes --------------------------------------------------------------------------------
    def _attrs(self, row) -> fuse.EntryAttributes:
        a = fuse.EntryAttributes()
        ino = row["id"]
        self.attrs_given.add(ino)
        a.st_ino = ino
        a.generation = 0
        a.entry_timeout = TIMEOUT
        a.attr_timeout = TIMEOUT
        a.st_mode = row["mode"]
        a.st_nlink = row["nlink"]
        a.st_uid = row["uid"]
        a.st_gid = row["gid"]
        a.st_rdev = row["rdev"]
        a.st_size = row["size"]
        a.st_atime_ns = self.index.pending_access(ino) or row["atime_ns"]
        a.st_mtime_ns = row["mtime_ns"]
        a.st_ctime_ns = row["ctime_ns"]
        a.st_blksize = self.config.frame_size
        a.st_blocks = -(-row["stored_bytes"] // 512)
        state = self.open_files.get(ino)
        if state is not None and state.modified:
            a.st_size = state.size
            if state.mtime_ns:
                a.st_mtime_ns = state.mtime_ns  # a utimensat's while unsaved writes wait keeps its value
            if state.ctime_ns:
                a.st_ctime_ns = max(state.ctime_ns, a.st_ctime_ns)
        return a

    def _virtual_attrs(self, ino: int) -> fuse.EntryAttributes:
        a = fuse.EntryAttributes()
        a.st_ino = ino
        a.entry_timeout = TIMEOUT
        a.attr_timeout = TIMEOUT
        # .kvfs is writable by its owner only for the control xattr (setxattr needs write permission);
        # the fsck report names files, so it is the owner's alone
        a.st_mode = {KVFS_DIR_INODE: stat.S_IFDIR | 0o755, FSCK_INODE: stat.S_IFREG | 0o400}.get(
            ino, stat.S_IFREG | 0o444)
        a.st_nlink = 2 if ino == KVFS_DIR_INODE else 1
        a.st_uid, a.st_gid = os.getuid(), os.getgid()
        a.st_blksize = BLOCK
        now = time.time_ns()
        a.st_atime_ns = a.st_mtime_ns = a.st_ctime_ns = now
        return a

    def _row(self, ino: int):
        row = self.index.get(ino)
        if row is None:
            raise _err(errno.ENOENT)
        return row

    def _ref(self, ino: int) -> None:
        self.lookups[ino] = self.lookups.get(ino, 0) + 1

    def _entry(self, ino: int) -> fuse.EntryAttributes:
        attrs = self._attrs(self._row(ino))
        self._ref(ino)
        return attrs

    @staticmethod
    def _check_name(name: bytes) -> None:
        if len(name) > NAME_MAX:
            raise _err(errno.ENAMETOOLONG)

    def _check_mutable_dir(self, parent: int, name: bytes | None = None) -> None:
        if parent in VIRTUAL_INODES or (parent == ROOT_INODE and name == KVFS_DIR_NAME):
            raise _err(errno.EPERM)

    # -- lookup and lifetime -----------------------------------------------------------------------
    @_guard
    async def lookup(self, parent_inode, name, ctx=None):
        if parent_inode == ROOT_INODE and name == KVFS_DIR_NAME:
            return self._virtual_attrs(KVFS_DIR_INODE)
        if parent_inode == KVFS_DIR_INODE:
            if name == STATS_NAME:
                return self._virtual_attrs(STATS_INODE)
            if name == FSCK_NAME:
                return self._virtual_attrs(FSCK_INODE)
            if name in (b".", b".."):
                return self._virtual_attrs(KVFS_DIR_INODE) if name == b"." else self._entry(ROOT_INODE)
            raise _err(errno.ENOENT)
        self._check_name(name)
        if name == b".":
            return self._entry(parent_inode)
        if name == b"..":
            return self._entry(self.index.parent_of(parent_inode) or ROOT_INODE)
        ino = self.index.lookup(parent_inode, name)
        if ino is None and self.shared is not None:
            ino = await self.shared.lookup(parent_inode, name)
        if ino is None:
            self.counters.lookup_misses += 1
            raise _err(errno.ENOENT)
        return self._entry(ino)

    async def forget(self, inode_list):
        """The kernel gets no reply to a forget: an error (logged by _guard) must not escape into pyfuse3's
        session loop, where it would end the mount."""
        try:
            await self._forget(inode_list)
        except fuse.FUSEError:
            pass

    @_guard
    async def _forget(self, inode_list):
        for ino, count in inode_list:
            left = self.lookups.get(ino, 0) - count
            if left > 0:
                self.lookups[ino] = left
            else:
                self.lookups.pop(ino, None)
                self.attrs_given.discard(ino)  # forgotten by the kernel, attributes included
                await self._maybe_delete(ino)

    async def _maybe_delete(self, ino: int) -> None:
        """Delete an inode and its data once it has no names, no kernel references and no open handles."""
        if ino in self.lookups or ino in self.open_files or ino < FIRST_USER_INODE:
            return
        row = self.index.get(ino)
        if row is None or row["nlink"] > 0:
            return
        self.index.delete_inode(ino)
        await self._discard_object(ObjectRef.of_row(row))

    async def _discard_object(self, ref: ObjectRef | None) -> None:
        """The object of a file that is gone. A published one's shared object is not this mount's to delete
        (unlink and drop decide about it): only its claim on the tier goes."""
        if ref is not None and ref.key is not None:
            self.store.release(ref.tier, ref.stored_bytes)
        elif ref is not None:
            try:
                await self.store.delete(ref)
            except OSError as e:  # the file is gone already; its object is an orphan until the next start
                log.warning("deleting the object of a removed file from %s failed: %s (reconcile removes it at "
                            "the next start)", ref.tier, e)

    @_guard
    async def getattr(self, inode, ctx=None):
        if inode in VIRTUAL_INODES:
            return self._virtual_attrs(inode)
        return self._attrs(self._row(inode))

    @_guard
    async def setattr(self, inode, attr, fields, fh, ctx):
        if inode in VIRTUAL_INODES:
            raise _err(errno.EPERM)
        await self.pages.settled(inode)
        row = self._row(inode)
        if fields.update_size:
            if stat.S_ISDIR(row["mode"]):
                raise _err(errno.EISDIR)
            if not stat.S_ISREG(row["mode"]):
                raise _err(errno.EINVAL)
            if row["published_key"]:
                raise _err(errno.EPERM)
            await self._truncate(inode, row, attr.st_size, commit_now=fh is None)
        now = time.time_ns()  # after a truncation's commit, which stamped mtime and ctime
        changes = {}
        if fields.update_mode:
            changes["mode"] = stat.S_IFMT(row["mode"]) | stat.S_IMODE(attr.st_mode)
        if fields.update_uid:
            changes["uid"] = attr.st_uid
        if fields.update_gid:
            changes["gid"] = attr.st_gid
        if fields.update_atime:
            changes["atime_ns"] = attr.st_atime_ns
        if fields.update_mtime:
            changes["mtime_ns"] = attr.st_mtime_ns
            state = self.open_files.get(inode)
            if state is not None and state.modified:
                state.mtime_ns = attr.st_mtime_ns
        changes["ctime_ns"] = attr.st_ctime_ns if fields.update_ctime else now
        self.index.set_attrs(inode, **changes)
        return self._attrs(self._row(inode))

    async def _truncate(self, ino: int, row, size: int, commit_now: bool) -> None:
        self._native_off(ino)
        state = self._acquire(ino, row)
        try:
            await state.truncate(size)
            if commit_now:
                await self._commit(state, durable=False)
        finally:
            await self._release_state(state)

    # -- open files --------------------------------------------------------------------------------
    def _policy(self, ino: int) -> EncodingPolicy:
        dtype = self.index.get_xattr(ino, XA_DTYPE)
        return EncodingPolicy(self.codec, dtype.decode() if dtype else self.config.dtype,
                              self.index.get_xattr(ino, XA_SHAPE), self._lossy(ino))

    def _lossy(self, ino: int) -> lossy_modes.Lossy:
        value = self.index.get_xattr(ino, XA_LOSSY)
        return lossy_modes.parse(value) if value is not None else self.config.lossy_mode

    def _inherit(self, parent: int, ino: int) -> None:
        """New files and directories take their directory's lossy opt-in."""
        value = self.index.get_xattr(parent, XA_LOSSY)
        if value is not None:
            self.index.set_xattr(ino, XA_LOSSY, value)

    def _acquire(self, ino: int, row) -> OpenFile:
        state = self.open_files.get(ino)
        if state is None:
            # the encoding policy is read from the index at the first write: most opens only read
            state = OpenFile(ino, row, self.store, self.index, functools.partial(self._policy, ino),
                             self.config.frame_size, self.nursery, self.counters, self.dirty_budget,
                             self.locks.take(ino))
            self.open_files[ino] = state
        state.handles += 1
        return state

    async def _release_state(self, state: OpenFile) -> None:
        state.handles -= 1
        if state.handles > 0:
            return
        if state.changed_since_failure and not state.corrupt:
            # data written after the last flush (e.g. through mmap): the kernel discards our answer. Data whose
            # commit already failed (close() returned the error) is not committed behind the caller's back.
            try:
                await self._commit(state, durable=False)
            except Exception as e:
                log.warning("inode %d: unsaved data discarded at release: %s", state.ino, e)
        if state.handles == 0 and self.open_files.get(state.ino) is state:
            state.discard()  # whatever could not be committed is gone with the last handle
            del self.open_files[state.ino]
            self.locks.give_back(state.ino)
            self.mover.publish_later(state.ino)
            await self._maybe_delete(state.ino)

    async def _commit(self, state: OpenFile, durable: bool) -> None:
        row = self.index.get(state.ino)
        if row is None or row["nlink"] == 0:
            return  # unlinked: nobody can open it again, keep its data in memory only
        try:
            committed = await state.commit(durable=durable)
        except OSError as e:
            if e.errno not in SELF_EXPLAINING_ERRNOS:
                self._commit_failed(state.ino, e)
            raise
        if committed and state.ino in self.attrs_given:  # else the kernel holds none: no thread hop
            self.attrs_given.discard(state.ino)
            await trio.to_thread.run_sync(_invalidate_attrs, state.ino)

    def _commit_failed(self, ino: int, e: OSError) -> None:
        """A writer's close() or fsync() got EIO and its data is not saved: say why, once a minute (a store that
        stopped answering fails every commit)."""
        if self._commit_failure_log.due():
            log.warning("commit of inode %d failed, the writer got %s: %s (%d failed commits so far)", ino,
                        errno.errorcode.get(e.errno or errno.EIO, e.errno), e.strerror or e,
                        self.counters.commit_failures)

    def _new_handle(self, handle: Handle) -> int:
        fh = self._next_fh
        self._next_fh += 1
        self.handles[fh] = handle
        return fh

    def _handle(self, fh: int) -> Handle:
        try:
            return self.handles[fh]
        except KeyError:
            raise _err(errno.EBADF) from None

    @_guard
    async def open(self, inode, flags, ctx):
        if inode in (STATS_INODE, FSCK_INODE):
            if flags & (os.O_WRONLY | os.O_RDWR | os.O_TRUNC):
                raise _err(errno.EACCES)
            snapshot = self.render_stats() if inode == STATS_INODE else self.fsck.render()
            fh = self._new_handle(Handle(inode, None, flags, snapshot))
            return fuse.FileInfo(fh=fh, direct_io=True)
        await self.pages.settled(inode)
        row = self._row(inode)
        if stat.S_ISDIR(row["mode"]):
            raise _err(errno.EISDIR)
        if row["nlink"] == 0 and inode not in self.open_files:
            raise _err(errno.ENOENT)  # evicted or dropped; the kernel's dentry was stale
        if row["published_key"] and flags & (os.O_WRONLY | os.O_RDWR | os.O_TRUNC):
            raise _err(errno.EPERM)  # published in the shared L4: immutable for every node
        state = self._acquire(inode, row)
        writer = bool(flags & _WRITE_FLAGS)
        if writer:  # from now on every read of the file sees what this handle writes: Python serves them
            state.writers += 1
            self._native_off(inode)
        try:
            if flags & os.O_TRUNC:  # even an empty file: open(O_TRUNC) marks mtime and ctime for update
                await state.truncate(0)
        except BaseException:
            state.writers -= writer
            await self._release_state(state)
            raise
        h = Handle(inode, state, flags, writer=writer)
        fh = self._new_handle(h)
        info = fuse.FileInfo(fh=fh, keep_cache=self._may_keep(inode, row))
        if not writer and fuse.native is not None and await self._native_open(fh, h):
            info.direct_io = NATIVE_DIRECT_IO
            info.noflush = True  # read-only, never modified through it: its FLUSH would do nothing
        return info

    async def _native_open(self, fh: int, h: Handle) -> bool:
        """Hand the handle's reads to the native front end's C threads (kvfs/frontend/_loop.c) when the file is
        its committed object, lossless, unsealed, in a local tier, and nobody writes it: an fd on the object (the
        C side owns it; it keeps reading the immutable object across moves and unlinks), and the frame table
        as verified here. Anything else, or anything unexpected, leaves the reads to OpenFile."""
        state = h.state
        ref = state.ref
        # a writer may be open (its RELEASE can reach the trio thread after this OPEN: the libfuse threads do not
        # keep the kernel's order): what it writes turns the native handles off (write, truncate)
        if ref is None or ref.key is not None or state.modified or state.corrupt:
            return False
        tier = self.store.tiers[ref.tier]
        path = None if tier.sealed or tier.shared else tier.local_path(ref.object_id)
        if path is None:
            return False
        try:
            layout = await state._layout_of(ref)  # a corrupt table marks the file: its first read reports it
        except Exception:  # noqa: BLE001
            return False
        header = layout.header
        if (state.ref is not ref or state.modified or state.corrupt or header.sealing is not None
                or header.lossy_mode or header.raw_size != state.size or len(layout.frames) != header.n_frames
                or any(not e.is_hole and e.transform not in _KERNEL_DECODES.get(e.codec, ()) for e in layout.frames)):
            return False
        pack = fmt.FRAME_ENTRY.pack
        table = b"".join(pack(e.offset, e.stored_len, e.raw_len, e.codec, e.transform, e.flags, e.stored_xxh3,
                              e.raw_xxh3) for e in layout.frames)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return False  # moved meanwhile: OpenFile finds it
        try:
            if os.fstat(fd).st_size != ref.stored_bytes:
                raise ValueError("object size")
        except (OSError, ValueError):
            os.close(fd)
            return False
        try:
            fuse.native.open(fh, h.ino, self.store.order.index(tier), fd, header.raw_size, header.frame_size, table)
        except ValueError as e:  # the fd is closed
            log.warning("inode %d: reads stay in Python: %s", h.ino, e)
            return False
        h.native = True
        state.native_live = True
        return True

    def _native_off(self, ino: int) -> None:
        """The file is being changed: its native handles' reads go to Python (which sees the changes)."""
        if fuse.native is not None:
            fuse.native.disable(ino)
            state = self.open_files.get(ino)
            if state is not None:
                state.native_live = False

    def native_first_read(self, fh: int) -> None:
        """The first read of a native handle was answered in C: count the hit, queue a due promotion, note the
        access (atime, LRU, the idle policy's last read), as `read` does at a handle's first read."""
        h = self.handles.get(fh)
        if h is None or h.state is None:
            return
        self.index.note_access(h.ino)
        if h.read_seen or h.state.ref is None:
            return
        h.read_seen = True
        if self.shared is not None:
            row = self.index.get(h.ino)
            if row is not None and row["published_key"]:
                self.shared.note_read(row["published_key"])
        self.mover.note_read(h.ino, h.state.ref.tier)  # a local tier: the mover promotes, in its own time

    @_guard
    async def native_read_failed(self, fh: int, code: int, frame: int) -> None:
        """A native read found a frame corrupt: drop the file and answer EIO, as for a read of OpenFile's."""
        h = self._handle(fh)
        if h.state is None:
            raise _err(errno.EIO)
        reason = _NATIVE_ERRORS.get(code, f"read failed ({code})")
        log.info("native read of inode %d: frame %d: %s", h.ino, frame, reason)
        raise h.state._mark_corrupt(f"frame {frame}: {reason}")

    def take_native_counts(self) -> None:
        """Add what the native front end's C threads counted since the last call: reads, writes (stats, metrics)."""
        t = fuse.native_counts()
        c = self.counters
        if t["writes"] or t["frames_encoded"] or t["write_fallbacks"] or t["write_budget_fallbacks"]:
            native_write.add_counts(self, t)
        if t["reads"]:
            c.read_requests += t["reads"]
            c.bytes_read += t["bytes"]
            c.frames_decoded += t["frames"]
            c.native_reads += t["reads"]
            c.native_read_bytes += t["bytes"]
            for tier, n in zip(self.store.order, t["stored"]):
                self.store.read_bytes[tier.name] += n
            self.latency.add_reads(t["latency"], t["latency_sum_s"])

    def _may_keep(self, inode: int, row) -> bool:
        """Whether the kernel may keep serving the file's cached pages at this open. Not for a file whose object
        lies only in a shared L4: another node may have unlinked it there, and the first read must find out
        (a miss, not the bytes this node once cached)."""
        if self.shared is None or not row["published_key"] or not row["obj_tier"]:
            return True
        return self.store.tiers[row["obj_tier"]].local_path(object_id(inode, row["obj_gen"])) is not None

    @_guard
    async def create(self, parent_inode, name, mode, flags, ctx):
        self._check_name(name)
        self._check_mutable_dir(parent_inode, name)
        if self.index.lookup(parent_inode, name) is not None:
            raise _err(errno.EEXIST)
        mode, gid = self._new_owner(parent_inode, stat.S_IFREG | stat.S_IMODE(mode), ctx)
        ino = self.index.create(parent_inode, name, mode, ctx.uid, gid)
        self._inherit(parent_inode, ino)
        row = self._row(ino)
        state = self._acquire(ino, row)
        state.writers += 1
        fh = self._new_handle(Handle(ino, state, flags, writer=True))
        self._ref(ino)
        return fuse.FileInfo(fh=fh), self._attrs(row)

    @_guard
    async def read(self, fh, off, size):
        started = time.perf_counter()
        h = self._handle(fh)
        if h.state is None:
            return h.snapshot[off:off + size]
        self.index.note_access(h.ino)  # before the read: a promotion it starts must see the file as recent
        if not h.read_seen and h.state.ref is not None:
            h.read_seen = True
            ref = h.state.ref
            if self.shared is not None:
                key = self.index.get(h.ino)["published_key"]
                if key:
                    self.shared.note_read(key)
            if self.mover.note_read(h.ino, ref.tier) and self._read_through(ref):
                await self.mover.promote_now(h.ino)  # the state is relocated: the read below hits L2
        data = await h.state.read(off, size)
        self.counters.read_requests += 1
        self.counters.bytes_read += len(data)
        self.latency.read.observe(time.perf_counter() - started)
        return data

    def _read_through(self, ref) -> bool:
        """Promote before reading: for a file in a remote tier (no local path), small enough that one GET of
        the whole object costs less than fetching its frames one ranged GET at a time and then again."""
        tier = self.store.tiers[ref.tier]
        return tier.local_path(ref.object_id) is None and ref.stored_bytes <= READ_THROUGH_MAX

    @_guard
    async def write(self, fh, off, buf):
        started = time.perf_counter()
        h = self._handle(fh)
        if h.state is None:
            raise _err(errno.EBADF)
        if h.state.native_live:  # a writer opened before them: from now on Python serves every read
            self._native_off(h.ino)
        n = await h.state.write(off, buf)
        self.attrs_given.discard(h.ino)  # the kernel drops its attributes of the file at this write's answer
        self.counters.write_requests += 1
        self.counters.bytes_written += n
        self.latency.write.observe(time.perf_counter() - started)
        return n

    @_guard
    async def flush(self, fh):
        h = self._handle(fh)
        if h.state is not None and (h.state.modified or h.state.corrupt):  # else nothing to commit
            written = self.pages.snapshot(h.state, h.flags)
            await self._commit(h.state, durable=False)
            if written is not None:
                await self.pages.keep(h.state, written)

    @_guard
    async def fsync(self, fh, datasync):
        h = self._handle(fh)
        if h.state is not None:
            await self._commit(h.state, durable=True)
            await self.mover.make_durable(h.ino)  # committed earlier to a memory tier: move it
            await trio.to_thread.run_sync(self.index.sync)

    @_guard
    async def release(self, fh):
        h = self.handles.pop(fh, None)
        if h is not None and h.native and fuse.native.close(fh) > 0:
            self.index.note_access(h.ino)  # the last read's time, for the idle policy
        if h is not None and h.state is not None:
            h.state.writers -= h.writer
            await self._release_state(h.state)

    # -- namespace ---------------------------------------------------------------------------------
    async def _make(self, parent: int, name: bytes, mode: int, ctx, rdev: int = 0,
                    target: bytes | None = None) -> fuse.EntryAttributes:
        self._check_name(name)
        self._check_mutable_dir(parent, name)
        prow = self._row(parent)
        if not stat.S_ISDIR(prow["mode"]):
            raise _err(errno.ENOTDIR)
        if self.index.lookup(parent, name) is not None:
            raise _err(errno.EEXIST)
        mode, gid = self._new_owner(parent, mode, ctx)
        ino = self.index.create(parent, name, mode, ctx.uid, gid, rdev, target)
        if target is None:
            self._inherit(parent, ino)
        return self._entry(ino)

    def _new_owner(self, parent: int, mode: int, ctx) -> tuple[int, int]:
        """The mode and group of a new entry: in a set-group-ID directory the directory's group, and a new
        subdirectory keeps the bit (Linux; the kernel already stripped a set-gid bit the caller may not set)."""
        prow = self.index.get(parent)
        if prow is None or not prow["mode"] & stat.S_ISGID:
            return mode, ctx.gid
        return (mode | stat.S_ISGID if stat.S_ISDIR(mode) else mode), prow["gid"]

    @_guard
    async def mkdir(self, parent_inode, name, mode, ctx):
        return await self._make(parent_inode, name, stat.S_IFDIR | stat.S_IMODE(mode), ctx)

    @_guard
    async def mknod(self, parent_inode, name, mode, rdev, ctx):
        if not (stat.S_ISREG(mode) or stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)):
            raise _err(errno.EPERM)  # device nodes make no sense in a cache
        return await self._make(parent_inode, name, mode, ctx, 0)

    @_guard
    async def symlink(self, parent_inode, name, target, ctx):
        if len(target) > 4095:
            raise _err(errno.ENAMETOOLONG)
        return await self._make(parent_inode, name, stat.S_IFLNK | 0o777, ctx, target=bytes(target))

    @_guard
    async def readlink(self, inode, ctx):
        row = self._row(inode)
        if not stat.S_ISLNK(row["mode"]):
            raise _err(errno.EINVAL)
        return row["target"]

    @_guard
    async def link(self, inode, new_parent_inode, new_name, ctx):
        self._check_name(new_name)
        self._check_mutable_dir(new_parent_inode, new_name)
        row = self._row(inode)
        if stat.S_ISDIR(row["mode"]):
            raise _err(errno.EPERM)
        if self.index.lookup(new_parent_inode, new_name) is not None:
            raise _err(errno.EEXIST)
        self.index.link(inode, new_parent_inode, new_name)
        return self._entry(inode)

    @_guard
    async def unlink(self, parent_inode, name, ctx):
        self._check_mutable_dir(parent_inode, name)
        ino = self.index.lookup(parent_inode, name)
        if ino is None:
            raise _err(errno.ENOENT)
        row = self._row(ino)
        if stat.S_ISDIR(row["mode"]):
            raise _err(errno.EISDIR)
        if row["published_key"] and self.shared is not None:
            tier = self.shared.tier  # the shared object goes only if it is still the one this node read
            await self.store.io(tier.name, tier.delete_if, row["published_key"], row["published_etag"])
        self.index.remove_entry(parent_inode, name, ino, is_dir=False)
        await self._maybe_delete(ino)

    @_guard
    async def rmdir(self, parent_inode, name, ctx):
        self._check_mutable_dir(parent_inode, name)
        ino = self.index.lookup(parent_inode, name)
        if ino is None:
            raise _err(errno.ENOENT)
        if not stat.S_ISDIR(self._row(ino)["mode"]):
            raise _err(errno.ENOTDIR)
        if self.index.has_children(ino):
            raise _err(errno.ENOTEMPTY)
        self.index.remove_entry(parent_inode, name, ino, is_dir=True)
        await self._maybe_delete(ino)

    @_guard
    async def rename(self, parent_inode_old, name_old, parent_inode_new, name_new, flags, ctx):
        self._check_name(name_new)
        self._check_mutable_dir(parent_inode_old, name_old)
        self._check_mutable_dir(parent_inode_new, name_new)
        if flags & ~(fuse.RENAME_EXCHANGE | fuse.RENAME_NOREPLACE):
            raise _err(errno.EINVAL)
        ino = self.index.lookup(parent_inode_old, name_old)
        if ino is None:
            raise _err(errno.ENOENT)
        target = self.index.lookup(parent_inode_new, name_new)
        if self._row(ino)["published_key"] or (target is not None and self._row(target)["published_key"]):
            raise _err(errno.EXDEV)  # a published name is the shared store's: copy and unlink instead
        if flags & fuse.RENAME_EXCHANGE:
            if target is None:
                raise _err(errno.ENOENT)
            self.index.exchange(parent_inode_old, name_old, parent_inode_new, name_new)
            return
        if target is not None and flags & fuse.RENAME_NOREPLACE:
            raise _err(errno.EEXIST)
        if target == ino:
            return  # two names of one inode: POSIX says do nothing
        moved_is_dir = stat.S_ISDIR(self._row(ino)["mode"])
        replaced = None
        if target is not None:
            target_is_dir = stat.S_ISDIR(self._row(target)["mode"])
            if moved_is_dir and not target_is_dir:
                raise _err(errno.ENOTDIR)
            if target_is_dir and not moved_is_dir:
                raise _err(errno.EISDIR)
            if target_is_dir and self.index.has_children(target):
                raise _err(errno.ENOTEMPTY)
            replaced = (target, target_is_dir)
        self.index.rename(parent_inode_old, name_old, parent_inode_new, name_new, moved_is_dir, replaced)
        if target is not None:
            await self._maybe_delete(target)

    # -- directories -------------------------------------------------------------------------------
    @_guard
    async def opendir(self, inode, ctx):
        if inode == KVFS_DIR_INODE:
            return inode
        if not stat.S_ISDIR(self._row(inode)["mode"]):
            raise _err(errno.ENOTDIR)
        return inode

    @_guard
    async def readdir(self, fh, start_id, token):
        # cookies: 1 = the virtual .kvfs entry in the root; entry id + 1 for real entries
        if fh == KVFS_DIR_INODE:
            for cookie, (name, ino) in enumerate(((STATS_NAME, STATS_INODE), (FSCK_NAME, FSCK_INODE)), 1):
                if start_id < cookie and not fuse.readdir_reply(token, name, self._virtual_attrs(ino), cookie):
                    return
            return
        if fh == ROOT_INODE and start_id < 1:
            if not fuse.readdir_reply(token, KVFS_DIR_NAME, self._virtual_attrs(KVFS_DIR_INODE), 1):
                return
        if start_id == 0:
            self.index.note_access(fh)  # readdir marks the directory's atime (batched like a file read's)
        if start_id == 0 and self.shared is not None:
            await self.shared.merge_dir(fh)  # names other mounts published here
        after = max(start_id - 1, 0)
        while True:
            rows = self.index.readdir(fh, after)
            if not rows:
                return
            for row in rows:
                if not fuse.readdir_reply(token, row["name"], self._attrs(row), row["cookie"] + 1):
                    return
                self._ref(row["id"])
                after = row["cookie"]

    @_guard
    async def releasedir(self, fh):
        return None

    @_guard
    async def fsyncdir(self, fh, datasync):
        await trio.to_thread.run_sync(self.index.sync)

    @_guard
    async def statfs(self, ctx):
        s = fuse.StatvfsData()
        capacity = sum(t.capacity for t in self.store.order)
        used = sum(t.used_bytes for t in self.store.order)
        s.f_bsize = s.f_frsize = BLOCK
        s.f_blocks = capacity // BLOCK
        s.f_bfree = s.f_bavail = max(0, capacity - used) // BLOCK
        inodes = self.index.count_inodes()
        s.f_files = inodes + (1 << 24)
        s.f_ffree = s.f_favail = 1 << 24
        s.f_namemax = NAME_MAX
        return s

    # -- extended attributes -------------------------------------------------------------------------
    def _info_xattr(self, row, name: bytes) -> bytes:
        key = name[len(XA_PREFIX):].decode()
        if key == "stored_bytes":
            return str(row["stored_bytes"]).encode()
        value = {"tier": row["obj_tier"], "codec": row["codec"], "transform": row["transform"]}[key]
        return (value or "none").encode()

    def _unsealed_path(self, ref: ObjectRef) -> str | None:
        tier = self.store.tiers[ref.tier]
        return None if tier.sealed else tier.local_path(ref.object_id)

    async def _object_xattr(self, ino: int, row) -> bytes:
        """Where a committed file's object can be opened past FUSE (kvfs.direct). Counts as a read of the
        file: the reader is about to read it all. A file in a remote tier that is due for promotion is
        promoted first (one whole-object GET), then located in L2. No answer (ENOATTR, a read through the
        mount then) for a file with unsaved writes, a corrupt one, or one with no object in a local tier."""
        state = self.open_files.get(ino)
        ref = ObjectRef.of_row(row)
        if ref is None or (state is not None and (state.modified or state.corrupt)):
            raise _err(fuse.ENOATTR)
        if self.store.tenants.of_inode(self.index, ino) is not None:
            raise _err(fuse.ENOATTR)  # sealed with its tenant's key, which only the mount holds
        path = self.store.tiers[ref.tier].local_path(ref.object_id)
        if path is None and self._read_through(ref) and self.mover.note_read(ino, ref.tier):
            self.index.note_access(ino)
            if await self.mover.promote_now(ino):
                row = self._row(ino)
                ref = ObjectRef.of_row(row)
                path = self._unsealed_path(ref) if ref is not None else None
                if path is not None:  # the promotion counted the read: a second hit would double it
                    self.counters.direct_reads += 1
                    self.counters.direct_bytes += row["size"]
                    return direct.Location(ref.tier, ref.stored_bytes, row["size"], path).encode()
            raise _err(fuse.ENOATTR)
        if path is None or self.store.tiers[ref.tier].sealed:  # sealed: only the mount holds the key
            raise _err(fuse.ENOATTR)
        self.mover.note_read(ino, ref.tier)
        self.index.note_access(ino)
        self.counters.direct_reads += 1
        self.counters.direct_bytes += row["size"]
        return direct.Location(ref.tier, ref.stored_bytes, row["size"], path).encode()

    @_guard
    async def getxattr(self, inode, name, ctx):
        if inode in VIRTUAL_INODES:
            if inode == KVFS_DIR_INODE and name == XA_FSCK:
                return self.fsck.status()
            raise _err(fuse.ENOATTR)
        row = self._row(inode)
        if name in INFO_XATTRS and stat.S_ISREG(row["mode"]):
            return self._info_xattr(row, name)
        if name == XA_OBJECT and stat.S_ISREG(row["mode"]):
            return await self._object_xattr(inode, row)
        if name == XA_STAGING and stat.S_ISDIR(row["mode"]):
            return self.adopter.offer(inode)
        if name == XA_CONGESTED:
            return b"1" if self.mover.congested() else b"0"
        if name in REQUEST_XATTRS:
            value = self.hotcold.read(inode, name)
            if value is None:
                raise _err(fuse.ENOATTR)
            return value
        if not name.startswith(b"user."):
            raise _err(fuse.ENOATTR)
        value = self.index.get_xattr(inode, name)
        if value is None:
            raise _err(fuse.ENOATTR)
        return value

    @_guard
    async def listxattr(self, inode, ctx):
        if inode in VIRTUAL_INODES:
            return []
        self._row(inode)
        # a quota is the mount's policy, as idle and ttl are: readable, not listed (a copy must not set one)
        return [n for n in self.index.list_xattrs(inode) if n != quotas.XA_QUOTA]

    def _count_shed(self, value: bytes) -> None:
        try:
            n = int(value.decode().strip())
        except (UnicodeDecodeError, ValueError):
            n = 0
        if not 1 <= n <= SHED_REPORT_MAX:
            raise _err(errno.EINVAL)
        self.counters.saves_shed += n

    def _set_quota(self, inode: int, row, value: bytes) -> None:
        """user.kvfs.quota on a directory (kvfs/quotas.py): validated, kept normalized, enforced by the mover."""
        if not stat.S_ISDIR(row["mode"]):
            raise _err(errno.ENOTDIR)
        try:
            limits = quotas.parse(value, [t.name for t in self.store.order])
        except ValueError as e:
            log.info("rejected user.kvfs.quota=%r: %s", value[:40], e)
            raise _err(errno.EINVAL) from None
        if limits:
            self.index.set_xattr(inode, quotas.XA_QUOTA, quotas.describe(limits).encode())
        else:
            self.index.remove_xattr(inode, quotas.XA_QUOTA)
        self.mover.wake()

    @_guard
    async def setxattr(self, inode, name, value, ctx):
        if inode in VIRTUAL_INODES:
            if inode == KVFS_DIR_INODE and name == XA_FSCK:
                try:
                    self.fsck.request(bytes(value), ctx.uid)
                except Refused as e:
                    log.info("fsck request %r refused: %s", bytes(value)[:20], e.reason)
                    raise _err(e.errno) from None
                return
            raise _err(errno.EPERM)
        row = self._row(inode)
        if len(name) > XATTR_NAME_MAX:
            raise _err(errno.ERANGE)
        if len(value) > XATTR_SIZE_MAX:
            raise _err(errno.E2BIG)
        if name == XA_ADOPT and stat.S_ISDIR(row["mode"]):
            await self._adopt(inode, bytes(value), ctx)
            return
        if name == XA_SHED:
            self._count_shed(bytes(value))
            return
        if not name.startswith(b"user."):
            raise _err(errno.EOPNOTSUPP)
        if name in REQUEST_XATTRS:
            try:
                await self.hotcold.request(inode, name, bytes(value))
            except RequestError as e:
                log.info("%s=%r on inode %d refused: %s", name.decode(), bytes(value)[:20], inode, e.strerror)
                raise _err(e.errno) from None
            return
        if name in IGNORED_XATTRS:
            return  # informational, recomputed by kvfs: copying files with their xattrs must not fail
        if name == quotas.XA_QUOTA:
            self._set_quota(inode, row, bytes(value))
            return
        if name == XA_DTYPE:
            dtype = bytes(value).decode(errors="replace").strip()
            if dtype not in SETTABLE_DTYPES:
                log.info("rejected user.kvfs.dtype=%r (choose one of %s)", dtype, ", ".join(SETTABLE_DTYPES))
                raise _err(errno.EINVAL)
            self.index.set_xattr(inode, name, dtype.encode())
            state = self.open_files.get(inode)
            if state is not None:
                state.policy = EncodingPolicy(self.codec, dtype, state.policy.shape, state.policy.lossy)
            return
        if name == XA_SHAPE:
            try:
                fmt.parse_shape_hint(bytes(value))
            except ValueError as e:
                log.info("rejected user.kvfs.shape=%r: %s", bytes(value)[:80], e)
                raise _err(errno.EINVAL) from None
            self.index.set_xattr(inode, name, bytes(value).strip())
            state = self.open_files.get(inode)
            if state is not None:
                state.policy.shape = bytes(value).strip()
            return
        if name == XA_LOSSY:
            try:
                mode = lossy_modes.parse(bytes(value))
            except ValueError as e:
                log.info("rejected user.kvfs.lossy=%r: %s", bytes(value)[:40], e)
                raise _err(errno.EINVAL) from None
            self.index.set_xattr(inode, name, mode.describe().encode())
            state = self.open_files.get(inode)
            if state is not None:
                state.policy.lossy = mode
            return
        if name == events.XA_BLOCKS:
            try:
                events.parse_record(bytes(value))
            except ValueError as e:
                log.info("rejected user.kvfs.blocks on inode %d: %s", inode, e)
                raise _err(errno.EINVAL) from None
        elif name.startswith(XA_PREFIX):
            raise _err(errno.EOPNOTSUPP)
        self.index.set_xattr(inode, name, bytes(value))

    async def _adopt(self, parent: int, value: bytes, ctx) -> None:
        self.counters.adopt_requests += 1
        try:
            await self.adopter.adopt(parent, value, ctx)
        except Shed as e:
            raise _err(e.errno) from None
        except AdoptRefused as e:
            self.counters.adopt_refusals += 1
            log.info("adopt request in directory inode %d refused: %s", parent, e.reason)
            raise _err(e.errno) from None
        except OSError as e:
            self.counters.adopt_refusals += 1
            if e.errno in EXPECTED_ERRNOS:
                log.info("adopt request in directory inode %d: %s", parent, e)
                raise _err(e.errno) from None
            raise

    @_guard
    async def removexattr(self, inode, name, ctx):
        if inode in VIRTUAL_INODES:
            raise _err(errno.EPERM)
        self._row(inode)
        if name == XA_PIN:
            self.hotcold.pin(inode, False)
            return
        if name == XA_IDLE:
            self.hotcold.set_idle(inode, None)  # back to the mount's default
            return
        if name == XA_TTL:
            self.hotcold.set_ttl(inode, None)
            return
        if name in IGNORED_XATTRS or name in REQUEST_XATTRS:
            return
        if not self.index.remove_xattr(inode, name):
            raise _err(fuse.ENOATTR)
        if name == XA_DTYPE and inode in self.open_files:
            self.open_files[inode].policy = self._policy(inode)
        if name == XA_SHAPE and inode in self.open_files:
            self.open_files[inode].policy.shape = None
        if name == XA_LOSSY and inode in self.open_files:
            self.open_files[inode].policy.lossy = self.config.lossy_mode

    # -- corruption, stats, shutdown ----------------------------------------------------------------
    async def drop_corrupt(self, err: FileCorrupt) -> None:
        """A checksum failed: count and log it, and make the file a miss for every later caller.

        Several requests can hit the same corrupt file at once (kernel read-ahead sends reads in parallel);
        all of them answer only after the kernel has forgotten the names, so no caller that got EIO can
        still find the file."""
        try:
            with trio.CancelScope(shield=True), trio.move_on_after(INVALIDATE_WAIT_S):
                in_progress = self._dropping.get(err.ino)
                if in_progress is not None:
                    await in_progress.wait()
                    return
                names = self.index.entries_of(err.ino)
                if not names:
                    return  # dropped earlier
                done = self._dropping[err.ino] = trio.Event()
                try:
                    gone = isinstance(err, PublishedGone)
                    if gone:  # not corruption: another node unlinked it
                        log.info("inode %d (%s): %s; file dropped", err.ino,
                                 ", ".join(repr(n) for _, n in names), err.reason)
                    else:
                        self.counters.checksum_failures += 1
                        log.error("corrupt object for inode %d (%s): %s; file dropped", err.ino,
                                  ", ".join(repr(n) for _, n in names), err.reason)
                    ref = ObjectRef.of_row(self.index.get(err.ino))
                    self.index.drop_file(err.ino)
                    if ref is not None and not gone:
                        await self._quarantine(ref)
                    # a worker thread keeps the trio loop serving requests the kernel may need meanwhile
                    for parent, name in names:
                        await trio.to_thread.run_sync(_invalidate_entry, parent, name, err.ino,
                                                      abandon_on_cancel=True)
                finally:
                    del self._dropping[err.ino]
                    done.set()
        except Exception:
            log.exception("dropping corrupt inode %d failed", err.ino)

    async def _quarantine(self, ref: ObjectRef) -> None:
        try:
            where = await self.store.quarantine(ref)
        except OSError as e:
            log.warning("could not quarantine the corrupt object %s in %s: %s", ref.object_id, ref.tier, e)
            return
        if where:
            log.warning("corrupt object %s kept aside as %s", ref.object_id, where)

    async def drop_file(self, ino: int) -> bool:
        """A drop request (user.kvfs.drop): the file leaves every tier now and its names go (the next lookup
        misses). A published file's shared object goes too, if it is still the one this node read. An open
        file keeps its data for its handles until the last one closes, as after unlink."""
        async with self.locks.holding(ino, wait=True):
            row = self.index.get(ino)
            if row is None or not stat.S_ISREG(row["mode"]) or row["nlink"] == 0:
                return False
            if row["published_key"] and self.shared is not None:
                tier = self.shared.tier
                await self.store.io(tier.name, tier.delete_if, row["published_key"], row["published_etag"])
            ref = ObjectRef.of_row(row)
            if ino in self.open_files:
                names = self.index.entries_of(ino)
                self.index.drop_file(ino)  # the object goes at the last release (_maybe_delete)
            else:
                names = self.drop_evicted(ino)
                await self._discard_object(ref)
            if ref is not None:
                c = self.counters.tier(ref.tier)
                c.dropped_files += 1
                c.dropped_bytes += ref.stored_bytes
        await self.forget_names(ino, names)
        return True

    def drop_evicted(self, ino: int) -> list[tuple[int, bytes]]:
        """A file is evicted (or dropped): its names and its object reference go from the index. Returns the names,
        for `forget_names` once the object is deleted."""
        names = self.index.entries_of(ino)
        self.index.drop_file(ino, forget_object=True)
        if ino not in self.lookups:
            self.index.delete_inode(ino)
        return names

    async def forget_names(self, ino: int, names: list[tuple[int, bytes]]) -> None:
        """Make the kernel forget names of a dropped file, so the next lookup is a miss. Waits at most
        INVALIDATE_WAIT_S: a request holding the directory may be in the way (it finishes on its own)."""
        if self.shared is not None:  # a miss the shared store answered before this node had the name (at its
            for parent, name in names:  # creation) is stale now: the name may be published by another node
                self.shared.forget_miss(parent, name)
        with trio.CancelScope(shield=True), trio.move_on_after(INVALIDATE_WAIT_S):
            for parent, name in names:
                try:
                    await trio.to_thread.run_sync(_invalidate_entry, parent, name, ino, abandon_on_cancel=True)
                except Exception:
                    log.debug("invalidating %r of inode %d failed", name, ino, exc_info=True)

    def render_stats(self) -> bytes:
        return stats_mod.to_json(self.stats_doc())

    def stats_doc(self) -> dict:
        """The statistics document (.kvfs/stats, metrics); on the trio thread: the index belongs to it."""
        self.take_native_counts()
        return stats_mod.document(counters=self.counters, tiers=self.store.order, totals=self.index.tier_totals(),
                                  config=self.config, started=self.started, open_files=len(self.open_files),
                                  dirty_bytes=self.dirty_budget.total, read_bytes=self.store.read_bytes,
                                  mover=self.mover.status(),
                                  qat=self.qat.status() if self.qat is not None else {"mode": "not loaded"},
                                  quotas=[q.doc() for q in self.mover.quotas.refresh()] if self.mover.quotas else [],
                                  events=self.events.stats() if self.events is not None else None)

    async def commit_all(self) -> None:
        """At shutdown: commit files still open with unsaved writes (best effort, logged)."""
        for state in list(self.open_files.values()):
            if state.modified and not state.corrupt:
                try:
                    await self._commit(state, durable=False)
                except Exception as e:
                    log.warning("inode %d: unsaved data lost at shutdown: %s", state.ino, e)


def _invalidate_entry(parent: int, name: bytes, ino: int) -> None:
    try:
        fuse.invalidate_entry(parent, name, deleted=ino)
    except OSError:
        pass  # not cached by the kernel: nothing to forget


def _invalidate_attrs(ino: int) -> None:
    """Tell the kernel that size/blocks changed (du right after close must see the stored size)."""
    try:
        fuse.invalidate_inode(ino, attr_only=True)
    except OSError:
        pass  # the kernel may have forgotten the inode already
