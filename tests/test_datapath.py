"""The FUSE data path's fast paths (docs/datapath.md): request sizes, whole frames kept as written, reads
answered with views of decoded frames, frames decoded by the C kernel. Real mounts, real KV bytes."""

from __future__ import annotations

import mmap
import os

from conftest import drop_page_cache, kv_samples

MiB = 1 << 20


def _kv(n_bytes: int) -> bytes:
    data = b"".join(p.read_bytes() for p in kv_samples("bf16"))
    while len(data) < n_bytes:
        data += data
    return data[:n_bytes]


def test_sequential_reads_reach_the_daemon_in_frame_sized_requests(kvfs):
    m = kvfs
    data = _kv(8 * MiB + 12345)
    (m.mountpoint / "f.kv").write_bytes(data)
    drop_page_cache(m.mountpoint / "f.kv")
    before = m.stats()
    with open(m.mountpoint / "f.kv", "rb", buffering=0) as f:
        assert f.read() == data
    after = m.stats()
    requests = after["read_requests"] - before["read_requests"]
    assert after["bytes_read"] - before["bytes_read"] == len(data)
    assert requests <= 10, f"{requests} read requests for 9 frames: read-ahead not widened"


def test_whole_frames_kept_as_written_then_changed_in_part(kvfs):
    """A frame written whole by one request is kept as that request's bytes; later partial writes and a
    truncation into it copy it first, before and after a commit."""
    m = kvfs
    path = m.mountpoint / "g.kv"
    data = bytearray(_kv(3 * MiB + 1000))
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.pwrite(fd, bytes(data[:2 * MiB]), 0)  # two whole frames in one write (the kernel: 1 MiB requests)
        os.pwrite(fd, bytes(data[2 * MiB:]), 2 * MiB)
        os.pwrite(fd, b"\xAA" * 100, MiB + 5)  # into a kept frame, before any commit
        data[MiB + 5:MiB + 105] = b"\xAA" * 100
        assert os.pread(fd, MiB, MiB) == bytes(data[MiB:2 * MiB])  # read back from the dirty frames
        os.fsync(fd)  # committed
        os.pwrite(fd, bytes(data[:MiB]), 0)  # the whole first frame again, then a part of it
        os.pwrite(fd, b"\x55" * 7, 3)
        data[3:10] = b"\x55" * 7
        os.truncate(path, MiB + MiB // 2)  # into the second frame
        del data[MiB + MiB // 2:]
        assert os.pread(fd, 4 * MiB, 0) == bytes(data)
    finally:
        os.close(fd)
    drop_page_cache(path)
    assert path.read_bytes() == bytes(data)
    m.stop()
    m.start()
    assert path.read_bytes() == bytes(data)


def test_unaligned_and_cross_frame_reads(kvfs):
    """Reads within one frame are answered with views of the decoded frame, across frames with one copy."""
    m = kvfs
    data = _kv(3 * MiB + 777)
    (m.mountpoint / "h.kv").write_bytes(data)
    drop_page_cache(m.mountpoint / "h.kv")
    fd = os.open(m.mountpoint / "h.kv", os.O_RDONLY | os.O_DIRECT)  # each read() reaches the daemon as is
    try:
        aligned = mmap.mmap(-1, 2 * MiB + 8192)  # O_DIRECT wants an aligned buffer
        for off, n in ((0, 4096), (MiB - 4096, 8192), (MiB, MiB), (3 * MiB - 4096, 8192), (4096, 2 * MiB)):
            got = os.preadv(fd, [memoryview(aligned)[:n]], off)
            assert aligned[:got] == data[off:off + n], (off, n)
    finally:
        os.close(fd)


def test_reads_of_every_codec_the_kernel_decodes_and_of_others(make_mount):
    """Memory-tier frames are read and decoded in one C call (entropy, zstd, stored raw); other codecs
    (deflate) fall back to Python. Every byte equal after a cold read."""
    samples = _kv(2 * MiB + 100)
    noise = os.urandom(MiB + 3)
    for codec in ("auto", "zstd", "deflate", "none"):
        m = make_mount(f"m-{codec}").start("--codec", codec)
        (m.mountpoint / "kv").write_bytes(samples)
        (m.mountpoint / "noise").write_bytes(noise)
        for name, want in (("kv", samples), ("noise", noise)):
            drop_page_cache(m.mountpoint / name)
            assert (m.mountpoint / name).read_bytes() == want, (codec, name)
        m.stop()
