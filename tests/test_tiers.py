"""Tiers on real mounts: demotion and eviction under pressure, promotion policies, big files, fsync to L3,
kill -9 during moves, a wiped L2 (reboot)."""

from __future__ import annotations

import errno
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import KvfsMount
from test_index import check_invariants

MiB = 1 << 20


def content(name: str, size: int) -> bytes:
    """Incompressible, deterministic per (name, size): stored size ≈ logical size, checkable anywhere."""
    return random.Random(f"{name}:{size}").randbytes(size)


def tier_of(path: Path) -> str:
    return os.getxattr(path, "user.kvfs.tier").decode()


def wait_for(predicate, timeout: float = 15.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def mover_idle(m: KvfsMount) -> bool:
    mover = m.stats()["mover"]
    return not (mover["draining"] or mover["backlog_bytes"] or mover["promotions_queued"] or mover["moves_in_flight"])


def read_uncached(path: Path) -> bytes:
    """Read through the daemon, not the kernel's page cache of the FUSE file."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def start_tiered(m: KvfsMount, l2: str, l3: str, *args: str) -> KvfsMount:
    return m.start("--l3", f"{m.root / (m.mountpoint.name + '-l3')}:{l3}", *args, l2_size=l2)


def object_ids(m: KvfsMount) -> dict[str, list[str]]:
    """object id → tiers holding it."""
    where: dict[str, list[str]] = {}
    for tier in ("L2", "L3"):
        for p in m.objects(tier):
            where.setdefault(p.name, []).append(tier)
    return where


# -- pressure --------------------------------------------------------------------------------------------
def test_demotion_and_eviction_under_pressure(make_mount):
    """Writers fill L2 and L3 many times over while readers read: caps hold at every sample, every byte read
    is right (a file is complete or gone, never wrong), demotions and evictions happen."""
    m = start_tiered(make_mount(), "12M", "36M")
    m.path("ns").mkdir()
    stop = threading.Event()
    written: dict[str, int] = {}
    problems: list[str] = []
    samples: list[dict] = []

    def writer(wid: int) -> None:
        rng = random.Random(wid)
        for i in range(45):
            name, size = f"w{wid}-{i:03d}", rng.randrange(200_000, 1_600_000)
            try:
                m.path("ns", name).write_bytes(content(name, size))
                written[name] = size
            except OSError as e:
                problems.append(f"write {name}: {e}")

    def reader(rid: int) -> None:
        rng = random.Random(100 + rid)
        while not stop.is_set():
            if not written:
                time.sleep(0.01)
                continue
            name = rng.choice(list(written))
            try:
                data = read_uncached(m.path("ns", name))
            except FileNotFoundError:
                continue  # evicted: a miss is allowed, wrong bytes are not
            except OSError as e:
                problems.append(f"read {name}: {e}")
                continue
            if data != content(name, written[name]):
                problems.append(f"wrong bytes from {name}")

    def monitor() -> None:
        while not stop.is_set():
            samples.append(m.stats()["tiers"])
            time.sleep(0.05)

    writers = [threading.Thread(target=writer, args=(w,)) for w in range(3)]
    others = [threading.Thread(target=reader, args=(r,)) for r in range(2)] + [threading.Thread(target=monitor)]
    for t in writers + others:
        t.start()
    for t in writers:
        t.join(300)
    stop.set()
    for t in others:
        t.join(60)
    assert not problems, problems[:10]
    assert len(samples) > 10
    for tiers in samples:
        for name, t in tiers.items():
            assert t["used_bytes"] <= t["capacity_bytes"], (name, t)

    wait_for(lambda: mover_idle(m), what="the mover to settle")
    stats = m.stats()
    l2, l3 = stats["tiers"]["L2"], stats["tiers"]["L3"]
    assert l2["demoted_files"] > 0 and l3["evicted_files"] > 0, stats
    assert l2["used_bytes"] <= 0.9 * l2["capacity_bytes"]  # drained below the high watermark
    assert stats["errors"] == 0 and stats["checksum_failures"] == 0 and stats["commit_failures"] == 0
    m.check_accounting(stats)
    present = set(os.listdir(m.path("ns")))
    assert len(present) == l2["files"] + l3["files"]
    assert len(present) < len(written)  # some were evicted ...
    assert {n for n in present if tier_of(m.path("ns", n)) == "L3"}  # ... and some live on L3
    verified = 0
    for name in present:  # reads promote, which demotes, which may evict: a miss is fine, wrong bytes not
        try:
            assert m.path("ns", name).read_bytes() == content(name, written[name]), name
            verified += 1
        except FileNotFoundError:
            pass
    assert verified >= len(present) // 2
    wait_for(lambda: mover_idle(m), what="promotions after the reads")
    assert all(len(t) == 1 for t in object_ids(m).values())
    m.stop()
    check_invariants(m.state / "index.sqlite", {"L2": m.l2, "L3": m.l3})


def test_open_reader_survives_moves(make_mount):
    """A file held open and read again and again while the mover moves it down and back up."""
    m = start_tiered(make_mount(), "8M", "64M", "--promote", "always")
    data = content("held", 3 * MiB)
    m.path("held").write_bytes(data)
    fd = os.open(m.path("held"), os.O_RDONLY)
    try:
        tiers_seen = set()
        for round_ in range(6):
            for i in range(4):  # push L2 past its high watermark: "held" is the least recently used
                m.path(f"filler-{round_}-{i}").write_bytes(content(f"f{round_}{i}", 2 * MiB))
            for _ in range(10):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                assert os.pread(fd, len(data), 0) == data
                tiers_seen.add(tier_of(m.path("held")))
                time.sleep(0.05)
        stats = m.stats()
        assert tiers_seen == {"L2", "L3"}, tiers_seen
        assert stats["tiers"]["L2"]["demoted_files"] >= 2
    finally:
        os.close(fd)
    assert m.stats()["errors"] == 0


# -- promotion ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("policy,reads_to_promote", [("always", 1), ("3", 3), ("never", None)])
def test_promotion_policy(make_mount, policy, reads_to_promote):
    started = time.time()
    m = start_tiered(make_mount(), "64M", "64M", "--promote", policy)
    f = m.path("f.kv")
    data = content("f", 2 * MiB)
    with open(f, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())  # fsync puts the file on L3
    assert tier_of(f) == "L3"
    for n in range(1, 5):
        assert read_uncached(f) == data
        if reads_to_promote is not None and n >= reads_to_promote:
            wait_for(lambda: tier_of(f) == "L2", what=f"promotion after {n} reads")
            break
        time.sleep(1.2)  # more than a mover tick: it had its chance
        assert tier_of(f) == "L3", f"promoted after {n} reads with policy {policy}"
    stats = m.stats()
    l2, l3 = stats["tiers"]["L2"], stats["tiers"]["L3"]
    assert l3["hits"] == (reads_to_promote or 4)
    assert l2["promoted_files"] == (1 if reads_to_promote else 0)
    moved_at = stats["mover"]["last_move_unix"]  # the promotion's (fsync writes to L3 itself: not a move)
    if reads_to_promote is None:
        assert moved_at is None
    else:
        assert started < moved_at <= time.time(), (started, moved_at)
    assert read_uncached(f) == data
    assert m.stats()["tiers"]["L2"]["hits"] == (1 if reads_to_promote else 0)
    m.check_accounting()


def test_promote_option_is_validated(make_mount, tmp_path):
    mnt = tmp_path / "bad"
    mnt.mkdir()
    res = subprocess.run([sys.executable, "-m", "kvfs", "mount", "-f", str(mnt), "--promote", "sometimes"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "promotion policy" in res.stderr


# -- placement ---------------------------------------------------------------------------------------------
def test_file_bigger_than_l2_goes_to_l3(make_mount):
    m = start_tiered(make_mount(), "4M", "64M")
    data = content("big", 6 * MiB)
    m.path("big").write_bytes(data)
    assert tier_of(m.path("big")) == "L3"
    assert m.stats()["tiers"]["L2"]["used_bytes"] == 0
    assert read_uncached(m.path("big")) == data
    time.sleep(1.2)  # a mover tick: the read queued a promotion that can never fit
    assert tier_of(m.path("big")) == "L3" and m.stats()["move_failures"] == 0
    m.path("small").write_bytes(b"s" * 1000)
    assert tier_of(m.path("small")) == "L2"
    m.check_accounting()


def test_writer_waits_for_the_mover_when_l2_is_full(make_mount):
    """Files written faster than the mover can keep L2 under its watermark all land, none fails."""
    m = start_tiered(make_mount(), "6M", "256M")
    for i in range(40):
        m.path(f"f{i}").write_bytes(content(f"f{i}", 1 * MiB))
    stats = m.stats()
    assert stats["commit_failures"] == 0 and stats["writer_waits"] > 0, stats
    assert stats["tiers"]["L2"]["used_bytes"] <= 6 * MiB
    for i in range(40):
        assert m.path(f"f{i}").read_bytes() == content(f"f{i}", 1 * MiB)
    m.check_accounting()


def test_fsync_lands_on_l3(make_mount):
    m = start_tiered(make_mount(), "64M", "64M", "--promote", "never")
    data = content("d", 3 * MiB)
    fd = os.open(m.path("durable"), os.O_WRONLY | os.O_CREAT, 0o644)
    os.write(fd, data)
    os.fsync(fd)
    assert tier_of(m.path("durable")) == "L3"  # before close: fsync returned with the object on L3
    os.close(fd)
    # a file already committed to L2 (closed), then fdatasync'ed without changes: moved to L3 as well
    m.path("later").write_bytes(data)
    assert tier_of(m.path("later")) == "L2"
    fd = os.open(m.path("later"), os.O_RDONLY)
    os.fdatasync(fd)
    os.close(fd)
    assert tier_of(m.path("later")) == "L3"
    assert not list(m.l2.glob("*/*"))
    m.stop()
    shutil.rmtree(m.l2)  # a reboot: tmpfs is gone, fsynced files are not
    start_tiered(m, "64M", "64M")
    assert m.path("durable").read_bytes() == data and m.path("later").read_bytes() == data


# -- restarts ------------------------------------------------------------------------------------------------
def test_wiped_l2_between_runs(make_mount):
    m = start_tiered(make_mount(), "64M", "64M")
    m.path("ns").mkdir()
    for i in range(6):
        with open(m.path("ns", f"f{i}"), "wb") as fh:
            fh.write(content(f"f{i}", MiB))
            if i % 2:
                fh.flush()
                os.fsync(fh.fileno())  # odd ones on L3
    assert [tier_of(m.path("ns", f"f{i}")) for i in range(6)] == ["L2", "L3"] * 3
    m.stop()
    shutil.rmtree(m.l2)
    start_tiered(m, "64M", "64M")
    stats = m.stats()
    assert stats["reconcile_rows_dropped"] == 3 and stats["tiers"]["L3"]["files"] == 3
    m.check_accounting(stats)
    assert sorted(os.listdir(m.path("ns"))) == ["f1", "f3", "f5"]
    for i in (1, 3, 5):
        assert read_uncached(m.path("ns", f"f{i}")) == content(f"f{i}", MiB)


def test_reconcile_after_moves_cut_short(make_mount):
    """The states a crash in the middle of a move leaves: a finished copy not yet switched to (row on L2), the
    same after a reboot emptied L2, a temp copy. Reconcile keeps exactly one object each, nothing is lost."""
    m = start_tiered(make_mount(), "64M", "64M")
    for name in ("a", "b", "c"):
        m.path(name).write_bytes(content(name, MiB))
    assert {tier_of(m.path(n)) for n in "abc"} == {"L2"}
    m.stop()
    objs = {p.name: p for p in m.objects("L2")}
    a, b, c = (objs[n] for n in sorted(objs, key=lambda oid: int(oid.split("-")[0], 16)))

    def l3_path(p: Path) -> Path:
        path = m.l3 / p.parent.name / p.name
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    shutil.copy(a, l3_path(a))  # copied and renamed, crash before the switch: the row says L2
    shutil.move(b, l3_path(b))  # the same, and then a reboot emptied L2: the copy is adopted
    shutil.copy(c, l3_path(c).with_name(c.name + ".tmp"))  # crash while copying
    start_tiered(m, "64M", "64M", "--promote", "never")
    assert object_ids(m) == {a.name: ["L2"], b.name: ["L3"], c.name: ["L2"]}
    assert [tier_of(m.path(n)) for n in "abc"] == ["L2", "L3", "L2"]
    stats = m.stats()
    assert stats["reconcile_objects_adopted"] == 1 and stats["reconcile_rows_dropped"] == 0
    assert stats["reconcile_orphans_removed"] == 1
    for name in "abc":
        assert m.path(name).read_bytes() == content(name, MiB)
    m.check_accounting()


def test_kill9_during_moves_then_remount(make_mount):
    """Kill the daemon while it demotes (a tiny L2 at start makes it demote nearly everything), three times
    at different moments: nothing lost, no object in two tiers, no orphans."""
    m = start_tiered(make_mount(), "256M", "512M")
    names = [f"f{i:02d}" for i in range(60)]
    for n in names:
        m.path(n).write_bytes(content(n, 2 * MiB))
    m.stop()
    cut_short = 0
    for delay in (0.03, 0.08, 0.15):
        start_tiered(m, "8M", "512M")
        time.sleep(delay)  # the mover starts at once; draining 120 MB takes a few hundred ms here
        m.kill9()
        start_tiered(m, "256M", "512M", "--promote", "never")  # room for everything: no further moves
        on_l2, on_l3 = len(m.objects("L2")), len(m.objects("L3"))
        cut_short += on_l2 > 4 and on_l3 > 0  # killed in the middle of the drain
        assert sorted(n for n in os.listdir(m.mountpoint) if n != ".kvfs") == names
        for n in names:
            assert read_uncached(m.path(n)) == content(n, 2 * MiB), n
        assert all(len(t) == 1 for t in object_ids(m).values())
        m.check_accounting()
        m.stop()
        check_invariants(m.state / "index.sqlite", {"L2": m.l2, "L3": m.l3})
        # everything back to L2 (reads promote) for the next attempt
        start_tiered(m, "256M", "512M", "--promote", "always")
        for n in names:
            read_uncached(m.path(n))
        wait_for(lambda: len(m.objects("L2")) == len(names) and mover_idle(m), what="promotions")
        m.stop()
    assert cut_short >= 1, "no kill landed in the middle of a drain"


# -- inspection --------------------------------------------------------------------------------------------
def test_stats_and_stat_command_show_tiers(make_mount):
    m = start_tiered(make_mount(), "64M", "64M")
    m.path("f").write_bytes(content("f", MiB))
    read_uncached(m.path("f"))
    doc = m.stats()
    assert set(doc["tiers"]) == {"L2", "L3"} and doc["tiers"]["L3"]["persistent"] is True
    for key in ("hits", "read_bytes", "demoted_files", "demoted_bytes", "promoted_files", "promoted_bytes",
                "evicted_files", "evicted_bytes"):
        assert key in doc["tiers"]["L2"], key
    assert doc["tiers"]["L2"]["hits"] == 1 and doc["tiers"]["L2"]["read_bytes"] >= MiB
    assert doc["mover"]["promotion"] == "always" and doc["mover"]["watermarks"]["L2"] == {"high": 0.9, "low": 0.8}
    out = subprocess.run([sys.executable, "-m", "kvfs", "stat", str(m.mountpoint)], capture_output=True, text=True,
                         check=True, timeout=60, env=dict(os.environ, COLUMNS="200")).stdout
    assert "L3" in out and "hits" in out and "demoted" in out and "backlog" in out


def test_eviction_never_takes_an_open_file(make_mount):
    m = start_tiered(make_mount(), "2M", "4M")
    keep = content("keep", 3 * MiB)
    m.path("keep").write_bytes(keep)  # bigger than L2: on L3
    fd = os.open(m.path("keep"), os.O_RDONLY)
    with pytest.raises(OSError) as e:
        m.path("other").write_bytes(content("other", 3 * MiB))  # L3 has room for one: "keep" is open
    assert e.value.errno == errno.ENOSPC
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    assert os.pread(fd, len(keep), 0) == keep
    os.close(fd)
    assert m.path("keep").exists()
    m.path("third").write_bytes(content("third", 3 * MiB))  # now "keep" can be evicted
    assert not m.path("keep").exists() and m.path("third").read_bytes() == content("third", 3 * MiB)
    m.check_accounting()


def test_a_committed_file_is_read_without_loading_its_table_again(make_mount):
    """A commit hands the frame table it wrote to the store: a reader opening the file afterwards reads only
    the frame it needs from L2, not the table first (one worker-thread hop and a 64 KiB read less)."""
    from kvfs import format as fmt

    m = start_tiered(make_mount(), "64M", "64M", "--promote", "never")
    data = content("t", 3 * MiB)
    m.path("t").write_bytes(data)  # committed at close
    (obj,) = m.objects("L2")
    stored = obj.read_bytes()
    header = fmt.parse_header(stored)
    first = fmt.parse_table(header, memoryview(stored)[header.size:], len(stored))[0]
    before = m.stats()["tiers"]["L2"]["read_bytes"]
    fd = os.open(m.path("t"), os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        assert os.pread(fd, 4096, 0) == data[:4096]
    finally:
        os.close(fd)
    assert m.stats()["tiers"]["L2"]["read_bytes"] - before == first.stored_len
