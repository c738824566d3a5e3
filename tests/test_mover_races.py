"""A move racing a delete (issue 40): a file unlinked while the mover copies it is a skipped move, not a failure.

Deletion (unlink, the kernel's forget of an unlinked file) does not take the mover's per-inode lock, so the
source object can vanish under a copy: the copy fails with ENOENT, or it succeeds and the index refuses the
switch. Under fsstress that was logged as "moving inode N from L2 to L3 failed" and counted in move_failures.
Now it counts in moves_skipped, with a debug line "skipped: file deleted". fsck stays clean either way.

First deterministically, on a Mover with real directory tiers (no mount): the deletion lands before the copy,
and after it. Then on a real mount: many files demoted (by name, and by watermark pressure) while another
thread unlinks them.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time

import trio

from kvfs import mover
from kvfs.config import PromotionPolicy, TierConfig
from kvfs.index import ROOT_INODE, Index, object_id
from kvfs.locks import InodeLocks
from kvfs.stats import Counters
from kvfs.store import ObjectRef, Store
from kvfs.tiers.directory import DirectoryTier

MiB = 1 << 20


# -- in process: the deletion lands at a known point of the move ---------------------------------------------
def _setup(tmp_path):
    l2 = DirectoryTier("L2", tmp_path / "l2", 1 << 30, persistent=False)
    l3 = DirectoryTier("L3", tmp_path / "l3", 1 << 30, persistent=True)
    store = Store([l2, l3])
    index = Index(tmp_path / "index.db")
    configs = tuple(TierConfig(t.name, tmp_path / t.name, t.capacity, t.persistent) for t in store.order)
    m = mover.Mover(store, index, configs, PromotionPolicy(1), Counters(), InodeLocks())
    ino = index.create(ROOT_INODE, b"f", 0o100644, 0, 0)
    data = os.urandom(4096)
    l2.put(object_id(ino, 1), [data], durable=False)
    store.charge(l2, len(data))
    index.switch_object(ino, gen=1, tier="L2", size=len(data), stored_bytes=len(data), codec="none",
                        transform=None, mtime_ns=time.time_ns())
    return m, store, index, ino, ObjectRef(ino, 1, "L2", len(data)), l2, l3


async def _delete(store: Store, index: Index, ino: int, ref: ObjectRef) -> None:
    """What kvfs/frontend/ops/names.py's _maybe_delete does for an unlinked file nobody holds: the row, then the
    object."""
    index.delete_inode(ino)
    await store.delete(ref)


def _objects(tier: DirectoryTier) -> list:
    return [p for p in tier.root.rglob("*") if p.is_file() and p.parent.name != "staging"]


def test_a_file_deleted_before_its_copy_is_a_skipped_move(tmp_path, caplog):
    m, store, index, ino, ref, l2, l3 = _setup(tmp_path)
    copy = store.copy

    async def deleted_first(ref_, dest, plan=None):
        await _delete(store, index, ino, ref)
        return await copy(ref_, dest, plan)  # FileNotFoundError: the source is gone

    store.copy = deleted_first
    caplog.set_level(logging.DEBUG, logger="kvfs.mover")
    assert not trio.run(m.move, ino, l3)
    assert (m.counters.moves_skipped, m.counters.move_failures) == (1, 0)
    assert "skipped: file deleted" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert l2.used_bytes == l3.used_bytes == 0 and not _objects(l2) and not _objects(l3)


def test_a_file_deleted_during_its_copy_is_a_skipped_move(tmp_path, caplog):
    """The copy succeeds, the index refuses the switch: the copy is removed, and the move counted skipped."""
    m, store, index, ino, ref, l2, l3 = _setup(tmp_path)
    copy = store.copy

    async def deleted_after(ref_, dest, plan=None):
        new = await copy(ref_, dest, plan)
        await _delete(store, index, ino, ref)
        return new

    store.copy = deleted_after
    caplog.set_level(logging.DEBUG, logger="kvfs.mover")
    assert not trio.run(m.move, ino, l3)
    assert (m.counters.moves_skipped, m.counters.move_failures) == (1, 0)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert l2.used_bytes == l3.used_bytes == 0 and not _objects(l2) and not _objects(l3)


def test_a_move_that_really_fails_still_counts_as_failed(tmp_path, caplog):
    """The control: a copy that fails while the file is still there is a failure, logged as one."""
    m, store, index, ino, ref, l2, l3 = _setup(tmp_path)

    async def broken(ref_, dest, plan=None):
        raise OSError(5, "Input/output error")

    store.copy = broken
    assert not trio.run(m.move, ino, l3)
    assert (m.counters.moves_skipped, m.counters.move_failures) == (0, 1)
    assert "failed" in caplog.text and index.get(ino)["obj_tier"] == "L2"


# -- on a real mount -----------------------------------------------------------------------------------------
SMALL = 256 * 1024  # small files: a drain moves dozens at once, most of them waiting for a copy slot


def _settle(m, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        st = m.stats()
        mv = st["mover"]
        if not (mv["moves_in_flight"] or mv["draining"] or mv["deletions_in_flight"] or mv["promotions_queued"]):
            return st
        assert time.monotonic() < deadline, mv
        time.sleep(0.1)


def _unlink_all(paths: list, errors: list, pause: float) -> None:
    for p in paths:
        time.sleep(pause)
        try:
            os.unlink(p)
        except OSError as e:
            errors.append(f"{p}: {e}")


def _race_round(m, n: int) -> None:
    """One round. By watermark: small files written into a full L2 while another thread unlinks the oldest
    ones, the very files its drains pick (dozens per drain, most of them waiting for a copy slot). By name: a
    tree of 6 MiB files (the newest: in L2) demoted with user.kvfs.tier on its directory while another thread
    unlinks them one after another. (They lie in a subdirectory: the kernel holds the inode lock of the
    directory a setxattr names, and an unlink locks its parent: in the same directory they would not overlap.)"""
    errors: list[str] = []
    w = m.path(f"pressed{n}")
    w.mkdir()
    old = [w / f"old{i}" for i in range(250)]
    for p in old:
        p.write_bytes(os.urandom(SMALL))
    unlinker = threading.Thread(target=_unlink_all, args=(old, errors, 0.002))
    unlinker.start()
    for i in range(250):
        (w / f"new{i}").write_bytes(os.urandom(SMALL))
    unlinker.join()
    d = m.path(f"named{n}")
    files = [d / "s" / str(i) for i in range(8)]
    files[0].parent.mkdir(parents=True)
    for p in files:
        p.write_bytes(os.urandom(6 * MiB))
    unlinker = threading.Thread(target=_unlink_all, args=(files, errors, 0.005))
    unlinker.start()
    os.setxattr(d, "user.kvfs.tier", b"L3")  # the whole tree, file after file
    unlinker.join()
    assert not errors, errors


def test_deletes_during_moves_are_skipped_moves_not_failures(make_mount):
    """Rounds of moves racing deletes (_race_round), until at least one move met its file deleted (usually the
    first round), then: no failed move, no "failed" in the log, the tiers accounted for, fsck clean."""
    m = make_mount().start("--codec", "none", "--debug", l2_size="64M")
    for n in range(1, 6):
        _race_round(m, n)
        st = _settle(m)
        if st["moves_skipped"]:
            break
    print(f"{n} rounds: {st['moves_skipped']} moves skipped, {st['tiers']['L2']['demoted_files']} demoted")
    assert st["move_failures"] == 0 and st["errors"] == 0, st
    assert st["moves_skipped"] > 0, "no move met a deleted file: the race was not exercised"
    log = m.log_text()
    assert "skipped: file deleted" in log  # --debug: the line that says what happened
    assert not [line for line in log.splitlines() if "failed" in line and ("WARNING" in line or "kvfs.mover" in line)]
    m.check_accounting()
    fsck = subprocess.run([sys.executable, "-m", "kvfs", "fsck", str(m.mountpoint), "--json"],
                          capture_output=True, text=True, timeout=300)
    assert fsck.returncode == 0, fsck.stdout[-3000:] + fsck.stderr[-3000:]
