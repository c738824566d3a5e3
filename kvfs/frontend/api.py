"""The pyfuse3 names kvfs uses, bound to the front end the mount runs (`kvfs mount --frontend`).

kvfs/fs.py, daemon.py and pagecache.py call `fuse.X` where they called `pyfuse3.X`. `use("native")` rebinds
the names to the native front end (kvfs/frontend/bridge.py, _loop.c) before the mount; until then (and with
`use("pyfuse3")`) they are pyfuse3's own. The value types of the native one are in types.py. FUSEError is
pyfuse3's class while pyfuse3 is installed, so code that raises pyfuse3's (adopt.py) is answered the same.
"""

from __future__ import annotations

from . import types as _types

try:
    import pyfuse3 as _pyfuse3
except ImportError:  # pragma: no cover - the native front end only
    _pyfuse3 = None

FRONTENDS = ("pyfuse3", "native")

FUSEError = _types.FUSEError
ENOATTR = _types.ENOATTR
ROOT_INODE = _types.ROOT_INODE
RENAME_EXCHANGE = _types.RENAME_EXCHANGE
RENAME_NOREPLACE = _types.RENAME_NOREPLACE
default_options = _types.default_options
# the base class is fixed when fs.py is imported; both front ends accept either (they look methods up by name)
Operations = _pyfuse3.Operations if _pyfuse3 is not None else _types.Operations

name = ""  # the front end the names below belong to
native = None


def use(frontend: str) -> None:
    """Bind the request-time names to one front end (before the mount)."""
    global name, EntryAttributes, FileInfo, StatvfsData, RequestContext, SetattrFields, readdir_reply
    global invalidate_entry, invalidate_inode, notify_store, init, main, terminate, close, native
    if frontend == "native":
        from . import bridge as m
        types = _types
    elif frontend == "pyfuse3":
        if _pyfuse3 is None:
            raise RuntimeError("the pyfuse3 front end needs pyfuse3, which is not installed")
        m = types = _pyfuse3
    else:
        raise ValueError(f"unknown front end {frontend!r} (choose one of {', '.join(FRONTENDS)})")
    EntryAttributes, FileInfo, StatvfsData = types.EntryAttributes, types.FileInfo, types.StatvfsData
    RequestContext, SetattrFields = types.RequestContext, types.SetattrFields
    readdir_reply, invalidate_entry, invalidate_inode = m.readdir_reply, m.invalidate_entry, m.invalidate_inode
    notify_store, init, main, terminate, close = m.notify_store, m.init, m.main, m.terminate, m.close
    # native reads (kvfs/frontend/_loop.c): READ of committed objects served in C threads; None: every read in Python
    native = m.NativeReads if frontend == "native" and m.NATIVE_READS else None
    name = frontend


use("pyfuse3" if _pyfuse3 is not None else "native")
