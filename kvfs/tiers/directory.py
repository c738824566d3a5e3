"""A tier in a local directory: L2 on tmpfs, L3 on an SSD, or L4 on a mounted distributed filesystem.

Layout: <root>/<2 hex digits>/<object_id>; puts go to <object_id>.tmp first. Directories are 0700 and
objects 0600 so other users cannot read cached KV through the backing store. <root>/staging/ holds objects
that direct writers encoded themselves, until the daemon adopts them (kvfs/staging.py, kvfs/adopt.py);
abandoned ones count as strays.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from .. import staging
from .base import ObjectInfo, Stray, Tier

TMP_SUFFIX = ".tmp"


class DirectoryTier(Tier):
    def __init__(self, name: str, root: Path, capacity: int, persistent: bool) -> None:
        super().__init__(name, capacity, persistent)
        self.root = Path(root)
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)

    def describe(self) -> str:
        return str(self.root)

    @property
    def staging_dir(self) -> Path:
        return self.root / staging.STAGING_DIR

    def make_staging_dir(self) -> Path:
        """The staging directory, created 0700 (only the daemon's user, or root, may write direct)."""
        self.staging_dir.mkdir(mode=0o700, exist_ok=True)
        os.chmod(self.staging_dir, 0o700)
        return self.staging_dir

    def adopt_staged(self, staged: Path, object_id: str) -> None:
        """Rename a verified staged object into place (same filesystem: no bytes move)."""
        self.check_writable()
        path = self._path(object_id)
        try:
            os.rename(staged, path)
        except FileNotFoundError:  # the shard's directory is made at its first object (or staged is gone: again)
            path.parent.mkdir(mode=0o700, exist_ok=True)
            os.rename(staged, path)
        if self.persistent:
            _fsync_dir(path.parent)

    def staged(self) -> Iterator[tuple[Path, os.stat_result]]:
        """Staged objects, live or abandoned."""
        try:
            entries = list(os.scandir(self.staging_dir))
        except FileNotFoundError:
            return
        for entry in entries:
            try:
                yield Path(entry.path), entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue  # adopted or removed meanwhile

    def _path(self, object_id: str) -> Path:
        shard = format(hash_shard(object_id), "02x")
        return self.root / shard / object_id

    def put(self, object_id: str, parts: Iterable[bytes], durable: bool) -> int:
        self.check_writable()
        path = self._path(object_id)
        path.parent.mkdir(mode=0o700, exist_ok=True)
        tmp = path.with_name(path.name + TMP_SUFFIX)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            size = 0
            for part in parts:
                view = memoryview(part)
                while view:
                    n = os.write(fd, view)
                    view = view[n:]
                    size += n
            if durable:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            _unlink_quietly(tmp)
            raise
        os.close(fd)
        os.rename(tmp, path)
        if durable:
            _fsync_dir(path.parent)
        return size

    def read(self, object_id: str, offset: int, length: int) -> bytes:
        self.check_readable(object_id)
        fd = os.open(self._path(object_id), os.O_RDONLY | os.O_CLOEXEC)
        try:
            return os.pread(fd, length, offset)
        finally:
            os.close(fd)

    def local_path(self, object_id: str) -> str | None:
        return None if self.disowned else str(self._path(object_id))

    def size_of(self, object_id: str) -> int | None:
        if self.disowned:
            return None  # not this mount's any more: absent, as far as it is concerned
        try:
            return self._path(object_id).stat().st_size
        except FileNotFoundError:
            return None

    def delete(self, object_id: str) -> None:
        self.check_writable()
        _unlink_quietly(self._path(object_id))

    def scan(self) -> Iterator[ObjectInfo]:
        for shard in self.root.iterdir():
            if not shard.is_dir():
                continue  # only shard directories hold objects
            for entry in os.scandir(shard):
                if entry.is_file(follow_symlinks=False) and not self._is_stray(Path(entry.path)):
                    try:
                        size = entry.stat(follow_symlinks=False).st_size
                    except FileNotFoundError:
                        continue  # deleted since the directory was read (a live fsck lists while moves run)
                    yield ObjectInfo(entry.name, size)

    def _is_stray(self, path: Path) -> bool:
        return path.name.endswith(TMP_SUFFIX) or path.parent != self._path(path.name).parent

    def strays(self) -> Iterator[Stray]:
        """Temp files of interrupted puts, misplaced files, and abandoned staged objects (a live writer's
        are not strays: it is about to ask for their adoption)."""
        now = time.time()
        for path, st in self.staged():
            if staging.abandoned(path.name, st.st_mtime, now):
                yield Stray(f"{staging.STAGING_DIR}/{path.name}", st.st_size)
        for path in self.root.glob("*/*"):
            if path.parent.name == staging.STAGING_DIR:
                continue
            if self._is_stray(path):
                try:
                    size = path.lstat().st_size
                except FileNotFoundError:
                    continue  # a put renamed it meanwhile
                of = path.name.removesuffix(TMP_SUFFIX) if path.name.endswith(TMP_SUFFIX) else None
                yield Stray(str(path.relative_to(self.root)), size, of)

    def _stray_path(self, name: str) -> Path | None:
        path = self.root / name
        return path if path.parent.parent == self.root else None  # only names strays() gives: in a shard

    def stray_size(self, name: str) -> int | None:
        path = self._stray_path(name)
        try:
            return path.lstat().st_size if path is not None else None
        except FileNotFoundError:
            return None

    def remove_stray(self, name: str) -> None:
        self.check_writable()
        path = self._stray_path(name)
        if path is not None:
            _unlink_quietly(path)

    def remove_strays(self) -> int:
        removed = 0
        for stray in self.strays():
            self.remove_stray(stray.name)
            removed += 1
        return removed


def hash_shard(object_id: str) -> int:
    """Spread objects over 256 subdirectories by a stable hash of the id."""
    h = 0
    for ch in object_id.encode():
        h = (h * 31 + ch) & 0xFFFF
    return h & 0xFF


def _unlink_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    except OSError as e:  # some filesystems refuse fsync on directories
        if e.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)
