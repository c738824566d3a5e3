"""The native FUSE front end (kvfs/frontend): hostile requests, exceptions, exit and unmount under load.

Every mount here runs `--frontend native`. The whole POSIX suite runs on it with KVFS_TEST_FRONTEND=native
(tests/conftest.py; docs/frontend.md).
"""

from __future__ import annotations

import ctypes
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
from kvfs.fs import Operations

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
