"""Native sequential writes (kvfs/frontend/native_write.py, _loop.c; docs/frontend.md, "Native writes"): WRITE of a
file written in order taken and encoded in the C threads, committed by OpenFile as if Python had received it.

Through a mount: real KV written and read back byte-equal with the codec and ratio Python's writes give, the
counters, writes that turn out of order, a read, a stat, a truncate or a second handle during a write, concurrent
writers, ENOSPC at close, the dirty budget (quotas: tests/test_quotas.py writes natively). Without a mount (_loop's test entry points): hostile
offsets and sizes, a write after the handle was taken, a take racing writers.
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
import threading
import time

import pytest

from conftest import KV_DATA, KvfsMount
from kvfs import format as fmt
from kvfs.codecs import kernel
from kvfs.frontend import _loop
from kvfs.metrics import LATENCY_BUCKETS
from kvfs.openfile import EncodingPolicy

F = 1 << 20
KV_FILES = sorted(KV_DATA.glob("*.kv"))


@pytest.fixture
def native(make_mount) -> KvfsMount:
    return make_mount().start("--frontend", "native")


def _write(path, data: bytes, chunk: int = 1 << 20, flags: int = 0) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flags, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view[:chunk]):]
    finally:
        os.close(fd)


def _delta(after: dict, before: dict, key: str) -> int:
    return after.get(key, 0) - before.get(key, 0)


def _python_ratio(data: bytes) -> float:
    """The stored/raw ratio of Python's encoding of one file (its policy, frame by frame)."""
    policy = EncodingPolicy(None, "auto")
    frames = [policy.encode(memoryview(data)[i:i + F], i) for i in range(0, len(data), F)]
    return sum(len(f.payload) for f in frames) / len(data)


# -- through a mount ------------------------------------------------------------------------------------
def test_real_kv_written_natively_reads_back(native: KvfsMount):
    """Files of real KV written in order are taken in C (every write request), encoded there as Python would
    (same codec and ratio) and committed: read back byte-equal, also after a restart."""
    before = native.stats()
    written = {}
    for k, src in enumerate(KV_FILES):
        data = src.read_bytes() * 2  # 5.9 MB: six frames, the last one short
        written[f"f{k}"] = data
        _write(native.path(f"f{k}"), data, chunk=(k + 1) * 100_000)  # request sizes not aligned to frames
    after = native.stats()
    total = sum(len(d) for d in written.values())
    assert _delta(after, before, "native_write_bytes") == total
    assert _delta(after, before, "bytes_written") == total
    assert _delta(after, before, "native_writes") == _delta(after, before, "write_requests") > 0
    assert _delta(after, before, "native_write_fallbacks") == 0
    assert _delta(after, before, "frames_encoded") == sum(-(-len(d) // F) for d in written.values())
    assert _delta(after, before, "commits") == len(written)
    for name, data in written.items():
        assert native.path(name).read_bytes() == data
        assert os.getxattr(native.path(name), "user.kvfs.codec") == b"entropy"
        stored = int(os.getxattr(native.path(name), "user.kvfs.stored_bytes"))
        assert stored <= _python_ratio(data) * len(data) + 4096  # the header and table beside the same frames
    native.stop()
    native.start(*native.args)
    for name, data in written.items():
        assert native.path(name).read_bytes() == data


def test_stat_during_a_native_write_and_empty_files(native: KvfsMount):
    data = KV_FILES[0].read_bytes()
    fd = os.open(native.path("f"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, data[:1_500_000])
        assert os.stat(native.path("f")).st_size == 1_500_000  # what C took shows in the attributes
        assert os.fstat(fd).st_size == 1_500_000
        os.write(fd, data[1_500_000:])
    finally:
        os.close(fd)
    assert os.stat(native.path("f")).st_size == len(data)
    assert native.path("f").read_bytes() == data
    _write(native.path("empty"), b"")
    assert native.path("empty").read_bytes() == b""
    native.path("zeros").write_bytes(bytes(3 * F + 5))  # holes
    assert native.path("zeros").read_bytes() == bytes(3 * F + 5)


def test_a_write_out_of_order_goes_on_in_python(native: KvfsMount):
    data = bytearray(KV_FILES[1].read_bytes())
    before = native.stats()
    fd = os.open(native.path("f"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, data[:2_000_000])
        os.pwrite(fd, b"XYZ" * 1000, 100_000)  # back into a frame C encoded already
        data[100_000:103_000] = b"XYZ" * 1000
        os.write(fd, data[2_000_000:])  # Python's from now on
        os.pwrite(fd, b"tail", len(data) + 10)  # past the end: a gap of zeros
        data += bytes(10) + b"tail"
    finally:
        os.close(fd)
    after = native.stats()
    assert _delta(after, before, "native_write_fallbacks") >= 1
    assert _delta(after, before, "native_write_bytes") == 2_000_000
    assert native.path("f").read_bytes() == bytes(data)


def test_a_read_or_an_open_during_a_native_write(native: KvfsMount):
    """Another handle opening the file takes the writer back into Python first: it reads what was written."""
    data = KV_FILES[2].read_bytes()
    fd = os.open(native.path("f"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, data[:1_200_000])
        with open(native.path("f"), "rb") as r:
            assert r.read() == data[:1_200_000]
        os.write(fd, data[1_200_000:])
        with open(native.path("f"), "rb") as r:
            assert r.read() == data
    finally:
        os.close(fd)
    assert native.path("f").read_bytes() == data


def test_truncate_and_fsync_during_a_native_write(native: KvfsMount):
    data = KV_FILES[0].read_bytes()
    fd = os.open(native.path("f"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, data[:2_500_000])
        os.fsync(fd)  # committed now
        assert os.stat(native.path("f")).st_size == 2_500_000
        os.write(fd, data[2_500_000:])
        os.ftruncate(fd, 1_000_001)
        os.write(fd, b"!")  # at the file position: a gap to it
    finally:
        os.close(fd)
    expected = data[:1_000_001] + bytes(len(data) - 1_000_001) + b"!"
    assert native.path("f").read_bytes() == expected


def test_a_dtype_set_before_or_during_a_native_write(native: KvfsMount):
    """user.kvfs.dtype set after create and before the first write: the writer starts again with the new policy;
    set during the write: Python takes the file over and encodes it for the new policy."""
    data = KV_FILES[0].read_bytes()
    before = native.stats()
    fd = os.open(native.path("early"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.setxattr(native.path("early"), "user.kvfs.dtype", b"bf16")
        os.write(fd, data)
    finally:
        os.close(fd)
    after = native.stats()
    assert _delta(after, before, "native_write_bytes") == len(data)
    assert native.path("early").read_bytes() == data
    assert os.getxattr(native.path("early"), "user.kvfs.codec") == b"entropy"
    fd = os.open(native.path("late"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, data[:1_500_000])
        os.setxattr(native.path("late"), "user.kvfs.dtype", b"int8")  # zstd on raw bytes from now on
        os.write(fd, data[1_500_000:])
    finally:
        os.close(fd)
    assert native.path("late").read_bytes() == data
    assert os.getxattr(native.path("late"), "user.kvfs.codec") == b"zstd"


def test_append_and_direct_io_writers(native: KvfsMount):
    """O_APPEND writes arrive in order; O_DIRECT ones may arrive in parallel pieces: either way the file is right
    (an out-of-order piece sends the writer to Python)."""
    import mmap

    data = KV_FILES[1].read_bytes()
    _write(native.path("append"), data, chunk=333_333, flags=os.O_APPEND)
    assert native.path("append").read_bytes() == data
    buf = mmap.mmap(-1, len(data))  # page-aligned, as O_DIRECT wants
    buf.write(data)
    fd = os.open(native.path("direct"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    try:
        assert os.write(fd, memoryview(buf)[:len(data) // 4096 * 4096]) == len(data) // 4096 * 4096
    finally:
        os.close(fd)
    assert native.path("direct").read_bytes() == data[:len(data) // 4096 * 4096]


def test_concurrent_native_writers(native: KvfsMount):
    srcs = [p.read_bytes() for p in KV_FILES]
    before = native.stats()
    errors = []

    def writer(k: int) -> None:
        try:
            for j in range(4):
                _write(native.path(f"w{k}-{j}"), srcs[(k + j) % len(srcs)] * (1 + j % 2))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    after = native.stats()
    assert _delta(after, before, "native_write_fallbacks") == 0
    assert _delta(after, before, "native_write_bytes") == _delta(after, before, "bytes_written")
    for k in range(4):
        for j in range(4):
            assert native.path(f"w{k}-{j}").read_bytes() == srcs[(k + j) % len(srcs)] * (1 + j % 2)


def test_enospc_at_close_of_a_native_write(make_mount):
    """No room in the tiers: close() answers ENOSPC, as for Python's writes, and the file keeps no partial data."""
    m = make_mount().start("--frontend", "native", "--l3", "none", l2_size="2M")
    fd = os.open(m.path("big"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.write(fd, os.urandom(3 * F))
    with pytest.raises(OSError) as e:
        os.close(fd)
    assert e.value.errno == errno.ENOSPC
    assert m.stats()["native_write_bytes"] == 3 * F
    assert os.stat(m.path("big")).st_size in (0, 3 * F)  # nothing committed: the size the open file showed


def test_the_dirty_budget_counts_native_frames(make_mount):
    """Frames held in C count against max_dirty with Python's: past it, the write answers ENOSPC."""
    m = make_mount()
    (m.root / "kvfs.toml").write_text('[mount]\nmax_dirty = "4M"\n')
    m.start("--frontend", "native", "--config", str(m.root / "kvfs.toml"))
    fd = os.open(m.path("f"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, os.urandom(4 * F))
        with pytest.raises(OSError) as e:
            os.write(fd, b"x" * 100)
        assert e.value.errno == errno.ENOSPC
    finally:
        os.close(fd)
    assert os.stat(m.path("f")).st_size == 4 * F
    assert m.stats()["native_write_fallbacks"] >= 1


def test_native_writes_off(make_mount):
    m = make_mount()
    m.start("--frontend", "native", env={"KVFS_NATIVE_WRITES": "0"})
    data = KV_FILES[0].read_bytes()
    _write(m.path("f"), data)
    assert m.stats()["native_writes"] == 0
    assert m.path("f").read_bytes() == data


# -- without a mount: _loop's entry points ---------------------------------------------------------------------
def _address(f) -> int:
    return ctypes.cast(f, ctypes.c_void_p).value


@pytest.fixture
def writer_loop():
    lib = kernel.lib
    _loop.set_writer(_address(lib.kvfs_encode_frame), _address(lib.kvfs_choose), _address(lib.kvfs_encode_bound), 2,
                     tuple(LATENCY_BUCKETS))
    _loop.native_write_budget(1 << 30, 0)
    yield
    assert _loop.native_write_held() == 0
    _loop.native_take()


AUTO = struct.pack("<12i", 4, 0, 1, 1, 1, 0, 1, 0, 0, 5, 0, 0)  # the candidates of codec auto, dtype auto


def _frames_of(taken) -> bytes:
    return b"".join(bytes(memoryview(raw)[:length]) for raw, length, _ in taken[4])


def test_native_writer_hostile_requests(writer_loop):
    fh = 9001
    _loop.native_write_open(fh, 5, 65536, AUTO, True)
    assert not _loop.native_write_pwrite(fh + 1, 0, b"x")  # not a native writer
    assert _loop.native_write_state(fh + 1) is None and _loop.native_write_take(fh + 1, True) is None
    assert _loop.native_write_pwrite(fh, 0, b"a" * 70000)
    assert not _loop.native_write_pwrite(fh, -1, b"b")  # negative: stops it, Python answers
    assert not _loop.native_write_pwrite(fh, 70000, b"c")  # stopped: everything goes to Python
    taken = _loop.native_write_take(fh, True)
    assert taken[0] == 70000 and _frames_of(taken) == b"a" * 70000
    assert _loop.native_write_take(fh, True) is None  # taken once
    assert not _loop.native_write_pwrite(fh, 70000, b"d")  # a write after the take: Python's

    _loop.native_write_open(fh, 5, 65536, AUTO, True)
    assert not _loop.native_write_pwrite(fh, 1 << 62, b"x")  # huge offsets
    _loop.native_write_take(fh, True)
    _loop.native_write_open(fh, 5, 65536, AUTO, True)
    assert not _loop.native_write_pwrite(fh, 0, b"")  # nothing to write: Python answers
    assert _loop.native_write_take(fh, True)[4] == []
    _loop.native_write_open(fh, 5, 65536, AUTO, True)
    assert _loop.native_write_pwrite(fh, 0, b"y" * 10)
    assert not _loop.native_write_pwrite(fh, 10, memoryview(b"z" * 10)[:0])
    _loop.native_write_take(fh, True)
    with pytest.raises(ValueError):
        _loop.native_write_open(fh, 5, 0, AUTO, True)
    with pytest.raises(ValueError):
        _loop.native_write_open(fh, 5, 65536, b"\0" * 5, True)
    with pytest.raises(ValueError):
        _loop.native_write_open(fh, 5, 65536, b"\0" * 12 * 9, True)


def test_native_writer_encodes_as_python(writer_loop):
    data = b"".join(p.read_bytes() for p in KV_FILES) + bytes(2 * F) + os.urandom(F + 7)
    fh = 9002
    _loop.native_write_open(fh, 5, F, AUTO, True)
    for off in range(0, len(data), 300_000):
        assert _loop.native_write_pwrite(fh, off, data[off:off + 300_000])
    _loop.native_write_finish(fh)
    taken = _loop.native_write_take(fh, False)
    size, writes, last_ns, choice, frames = taken
    assert size == len(data) and writes == -(-len(data) // 300_000) and abs(last_ns - time.time_ns()) < 60e9
    assert choice == (4, 0, 1)
    policy = EncodingPolicy(None, "auto")
    for i, (raw, length, enc) in enumerate(frames):
        assert len(raw) == F and bytes(memoryview(raw)[length:]) == bytes(F - length)
        expected = policy.encode(memoryview(data)[i * F:i * F + length], i * F)
        payload, stored_len, codec, transform, flags, sx, rx = enc
        got = b"" if flags & fmt.FRAME_HOLE else bytes(memoryview(raw)[:length]) if payload is None else bytes(payload)
        assert (got, length, codec, transform, flags, sx, rx) == (
            bytes(expected.payload), expected.raw_len, expected.codec, expected.transform, expected.flags,
            expected.stored_xxh3, expected.raw_xxh3)


def test_native_writer_take_races_writers(writer_loop):
    """A take while threads write (as libfuse workers would): whatever was taken is a prefix of the file, and
    every later write goes to Python."""
    data = os.urandom(1 << 20)
    for rep in range(30):
        fh = 9100 + rep
        _loop.native_write_open(fh, 5, 65536, AUTO, True)
        lock = threading.Lock()
        pos = [0]
        refused = []

        def w():
            while True:
                with lock:
                    off = pos[0]
                    if off >= len(data):
                        return
                    if not _loop.native_write_pwrite(fh, off, data[off:off + 50_000]):
                        refused.append(off)
                        return
                    pos[0] = off + 50_000

        threads = [threading.Thread(target=w) for _ in range(2)]
        for t in threads:
            t.start()
        time.sleep(0.0005 * (rep % 5))
        taken = _loop.native_write_take(fh, bool(rep % 2))
        if taken is False:
            taken = _loop.native_write_take(fh, True)
        for t in threads:
            t.join()
        got = _frames_of(taken)
        assert got == data[:len(got)] and len(got) == taken[0] == min(pos[0], len(data))
        assert not _loop.native_write_pwrite(fh, taken[0], b"late")


def test_native_writer_finish_races_take(writer_loop):
    data = os.urandom(600_000)
    for rep in range(30):
        fh = 9200 + rep
        _loop.native_write_open(fh, 5, 65536, AUTO, True)
        assert _loop.native_write_pwrite(fh, 0, data)
        results = []
        threads = [threading.Thread(target=_loop.native_write_finish, args=(fh,)),
                   threading.Thread(target=lambda: results.append(_loop.native_write_take(fh, True)))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert _frames_of(results[0]) == data
