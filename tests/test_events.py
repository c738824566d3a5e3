"""KV events from a real mount, received by a real ZMQ subscriber and decoded with vLLM's own event classes:
store, demote, promote, drop and delete in order; a rewrite under a temporary name that changes nothing; a
late subscriber's replay; a restart (AllBlocksCleared, then everything announced again); `kvfs events`."""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
import time

import pytest
from kv_events import EventCollector
from vllm.distributed.kv_events import AllBlocksCleared

from kvfs import direct
from kvfs.events import BlockRecord, blocks_of, encode_record, replay
from test_tiers import read_uncached, start_tiered, tier_of, wait_for

KiB = 1 << 10


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def record(n: int, block_size: int = 16) -> BlockRecord:
    """A chunk of 4 blocks, hashes as vLLM's (32-byte sha256), chained from the previous chunk's."""
    hashes = [bytes([n, i]) * 16 for i in range(4)]
    return BlockRecord(block_hashes=hashes, block_size=block_size, parent_block_hash=bytes([n, 255]) * 16 if n else None,
                       token_ids=list(range(n * 64, n * 64 + 64)))


def summary(events: list) -> list[tuple]:
    """(type, medium, first hash's first byte) per event: the order a router sees."""
    out = []
    for ev in events:
        if isinstance(ev, AllBlocksCleared):
            out.append(("cleared",))
        else:
            out.append((type(ev).__name__, ev.medium, ev.block_hashes[0][0]))
    return out


def write_chunk(m, rel: str, n: int, size: int = 256 * KiB, *, via_tmp: bool = True) -> bytes:
    """As the connector does: a temporary name, the record, the data, a rename."""
    data = os.urandom(size)
    path = m.path(rel)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp") if via_tmp else path
    tmp.write_bytes(data)
    os.setxattr(tmp, "user.kvfs.blocks", encode_record(record(n)))
    if via_tmp:
        os.rename(tmp, path)
    return data


def endpoints() -> tuple[str, str]:
    return f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"


def test_store_move_drop_delete_give_vllm_events_in_order(make_mount):
    pub, rep = endpoints()
    m = start_tiered(make_mount(), "64M", "256M", "--events", pub, "--events-replay", rep)
    sub = EventCollector([pub], {pub: rep}).__enter__()
    assert summary(sub.wait(1)) == [("cleared",)]  # the start: whatever a subscriber knew is stale

    a = write_chunk(m, "ns/aa/a.kv", 1)
    assert summary(sub.wait(2)[1:]) == [("BlockStored", "L2", 1)]
    stored = sub.events()[1]
    assert stored.block_hashes == record(1).block_hashes and stored.token_ids == record(1).token_ids
    assert stored.parent_block_hash == record(1).parent_block_hash and stored.block_size == 16

    os.setxattr(m.path("ns/aa/a.kv"), "user.kvfs.tier", b"L3")  # demote (the hot/cold API)
    assert summary(sub.wait(4)[2:]) == [("BlockRemoved", "L2", 1), ("BlockStored", "L3", 1)]
    assert read_uncached(m.path("ns/aa/a.kv")) == a  # a read promotes it
    wait_for(lambda: tier_of(m.path("ns/aa/a.kv")) == "L2", what="promotion")
    assert summary(sub.wait(6)[4:]) == [("BlockRemoved", "L3", 1), ("BlockStored", "L2", 1)]

    # the same chunk rewritten through a temporary name: two files hold it for a moment, one after
    write_chunk(m, "ns/aa/a.kv", 1)
    # a direct write (past FUSE) announces as any commit does
    m.path("ns/bb").mkdir()
    assert direct.write_file(m.path("ns/bb/b.kv"), os.urandom(128 * KiB),
                             xattrs={"user.kvfs.blocks": encode_record(record(2))}, mode=0o644)
    assert summary(sub.wait(7)[6:]) == [("BlockStored", "L2", 2)]

    os.setxattr(m.path("ns/bb/b.kv"), "user.kvfs.drop", b"1")  # drop: a miss from now on
    os.unlink(m.path("ns/aa/a.kv"))
    assert summary(sub.wait(9)[7:]) == [("BlockRemoved", "L2", 2), ("BlockRemoved", "L2", 1)]
    time.sleep(0.3)
    assert len(sub.events()) == 9, summary(sub.events())  # the rewrite gave nothing: still held in L2
    assert blocks_of(sub.events()) == set()
    assert sub.seqs() == list(range(len(sub.seqs())))  # sequence numbers without a gap

    m.path("ns/x").write_bytes(b"x")
    with pytest.raises(OSError) as e:  # a record that is not one is refused, and never published
        os.setxattr(m.path("ns/x"), "user.kvfs.blocks", b"garbage")
    assert e.value.errno == errno.EINVAL
    doc = m.stats()["events"]
    assert doc["events_published"] == 9 and doc["announced_files"] == 0 and doc["batches_dropped"] == 0
    sub.__exit__()


def test_late_subscriber_replays_and_restart_clears_then_announces(make_mount, tmp_path):
    pub, rep = endpoints()
    config = tmp_path / "kvfs.toml"
    config.write_text('[events]\nmedia = { L2 = "CPU", L3 = "STORAGE" }\ntopic = "kvfs"\n')
    m = start_tiered(make_mount(), "64M", "256M", "--config", str(config), "--events", pub, "--events-replay", rep)
    wait_for(lambda: m.stats()["events"]["events_published"] == 1, what="the start's AllBlocksCleared")
    for n in range(3):
        write_chunk(m, f"ns/{n:02x}/c{n}.kv", n)
    os.setxattr(m.path("ns/02/c2.kv"), "user.kvfs.tier", b"L3")
    wait_for(lambda: m.stats()["events"]["events_published"] == 6, what="6 events")

    late = EventCollector([pub], {pub: rep}).__enter__()  # it missed everything: the replay has it, in order
    view = late.events()
    assert summary(view) == [("cleared",), ("BlockStored", "CPU", 0), ("BlockStored", "CPU", 1),
                             ("BlockStored", "CPU", 2), ("BlockRemoved", "CPU", 2), ("BlockStored", "STORAGE", 2)]
    held = blocks_of(view)
    assert held == {("CPU", h) for n in (0, 1) for h in record(n).block_hashes} | {
        ("STORAGE", h) for h in record(2).block_hashes}
    assert [seq for seq, _ in replay(rep, 1)] == late.seqs()[1:]  # a replay starts where asked

    batches_before = len(late.seqs())
    m.stop()
    m.start(*m.args)  # same endpoints: the subscriber's connection comes back by itself
    after = late.wait(len(view) + 4, timeout=20)[len(view):]
    assert summary(after)[0] == ("cleared",) and late.seqs()[batches_before] == 0  # a new run counts from 0
    assert sorted(summary(after)[1:]) == [("BlockStored", "CPU", 0), ("BlockStored", "CPU", 1),
                                          ("BlockStored", "STORAGE", 2)]
    assert blocks_of(view + after) == held  # the view after the restart is the view before it

    # kvfs events: what a person watching sees, from the mountpoint (the endpoints come from .kvfs/stats)
    out = subprocess.run([sys.executable, "-m", "kvfs", "events", str(m.mountpoint), "--from", "0", "--count", "4",
                          "--topic", "kvfs"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 4 and "AllBlocksCleared" in lines[0] and "BlockStored" in lines[1]
    assert ("STORAGE" in out.stdout) and ("CPU" in out.stdout)
    late.__exit__()


def test_events_config_errors(make_mount):
    m = make_mount()
    bad = subprocess.run([sys.executable, "-m", "kvfs", "mount", str(m.mountpoint), "--events", "localhost:5557"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "ZMQ endpoint" in bad.stderr
    only_replay = subprocess.run([sys.executable, "-m", "kvfs", "mount", str(m.mountpoint), "--events-replay",
                                  "tcp://127.0.0.1:1"], capture_output=True, text=True, timeout=60)
    assert only_replay.returncode != 0 and "needs an events endpoint" in only_replay.stderr
    assert not os.path.ismount(m.mountpoint)


def test_eviction_from_the_last_tier_removes_the_blocks(make_mount):
    """L2 alone, 4 MiB: the oldest chunks are evicted to make room, and a router hears it."""
    pub, rep = endpoints()
    m = make_mount().start("--l3", "none", "--events", pub, "--events-replay", rep, l2_size="4M")
    sub = EventCollector([pub], {pub: rep}).__enter__()
    sub.wait(1)
    for n in range(6):
        write_chunk(m, f"ns/{n:02x}/c{n}.kv", n, size=1 << 20)
    wait_for(lambda: m.stats()["tiers"]["L2"]["evicted_files"] >= 2, what="evictions")
    time.sleep(0.2)
    view = summary(sub.events())
    evicted = sorted(n for n in range(6) if not m.path(f"ns/{n:02x}/c{n}.kv").exists())
    assert evicted and sorted(e[2] for e in view if e[0] == "BlockRemoved") == evicted
    assert blocks_of(sub.events()) == {("L2", h) for n in range(6) if n not in evicted for h in record(n).block_hashes}
    sub.__exit__()


def test_a_file_of_several_groups_is_announced_under_each(make_mount):
    """A hybrid model's part (kvfs_connector: e.g. every sliding-window group of Gemma 3) is one file whose
    record names its groups: a subscriber gets one BlockStored and one BlockRemoved per group, as vLLM
    announces each group's blocks."""
    pub, rep = endpoints()
    m = start_tiered(make_mount(), "64M", "256M", "--events", pub, "--events-replay", rep)
    sub = EventCollector([pub], {pub: rep}).__enter__()
    assert summary(sub.wait(1)) == [("cleared",)]
    rec = record(3)
    rec.group_idx, rec.group_ids = 1, [1, 2, 5]
    path = m.path("ns/cc/c.kv")
    path.parent.mkdir(parents=True)
    path.write_bytes(os.urandom(64 * KiB))
    os.setxattr(path, "user.kvfs.blocks", encode_record(rec))
    stored = sub.wait(4)[1:]
    assert summary(stored) == [("BlockStored", "L2", 3)] * 3 and [ev.group_idx for ev in stored] == [1, 2, 5]
    os.unlink(path)
    removed = sub.wait(7)[4:]
    assert summary(removed) == [("BlockRemoved", "L2", 3)] * 3 and [ev.group_idx for ev in removed] == [1, 2, 5]
    with pytest.raises(OSError) as e:  # more groups than a record may name: refused
        rec.group_ids = list(range(2000))
        m.path("ns/x").write_bytes(b"x")
        os.setxattr(m.path("ns/x"), "user.kvfs.blocks", encode_record(rec))
    assert e.value.errno == errno.EINVAL
    sub.__exit__()
