"""The FUSE Operations: translate FUSE requests into index and open-file operations (in pyfuse3's calling
convention, for either front end: kvfs/frontend).

Every handler runs under `_guard`, which turns anything unexpected into a logged EIO so no request can
kill the mount. Regular-file content goes through openfile.OpenFile; names and attributes through
index.Index. A virtual read-only directory `.kvfs/` (inodes 2-4) serves live statistics and the fsck
status; setxattr(.kvfs, user.kvfs.fsck) starts an fsck job (kvfs/fsck_live.py).
"""

from __future__ import annotations

from .names import Names
from .attrs import Attrs
from .files import Files
from .native import Native
from .xattrs import Xattrs
from .lifecycle import Lifecycle
from .base import Handle

__all__ = ["Handle", "Operations"]


class Operations(Names, Attrs, Files, Native, Xattrs, Lifecycle):
    """kvfs's FUSE request handlers (pyfuse3's calling convention), one mixin per concern."""
