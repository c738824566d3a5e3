"""Attributes: getattr, setattr (and the truncate it may do), statfs.
"""

from __future__ import annotations

import errno
import stat
import time

from .. import api as fuse
from .base import (VIRTUAL_INODES, NAME_MAX, BLOCK, _guard, _err, OperationsBase)


class Attrs(OperationsBase):
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
