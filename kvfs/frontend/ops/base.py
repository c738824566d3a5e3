"""What every part of the FUSE Operations shares: the handles, the attributes the kernel is given, the guard that
turns anything unexpected into a logged EIO, the constants of the virtual .kvfs directory and of the xattrs.
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

from ... import crypto, direct
from ... import staging
from ...adopt import Adopter
from ... import metrics
from ... import format as fmt
from ... import stats as stats_mod
from ...codecs import by_name, kernel
from .. import api as fuse
from ...fsck_live import LiveFsck
from ...hotcold import HotCold
from ...index import ROOT_INODE, Index
from ...locks import InodeLocks
from ...mover import Mover
from ...openfile import DirtyBudget, FileCorrupt, OpenFile, PublishedGone
from ...pagecache import PageKeeper, forget_pages
from ...ratelimit import Throttle
from ...store import Store

log = logging.getLogger("kvfs.ops")

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
    async def wrapper(self: "OperationsBase", *args, **kwargs):
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


class OperationsBase(fuse.Operations):
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
        # written pages stay cached
        self.pages = PageKeeper(config.mountpoint, index, config.frame_size, store.order[0].name)
        mover.drop_pages = forget_pages  # until the file is demoted
        self.adopter = Adopter(self)  # direct writes: objects encoded by their writers (kvfs/adopt.py)

    def init(self) -> None:
        """The kernel's INIT request is being answered (pyfuse3 calls this, then replies)."""
        self.initialized.set()

    def open_files_get(self, ino: int) -> OpenFile | None:
        return self.open_files.get(ino)

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
