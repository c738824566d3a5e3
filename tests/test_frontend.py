"""The native FUSE front end (kvfs/frontend): hostile requests, exceptions, exit and unmount under load.

Every mount here runs `--frontend native`. The whole POSIX suite runs on it with KVFS_TEST_FRONTEND=native
(tests/conftest.py; docs/frontend.md).
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import os
import signal
import subprocess
import threading
import time

import pytest
import trio

from conftest import FUSERMOUNT, KvfsMount
from kvfs.frontend import _loop, bridge, types
from kvfs.frontend.ops import Operations

libc = ctypes.CDLL("libc.so.6", use_errno=True)


@pytest.fixture
def native(make_mount) -> KvfsMount:
    return make_mount().start("--frontend", "native")


# -- the dispatch, with fake requests ------------------------------------------------------------------
class FakeRequest:
    """What bridge.Dispatch sees of a _loop.Request; records the answer."""

    def __init__(self, op, **fields) -> None:
        self.op = op
        self.ino = self.ino2 = self.fh = self.size = self.rdev = self.off = self.flags = self.mode = 0
        self.uid = self.gid = self.pid = self.umask = 0
        self.has_fh = 1
        self.name = self.name2 = None
        self.data = memoryview(b"")
        self.replied = 0
        self.answers: list[tuple] = []
        for k, v in fields.items():
            setattr(self, k, v)

    def __getattr__(self, name):
        if name.startswith("reply_"):
            def reply(*args):
                assert not self.replied, "answered twice"
                self.replied = 1
                self.answers.append((name, *args))
                return 0
            return reply
        raise AttributeError(name)


def dispatch(ops, *requests: FakeRequest) -> list[tuple]:
    async def main():
        d = bridge.Dispatch(ops)
        for r in requests:
            await d.run(r)

    trio.run(main)
    return [a for r in requests for a in r.answers]


def test_unknown_handles_answer_ebadf():
    ops = Operations.__new__(Operations)  # only what the handle lookups touch
    ops.handles = {}
    reqs = [FakeRequest(_loop.OP_READ, fh=987654, off=0, size=4096),
            FakeRequest(_loop.OP_WRITE, fh=987654, off=0, data=memoryview(b"x" * 10)),
            FakeRequest(_loop.OP_FLUSH, fh=1 << 63),
            FakeRequest(_loop.OP_FSYNC, fh=2)]
    assert dispatch(ops, *reqs) == [("reply_err", errno.EBADF)] * 4
    release = FakeRequest(_loop.OP_RELEASE, fh=424242)  # a second release of a handle: answered, no error
    assert dispatch(ops, release) == [("reply_err", 0)]


def test_exceptions_and_unknown_requests_never_end_the_mount(caplog):
    class Broken:
        async def getattr(self, ino, ctx):
            raise RuntimeError("a bug")

        async def read(self, fh, off, size):
            return b"x" * (size + 100)  # longer than asked

        async def lookup(self, parent, name, ctx):
            raise types.FUSEError(errno.ENOENT)

    answers = dispatch(Broken(), FakeRequest(_loop.OP_GETATTR, ino=5), FakeRequest(_loop.OP_READ, size=10),
                       FakeRequest(_loop.OP_LOOKUP, ino=1, name=b"x"), FakeRequest(_loop.OP_STATFS),
                       FakeRequest(999))
    assert answers[0] == ("reply_err", errno.EIO)
    assert answers[1][0] == "reply_buf" and len(answers[1][1]) == 10
    assert answers[2:] == [("reply_err", errno.ENOENT), ("reply_err", errno.ENOSYS), ("reply_err", errno.ENOSYS)]
    assert "a bug" in caplog.text


# -- hostile requests through a real mount ---------------------------------------------------------------
def test_offsets_past_the_end_and_huge_sizes(native: KvfsMount):
    f = native.path("f")
    data = os.urandom(300_000)
    f.write_bytes(data)
    fd = os.open(f, os.O_RDWR)
    try:
        assert os.pread(fd, 4096, len(data) + 1) == b""
        assert os.pread(fd, 4096, 1 << 62) == b""
        assert os.pread(fd, 1 << 30, 0) == data  # the kernel splits it; the answers never exceed a request
        with pytest.raises(OSError) as e:
            os.pwrite(fd, b"x", (1 << 63) - 1)
        assert e.value.errno in (errno.EFBIG, errno.EINVAL)
        with pytest.raises(OSError) as e:
            os.ftruncate(fd, 1 << 62)
        assert e.value.errno in (errno.EFBIG, errno.EINVAL)
        assert os.pread(fd, 100, 0) == data[:100]
    finally:
        os.close(fd)
    with pytest.raises(OSError) as e:
        os.setxattr(f, "user.big", b"v" * (1 << 17))
    assert e.value.errno in (errno.E2BIG, errno.ERANGE)
    os.setxattr(f, "user.small", b"0123456789")
    buf = ctypes.create_string_buffer(4)
    n = libc.getxattr(bytes(f), b"user.small", buf, ctypes.c_size_t(4))
    assert n == -1 and ctypes.get_errno() == errno.ERANGE
    assert libc.getxattr(bytes(f), b"user.small", None, ctypes.c_size_t(0)) == 10
    assert libc.listxattr(bytes(f), None, ctypes.c_size_t(0)) > 0
    names = ctypes.create_string_buffer(2)
    assert libc.listxattr(bytes(f), names, ctypes.c_size_t(2)) == -1 and ctypes.get_errno() == errno.ERANGE
    with pytest.raises(OSError) as e:
        os.getxattr(f, "user.missing")
    assert e.value.errno == errno.ENODATA
    long_name = "n" * 256
    with pytest.raises(OSError) as e:
        native.path(long_name).write_bytes(b"")
    assert e.value.errno == errno.ENAMETOOLONG
    assert native.alive()


def test_concurrent_open_read_release(native: KvfsMount):
    payload = os.urandom(2 << 20)
    native.path("shared").write_bytes(payload)
    errors: list[BaseException] = []

    def reader(k: int) -> None:
        try:
            for i in range(40):
                fd = os.open(native.path("shared"), os.O_RDONLY)
                try:
                    assert os.pread(fd, 65536, (i * 4096 * k) % len(payload)) == \
                        payload[(i * 4096 * k) % len(payload):][:65536]
                finally:
                    os.close(fd)  # releases race with reads of the other threads' handles
                with open(native.path(f"w{k}"), "wb") as w:
                    w.write(payload[:100_000 + k])
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=reader, args=(k,)) for k in range(1, 9)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    for k in range(1, 9):
        assert native.path(f"w{k}").read_bytes() == payload[:100_000 + k]
    assert native.alive()


def _load(m: KvfsMount, stop: threading.Event, k: int) -> None:
    data = os.urandom(1 << 20)
    i = 0
    while not stop.is_set():
        try:
            p = m.path(f"load{k}-{i % 4}")
            p.write_bytes(data)
            p.read_bytes()
        except OSError:
            pass  # the mount is going away
        i += 1


@pytest.mark.parametrize("how", ["sigterm", "unmount"])
def test_exit_under_load(make_mount, how):
    m = make_mount().start("--frontend", "native")
    stop = threading.Event()
    threads = [threading.Thread(target=_load, args=(m, stop, k), daemon=True) for k in range(4)]
    for t in threads:
        t.start()
    time.sleep(1.5)
    started = time.monotonic()
    if how == "sigterm":
        assert m.signal(signal.SIGTERM, timeout=60) == 0
    else:
        subprocess.run([FUSERMOUNT, "-u", "-z", str(m.mountpoint)], check=True, capture_output=True)
        stop.set()
        assert m.proc.wait(60) == 0
        m.proc = None
    stop.set()
    for t in threads:
        t.join(30)
    assert time.monotonic() - started < 30
    assert not os.path.ismount(m.mountpoint)
    assert "unmounted" in m.log_text()
    # what was committed is there at the next mount
    m.start("--frontend", "native")
    assert [p for p in os.listdir(m.mountpoint) if p.startswith("load")]


# -- native reads: READ of committed objects served in the C threads (kvfs/frontend/_loop.c) ------------------
def _uncached_pread(path, size: int, off: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return os.pread(fd, size, off)
    finally:
        os.close(fd)


def test_native_reads_are_served_in_c(native: KvfsMount):
    """Reads of a committed file are answered by the C threads: every read request the daemon counted is a
    native one (the Python read handler counts read_requests but not native_reads), and the first read of each
    handle still counts a hit."""
    data = os.urandom(1 << 20) + bytes(1 << 20) + b"kv" * (600_000)  # stored raw, a hole, compressed
    native.path("f").write_bytes(data)
    time.sleep(0.2)  # the writer's release (asynchronous) before the reader's open
    before = native.stats()
    for off, size in ((0, 1 << 20), (123_457, 70_000), ((1 << 20) - 10, 20), (len(data) - 5, 100),
                      (len(data), 10), (len(data) + (1 << 40), 10)):
        assert _uncached_pread(native.path("f"), size, off) == data[off:off + size], (off, size)
    fd = os.open(native.path("f"), os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        assert os.read(fd, len(data) + 1) == data
    finally:
        os.close(fd)
    after = native.stats()
    reads = after["read_requests"] - before["read_requests"]
    assert reads > 0 and after["native_reads"] - before["native_reads"] == reads
    assert after["native_read_bytes"] - before["native_read_bytes"] == after["bytes_read"] - before["bytes_read"]
    assert after["tiers"]["L2"]["hits"] - before["tiers"]["L2"]["hits"] == 5  # reads past the end stay in the kernel
    assert after["tiers"]["L2"]["read_bytes"] > before["tiers"]["L2"]["read_bytes"]
    assert after["checksum_failures"] == 0 and native.alive()


def test_a_writer_takes_reads_back_to_python(native: KvfsMount):
    """A handle read natively sees what another handle writes afterwards (its reads go to Python then)."""
    native.path("f").write_bytes(b"a" * 300_000)
    time.sleep(0.2)
    r = os.open(native.path("f"), os.O_RDONLY)
    try:
        os.posix_fadvise(r, 0, 0, os.POSIX_FADV_DONTNEED)
        assert os.pread(r, 10, 0) == b"a" * 10
        w = os.open(native.path("f"), os.O_WRONLY)
        try:
            os.pwrite(w, b"bbbb", 100)  # not committed yet: only Python's OpenFile has it
            os.posix_fadvise(r, 0, 0, os.POSIX_FADV_DONTNEED)
            assert os.pread(r, 8, 98) == b"aabbbbaa"
        finally:
            os.close(w)
        os.posix_fadvise(r, 0, 0, os.POSIX_FADV_DONTNEED)
        assert os.pread(r, 8, 98) == b"aabbbbaa"
    finally:
        os.close(r)
    assert _uncached_pread(native.path("f"), 8, 98) == b"aabbbbaa"



def test_a_reader_opened_beside_a_clean_writer_reads_natively(native: KvfsMount):
    """A writer that has nothing unsaved does not keep a new reader in Python (a writer's RELEASE can reach the
    trio thread after the next OPEN); its first write takes the reader's reads back to Python."""
    native.path("f").write_bytes(b"a" * 300_000)
    w = os.open(native.path("f"), os.O_WRONLY)  # open, nothing written: like a RELEASE not yet handled
    try:
        before = native.stats()
        r = os.open(native.path("f"), os.O_RDONLY)
        try:
            os.posix_fadvise(r, 0, 0, os.POSIX_FADV_DONTNEED)
            assert os.pread(r, 10, 0) == b"a" * 10
            assert native.stats()["native_reads"] > before["native_reads"]
            os.pwrite(w, b"bbbb", 100)
            os.posix_fadvise(r, 0, 0, os.POSIX_FADV_DONTNEED)
            assert os.pread(r, 8, 98) == b"aabbbbaa"
        finally:
            os.close(r)
    finally:
        os.close(w)
    assert _uncached_pread(native.path("f"), 8, 98) == b"aabbbbaa"

@pytest.fixture
def native_object(tmp_path):
    """An object of 64 KiB frames (stored raw, a hole, zstd, a short last frame) handed to _loop as handle 77,
    without a mount: native_pread runs the worker's read path."""
    from kvfs import codecs, format as fmt
    from kvfs.codecs import kernel, transforms

    if not kernel.ZSTD_IN_KERNEL:
        pytest.skip("no libzstd: zstd frames are decoded in Python")
    bridge._set_reader()
    F = 64 << 10
    data = os.urandom(F) + bytes(F) + b"0123456789abcdef" * (F // 16) + os.urandom(1000)
    frames = [fmt.encode_frame(data[i:i + F], codecs.by_name("zstd"), transforms.IDENTITY)
              for i in range(0, len(data), F)]
    header = fmt.Header(raw_size=len(data), frame_size=F, n_frames=len(frames))
    parts, entries = fmt.build_object(header, frames)
    path = tmp_path / "object"
    path.write_bytes(b"".join(parts))
    table = b"".join(fmt.FRAME_ENTRY.pack(*dataclasses.astuple(e)) for e in entries)

    def register(fh: int = 77) -> None:
        _loop.native_open(fh, 5, 0, os.open(path, os.O_RDONLY), len(data), F, table)

    register()
    yield data, path, entries, register
    _loop.native_close(77)
    _loop.native_take()


def test_native_hostile_reads(native_object):
    data, _, _, _ = native_object
    _loop.native_take()
    assert _loop.native_pread(424242, 0, 10) is None  # unknown handle: Python's (EBADF there)
    assert _loop.native_pread(77, -1, 10) is None  # a negative offset: Python's
    assert _loop.native_pread(77, len(data), 10) == b""
    assert _loop.native_pread(77, 1 << 62, 1 << 30) == b""
    assert _loop.native_pread(77, 0, 0) == b""
    assert _loop.native_pread(77, 5, 1 << 40) == data[5:]  # a huge size: what there is
    assert _loop.native_pread(77, 0, len(data)) == data
    F = 64 << 10
    assert _loop.native_pread(77, 2 * F + 100, 4096) == data[2 * F + 100:2 * F + 4196]  # a part: decoded, kept
    assert _loop.native_pread(77, 2 * F + 8192, 4096) == data[2 * F + 8192:2 * F + 12288]  # the kept frame
    t = _loop.native_take()
    assert t["reads"] == 7 and t["cache_hits"] == 1 and t["corrupt"] == 0 and t["fallbacks"] == 0
    assert sum(t["latency"]) == 7 and t["handles"] == 1
    with pytest.raises(ValueError):  # a table that does not match the sizes: refused, the fd closed
        _loop.native_open(78, 5, 0, os.open("/dev/null", os.O_RDONLY), len(data), F, b"x" * 36)
    assert _loop.native_close(78) == -1 and _loop.native_close(424242) == -1


def test_native_release_while_reads_run(native_object):
    """native_close (a RELEASE) while threads read the handle: each read holds a reference; nothing crashes,
    every answer is right or None (gone), and the handle is freed after the last read."""
    data, _, _, register = native_object
    stop = threading.Event()
    errors: list[BaseException] = []

    def reader(k: int) -> None:
        try:
            i = 0
            while not stop.is_set():
                off = (i * 7919 * k) % len(data)
                got = _loop.native_pread(77, off, 100_000)
                assert got is None or got == data[off:off + 100_000]
                i += 1
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=reader, args=(k,)) for k in range(1, 5)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        assert _loop.native_close(77) >= 0
        register()
    stop.set()
    for t in threads:
        t.join(30)
    assert not errors, errors


def test_native_corrupt_frame(native_object):
    """A frame that fails its checksum is never answered: the error goes to Python, and the handle's later
    reads too (they find the file marked corrupt)."""
    data, path, entries, register = native_object
    victim = entries[2]
    with open(path, "r+b") as f:
        f.seek(victim.offset + 10)
        b = f.read(1)
        f.seek(victim.offset + 10)
        f.write(bytes([b[0] ^ 0x40]))
    assert _loop.native_pread(77, 0, 4096) == data[:4096]  # frame 0 is intact
    assert _loop.native_pread(77, 2 * (64 << 10), 10) == -3  # KVF_ERR_PAYLOAD
    assert _loop.native_pread(77, 0, 4096) is None  # Python's from now on
    assert _loop.native_take()["corrupt"] == 1


def test_native_read_of_a_corrupt_object(native: KvfsMount):
    """A frame corrupted after the commit: the native read finds it, the file is dropped and counted as the
    Python path does it, and the reader gets EIO, then ENOENT."""
    native.path("c").write_bytes(os.urandom(300_000))  # one frame, stored raw
    time.sleep(0.2)
    (obj,) = native.objects("L2")
    with open(obj, "r+b") as f:
        f.seek(-1000, os.SEEK_END)
        b = f.read(1)
        f.seek(-1000, os.SEEK_END)
        f.write(bytes([b[0] ^ 1]))
    native.expect_log(r"corrupt object for inode \d+ \(b'c'\): frame 0: frame payload checksum mismatch")
    with pytest.raises(OSError) as e:
        _uncached_pread(native.path("c"), 4096, 0)
    assert e.value.errno == errno.EIO
    assert "native read of inode" in native.log_text()
    assert native.stats()["checksum_failures"] == 1
    assert not native.path("c").exists()
    assert native.alive()


def test_a_native_readers_late_release_keeps_an_explicit_atime(native: KvfsMount):
    """A native reader's RELEASE notes its last read's time, not its own: an atime set after the last read (here
    before the reader closes; with the threaded loop a RELEASE can also simply arrive late) is kept."""
    f = native.path("f")
    f.write_bytes(b"0123456789" * 1000)
    time.sleep(0.2)
    r = os.open(f, os.O_RDONLY)
    try:
        os.posix_fadvise(r, 0, 0, os.POSIX_FADV_DONTNEED)
        assert os.pread(r, 10, 0) == b"0123456789"
        assert native.stats()["native_reads"] > 0
        time.sleep(0.01)
        os.utime(f, ns=(1_000_000_007, 2_000_000_009))
    finally:
        os.close(r)
    native.stop()
    native.start(*native.args)
    st = f.stat()
    assert (st.st_atime_ns, st.st_mtime_ns) == (1_000_000_007, 2_000_000_009)


def test_attributes_outside_user_are_answered_enodata(native: KvfsMount):
    """Names outside user.* (ls -l asks for security.selinux and system.posix_acl_access of every entry, the
    kernel for security.capability before each write) are answered in C, as the Operations would: ENODATA."""
    f = native.path("f")
    f.write_bytes(b"x")
    os.setxattr(f, "user.mine", b"1")
    for name in ("security.selinux", "system.posix_acl_access", "security.capability", "trusted.x"):
        with pytest.raises(OSError) as e:
            os.getxattr(f, name)
        assert e.value.errno == errno.ENODATA, name
    assert os.getxattr(f, "user.mine") == b"1"
    assert os.getxattr(f, "user.kvfs.tier") == b"L2"
    with pytest.raises(OSError) as e:
        os.getxattr(native.path("missing"), "security.selinux")
    assert e.value.errno == errno.ENOENT


def test_setxattr_create_and_replace_flags(native: KvfsMount):
    """XATTR_CREATE fails with EEXIST on a name that is there, XATTR_REPLACE with ENODATA on one that is not."""
    f = native.path("f")
    f.write_bytes(b"x")
    with pytest.raises(OSError) as e:
        os.setxattr(f, "user.a", b"1", os.XATTR_REPLACE)
    assert e.value.errno == errno.ENODATA
    os.setxattr(f, "user.a", b"1", os.XATTR_CREATE)
    with pytest.raises(OSError) as e:
        os.setxattr(f, "user.a", b"2", os.XATTR_CREATE)
    assert e.value.errno == errno.EEXIST
    os.setxattr(f, "user.a", b"3", os.XATTR_REPLACE)
    assert os.getxattr(f, "user.a") == b"3"
