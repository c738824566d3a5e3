"""Open files: open, create, read, write, flush, fsync, release, and the commit of what was written (kvfs/openfile.py
holds a file's frames).
"""

from __future__ import annotations

import errno
import functools
import os
import stat
import time

import trio

from ... import lossy as lossy_modes
from .. import api as fuse
from ...index import object_id
from ...openfile import EncodingPolicy, OpenFile
from .base import (log, STATS_INODE, FSCK_INODE, XA_DTYPE, XA_SHAPE, XA_LOSSY, READ_THROUGH_MAX,
                   SELF_EXPLAINING_ERRNOS, NATIVE_DIRECT_IO, _WRITE_FLAGS, _guard, _err, Handle, _invalidate_attrs,
                   OperationsBase)


class Files(OperationsBase):
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
        if h is not None and h.native:
            last_read = fuse.native.last_read(fh)
            if fuse.native.close(fh) > 0 and last_read:  # the last read's time (atime, the idle policy)
                self.index.note_access(h.ino, at_ns=last_read)
        if h is not None and h.state is not None:
            h.state.writers -= h.writer
            await self._release_state(h.state)
