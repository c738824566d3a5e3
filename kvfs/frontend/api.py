"""The FUSE names the rest of kvfs uses (`from .frontend import api as fuse`; ops/, daemon.py, pagecache.py,
adopt.py): the native front end's (bridge.py, _loop.c), in the names and calling convention of pyfuse3, which it
replaced. The value types are in types.py.
"""

from __future__ import annotations

from . import bridge
from .bridge import (close, init, invalidate_entry, invalidate_inode, main, native_counts, notify_store, readdir_reply,
                     terminate)
from .types import (ENOATTR, RENAME_EXCHANGE, RENAME_NOREPLACE, ROOT_INODE, EntryAttributes, FileInfo, FUSEError,
                    Operations, RequestContext, SetattrFields, StatvfsData, default_options)

__all__ = ["ENOATTR", "RENAME_EXCHANGE", "RENAME_NOREPLACE", "ROOT_INODE", "EntryAttributes", "FileInfo",
           "FUSEError", "Operations", "RequestContext", "SetattrFields", "StatvfsData", "close", "default_options",
           "init", "invalidate_entry", "invalidate_inode", "main", "native", "native_counts", "notify_store",
           "readdir_reply", "terminate"]

# READ of committed objects served in the C threads (kvfs/frontend/ops decides per open file); None with
# KVFS_NATIVE_READS=0 in the daemon's environment: every read in Python
native = bridge.NativeReads if bridge.NATIVE_READS else None
