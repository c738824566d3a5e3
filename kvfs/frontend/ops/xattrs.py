"""Extended attributes: user.* of files and directories, kvfs's own (the hot/cold API, quotas, direct writes' staging
and adoption, back-pressure, the object's place for direct reads).
"""

from __future__ import annotations

import errno
import stat

from ... import direct, events, quotas
from ...adopt import AdoptRefused, Shed
from ... import lossy as lossy_modes
from ... import format as fmt
from .. import api as fuse
from ...fsck_live import XA_FSCK, Refused
from ...hotcold import REQUEST_XATTRS, XA_IDLE, XA_PIN, XA_TTL, RequestError
from ...openfile import EncodingPolicy
from ...store import ObjectRef
from .base import (log, KVFS_DIR_INODE, VIRTUAL_INODES, XATTR_NAME_MAX, XATTR_SIZE_MAX, XA_PREFIX, XA_DTYPE,
                   XA_SHAPE, XA_LOSSY, INFO_XATTRS, XA_OBJECT, XA_STAGING, XA_ADOPT, XA_CONGESTED, XA_SHED,
                   SHED_REPORT_MAX, IGNORED_XATTRS, SETTABLE_DTYPES, EXPECTED_ERRNOS, _guard, _err, OperationsBase)


class Xattrs(OperationsBase):
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
