"""What a writer wrote stays in the kernel's page cache after its close (kvfs/pagecache.py), as in a plain
directory: the first read of a freshly written file is not a read through the daemon. This is what made
LMCache's fs L2 adapter in a mount as fast as on a plain directory (docs/engines.md)."""

from __future__ import annotations

import os

from conftest import drop_page_cache, kv_samples
from kvfs import lossy


def _daemon_reads(m) -> tuple[int, int]:
    s = m.stats()
    return s["read_requests"], s["tiers"]["L2"]["hits"]


def _write_then_rename(directory, name: str, data: bytes) -> None:
    """LMCache's fs adapter: write a temporary file, close it, rename it to its final name."""
    tmp = directory / (name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, directory / name)


def test_a_written_file_is_read_back_from_the_page_cache(make_mount):
    m = make_mount().start()
    d = m.path("lmcache", "l2")
    d.mkdir(parents=True)
    chunks = {f"c{i}.data": b"".join(p.read_bytes() for p in kv_samples("bf16")[i:] + kv_samples("bf16")[:i])
              for i in range(2)}
    for name, data in chunks.items():
        _write_then_rename(d, name, data)
    before = _daemon_reads(m)
    for name, data in chunks.items():
        assert os.path.exists(d / name)  # LMCache's lookup: a stat refreshes the attributes
        assert (d / name).read_bytes() == data
    assert _daemon_reads(m) == before  # no read request reached the daemon
    for name, data in chunks.items():  # the objects hold the same bytes
        drop_page_cache(d / name)
        assert (d / name).read_bytes() == data
    reads, hits = _daemon_reads(m)
    assert reads > before[0] and hits == before[1] + len(chunks)


def test_without_it_the_first_read_goes_through_the_daemon(make_mount):
    """The kernel behaviour it works around: the attribute refresh after a write drops the written pages."""
    m = make_mount().start(env={"KVFS_KEEP_WRITTEN_PAGES": "0"})
    data = kv_samples("bf16")[0].read_bytes()
    _write_then_rename(m.mountpoint, "a.data", data)
    before = _daemon_reads(m)
    assert m.path("a.data").read_bytes() == data
    reads, hits = _daemon_reads(m)
    assert reads > before[0] and hits == before[1] + 1


def test_files_another_handle_could_change_are_read_through_the_daemon(make_mount):
    """Kept only after a write-only handle that was the file's only one (an mmap needs a readable one)."""
    m = make_mount().start()
    data = kv_samples("bf16")[0].read_bytes()
    with open(m.path("rw.kv"), "w+b") as f:  # readable: could be mapped
        f.write(data)
    with open(m.path("two.kv"), "wb") as f, open(m.path("two.kv"), "rb"):  # a second handle is open
        f.write(data)
    for name in ("rw.kv", "two.kv"):
        before = _daemon_reads(m)
        assert m.path(name).read_bytes() == data
        assert _daemon_reads(m)[0] > before[0], name


def test_rewrites_and_partial_writes_read_back_their_new_content(make_mount):
    m = make_mount().start()
    a, b = kv_samples("bf16")[0].read_bytes(), kv_samples("fp16")[0].read_bytes()
    p = m.path("f.kv")
    p.write_bytes(a)
    assert p.read_bytes() == a
    p.write_bytes(b)  # O_TRUNC and a whole new content
    assert p.read_bytes() == b
    with open(p, "r+b") as f:  # not written in full: the frames it did not touch are not in memory
        f.seek(1_000_000)
        f.write(b"x" * 5000)
    assert p.read_bytes() == b[:1_000_000] + b"x" * 5000 + b[1_005_000:]
    p.write_bytes(a[:12345])  # shorter
    assert p.read_bytes() == a[:12345] and p.stat().st_size == 12345
    drop_page_cache(p)
    assert p.read_bytes() == a[:12345]


def test_a_lossy_file_reads_back_its_stored_values(make_mount):
    """A lossy file's reads must return what was stored, not what was written: its pages are not kept."""
    m = make_mount().start()
    d = m.path("lossy")
    d.mkdir()
    os.setxattr(d, "user.kvfs.lossy", b"mantissa:3")
    data = kv_samples("bf16")[0].read_bytes()
    with open(d / "a.kv", "wb") as f:
        os.setxattr(f.fileno(), "user.kvfs.dtype", b"bf16")
        f.write(data)
    expected = bytes(lossy.round_mantissa(data, "bf16", 3))
    assert expected != data
    assert (d / "a.kv").read_bytes() == expected


def test_an_o_direct_writer_keeps_its_data_out_of_the_page_cache(make_mount):
    """As on any filesystem: vLLM's fs tier writes and reads with O_DIRECT, past the page cache."""
    import mmap

    m = make_mount().start()
    data = kv_samples("bf16")[0].read_bytes()
    buf = mmap.mmap(-1, len(data))  # page-aligned, as O_DIRECT needs
    buf[:] = data
    fd = os.open(m.path("d.bin"), os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o644)
    try:
        assert os.write(fd, buf) == len(data)
    finally:
        os.close(fd)
    before = _daemon_reads(m)
    assert m.path("d.bin").read_bytes() == data
    assert _daemon_reads(m)[0] > before[0]


def test_a_demoted_file_leaves_the_page_cache(make_mount):
    """Kept pages are a cache in front of L2 only: after a demotion the next read reaches the daemon, which
    counts it as a read of the colder tier."""
    m = make_mount().start()
    data = kv_samples("bf16")[0].read_bytes()
    _write_then_rename(m.mountpoint, "a.data", data)
    before = _daemon_reads(m)
    assert m.path("a.data").read_bytes() == data
    assert _daemon_reads(m) == before  # kept
    os.setxattr(m.path("a.data"), "user.kvfs.tier", b"L3")
    l3_hits = m.stats()["tiers"]["L3"]["hits"]
    assert m.path("a.data").read_bytes() == data
    assert m.stats()["tiers"]["L3"]["hits"] == l3_hits + 1
