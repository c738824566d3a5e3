"""A tiny pjdfstest-like operation runner: each operation answers "0" (done), an errno name ("EACCES") or a
value (stat fields, readlink). Tests run it in-process as root, or as another user through setpriv
(`run_as`), where the kernel checks permissions for real. Only the standard library: the child process
imports nothing from kvfs."""

from __future__ import annotations

import ctypes
import errno
import json
import os
import subprocess
import sys
from pathlib import Path

NOBODY = 65534
AT_FDCWD = -100
RENAME_FLAGS = {"NOREPLACE": 1, "EXCHANGE": 2}


def _flags(names: str) -> int:
    value = 0
    for name in names.split("|"):
        value |= getattr(os, name)
    return value


def _times(spec) -> int:
    if spec == "NOW":
        return -1  # marker, see _utimensat
    if spec == "OMIT":
        return -2
    return int(spec)


def _utimensat(path: str, atime, mtime, nofollow: bool = False) -> None:
    """utimensat(2) with UTIME_NOW / UTIME_OMIT, which os.utime cannot express."""
    libc = ctypes.CDLL(None, use_errno=True)

    class Timespec(ctypes.Structure):
        _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]

    def spec(value) -> Timespec:
        t = _times(value)
        if t == -1:
            return Timespec(0, (1 << 30) - 1)  # UTIME_NOW
        if t == -2:
            return Timespec(0, (1 << 30) - 2)  # UTIME_OMIT
        return Timespec(t // 1_000_000_000, t % 1_000_000_000)

    times = (Timespec * 2)(spec(atime), spec(mtime))
    flags = 0x100 if nofollow else 0  # AT_SYMLINK_NOFOLLOW
    if libc.utimensat(AT_FDCWD, os.fsencode(path), times, flags) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), path)


def _renameat2(a: str, b: str, flag: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.renameat2(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_FLAGS[flag]) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), a)


def statx_times(path: str) -> dict[str, int]:
    """atime, mtime and ctime in ns, asked of the filesystem (AT_STATX_FORCE_SYNC: not the kernel's attribute
    cache, which FUSE keeps for the attribute timeout), of the path itself (AT_SYMLINK_NOFOLLOW)."""
    libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(256)
    if libc.statx(AT_FDCWD, os.fsencode(path), 0x100 | 0x2000, 0xFFF, buf) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), path)

    def at(offset: int) -> int:
        sec = int.from_bytes(buf.raw[offset:offset + 8], "little", signed=True)
        return sec * 1_000_000_000 + int.from_bytes(buf.raw[offset + 8:offset + 12], "little")

    return {"atime": at(64), "ctime": at(96), "mtime": at(112)}


def _open(path: str, flags: str, mode: int = 0o644) -> None:
    os.close(os.open(path, _flags(flags), mode))


def _write(path: str, data: str, flags: str = "O_WRONLY") -> None:
    fd = os.open(path, _flags(flags))
    try:
        os.write(fd, data.encode())
    finally:
        os.close(fd)


def _read(path: str) -> str:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.read(fd, 1 << 20).decode(errors="replace")
    finally:
        os.close(fd)


def _stat(path: str, field: str, follow: bool = True):
    st = os.stat(path) if follow else os.lstat(path)
    if field == "mode":
        return oct(st.st_mode & 0o7777)
    if field == "type":
        return oct(st.st_mode & 0o170000)
    return getattr(st, f"st_{field}")


OPS = {
    "open": _open,
    "create": lambda path, mode=0o644: _open(path, "O_CREAT|O_EXCL|O_WRONLY", mode),
    "mkdir": lambda path, mode=0o755: os.mkdir(path, mode),
    "rmdir": os.rmdir,
    "unlink": os.unlink,
    "rename": os.rename,
    "renameat2": _renameat2,
    "link": os.link,
    "symlink": os.symlink,
    "readlink": os.readlink,
    "chmod": os.chmod,
    "chown": lambda path, uid, gid: os.chown(path, uid, gid),
    "lchown": lambda path, uid, gid: os.lchown(path, uid, gid),
    "truncate": os.truncate,
    "mkfifo": lambda path, mode=0o644: os.mkfifo(path, mode),
    "utimensat": _utimensat,
    "write": _write,
    "read": _read,
    "stat": _stat,
    "lstat": lambda path, field: _stat(path, field, follow=False),
    "setxattr": lambda path, name, value: os.setxattr(path, name, value.encode()),
    "getxattr": lambda path, name: os.getxattr(path, name).decode(errors="replace"),
    "opendir": lambda path: (os.listdir(path), None)[1],
}


def run(ops: list[list]) -> list:
    """Run each operation; its answer is "0", an errno name or a value. Never raises for an errno."""
    answers = []
    for name, *args in ops:
        try:
            value = OPS[name](*args)
        except OSError as e:
            answers.append(errno.errorcode.get(e.errno, str(e.errno)))
            continue
        answers.append("0" if value is None else value)
    return answers


def run_as(uid: int, gid: int, ops: list[list], groups: list[int] | None = None) -> list:
    """The same operations in a child process with another real and effective uid/gid (no capabilities)."""
    group_opt = ["--groups=" + ",".join(map(str, groups))] if groups else ["--clear-groups"]
    child = subprocess.run(
        ["setpriv", f"--reuid={uid}", f"--regid={gid}", *group_opt, "--inh-caps=-all", sys.executable,
         str(Path(__file__).resolve())],
        input=json.dumps(ops), capture_output=True, text=True, timeout=60, cwd="/")
    if child.returncode != 0:
        raise AssertionError(f"operation runner as uid {uid} failed: {child.stderr}")
    return json.loads(child.stdout)


if __name__ == "__main__":
    print(json.dumps(run(json.load(sys.stdin))))
