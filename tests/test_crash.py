"""Crash safety: kill -9 during concurrent writes, restarts, a wiped L2, ENOSPC, corruption."""

from __future__ import annotations

import errno
import hashlib
import os
import random
import threading
import time

import pytest

from conftest import KvfsMount, drop_page_cache
from kvfs import format as fmt


def _content(name: str, size: int) -> bytes:
    """Deterministic content per (name, size) so a survivor can be checked without a manifest."""
    seed = hashlib.sha256(f"{name}:{size}".encode()).digest()
    rng = random.Random(seed)
    return rng.randbytes(size // 2) + bytes(size - size // 2)


def _writer(mount: KvfsMount, wid: int, stop: threading.Event, written: list) -> None:
    i = 0
    while not stop.is_set():
        size = random.Random(wid * 1000 + i).randrange(1, 3_000_000)
        name = f"w{wid}-{i:04d}-{size}"
        try:
            with open(mount.path("crash", name), "wb") as fh:
                data = _content(name, size)
                for off in range(0, size, 256 << 10):
                    fh.write(data[off:off + (256 << 10)])
            written.append(name)
        except OSError:
            return  # the daemon was killed under us
        i += 1


def test_kill9_during_concurrent_writes_then_remount(make_mount):
    m = make_mount().start()
    m.path("crash").mkdir()
    for round_ in range(3):
        stop, written = threading.Event(), []
        threads = [threading.Thread(target=_writer, args=(m, w, stop, written)) for w in range(3)]
        for t in threads:
            t.start()
        time.sleep(1.5 + round_)
        m.kill9()
        stop.set()
        for t in threads:
            t.join(30)
        m.start()
        survivors = os.listdir(m.path("crash"))
        assert survivors, "nothing survived at all"
        for name in survivors:
            size = int(name.rsplit("-", 1)[1])
            data = m.path("crash", name).read_bytes()
            # complete and correct, or (created but never committed) empty
            assert data == _content(name, size) or data == b"", name
        # everything whose close() returned before the kill is there and complete
        for name in written:
            size = int(name.rsplit("-", 1)[1])
            assert m.path("crash", name).read_bytes() == _content(name, size)
        # the reads above promote files demoted to L3: wait for the mover to settle before counting
        m.check_accounting()
        objects = m.objects()
        assert len(objects) == sum(1 for n in survivors if m.path("crash", n).stat().st_size > 0)
    m.stop()


def test_files_survive_clean_restart_and_sigterm(make_mount):
    m = make_mount().start()
    data = os.urandom(2_000_000)
    m.path("keep").write_bytes(data)
    os.setxattr(m.path("keep"), "user.tag", b"v1")
    m.stop()
    m.start()
    assert m.path("keep").read_bytes() == data
    assert os.getxattr(m.path("keep"), "user.tag") == b"v1"
    # SIGTERM unmounts cleanly, committing a file still open with unsaved writes
    fh = open(m.path("open-at-sigterm"), "wb")
    fh.write(b"pending" * 1000)
    fh.flush()  # into the daemon's dirty frames; no close yet
    import signal
    assert m.signal(signal.SIGTERM) == 0
    assert not os.path.ismount(m.mountpoint)
    try:
        fh.close()
    except OSError:
        pass  # the mount is gone under the writer
    m.start()
    assert m.path("keep").read_bytes() == data
    assert m.path("open-at-sigterm").read_bytes() == b"pending" * 1000


def test_wiped_l2_makes_files_misses(make_mount):
    m = make_mount().start()
    m.path("d").mkdir()
    m.path("d", "f").write_bytes(b"x" * 100_000)
    m.path("empty").touch()
    m.stop()
    for p in m.objects("L2"):  # a reboot empties tmpfs
        p.unlink()
    m.start()
    assert not m.path("d", "f").exists()
    assert m.path("d").is_dir() and m.path("empty").exists()
    assert m.stats()["reconcile_rows_dropped"] == 1


def test_orphan_objects_removed_at_start(make_mount):
    m = make_mount().start()
    m.path("f").write_bytes(b"y" * 50_000)
    m.stop()
    shard = m.objects()[0].parent
    (shard / "ff-1").write_bytes(b"orphan")
    (shard / "ff-2.tmp").write_bytes(b"half")
    m.start()
    assert [p.name for p in m.objects()] != [] and all(p.name != "ff-1" for p in m.objects())
    assert not (shard / "ff-2.tmp").exists()
    assert m.path("f").read_bytes() == b"y" * 50_000


def test_enospc_at_close_and_daemon_lives(make_mount):
    """ENOSPC only when nothing can be freed: the one other file is open, and open files are never evicted."""
    m = make_mount().start("--l3", "none", l2_size="3M")
    m.path("fits").write_bytes(os.urandom(2_000_000))
    holder = open(m.path("fits"), "rb")
    fh = open(m.path("too-big"), "wb", buffering=0)
    fh.write(os.urandom(2_000_000))  # accepted into memory ...
    with pytest.raises(OSError) as e:
        fh.close()  # ... refused when committed
    assert e.value.errno == errno.ENOSPC
    assert m.alive()
    assert m.stats()["commit_failures"] >= 1
    holder.close()
    time.sleep(0.3)  # the kernel's release of "too-big" has arrived: its data, refused at close, stays refused
    assert m.path("too-big").stat().st_size == 0 and m.path("fits").exists()
    m.path("second").write_bytes(b"z" * 1000)
    assert m.path("second").read_bytes() == b"z" * 1000
    m.path("third").write_bytes(os.urandom(2_000_000))  # now "fits" can be evicted to make room
    assert not m.path("fits").exists() and m.path("third").stat().st_size == 2_000_000
    stats = m.stats()
    assert stats["tiers"]["L2"]["evicted_files"] == 1
    m.check_accounting(stats)


@pytest.mark.parametrize("where", ["header", "table", "frame", "truncated"])
def test_corruption_anywhere_is_eio_and_a_miss(make_mount, where):
    m = make_mount().start()
    m.expect_log(r"corrupt object for inode")
    data = bytes(range(256)) * 12_000  # ~3 MB, compressible, 3 frames
    m.path("victim.kv").write_bytes(data)
    m.path("bystander").write_bytes(b"b" * 10_000)
    if where != "truncated":  # truncation is damaged under the live mount; the rest at rest
        m.stop()
    victim = max(m.objects(), key=lambda p: p.stat().st_size)
    raw = bytearray(victim.read_bytes())
    header = fmt.parse_header(raw)
    rng = random.Random(where)
    if where == "truncated":
        raw = raw[: len(raw) - 100]
    else:
        lo, hi = {"header": (0, header.size), "table": (header.size, header.data_offset),
                  "frame": (header.data_offset, len(raw))}[where]
        pos = rng.randrange(lo, hi)
        raw[pos] ^= 0x10
    victim.write_bytes(bytes(raw))
    if where != "truncated":
        m.start()
    else:
        drop_page_cache(m.path("victim.kv"))  # what the writer wrote is still in the page cache
    with pytest.raises(OSError) as e:
        with open(m.path("victim.kv"), "rb") as fh:
            while fh.read(1 << 20):
                pass
    assert e.value.errno == errno.EIO
    assert m.alive()
    assert not m.path("victim.kv").exists()  # a miss for the next caller
    assert m.path("bystander").read_bytes() == b"b" * 10_000
    assert m.stats()["checksum_failures"] == 1
    assert "corrupt object" in m.log_text()


def test_object_truncated_at_rest_is_dropped_at_start(make_mount):
    m = make_mount().start()
    m.path("v").write_bytes(os.urandom(1_500_000))
    m.stop()
    victim = m.objects()[0]
    victim.write_bytes(victim.read_bytes()[:-1])
    m.start()
    assert not m.path("v").exists()
    assert m.stats()["reconcile_rows_dropped"] == 1 and m.objects() == []


def test_index_wal_stays_bounded_under_metadata_churn(make_mount):
    """A steady stream of commits must not grow the SQLite WAL without bound (checkpoints must finish)."""
    from kvfs.daemon import WAL_LIMIT_BYTES
    m = make_mount().start()
    wal = m.state / "index.sqlite-wal"
    deadline = time.monotonic() + 12
    largest = n = 0
    while time.monotonic() < deadline:
        p = m.path(f"churn-{n}")
        p.write_bytes(b"x")
        p.unlink()
        n += 1
        if n % 50 == 0:
            largest = max(largest, wal.stat().st_size)
    assert n > 500
    assert largest < 2 * WAL_LIMIT_BYTES, (largest, n)
    assert wal.stat().st_size < 2 * WAL_LIMIT_BYTES


def test_sigint_unmounts_cleanly(make_mount):
    import signal
    m = make_mount().start()
    m.path("f").write_bytes(b"kept")
    assert m.signal(signal.SIGINT) == 0
    assert not os.path.ismount(m.mountpoint)
    assert "received SIGINT, unmounting" in m.log_text()
    m.start()
    assert m.path("f").read_bytes() == b"kept"


def test_unsaved_data_is_bounded_enospc_not_oom(make_mount):
    m = make_mount()
    cfg = m.root / "kvfs.toml"
    cfg.write_text('[mount]\nmax_dirty = "8M"\n')
    m.start("--config", str(cfg))
    fd = os.open(m.path("big"), os.O_CREAT | os.O_WRONLY)
    chunk = os.urandom(1 << 20)
    with pytest.raises(OSError) as e:
        for i in range(20):
            os.pwrite(fd, chunk, i << 20)
    assert e.value.errno == errno.ENOSPC and i == 8
    assert m.stats()["dirty_bytes"] == 8 << 20
    os.close(fd)  # commits the 8 MiB that were accepted
    assert m.stats()["dirty_bytes"] == 0
    assert m.path("big").read_bytes() == chunk * 8
    m.path("after").write_bytes(chunk * 4)
    assert m.path("after").read_bytes() == chunk * 4 and m.alive()
    assert "dirty limit" in m.log_text()


def test_concurrent_readers_of_a_corrupt_file_all_see_eio_then_a_miss(make_mount):
    import threading
    m = make_mount().start()
    m.expect_log(r"corrupt object for inode")
    data = bytes(range(256)) * 40_000  # 10 MB, 10 frames
    m.path("victim.kv").write_bytes(data)
    victim = m.objects()[0]
    raw = bytearray(victim.read_bytes())
    raw[-5] ^= 0xFF  # damage the last frame
    victim.write_bytes(bytes(raw))
    drop_page_cache(m.path("victim.kv"))  # what the writer wrote is still in the page cache
    outcomes = []

    def reader():
        try:
            with open(m.path("victim.kv"), "rb") as fh:
                while fh.read(256 << 10):
                    pass
            outcomes.append("data")
        except OSError as e:
            outcomes.append(("eio" if e.errno == errno.EIO else e.errno, m.path("victim.kv").exists()))

    threads = [threading.Thread(target=reader) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # every reader that got EIO found the file gone right after; none got the damaged bytes
    assert outcomes and all(o in (("eio", False), (errno.ENOENT, False)) for o in outcomes), \
        (outcomes, m.log_text()[-3000:])
    assert m.stats()["checksum_failures"] == 1 and m.alive()
