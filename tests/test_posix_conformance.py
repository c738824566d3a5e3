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
# fs.protected_hardlinks (the default of most distributions): no hard links to files one may not read and write
PROTECTED_HARDLINKS = Path("/proc/sys/fs/protected_hardlinks").read_text().strip() == "1"
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
        (["rmdir", "{d}/dir/sub/."], "EINVAL"), (["readlink", "{d}/f"], "EINVAL"),
        (["truncate", "{d}/f", -1], "EINVAL"),
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
    "efbig": ([], "root", [  # format.MAX_FILE_SIZE: 64 GiB
        (["truncate", "{d}/f", 64 << 30], "0"), (["truncate", "{d}/f", (64 << 30) + 1], "EFBIG"),
        (["stat", "{d}/f", "size"], 64 << 30), (["truncate", "{d}/f", 0], "0")]),
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
        (["link", "{d}/f", "{d}/g2"], "EPERM" if PROTECTED_HARDLINKS else "EACCES"),  # not the caller's file
        (["mkfifo", "{d}/g"], "EACCES"), (["stat", "{d}/private/p", "size"], "EACCES"),
        (["opendir", "{d}/private"], "EACCES"), (["utimensat", "{d}/f", "NOW", "NOW"], "EACCES"),
        (["setxattr", "{d}/f", "user.x", "1"], "EACCES"), (["getxattr", "{d}/secret", "user.x"], "EACCES"),
        (["getxattr", "{d}/f", "user.kvfs.tier"], "L2"), (["setxattr", "{d}/owned", "user.x", "mine"], "0"),
        (["getxattr", "{d}/owned", "user.x"], "mine"),
        (["setxattr", "{d}/../.kvfs", "user.kvfs.fsck", "check"], "EACCES"),  # fsck is the daemon user's
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


# -- timestamps ------------------------------------------------------------------------------------------------
def _set_xattr(p: Path) -> None:
    os.setxattr(p, "user.t", b"1")


def _remove_xattr(p: Path) -> None:
    os.removexattr(p, "user.set-up")


def _o_trunc(p: Path) -> None:
    os.close(os.open(p, os.O_WRONLY | os.O_TRUNC))


def _uncached_read(p: Path) -> None:
    fd = os.open(p, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # the daemon serves the read, not the page cache
    assert os.read(fd, 10) == b"0123456789"
    os.close(fd)


def _write(p: Path) -> None:
    with open(p, "r+b") as fh:
        fh.write(b"w")


def _utimens(atime, mtime):
    return lambda p: run([["utimensat", str(p), atime, mtime]]) == ["0"] or pytest.fail("utimensat failed")


# (operation on the directory d with file d/f (10 bytes, xattr user.set-up), d/e (empty), d/sub/; which (path,
# field) must advance, all other fields of d, f, e and sub staying as they were; renamed entries: new -> old name)
TIME_CASES = {
    "create": (lambda d: (d / "new").touch(), {("d", "mtime"), ("d", "ctime")}),
    "mkdir": (lambda d: (d / "nd").mkdir(), {("d", "mtime"), ("d", "ctime")}),
    "mkfifo": (lambda d: os.mkfifo(d / "p"), {("d", "mtime"), ("d", "ctime")}),
    "symlink": (lambda d: os.symlink("f", d / "s"), {("d", "mtime"), ("d", "ctime")}),
    "link": (lambda d: os.link(d / "f", d / "sub" / "f2"),
             {("f", "ctime"), ("sub", "mtime"), ("sub", "ctime")}),
    "unlink_one_of_two_links": (lambda d: (os.link(d / "f", d / "g"), time.sleep(TIME_STEP), os.unlink(d / "g")),
                                {("d", "mtime"), ("d", "ctime"), ("f", "ctime")}),
    "rmdir": (lambda d: (d / "sub").rmdir(), {("d", "mtime"), ("d", "ctime")}),
    "rename_in_dir": (lambda d: os.rename(d / "e", d / "e2"), {("d", "mtime"), ("d", "ctime")}),
    "rename_across": (lambda d: os.rename(d / "f", d / "sub" / "f"),
                      {("d", "mtime"), ("d", "ctime"), ("sub", "mtime"), ("sub", "ctime"), ("sub/f", "ctime")},
                      {"sub/f": "f"}),
    "rename_dir_across": (lambda d: (os.mkdir(d / "x"), time.sleep(TIME_STEP), os.rename(d / "sub", d / "x" / "sub")),
                          {("d", "mtime"), ("d", "ctime"), ("x/sub", "ctime")}, {"x/sub": "sub"}),
    "chmod": (lambda d: os.chmod(d / "f", 0o600), {("f", "ctime")}),
    "chown": (lambda d: os.chown(d / "f", 7, 7), {("f", "ctime")}),
    "write": (lambda d: _write(d / "f"), {("f", "mtime"), ("f", "ctime")}),
    "truncate": (lambda d: os.truncate(d / "f", 3), {("f", "mtime"), ("f", "ctime")}),
    "o_trunc": (lambda d: _o_trunc(d / "f"), {("f", "mtime"), ("f", "ctime")}),
    "o_trunc_empty": (lambda d: _o_trunc(d / "e"), {("e", "mtime"), ("e", "ctime")}),
    "setxattr": (lambda d: _set_xattr(d / "f"), {("f", "ctime")}),
    "removexattr": (lambda d: _remove_xattr(d / "f"), {("f", "ctime")}),
    "read": (lambda d: _uncached_read(d / "f"), {("f", "atime")}),
    "readdir": (lambda d: os.listdir(d / "sub"), {("sub", "atime")}),
    "utime_now_now": (lambda d: _utimens("NOW", "NOW")(d / "f"), {("f", "atime"), ("f", "mtime"), ("f", "ctime")}),
    "utime_omit_now": (lambda d: _utimens("OMIT", "NOW")(d / "f"), {("f", "mtime"), ("f", "ctime")}),
    "utime_now_omit": (lambda d: _utimens("NOW", "OMIT")(d / "f"), {("f", "atime"), ("f", "ctime")}),
    "utime_omit_omit": (lambda d: _utimens("OMIT", "OMIT")(d / "f"), set()),
    "exchange": (lambda d: run([["renameat2", str(d / "f"), str(d / "e"), "EXCHANGE"]]) == ["0"] or pytest.fail(),
                 {("d", "mtime"), ("d", "ctime"), ("e", "ctime"), ("f", "ctime")}, {"e": "f", "f": "e"}),
}


@pytest.mark.parametrize("case", sorted(TIME_CASES))
def test_times_per_operation(d: Path, case: str):
    from posix_ops import statx_times

    operation, advance, renamed = (*TIME_CASES[case], {})[:3]
    (d / "f").write_bytes(b"0123456789")
    os.setxattr(d / "f", "user.set-up", b"1")
    (d / "e").touch()
    (d / "sub").mkdir()
    names = ["d", "f", "e", "sub"]

    def snapshot() -> dict[str, dict[str, int]]:
        return {n: statx_times(str(d if n == "d" else d / n)) for n in names}

    time.sleep(TIME_STEP)  # the clock must move: setup and the operation can share a millisecond
    before = snapshot()
    time.sleep(TIME_STEP)
    operation(d)
    after = {n: statx_times(str(d if n == "d" else d / n)) for n in {*names, *renamed}
             if n == "d" or (d / n).exists()}
    wrong = []
    for n, fields in after.items():
        if fields["ctime"] < fields["mtime"]:  # no case sets times explicitly: a change is a status change
            wrong.append(f"{n} ctime {fields['ctime']} before its mtime {fields['mtime']}")
        old = before.get(renamed.get(n, n))
        if old is None:
            continue
        for field in ("atime", "mtime", "ctime"):
            want_advance = (n, field) in advance
            if want_advance and not fields[field] > old[field]:
                wrong.append(f"{n} {field} did not advance ({old[field]} -> {fields[field]})")
            if not want_advance and fields[field] != old[field]:
                wrong.append(f"{n} {field} changed ({old[field]} -> {fields[field]})")
    assert not wrong, "\n".join(wrong)


def test_explicit_atime_outlives_an_earlier_reads_batched_atime(make_mount):
    """kvfs batches read access times; one set by utimensat after a read must not be overwritten when the
    batch is written (here: at unmount)."""
    m = make_mount().start()
    f = m.path("f")
    f.write_bytes(b"0123456789")
    _uncached_read(f)
    os.utime(f, ns=(1_000_000_007, 2_000_000_009))
    m.stop()
    m.start(*m.args)
    st = f.stat()
    assert (st.st_atime_ns, st.st_mtime_ns) == (1_000_000_007, 2_000_000_009)


def test_times_set_while_writes_are_unsaved(d: Path):
    """An explicit mtime on a file with unsaved writes is kept by the commit at close; ctime is the status
    change's time, never the mtime given."""
    from posix_ops import statx_times

    f = d / "f"
    fd = os.open(f, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        os.write(fd, b"unsaved")
        before = time.time_ns() - 10_000_000  # the kernel's clock may be coarser
        os.utime(f, ns=(1_000_000_000, 2_000_000_000))
        t = statx_times(str(f))
        assert t["mtime"] == 2_000_000_000 and t["ctime"] >= before, t
    finally:
        os.close(fd)
    t = statx_times(str(f))
    assert t["mtime"] == 2_000_000_000 and t["ctime"] >= before, t
    assert f.read_bytes() == b"unsaved"


def test_moves_between_tiers_are_not_accesses(d: Path):
    """Demoting, promoting and prefetching a file moves it but reads nothing: its times stay."""
    from posix_ops import statx_times

    f = d / "f"
    f.write_bytes(os.urandom(100_000))
    before = statx_times(str(f))
    time.sleep(TIME_STEP)
    for request, value, tier in (("user.kvfs.tier", b"L3", b"L3"), ("user.kvfs.tier", b"L2", b"L2"),
                                 ("user.kvfs.tier", b"L3", b"L3"), ("user.kvfs.prefetch", b"1", b"L2")):
        os.setxattr(f, request, value)
        deadline = time.monotonic() + 10
        while os.getxattr(f, "user.kvfs.tier") != tier and time.monotonic() < deadline:
            time.sleep(0.02)
        assert os.getxattr(f, "user.kvfs.tier") == tier, (request, value)
    assert statx_times(str(f)) == before


def test_utimensat_values(d: Path):
    from posix_ops import statx_times

    f = str(d / "f")
    (d / "f").write_bytes(b"x")
    assert run([["utimensat", f, 1_500_000_000_123_456_789, 1_600_000_000_987_654_321]]) == ["0"]
    t = statx_times(f)
    assert (t["atime"], t["mtime"]) == (1_500_000_000_123_456_789, 1_600_000_000_987_654_321)
    assert t["ctime"] > 1_700_000_000 * 10**9  # a status change: now, not the time given
    assert run([["utimensat", f, "OMIT", 42]]) == ["0"]
    assert (statx_times(f)["atime"], statx_times(f)["mtime"]) == (1_500_000_000_123_456_789, 42)
    before = time.time_ns()
    assert run([["utimensat", f, "NOW", "OMIT"]]) == ["0"]
    t = statx_times(f)
    assert t["atime"] >= before - 10_000_000 and t["mtime"] == 42  # the kernel's clock may be coarser
    os.symlink("f", d / "s")
    assert run([["utimensat", f, -5_000_000_000, 0]]) == ["0"]  # before the epoch
    assert statx_times(f)["atime"] == -5_000_000_000


# -- open flags ------------------------------------------------------------------------------------------------
def test_o_append_writes_at_the_end_whatever_the_offset(d: Path):
    f = d / "log"
    f.write_bytes(b"start:")
    a = os.open(f, os.O_WRONLY | os.O_APPEND)
    b = os.open(f, os.O_WRONLY | os.O_APPEND)
    plain = os.open(f, os.O_WRONLY)
    try:
        os.write(a, b"a1;")
        os.lseek(b, 0, os.SEEK_SET)
        os.write(b, b"b1;")  # at the end, not at 0
        os.pwrite(plain, b"S", 0)
        os.write(a, b"a2;")
        os.pwrite(b, b"b2;", 0)  # Linux: pwrite on an O_APPEND descriptor appends too
        assert os.lseek(a, 0, os.SEEK_CUR) == len(b"start:a1;b1;a2;")
    finally:
        for fd in (a, b, plain):
            os.close(fd)
    assert f.read_bytes() == b"Start:a1;b1;a2;b2;"


def test_o_append_writers_racing_lose_no_record(d: Path):
    f = d / "shared.log"
    f.touch()

    def append(w: int) -> None:
        fd = os.open(f, os.O_WRONLY | os.O_APPEND)
        try:
            for i in range(200):
                os.write(fd, f"{w}:{i:04d}:".encode().ljust(100, b"."))
        finally:
            os.close(fd)

    threads = [threading.Thread(target=append, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    data = f.read_bytes()
    records = [data[k:k + 100] for k in range(0, len(data), 100)]
    assert len(data) == 4 * 200 * 100
    assert sorted(r.split(b":")[0] + b":" + r.split(b":")[1] for r in records) == sorted(
        f"{w}:{i:04d}".encode() for w in range(4) for i in range(200))


def test_o_excl_has_one_winner_among_racing_creators(d: Path):
    winners, losers = [], []

    def create(i: int) -> None:
        try:
            fd = os.open(d / "lock", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        except FileExistsError:
            losers.append(i)
            return
        os.write(fd, str(i).encode())
        os.close(fd)
        winners.append(i)

    threads = [threading.Thread(target=create, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(winners) == 1 and len(losers) == 15
    assert (d / "lock").read_bytes() == str(winners[0]).encode()


def test_o_trunc_empties_the_file_for_every_handle(d: Path):
    f = d / "t"
    f.write_bytes(os.urandom(3_000_000))
    reader = os.open(f, os.O_RDONLY)
    try:
        fd = os.open(f, os.O_RDWR | os.O_TRUNC)
        assert os.fstat(fd).st_size == 0 and os.pread(reader, 10, 0) == b""
        os.write(fd, b"after")
        os.close(fd)
        assert os.pread(reader, 10, 0) == b"after"
    finally:
        os.close(reader)
    assert f.read_bytes() == b"after" and f.stat().st_size == 5


# -- hard links --------------------------------------------------------------------------------------------------
def test_hard_links_share_data_and_count(d: Path):
    a, b, c = d / "a", d / "sub" / "b", d / "c"
    (d / "sub").mkdir()
    a.write_bytes(b"one")
    os.link(a, b)
    os.link(b, c)
    assert [p.stat().st_nlink for p in (a, b, c)] == [3, 3, 3]
    assert a.stat().st_ino == b.stat().st_ino == c.stat().st_ino
    with open(b, "r+b") as fh:
        fh.write(b"TWO")
    assert a.read_bytes() == c.read_bytes() == b"TWO"
    os.rename(a, c)  # two names of one file: nothing happens
    assert a.exists() and c.exists() and a.stat().st_nlink == 3
    other = d / "other"
    other.write_bytes(b"other")
    os.rename(other, b)  # replaces one name of the linked file
    assert a.stat().st_nlink == 2 and b.read_bytes() == b"other" and b.stat().st_nlink == 1
    with open(a, "rb") as fh:
        os.unlink(a)
        assert c.stat().st_nlink == 1
        os.unlink(c)
        assert fh.read() == b"TWO"  # the last name is gone, the open handle still reads
    assert sorted(os.listdir(d)) == ["sub"]


# -- rename rules ------------------------------------------------------------------------------------------------
def test_rename_directory_over_an_empty_one(d: Path):
    for path in ("src/inner", "dst-parent/empty"):
        (d / path).mkdir(parents=True)
    (d / "src" / "inner" / "f").write_bytes(b"f")
    parent_links = (d / "dst-parent").stat().st_nlink, d.stat().st_nlink
    replaced_ino = (d / "dst-parent" / "empty").stat().st_ino
    os.rename(d / "src", d / "dst-parent" / "empty")
    moved = d / "dst-parent" / "empty"
    assert (moved / "inner" / "f").read_bytes() == b"f" and not (d / "src").exists()
    assert moved.stat().st_ino != replaced_ino
    assert ((d / "dst-parent").stat().st_nlink, d.stat().st_nlink) == (parent_links[0], parent_links[1] - 1)
    assert os.stat(moved / "..").st_ino == (d / "dst-parent").stat().st_ino
    assert os.stat(moved / "inner" / "..").st_ino == moved.stat().st_ino
    with pytest.raises(OSError) as e:  # never into its own subtree, however deep
        os.rename(d / "dst-parent", moved / "inner" / "x")
    assert e.value.errno == errno.EINVAL
    os.rename(moved / "inner", d / "inner")  # out of it is fine
    assert moved.stat().st_nlink == 2 and d.stat().st_nlink == 4


def test_readdir_returns_each_unchanged_entry_once_while_the_directory_changes(d: Path):
    """Entries removed or added during a readdir may or may not appear; every other one appears exactly once
    (kvfs's cookies are stable entry ids, so a listing resumes where it was)."""
    names = {f"f{i:04d}" for i in range(1500)}
    for name in names:
        (d / name).touch()
    seen, removed = [], set()
    with os.scandir(d) as entries:
        for k, entry in enumerate(entries):
            seen.append(entry.name)
            if entry.name in removed or entry.name not in names:
                continue  # removed after the listing fetched it, or added: either may appear
            if k % 3 == 0:
                os.unlink(entry.path)
                removed.add(entry.name)
            if k % 3 == 1:  # a name not yet listed goes too
                victim = f"f{(int(entry.name[1:]) + 700) % 1500:04d}"
                if victim not in removed and victim not in seen:
                    os.unlink(d / victim)
                    removed.add(victim)
            if k == 100:
                for j in range(40):
                    (d / f"new{j}").touch()
    assert len(seen) == len(set(seen)), "an entry came twice"
    assert names - removed <= set(seen), sorted(names - removed - set(seen))[:10]
    assert set(os.listdir(d)) == (names - removed) | {f"new{j}" for j in range(40)}


# -- names and paths at the limits ---------------------------------------------------------------------------------
PATH_MAX = 4096  # bytes, with the terminating NUL


def test_paths_at_path_max(d: Path):
    """A path of PATH_MAX - 1 bytes resolves; one byte more is ENAMETOOLONG. Deeper trees are reachable
    relative to a directory descriptor."""
    base = os.fsencode(d)
    parts, path = [], base
    while len(path) + 1 + 255 < PATH_MAX - 1:
        parts.append(b"%c" % (ord("a") + len(parts) % 26) * 255)
        path = os.path.join(path, parts[-1])
    os.makedirs(path)
    leaf = os.path.join(path, b"L" * (PATH_MAX - 1 - len(path) - 1))
    assert len(leaf) == PATH_MAX - 1
    with open(leaf, "wb") as fh:
        fh.write(b"at PATH_MAX")
    with open(leaf, "rb") as fh:
        assert fh.read() == b"at PATH_MAX"
    assert os.stat(leaf).st_size == 11
    with pytest.raises(OSError) as e:
        os.stat(leaf + b"x")
    assert e.value.errno == errno.ENAMETOOLONG
    with pytest.raises(OSError) as e:
        os.open(leaf + b"x", os.O_CREAT | os.O_WRONLY)
    assert e.value.errno == errno.ENAMETOOLONG
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)  # beyond PATH_MAX, one level at a time
    try:
        for _ in range(3):
            os.mkdir(b"z" * 255, dir_fd=fd)
            nxt = os.open(b"z" * 255, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nxt
        out = os.open(b"deep", os.O_CREAT | os.O_WRONLY, dir_fd=fd)
        os.write(out, b"deep")
        os.close(out)
        inp = os.open(b"deep", os.O_RDONLY, dir_fd=fd)
        assert os.read(inp, 10) == b"deep"
        os.close(inp)
    finally:
        os.close(fd)
    assert os.listdir(d) == [parts[0].decode()]


# -- what kvfs does not do ---------------------------------------------------------------------------------------
def test_unsupported_features_answer_clearly(d: Path):
    """No POSIX ACLs, no O_TMPFILE, no security.* xattrs: each fails with EOPNOTSUPP, nothing half-done."""
    f = d / "f"
    f.write_bytes(b"x")
    # an ACL granting nobody read access: user::rw- user:65534:r-- group::r-- mask::r-- other::r--
    entries = [(0x01, 6, 0xFFFFFFFF), (0x02, 4, NOBODY), (0x04, 4, 0xFFFFFFFF), (0x10, 4, 0xFFFFFFFF),
               (0x20, 4, 0xFFFFFFFF)]
    acl = (2).to_bytes(4, "little") + b"".join(
        t.to_bytes(2, "little") + p.to_bytes(2, "little") + i.to_bytes(4, "little") for t, p, i in entries)
    for name, value in (("system.posix_acl_access", acl), ("security.selinux", b"x")):
        with pytest.raises(OSError) as e:
            os.setxattr(f, name, value)
        assert e.value.errno == errno.EOPNOTSUPP, name
    with pytest.raises(OSError) as e:
        os.open(d, os.O_TMPFILE | os.O_RDWR, 0o600)
    assert e.value.errno == errno.EOPNOTSUPP
    assert os.listdir(d) == ["f"] and stat.S_IMODE(f.stat().st_mode) == 0o644
    fd = os.open(f, os.O_RDWR | os.O_DIRECT)  # accepted, and served like any other descriptor
    try:
        assert os.pwrite(fd, b"d" * 4096, 0) == 4096 and os.pread(fd, 4096, 0) == b"d" * 4096
    finally:
        os.close(fd)
