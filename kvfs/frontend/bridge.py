"""The trio side of the native front end: requests from the C loop (kvfs/frontend/_loop.c) into the Operations.

`_loop` runs libfuse's multi-threaded session loop in C threads. They queue each request and signal an
eventfd; `main()` waits for it in the daemon's trio loop, takes the queue and hands each request to a request
task (RequestTasks). The task calls the Operations method in pyfuse3's calling convention (kvfs/frontend/ops)
and answers through the request's reply_* method. Every request is answered exactly once: a FUSEError with its errno, anything else
with EIO (logged); a request the handler forgot to answer answers EIO when it is dropped.
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import time

import trio

from . import _loop, native_write
from .types import (FUSEError, EntryAttributes, ReaddirToken, RequestContext, SetattrFields, entry_tuple,
                    statvfs_tuple)

log = logging.getLogger("kvfs.frontend")

MAX_THREADS = int(os.environ.get("KVFS_FUSE_THREADS", "8"))  # libfuse workers (they queue, or serve native reads)
END_GRACE_S = 2.0  # at the loop's end, for the requests in progress
CLONE_FD = os.environ.get("KVFS_FUSE_CLONE_FD", "1") != "0"
# READ of committed objects in local tiers served in the C threads (kvfs/frontend/ops decides per open file)
NATIVE_READS = os.environ.get("KVFS_NATIVE_READS", "1") != "0"

_ops = None
_mounted = False
_writes = None  # native_write.NativeWrites: WRITE of files written in order taken in the C threads


def init(ops, mountpoint: str, options) -> None:
    """Mount (pyfuse3.init): a RuntimeError when libfuse refuses (it says why on stderr)."""
    global _ops, _mounted
    _loop.mount(os.path.abspath(mountpoint), ",".join(sorted(options)),
                export_support=bool(getattr(ops, "supports_dot_lookup", True)),
                writeback_cache=bool(getattr(ops, "enable_writeback_cache", False)),
                acl=bool(getattr(ops, "enable_acl", False)))
    global _writes
    _ops = ops
    _mounted = True
    if NATIVE_READS:
        _set_reader()
    _writes = None
    if native_write.ENABLED and hasattr(ops, "dirty_budget"):
        _writes = native_write.NativeWrites(ops)


def _set_reader() -> None:
    """Hand the C loop the codec kernel's kvfs_read_frames (kvfs/codecs/_object.c): the library loaded once,
    with its libzstd handed over (kernel.py), is the one that decodes, in Python's readers and in the C loop's."""
    import ctypes

    from ..codecs import kernel
    from ..metrics import LATENCY_BUCKETS
    _loop.set_reader(ctypes.cast(kernel.lib.kvfs_read_frames, ctypes.c_void_p).value, tuple(LATENCY_BUCKETS))


def terminate() -> None:
    """Make main() return (the mount stays until close(), as with pyfuse3.terminate)."""
    _loop.exit()


def close(unmount: bool = True) -> None:
    global _mounted
    _loop.close(unmount)
    _mounted = False


async def main(max_threads: int = MAX_THREADS, clone_fd: bool = CLONE_FD) -> None:
    """Serve requests until the kernel unmounts or terminate() is called; returns after the requests in
    progress have been answered."""
    if not _mounted:
        raise RuntimeError("init() first")
    dispatch = Dispatch(_ops)
    fd = _loop.fileno()
    _loop.start(max_threads, clone_fd)
    ended = False
    try:
        async with trio.open_nursery() as nursery:
            tasks = RequestTasks(nursery, dispatch.run)
            while not ended:
                await trio.lowlevel.wait_readable(fd)
                for r in _loop.fetch():
                    op = r.op
                    if op == _loop.OP_ENDED:
                        ended = True
                        if r.off:
                            log.info("the FUSE loop ended: %s", os.strerror(-r.off) if r.off < 0 else r.off)
                    elif op == _loop.OP_INIT:
                        _ops.init()
                    elif op == _loop.OP_NATIVE_FIRST:  # here, in order: what the reader asks next sees it
                        try:
                            _ops.native_first_read(r.fh)
                        except Exception:  # noqa: BLE001 - bookkeeping never ends the mount
                            log.exception("first native read of handle %d: bookkeeping failed", r.fh)
                    else:
                        tasks.submit(r)
            # requests in progress get a moment to answer; then they are cancelled (answered EINTR), as
            # pyfuse3's main() cancels its handlers: one may wait for a request no thread reads any more
            # (pagecache.py stats the file through the mount)
            nursery.cancel_scope.deadline = trio.current_time() + END_GRACE_S
    finally:
        if not ended:  # cancelled or failed: stop the C loop too (the mount stays until close)
            _loop.exit()
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(_loop.join)
            if _writes is not None:  # what native writers still hold goes into their files (commit_all)
                await _writes.settle_all()


class RequestTasks:
    """The tasks that run requests, long-lived: a request wakes an idle one instead of costing a new task.
    No request waits for a busy task (a handler may wait for another request: pagecache.py stats through the
    mount): each request wakes an idle task or starts a new one. At most MAX_IDLE stay idle; the others end.
    Requests still queued when the nursery is cancelled are answered EIO (Request's destructor)."""

    MAX_IDLE = 16

    def __init__(self, nursery: trio.Nursery, run) -> None:
        self.nursery = nursery
        self.run = run
        self.pending: collections.deque = collections.deque()
        self.idle = trio.lowlevel.ParkingLot()

    def submit(self, r) -> None:
        self.pending.append(r)
        if self.idle:
            self.idle.unpark()
        else:
            self.nursery.start_soon(self._serve)

    async def _serve(self) -> None:
        while True:
            while self.pending:
                await self.run(self.pending.popleft())
            if len(self.idle) >= self.MAX_IDLE:
                return
            await self.idle.park()


def _ctx(r) -> RequestContext:
    return RequestContext(r.uid, r.gid, r.pid, r.umask)


def _check(ret: int, r) -> None:
    if ret:  # the kernel no longer waits (interrupted, unmounted): nothing lost
        log.debug("reply to request %d failed: %s", r.op, os.strerror(-ret))


class Dispatch:
    def __init__(self, ops) -> None:
        self.ops = ops
        self.writes = _writes  # native writers: taken back into Python before their file is touched otherwise
        L = _loop
        self.handlers = {
            L.OP_LOOKUP: self.lookup, L.OP_FORGET: self.forget, L.OP_GETATTR: self.getattr,
            L.OP_SETATTR: self.setattr, L.OP_READLINK: self.readlink, L.OP_MKNOD: self.mknod,
            L.OP_MKDIR: self.mkdir, L.OP_UNLINK: self.unlink, L.OP_RMDIR: self.rmdir, L.OP_SYMLINK: self.symlink,
            L.OP_RENAME: self.rename, L.OP_LINK: self.link, L.OP_OPEN: self.open, L.OP_READ: self.read,
            L.OP_WRITE: self.write, L.OP_FLUSH: self.flush, L.OP_RELEASE: self.release, L.OP_FSYNC: self.fsync,
            L.OP_OPENDIR: self.opendir, L.OP_READDIRPLUS: self.readdirplus, L.OP_RELEASEDIR: self.releasedir,
            L.OP_FSYNCDIR: self.fsyncdir, L.OP_STATFS: self.statfs, L.OP_SETXATTR: self.setxattr,
            L.OP_GETXATTR: self.getxattr, L.OP_LISTXATTR: self.listxattr, L.OP_REMOVEXATTR: self.removexattr,
            L.OP_CREATE: self.create, L.OP_READ_CORRUPT: self.read_corrupt,
        }

    async def run(self, r) -> None:
        handler = self.handlers.get(r.op)
        try:
            if handler is None:
                raise FUSEError(errno.ENOSYS)
            await handler(r)
        except FUSEError as e:
            if not r.replied:
                _check(r.reply_err(e.errno), r)
        except trio.Cancelled:
            if not r.replied:
                r.reply_err(errno.EINTR)
            raise
        except BaseException as e:  # noqa: BLE001 - a request never ends the mount
            if not r.replied:
                r.reply_err(errno.EIO)
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            log.exception("request %d failed; answered EIO", r.op)

    async def _settle(self, fh: int) -> None:
        """The handle's native writes, if any, become its OpenFile's before Python handles its request."""
        if self.writes is not None and fh in self.writes.writers:
            await self.writes.settle_fh(fh)

    def _method(self, name: str):
        m = getattr(self.ops, name, None)
        if m is None:
            raise FUSEError(errno.ENOSYS)
        return m

    # -- names and attributes ------------------------------------------------------------------------
    async def lookup(self, r):
        if self.writes is not None and self.writes.writers:
            self.writes.sync()
        a = await self._method("lookup")(r.ino, r.name, _ctx(r))
        _check(r.reply_entry(entry_tuple(a)), r)

    async def forget(self, r):
        await self._method("forget")(r.forgets)

    async def getattr(self, r):
        if self.writes is not None and self.writes.writers:
            self.writes.sync(r.ino)
        a = await self._method("getattr")(r.ino, _ctx(r))
        _check(r.reply_attr(entry_tuple(a)), r)

    async def setattr(self, r):
        to_set, mode, uid, gid, size, atime_ns, mtime_ns, ctime_ns = r.setattr
        L = _loop
        attr = EntryAttributes()
        attr.st_ino = r.ino
        attr.st_mode, attr.st_uid, attr.st_gid, attr.st_size = mode, uid, gid, size
        attr.st_atime_ns, attr.st_mtime_ns, attr.st_ctime_ns = atime_ns, mtime_ns, ctime_ns
        fields = SetattrFields()
        now = time.time_ns() if to_set & (L.FUSE_SET_ATTR_ATIME_NOW | L.FUSE_SET_ATTR_MTIME_NOW) else 0
        if to_set & L.FUSE_SET_ATTR_ATIME:
            fields.update_atime = True
        elif to_set & L.FUSE_SET_ATTR_ATIME_NOW:
            fields.update_atime = True
            attr.st_atime_ns = now
        if to_set & L.FUSE_SET_ATTR_MTIME:
            fields.update_mtime = True
        elif to_set & L.FUSE_SET_ATTR_MTIME_NOW:
            fields.update_mtime = True
            attr.st_mtime_ns = now
        fields.update_ctime = bool(to_set & L.FUSE_SET_ATTR_CTIME)
        fields.update_mode = bool(to_set & L.FUSE_SET_ATTR_MODE)
        fields.update_uid = bool(to_set & L.FUSE_SET_ATTR_UID)
        fields.update_gid = bool(to_set & L.FUSE_SET_ATTR_GID)
        fields.update_size = bool(to_set & L.FUSE_SET_ATTR_SIZE)
        if self.writes is not None and self.writes.writers:
            await self.writes.settle_ino(r.ino)
        a = await self._method("setattr")(r.ino, attr, fields, r.fh if r.has_fh else None, _ctx(r))
        _check(r.reply_attr(entry_tuple(a)), r)

    async def readlink(self, r):
        target = await self._method("readlink")(r.ino, _ctx(r))
        _check(r.reply_readlink(bytes(target)), r)

    async def mknod(self, r):
        a = await self._method("mknod")(r.ino, r.name, r.mode, r.rdev, _ctx(r))
        _check(r.reply_entry(entry_tuple(a)), r)

    async def mkdir(self, r):
        a = await self._method("mkdir")(r.ino, r.name, r.mode, _ctx(r))
        _check(r.reply_entry(entry_tuple(a)), r)

    async def symlink(self, r):
        a = await self._method("symlink")(r.ino, r.name, r.name2, _ctx(r))
        _check(r.reply_entry(entry_tuple(a)), r)

    async def link(self, r):
        a = await self._method("link")(r.ino, r.ino2, r.name, _ctx(r))
        _check(r.reply_entry(entry_tuple(a)), r)

    async def unlink(self, r):
        await self._method("unlink")(r.ino, r.name, _ctx(r))
        _check(r.reply_err(0), r)

    async def rmdir(self, r):
        await self._method("rmdir")(r.ino, r.name, _ctx(r))
        _check(r.reply_err(0), r)

    async def rename(self, r):
        await self._method("rename")(r.ino, r.name, r.ino2, r.name2, r.flags, _ctx(r))
        _check(r.reply_err(0), r)

    async def statfs(self, r):
        s = await self._method("statfs")(_ctx(r))
        _check(r.reply_statfs(statvfs_tuple(s)), r)

    # -- files -------------------------------------------------------------------------------------------
    async def open(self, r):
        if self.writes is not None and self.writes.writers:  # another handle: the file is Python's again
            await self.writes.settle_ino(r.ino)
        fi = await self._method("open")(r.ino, r.flags, _ctx(r))
        if self.writes is not None:
            self.writes.start(fi.fh, r.flags)
        _check(r.reply_open(fi.fh, bool(fi.direct_io), bool(fi.keep_cache), bool(fi.nonseekable),
                            bool(getattr(fi, "noflush", False))), r)

    async def create(self, r):
        fi, a = await self._method("create")(r.ino, r.name, r.mode, r.flags, _ctx(r))
        if self.writes is not None:
            self.writes.start(fi.fh, r.flags)
        _check(r.reply_create(entry_tuple(a), fi.fh, bool(fi.direct_io), bool(fi.keep_cache),
                              bool(fi.nonseekable)), r)

    async def read(self, r):
        data = await self._method("read")(r.fh, r.off, r.size)
        if len(data) > r.size:  # never more than asked: the kernel would take it as a protocol error
            data = memoryview(data)[:r.size]
        _check(r.reply_buf(data), r)

    async def read_corrupt(self, r):
        """A native read found frame r.ino2 corrupt (kvfs_read_frames' error -r.mode): the Operations drop the
        file as for a corrupt read of their own; the answer is EIO."""
        await self._method("native_read_failed")(r.fh, -r.mode, r.ino2)
        raise FUSEError(errno.EIO)

    async def write(self, r):
        await self._settle(r.fh)  # a native writer's WRITE sent here by C: Python goes on from its frames
        # a read-only view of the request's copy of the written bytes: no second copy (openfile keeps it)
        n = await self._method("write")(r.fh, r.off, r.data)
        _check(r.reply_write(n), r)

    async def flush(self, r):
        await self._settle(r.fh)
        await self._method("flush")(r.fh)
        _check(r.reply_err(0), r)

    async def release(self, r):
        await self._settle(r.fh)
        await self._method("release")(r.fh)
        _check(r.reply_err(0), r)

    async def fsync(self, r):
        await self._settle(r.fh)
        await self._method("fsync")(r.fh, bool(r.flags))
        _check(r.reply_err(0), r)

    # -- directories -------------------------------------------------------------------------------------
    async def opendir(self, r):
        fh = await self._method("opendir")(r.ino, _ctx(r))
        _check(r.reply_open(fh, False, False, False), r)

    async def readdirplus(self, r):
        if self.writes is not None and self.writes.writers:
            self.writes.sync()
        token = ReaddirToken(r, min(r.size, 1 << 20))
        await self._method("readdir")(r.fh, r.off, token)
        _check(r.reply_buf(memoryview(token.buf)[:token.used]), r)

    async def releasedir(self, r):
        await self._method("releasedir")(r.fh)
        _check(r.reply_err(0), r)

    async def fsyncdir(self, r):
        await self._method("fsyncdir")(r.fh, bool(r.flags))
        _check(r.reply_err(0), r)

    # -- extended attributes -----------------------------------------------------------------------------
    async def setxattr(self, r):
        ctx = _ctx(r)
        if r.flags & (os.XATTR_CREATE | os.XATTR_REPLACE):  # the Operations take no flags (nor did pyfuse3's)
            try:
                await self._method("getxattr")(r.ino, r.name, ctx)
            except FUSEError as e:
                if e.errno != errno.ENODATA or r.flags & os.XATTR_REPLACE:
                    raise  # XATTR_REPLACE of a name that is not there: ENODATA
            else:
                if r.flags & os.XATTR_CREATE:
                    raise FUSEError(errno.EEXIST)
        await self._method("setxattr")(r.ino, r.name, bytes(r.data), ctx)
        if self.writes is not None and self.writes.writers:  # user.kvfs.dtype, shape, lossy: the encoding
            await self.writes.policy_changed(r.ino)
        _check(r.reply_err(0), r)

    async def getxattr(self, r):
        value = bytes(await self._method("getxattr")(r.ino, r.name, _ctx(r)))
        self._xattr_reply(r, value)

    async def listxattr(self, r):
        names = await self._method("listxattr")(r.ino, _ctx(r))
        value = b"".join(bytes(n) + b"\0" for n in names)
        self._xattr_reply(r, value)

    @staticmethod
    def _xattr_reply(r, value: bytes) -> None:
        if r.size == 0:
            _check(r.reply_xattr(len(value)), r)
        elif len(value) <= r.size:
            _check(r.reply_buf(value), r)
        else:
            _check(r.reply_err(errno.ERANGE), r)

    async def removexattr(self, r):
        await self._method("removexattr")(r.ino, r.name, _ctx(r))
        if self.writes is not None and self.writes.writers:
            await self.writes.policy_changed(r.ino)
        _check(r.reply_err(0), r)


# -- what the Operations call (the pyfuse3 module functions) ------------------------------------------------
def readdir_reply(token: ReaddirToken, name: bytes, attr, next_id: int) -> bool:
    pos = _loop.add_direntry_plus(token.buf, token.used, bytes(name), entry_tuple(attr), next_id)
    if pos < 0:
        return False
    token.used = pos
    return True


def invalidate_entry(parent: int, name: bytes, deleted: int = 0) -> None:
    _loop.invalidate_entry(parent, bytes(name), deleted)


def invalidate_inode(ino: int, attr_only: bool = False) -> None:
    _loop.invalidate_inode(ino, attr_only)


def notify_store(ino: int, offset: int, data) -> None:
    _loop.notify_store(ino, offset, data)


class NativeReads:
    """What kvfs/frontend/ops calls to have a handle's reads served in the C threads (api.native; None with
    KVFS_NATIVE_READS=0)."""

    open = staticmethod(_loop.native_open)  # (fh, ino, tier index, fd (handed over), raw size, frame size, table)
    close = staticmethod(_loop.native_close)  # (fh) -> logical bytes its reads answered, -1: not native
    last_read = staticmethod(_loop.native_last_read)  # (fh) -> wall-clock ns of its last read answered, 0: none
    disable = staticmethod(_loop.native_disable)  # (ino): its handles' reads go to Python from now on
    take = staticmethod(_loop.native_take)  # counters since the last call (stats, metrics)


native_counts = _loop.native_take  # what the C threads counted since the last call: native reads and writes
