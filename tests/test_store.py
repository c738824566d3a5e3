"""The store's frame tables and the mover's deletion policy, on real directory tiers (no mount).

A move hands its copy's frame table to the store, so the reader a promotion was for reads frames at once; a
table is read and parsed in one worker-thread hop, at most once per object; a copy whose table does not
verify is not trusted (the first read loads it and reports the corruption). Deletions from a remote tier
wait while moves run, up to a bound.
"""

from __future__ import annotations

import os

import pytest
import trio
import trio.testing

from kvfs import codecs, mover
from kvfs import format as fmt
from kvfs.codecs import transforms
from kvfs.config import PromotionPolicy, TierConfig
from kvfs.index import Index, object_id
from kvfs.locks import InodeLocks
from kvfs.stats import Counters
from kvfs.store import PROBE_BYTES, ObjectRef, Store
from kvfs.tiers.directory import DirectoryTier

FRAME = 4096
DATA = bytes(range(256)) * 40 + os.urandom(3000)  # 3 frames: two that compress, one that does not


def _object(data: bytes) -> bytes:
    n = -(-len(data) // FRAME)
    codec = codecs.by_name("zstd")
    frames = [fmt.encode_frame(data[i * FRAME:(i + 1) * FRAME], codec, transforms.BYTEPLANE2) for i in range(n)]
    parts, _ = fmt.build_object(fmt.Header(len(data), FRAME, n, transforms.BYTEPLANE2, 2, codec.id), frames)
    return b"".join(parts)


@pytest.fixture
def tiers(tmp_path):
    l2 = DirectoryTier("L2", tmp_path / "l2", 1 << 30, persistent=False)
    l3 = DirectoryTier("L3", tmp_path / "l3", 1 << 30, persistent=True)
    return Store([l2, l3]), l2, l3


def _on_l3(l3: DirectoryTier, obj: bytes, ino: int = 7) -> ObjectRef:
    l3.put(object_id(ino, 1), [obj], durable=True)
    return ObjectRef(ino, 1, "L3", len(obj))


async def _read_all(store: Store, ref: ObjectRef) -> bytes:
    layout = await store.load_layout(ref)
    return b"".join([await store.read_frame(ref, e) for e in layout.frames])


def test_a_moved_object_is_read_without_reading_its_table_again(tiers):
    store, l2, l3 = tiers
    ref = _on_l3(l3, _object(DATA))

    async def main():
        moved = await store.copy(ref, l2)
        layout = await store.load_layout(moved)
        assert store.read_bytes["L2"] == 0  # the table came with the copy
        assert await _read_all(store, moved) == DATA
        assert store.read_bytes["L2"] == sum(e.stored_len for e in layout.frames)

    trio.run(main)


def test_a_table_is_read_once_per_object(tiers):
    store, _, l3 = tiers
    obj = _object(DATA)
    ref = _on_l3(l3, obj)

    async def main():
        first = await store.load_layout(ref)
        assert store.read_bytes["L3"] == min(PROBE_BYTES, len(obj))
        assert await store.load_layout(ref) is first
        assert store.read_bytes["L3"] == min(PROBE_BYTES, len(obj))

    trio.run(main)


def test_a_copy_whose_table_does_not_verify_is_not_trusted(tiers):
    store, l2, l3 = tiers
    obj = bytearray(_object(DATA))
    obj[fmt.parse_header(bytes(obj)).size + 1] ^= 0x40  # a bit of the frame table
    ref = _on_l3(l3, bytes(obj))

    async def main():
        moved = await store.copy(ref, l2)  # a copy moves bytes as they are
        with pytest.raises(fmt.CorruptObject, match="frame table checksum"):
            await store.load_layout(moved)  # nothing remembered from the copy: read from L2 and rejected

    trio.run(main)


def test_a_deleted_object_is_not_served_from_its_remembered_table(tiers):
    store, l2, l3 = tiers
    ref = _on_l3(l3, _object(DATA))

    async def main():
        moved = await store.copy(ref, l2)
        store.charge(l2, moved.stored_bytes)
        await store.delete(moved)
        with pytest.raises(FileNotFoundError):
            await store.load_layout(moved)

    trio.run(main)


def _mover(tmp_path, store: Store) -> mover.Mover:
    configs = tuple(TierConfig(t.name, tmp_path / t.name, t.capacity, t.persistent) for t in store.order)
    return mover.Mover(store, Index(tmp_path / "index.db"), configs, PromotionPolicy(1), Counters(), InodeLocks())


def test_remote_deletions_wait_while_moves_run(tiers, tmp_path):
    m = _mover(tmp_path, tiers[0])

    async def main():
        m._moving = 1  # a move in flight: deletions wait for it, up to the bound
        start = trio.current_time()
        await m._while_moving(["a"])
        assert trio.current_time() - start == pytest.approx(mover.DELETE_DEFER_MAX_S, abs=mover.DELETE_GATHER_S)

        async def move_ends():
            await trio.sleep(0.3)
            m._moving = 0

        async with trio.open_nursery() as nursery:
            nursery.start_soon(move_ends)
            start = trio.current_time()
            await m._while_moving(["a"])  # the moves end: the batch goes out
            assert 0.3 <= trio.current_time() - start <= 0.3 + mover.DELETE_GATHER_S

        m._moving = 1
        start = trio.current_time()
        await m._while_moving(["a"] * mover.DELETE_BATCH)  # a full batch never waits
        assert trio.current_time() == start

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
