"""Names and their lifetime: lookup and forget, create and remove, rename, links, directories.
"""

from __future__ import annotations

import errno
import stat

import trio

from .. import api as fuse
from ...index import FIRST_USER_INODE, ROOT_INODE
from ...store import ObjectRef
from .base import (log, KVFS_DIR_INODE, STATS_INODE, FSCK_INODE, KVFS_DIR_NAME, STATS_NAME, FSCK_NAME, _guard, _err,
                   OperationsBase)


class Names(OperationsBase):
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
