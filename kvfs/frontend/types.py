"""The value types the Operations (kvfs/frontend/ops) use, with the names, fields and defaults of pyfuse3 (the
front end the native one replaced), so the Operations kept their calling convention. bridge.py reads them by
attribute.
"""

from __future__ import annotations

import errno

ROOT_INODE = 1
ENOATTR = errno.ENODATA
RENAME_NOREPLACE = 1  # linux/fs.h
RENAME_EXCHANGE = 2
default_options = frozenset({"default_permissions"})


class FUSEError(Exception):
    """A request's answer is an error number (not a daemon fault)."""

    __slots__ = ("errno",)

    def __init__(self, errno_: int) -> None:
        super().__init__(errno_)
        self.errno = errno_

    def __str__(self) -> str:
        return errno.errorcode.get(self.errno, str(self.errno))


class EntryAttributes:
    """struct stat plus the entry's generation and cache timeouts (pyfuse3.EntryAttributes)."""

    __slots__ = ("st_ino", "generation", "entry_timeout", "attr_timeout", "st_mode", "st_nlink", "st_uid",
                 "st_gid", "st_rdev", "st_size", "st_blksize", "st_blocks", "st_atime_ns", "st_mtime_ns",
                 "st_ctime_ns", "st_birthtime_ns")

    def __init__(self) -> None:
        self.st_ino = self.generation = 0
        self.entry_timeout = self.attr_timeout = 300.0
        self.st_mode = self.st_nlink = self.st_uid = self.st_gid = self.st_rdev = self.st_size = 0
        self.st_blksize = 4096
        self.st_blocks = 0
        self.st_atime_ns = self.st_mtime_ns = self.st_ctime_ns = self.st_birthtime_ns = 0

    def __repr__(self) -> str:
        return f"EntryAttributes(ino={self.st_ino}, mode={self.st_mode:o}, size={self.st_size})"


def entry_tuple(a) -> tuple:
    """The attributes in the order _loop's reply_entry/reply_attr/add_direntry_plus take them."""
    return (a.st_ino, a.generation, float(a.entry_timeout), float(a.attr_timeout), a.st_mode, a.st_nlink, a.st_uid,
            a.st_gid, a.st_rdev, a.st_size, a.st_blksize, a.st_blocks, a.st_atime_ns, a.st_mtime_ns, a.st_ctime_ns)


class FileInfo:
    """An open's answer (pyfuse3.FileInfo): the handle and the kernel's caching of the file."""

    __slots__ = ("fh", "direct_io", "keep_cache", "nonseekable", "noflush")

    def __init__(self, fh: int = 0, direct_io: bool = False, keep_cache: bool = True,
                 nonseekable: bool = False, noflush: bool = False) -> None:
        self.fh = fh
        self.direct_io = direct_io
        self.keep_cache = keep_cache
        self.nonseekable = nonseekable
        self.noflush = noflush  # FOPEN_NOFLUSH: no FLUSH at close (the native front end only)


class StatvfsData:
    __slots__ = ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files", "f_ffree", "f_favail",
                 "f_namemax")

    def __init__(self) -> None:
        for name in self.__slots__:
            setattr(self, name, 0)


def statvfs_tuple(s) -> tuple:
    return tuple(int(getattr(s, name)) for name in StatvfsData.__slots__)


class RequestContext:
    """Who sent a request (pyfuse3.RequestContext)."""

    __slots__ = ("uid", "gid", "pid", "umask")

    def __init__(self, uid: int = 0, gid: int = 0, pid: int = 0, umask: int = 0) -> None:
        self.uid, self.gid, self.pid, self.umask = uid, gid, pid, umask


class SetattrFields:
    """Which attributes a setattr changes (pyfuse3.SetattrFields)."""

    __slots__ = ("update_atime", "update_mtime", "update_ctime", "update_mode", "update_uid", "update_gid",
                 "update_size")

    def __init__(self) -> None:
        for name in self.__slots__:
            setattr(self, name, False)


class ReaddirToken:
    """The buffer of one readdirplus answer, filled by readdir_reply."""

    __slots__ = ("req", "buf", "used")

    def __init__(self, req, size: int) -> None:
        self.req = req
        self.buf = bytearray(size)
        self.used = 0


class Operations:
    """The request handlers' base (pyfuse3.Operations): every request it does not handle answers ENOSYS."""

    supports_dot_lookup = True
    enable_writeback_cache = False
    enable_acl = False

    def init(self) -> None:
        pass
