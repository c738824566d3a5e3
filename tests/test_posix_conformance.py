"""POSIX conformance in the style of pjdfstest, on one real mount (allow_other, default_permissions).

Tables of (operation, expected answer) cases run through tests/posix_ops.py, as root or as another uid under
setpriv (root bypasses permission checks). Then sticky directories, timestamps per operation, open flags,
hard links, rename rules, utimensat and PATH_MAX. docs/posix.md lists what each case covers.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import tempfile
import threading
import time
from pathlib import Path

import pytest

from conftest import KvfsMount
from posix_ops import NOBODY, run, run_as

OTHER = 65533  # a second unprivileged user (no passwd entry needed)
TIME_STEP = 0.02  # between an operation and the one whose timestamps must be later


@pytest.fixture(scope="module")
def mount():
    """One mount for the module, in a root that other users may traverse (tmp_path is 0700)."""
    root = Path(tempfile.mkdtemp(prefix="kvfs-posix-"))
    os.chmod(root, 0o755)
    m = KvfsMount(root)
    try:
        m.start("--allow-other")
        os.chmod(m.mountpoint, 0o755)
        yield m
        assert m.alive(), "the daemon died during the module\n" + m.log_text()[-4000:]
        assert m.stop() == 0
        assert not m.unexpected_log_lines(), m.unexpected_log_lines()
    finally:
        if m.proc is not None:
            m.kill9()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def d(mount: KvfsMount, request) -> Path:
    """A fresh directory per test, world-writable only where a test says so."""
    path = mount.path(request.node.name.replace("/", "_")[:200])
    path.mkdir(mode=0o755)
    os.chmod(path, 0o755)
    return path


def fmt(ops: list[list], d: Path) -> list[list]:
    return [[a.format(d=d) if isinstance(a, str) else a for a in op] for op in ops]


# -- errno tables --------------------------------------------------------------------------------------------
# Setups run as root in a fresh directory {d}: f (a file with data), dir (an empty directory), full (a directory
# with a file), ln (a symlink to f). Each case: (setup extras, who runs the checks, [(operation, answer)]).
BASE = [["write", "{d}/f", "data", "O_WRONLY|O_CREAT"], ["mkdir", "{d}/dir"], ["mkdir", "{d}/full"],
        ["create", "{d}/full/x"], ["symlink", "f", "{d}/ln"]]
LONG = "n" * 256

ERRNO_CASES = {
    # ENOENT: a missing name or a missing component
    "enoent": ([], "root", [
        (["open", "{d}/nx", "O_RDONLY"], "ENOENT"), (["open", "{d}/nx/f", "O_CREAT|O_WRONLY"], "ENOENT"),
        (["unlink", "{d}/nx"], "ENOENT"), (["rmdir", "{d}/nx"], "ENOENT"), (["rename", "{d}/nx", "{d}/y"], "ENOENT"),
        (["link", "{d}/nx", "{d}/y"], "ENOENT"), (["chmod", "{d}/nx", 0o644], "ENOENT"),
        (["chown", "{d}/nx", 0, 0], "ENOENT"), (["truncate", "{d}/nx", 0], "ENOENT"),
        (["readlink", "{d}/nx"], "ENOENT"), (["utimensat", "{d}/nx", "NOW", "NOW"], "ENOENT"),
        (["mkdir", "{d}/nx/y"], "ENOENT"), (["symlink", "t", "{d}/nx/y"], "ENOENT"),
        (["renameat2", "{d}/f", "{d}/nx", "EXCHANGE"], "ENOENT"),
        (["symlink", "nowhere", "{d}/dangling"], "0"), (["open", "{d}/dangling", "O_RDONLY"], "ENOENT"),
        (["open", "{d}/dangling", "O_CREAT|O_WRONLY"], "0"), (["stat", "{d}/nowhere", "size"], 0)]),
    # ENOTDIR: a file used as a directory
    "enotdir": ([], "root", [
        (["open", "{d}/f/x", "O_RDONLY"], "ENOTDIR"), (["open", "{d}/f/x", "O_CREAT|O_WRONLY"], "ENOTDIR"),
        (["mkdir", "{d}/f/x"], "ENOTDIR"), (["unlink", "{d}/f/x"], "ENOTDIR"), (["rmdir", "{d}/f"], "ENOTDIR"),
        (["rename", "{d}/dir", "{d}/f"], "ENOTDIR"), (["rename", "{d}/f", "{d}/g/"], "ENOTDIR"),
        (["open", "{d}/f", "O_RDONLY|O_DIRECTORY"], "ENOTDIR"), (["open", "{d}/f/", "O_RDONLY"], "ENOTDIR"),
        (["opendir", "{d}/f"], "ENOTDIR"), (["link", "{d}/f", "{d}/f/x"], "ENOTDIR"),
        (["symlink", "t", "{d}/f/x"], "ENOTDIR"), (["mkfifo", "{d}/f/x"], "ENOTDIR")]),
    # EISDIR: a directory used as a file
    "eisdir": ([], "root", [
        (["open", "{d}/dir", "O_WRONLY"], "EISDIR"), (["open", "{d}/dir", "O_RDWR"], "EISDIR"),
        (["open", "{d}/dir", "O_CREAT|O_RDONLY"], "EISDIR"), (["rename", "{d}/f", "{d}/dir"], "EISDIR"),
        (["unlink", "{d}/dir"], "EISDIR"), (["truncate", "{d}/dir", 0], "EISDIR"),
        (["open", "{d}/dir", "O_RDONLY|O_DIRECTORY"], "0")]),
    # EEXIST: the new name is taken (a dangling symlink counts)
    "eexist": ([["symlink", "nowhere", "{d}/dangling"]], "root", [
        (["mkdir", "{d}/f"], "EEXIST"), (["mkdir", "{d}/dir"], "EEXIST"), (["mkdir", "{d}/dangling"], "EEXIST"),
        (["create", "{d}/f"], "EEXIST"), (["create", "{d}/dangling"], "EEXIST"),
        (["open", "{d}/ln", "O_CREAT|O_EXCL|O_WRONLY"], "EEXIST"), (["link", "{d}/f", "{d}/dir"], "EEXIST"),
        (["symlink", "t", "{d}/f"], "EEXIST"), (["mkfifo", "{d}/f"], "EEXIST"),
        (["renameat2", "{d}/full/x", "{d}/f", "NOREPLACE"], "EEXIST"), (["stat", "{d}/full/x", "size"], 0)]),
    # ENOTEMPTY, EINVAL, ELOOP, EPERM, EXDEV-free rules of the namespace
    "enotempty": ([], "root", [
        (["rmdir", "{d}/full"], "ENOTEMPTY"), (["rename", "{d}/dir", "{d}/full"], "ENOTEMPTY"),
        (["rmdir", "{d}/full/.."], "ENOTEMPTY"), (["stat", "{d}/full/x", "nlink"], 1)]),
    "einval": ([["mkdir", "{d}/dir/sub"]], "root", [
        (["rename", "{d}/dir", "{d}/dir/sub/into"], "EINVAL"), (["rename", "{d}/dir", "{d}/dir/into"], "EINVAL"),
        (["rmdir", "{d}/dir/sub/."], "EINVAL"), (["readlink", "{d}/f"], "EINVAL"), (["truncate", "{d}/f", -1], "EINVAL"),
        (["rename", "{d}/dir/sub", "{d}/dir/sub/"], "0")]),
    "eloop": ([["symlink", "loop-b", "{d}/loop-a"], ["symlink", "loop-a", "{d}/loop-b"]], "root", [
        (["open", "{d}/loop-a", "O_RDONLY"], "ELOOP"), (["open", "{d}/ln", "O_RDONLY|O_NOFOLLOW"], "ELOOP"),
        (["mkdir", "{d}/loop-a/x"], "ELOOP"), (["chmod", "{d}/loop-a", 0o644], "ELOOP"),
        (["lstat", "{d}/loop-a", "type"], oct(stat.S_IFLNK))]),
    "enametoolong": ([], "root", [
        (["create", "{d}/" + LONG], "ENAMETOOLONG"), (["mkdir", "{d}/" + LONG], "ENAMETOOLONG"),
        (["symlink", "f", "{d}/" + LONG], "ENAMETOOLONG"), (["link", "{d}/f", "{d}/" + LONG], "ENAMETOOLONG"),
        (["rename", "{d}/f", "{d}/" + LONG], "ENAMETOOLONG"), (["mkfifo", "{d}/" + LONG], "ENAMETOOLONG"),
        (["unlink", "{d}/" + LONG], "ENAMETOOLONG"), (["symlink", "t" * 4096, "{d}/s"], "ENAMETOOLONG"),
        (["create", "{d}/" + "n" * 255], "0"), (["symlink", "t" * 4095, "{d}/s"], "0"),
        (["lstat", "{d}/s", "size"], 4095)]),
    "eperm_root": ([], "root", [
        (["link", "{d}/dir", "{d}/dirlink"], "EPERM"), (["unlink", "{d}/../.kvfs/stats"], "EPERM"),
        (["mkdir", "{d}/../.kvfs/x"], "EPERM"), (["rename", "{d}/../.kvfs", "{d}/k"], "EPERM"),
        (["open", "{d}/../.kvfs/stats", "O_WRONLY"], "EACCES")]),
    "enxio_fifo": ([["mkfifo", "{d}/fifo"]], "root", [
        (["open", "{d}/fifo", "O_WRONLY|O_NONBLOCK"], "ENXIO"), (["open", "{d}/fifo", "O_RDONLY|O_NONBLOCK"], "0")]),
    # permission checks: the kernel's, from the modes and owners kvfs reports (default_permissions)
    "eacces_nobody": ([["chmod", "{d}/f", 0o644], ["mkdir", "{d}/private", 0o700], ["create", "{d}/private/p"],
                       ["write", "{d}/secret", "s", "O_WRONLY|O_CREAT"], ["chmod", "{d}/secret", 0o600],
                      ["create", "{d}/owned"], ["chown", "{d}/owned", NOBODY, NOBODY]], "nobody", [
        (["read", "{d}/secret"], "EACCES"), (["open", "{d}/f", "O_WRONLY"], "EACCES"),
        (["open", "{d}/f", "O_RDONLY|O_TRUNC"], "EACCES"), (["truncate", "{d}/f", 0], "EACCES"),
        (["read", "{d}/f"], "data"), (["create", "{d}/new"], "EACCES"), (["mkdir", "{d}/new"], "EACCES"),
        (["unlink", "{d}/f"], "EACCES"), (["rmdir", "{d}/dir"], "EACCES"), (["rename", "{d}/f", "{d}/g"], "EACCES"),
        (["link", "{d}/owned", "{d}/g"], "EACCES"), (["symlink", "f", "{d}/g"], "EACCES"),
        (["link", "{d}/f", "{d}/g2"], "EPERM"),  # fs.protected_hardlinks: not the caller's file
        (["mkfifo", "{d}/g"], "EACCES"), (["stat", "{d}/private/p", "size"], "EACCES"),
        (["opendir", "{d}/private"], "EACCES"), (["utimensat", "{d}/f", "NOW", "NOW"], "EACCES"),
        (["stat", "{d}/f", "size"], 4)]),
    "eperm_nobody": ([["chmod", "{d}/f", 0o666], ["chmod", "{d}", 0o777]], "nobody", [
        (["chmod", "{d}/f", 0o777], "EPERM"), (["chown", "{d}/f", NOBODY, NOBODY], "EPERM"),
        (["utimensat", "{d}/f", 1_000_000_000, 1_000_000_000], "EPERM"), (["utimensat", "{d}/f", "NOW", "NOW"], "0"),
        (["utimensat", "{d}/f", "OMIT", "NOW"], "EPERM"), (["utimensat", "{d}/f", "OMIT", "OMIT"], "0"),  # as tmpfs
        (["create", "{d}/mine", 0o644], "0"), (["chown", "{d}/mine", 0, 0], "EPERM"),
        (["chown", "{d}/mine", -1, 0], "EPERM"), (["chown", "{d}/mine", NOBODY, NOBODY], "0"),
        (["chmod", "{d}/mine", 0o600], "0"), (["stat", "{d}/mine", "mode"], oct(0o600)),
        (["stat", "{d}/mine", "uid"], NOBODY), (["stat", "{d}/mine", "gid"], NOBODY),
        (["setxattr", "{d}/f", "trusted.x", "1"], "EPERM")]),
}


@pytest.mark.parametrize("case", sorted(ERRNO_CASES))
def test_errno_table(d: Path, case: str):
    extra, who, checks = ERRNO_CASES[case]
    assert set(run(fmt(BASE + extra, d))) == {"0"}
    ops = fmt([op for op, _ in checks], d)
    answers = run(ops) if who == "root" else run_as(NOBODY, NOBODY, ops)
    wrong = [(op, want, got) for op, (_, want), got in zip(ops, checks, answers) if want != got]
    assert not wrong, "\n".join(f"{op}: expected {want}, got {got}" for op, want, got in wrong)


def test_exdev_and_ebusy(mount: KvfsMount, d: Path, tmp_path: Path):
    (d / "f").write_bytes(b"x")
    outside = tmp_path / "outside"
    assert run([["rename", str(d / "f"), str(outside)], ["link", str(d / "f"), str(outside)],
                ["rmdir", str(mount.mountpoint)]]) == ["EXDEV", "EXDEV", "EBUSY"]


def test_fd_errors(d: Path):
    f = d / "f"
    f.write_bytes(b"abc")
    fd = os.open(f, os.O_RDONLY)
    try:
        with pytest.raises(OSError) as e:
            os.write(fd, b"x")
        assert e.value.errno == errno.EBADF
        with pytest.raises(OSError) as e:
            os.ftruncate(fd, 0)
        assert e.value.errno == errno.EINVAL
    finally:
        os.close(fd)
    fd = os.open(f, os.O_WRONLY)
    try:
        with pytest.raises(OSError) as e:
            os.read(fd, 1)
        assert e.value.errno == errno.EBADF
    finally:
        os.close(fd)
    assert f.read_bytes() == b"abc"


# -- other users: sticky directories, set-id bits --------------------------------------------------------------
def test_sticky_directory(d: Path):
    """In a 1777 directory only a file's owner, the directory's owner or root may remove or rename it."""
    sticky = d / "tmp"
    sticky.mkdir()
    os.chmod(sticky, 0o1777)
    assert run([["stat", str(sticky), "mode"]]) == [oct(0o1777)]
    s = str(sticky)
    assert run_as(NOBODY, NOBODY, [["create", f"{s}/nobodys"], ["mkdir", f"{s}/nobodys-dir"]]) == ["0", "0"]
    assert run_as(OTHER, OTHER, [["create", f"{s}/others"], ["chmod", f"{s}/others", 0o666]]) == ["0", "0"]
    (sticky / "roots").write_bytes(b"r")
    os.chmod(sticky / "roots", 0o666)
    assert run_as(NOBODY, NOBODY, [
        ["unlink", f"{s}/others"], ["unlink", f"{s}/roots"], ["rename", f"{s}/others", f"{s}/mine"],
        ["rename", f"{s}/nobodys", f"{s}/others"],  # replacing another user's file is removing it
        ["write", f"{s}/others", "w"],  # writing is not removing: the file mode allows it
        ["rename", f"{s}/nobodys", f"{s}/renamed"], ["unlink", f"{s}/renamed"], ["rmdir", f"{s}/nobodys-dir"],
    ]) == ["EPERM", "EPERM", "EPERM", "EPERM", "0", "0", "0", "0"]
    assert run([["unlink", f"{s}/others"], ["unlink", f"{s}/roots"]]) == ["0", "0"]  # root may
    os.chown(sticky, OTHER, OTHER)  # the directory's owner may remove anyone's file
    assert run_as(NOBODY, NOBODY, [["create", f"{s}/n2"]]) == ["0"]
    assert run_as(OTHER, OTHER, [["unlink", f"{s}/n2"]]) == ["0"]
    assert sorted(os.listdir(sticky)) == []


def test_setid_bits_cleared_by_write_and_chown(d: Path):
    """A write by another user drops S_ISUID/S_ISGID (the kernel asks kvfs to), as does chown; a chmod g+s by
    someone outside the file's group is silently dropped."""
    os.chmod(d, 0o777)
    f = d / "suid"
    f.write_bytes(b"#!/bin/sh\n")
    os.chmod(f, 0o6777)
    assert run_as(NOBODY, NOBODY, [["write", str(f), "x"], ["stat", str(f), "mode"]]) == ["0", oct(0o777)]
    os.chmod(f, 0o4755)
    os.chown(f, NOBODY, NOBODY)
    assert stat.S_IMODE(f.stat().st_mode) == 0o755
    assert run_as(NOBODY, NOBODY, [["chown", str(f), -1, 0]]) == ["EPERM"]
    os.chown(f, NOBODY, 0)
    assert run_as(NOBODY, NOBODY, [["chmod", str(f), 0o2755], ["stat", str(f), "mode"]]) == ["0", oct(0o755)]
    assert run_as(NOBODY, 0, [["chmod", str(f), 0o2755], ["stat", str(f), "mode"]], groups=[0]) == ["0", oct(0o2755)]


def test_setgid_directory_passes_its_group_on(d: Path):
    """Linux semantics: in a set-group-ID directory new entries take the directory's group and new
    subdirectories inherit the bit."""
    shared = d / "shared"
    shared.mkdir()
    os.chown(shared, 0, 4321)
    os.chmod(shared, 0o2777)
    s = str(shared)
    assert run_as(NOBODY, NOBODY, [["create", f"{s}/f"], ["mkdir", f"{s}/sub", 0o755], ["stat", f"{s}/f", "gid"],
                                   ["stat", f"{s}/sub", "gid"], ["stat", f"{s}/sub", "mode"],
                                   ["stat", f"{s}/f", "uid"]]) == ["0", "0", 4321, 4321, oct(0o2755), NOBODY]
