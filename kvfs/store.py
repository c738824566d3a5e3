"""Async access to encoded objects in tiers: capacity accounting, thread hops, verified frame reads.

CPU work (encode, decode, hashing) runs under the codec limiter; tier I/O under each tier's own I/O limiter,
so slow tier I/O cannot starve decoding of hits in a fast tier.
"""

from __future__ import annotations

import dataclasses
import errno
import os
from collections.abc import Callable, Sequence
from typing import TypeVar

import trio

from . import format as fmt
from .index import object_id
from .tiers import Tier

T = TypeVar("T")
PROBE_BYTES = 64 << 10  # first read of an object: header + table of up to ~1800 frames


@dataclasses.dataclass(frozen=True)
class ObjectRef:
    ino: int
    gen: int
    tier: str
    stored_bytes: int

    @property
    def object_id(self) -> str:
        return object_id(self.ino, self.gen)


@dataclasses.dataclass(frozen=True)
class Layout:
    header: fmt.Header
    frames: list[fmt.FrameEntry]


class Store:
    def __init__(self, tiers: Sequence[Tier], codec_threads: int | None = None, io_threads: int = 8) -> None:
        self.tiers = {t.name: t for t in tiers}
        self.order = list(tiers)  # fastest first
        self.codec_limiter = trio.CapacityLimiter(codec_threads or max(2, os.cpu_count() or 2))
        self.io_limiters = {t.name: trio.CapacityLimiter(io_threads) for t in tiers}

    async def cpu(self, fn: Callable[..., T], *args) -> T:
        return await trio.to_thread.run_sync(fn, *args, limiter=self.codec_limiter)

    async def io(self, tier: str, fn: Callable[..., T], *args) -> T:
        return await trio.to_thread.run_sync(fn, *args, limiter=self.io_limiters[tier])

    def reserve(self, size: int, replacing: ObjectRef | None) -> Tier:
        """Pick the tier for a new object of `size` bytes and charge it; ENOSPC if it cannot fit."""
        for tier in self.order:
            credit = replacing.stored_bytes if replacing and replacing.tier == tier.name else 0
            if tier.used_bytes - credit + size <= tier.capacity:
                tier.used_bytes += size
                tier.files += 1
                return tier
        raise OSError(errno.ENOSPC, "no tier has room for the object")

    def release(self, tier_name: str, size: int) -> None:
        tier = self.tiers[tier_name]
        tier.used_bytes -= size
        tier.files -= 1

    async def put(self, ino: int, gen: int, parts: Sequence[bytes], replacing: ObjectRef | None,
                  durable: bool) -> ObjectRef:
        size = sum(len(p) for p in parts)
        tier = self.reserve(size, replacing)
        oid = object_id(ino, gen)
        try:
            await self.io(tier.name, tier.put, oid, parts, durable or tier.persistent)
        except BaseException:
            self.release(tier.name, size)
            with trio.CancelScope(shield=True):
                await self.io(tier.name, tier.delete, oid)
            raise
        return ObjectRef(ino, gen, tier.name, size)

    async def delete(self, ref: ObjectRef) -> None:
        self.release(ref.tier, ref.stored_bytes)
        tier = self.tiers[ref.tier]
        await self.io(ref.tier, tier.delete, ref.object_id)

    async def load_layout(self, ref: ObjectRef) -> Layout:
        tier = self.tiers[ref.tier]
        head = await self.io(ref.tier, tier.read, ref.object_id, 0, PROBE_BYTES)
        return await self.cpu(self._parse_layout, tier, ref, head)

    @staticmethod
    def _parse_layout(tier: Tier, ref: ObjectRef, head: bytes) -> Layout:
        header = fmt.parse_header(head)
        if header.data_offset > len(head):
            head = tier.read(ref.object_id, 0, header.data_offset)
        if len(head) < header.data_offset:
            raise fmt.CorruptObject("object shorter than its frame table")
        frames = fmt.parse_table(header, memoryview(head)[header.size:], ref.stored_bytes)
        return Layout(header, frames)

    async def read_payload(self, ref: ObjectRef, entry: fmt.FrameEntry) -> bytes:
        if entry.is_hole:
            return b""
        tier = self.tiers[ref.tier]
        return await self.io(ref.tier, tier.read, ref.object_id, entry.offset, entry.stored_len)

    async def read_frame(self, ref: ObjectRef, entry: fmt.FrameEntry) -> bytes:
        """Raw bytes of one frame, verified before and after decoding (CorruptObject otherwise)."""
        if entry.is_hole:
            return bytes(entry.raw_len)
        tier = self.tiers[ref.tier]
        if not tier.persistent:
            # a memory-backed tier reads at memory speed: one thread hop instead of two
            return await self.cpu(_read_and_decode, tier, ref.object_id, entry)
        payload = await self.read_payload(ref, entry)
        return await self.cpu(fmt.decode_frame, entry, payload)


def _read_and_decode(tier: Tier, oid: str, entry: fmt.FrameEntry) -> bytes:
    return fmt.decode_frame(entry, tier.read(oid, entry.offset, entry.stored_len))
