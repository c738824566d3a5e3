"""Async access to encoded objects in tiers: capacity accounting, thread hops, verified frame reads.

CPU work (encode, decode, hashing) runs under the codec limiter; tier I/O under each tier's own I/O limiter,
so slow tier I/O cannot starve decoding of hits in a fast tier.

Capacity: `fits`/`charge`/`release` keep each tier's used bytes (on the trio thread). Where a new object
goes is decided by `place`, which the daemon replaces with the mover's policy (it may wait for room).
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import errno
import functools
import os
from collections.abc import Awaitable, Callable, Iterable
from typing import TypeVar

import numpy as np
import trio

from . import crypto, sealing
from . import format as fmt
from .codecs import kernel
from .index import object_id
from .tiers import Tier
from .tiers.base import HEAD_BYTES

T = TypeVar("T")
SHARED_TIER = "L4"  # the only tier that can be shared among nodes
PROBE_BYTES = HEAD_BYTES  # first read of an object (and what a copy keeps): header + table of ~1800 frames
LAYOUT_CACHE_FRAMES = 1 << 16  # parsed frame tables kept, counted in frames (~10 MB at most)


@dataclasses.dataclass(frozen=True)
class ObjectRef:
    ino: int
    gen: int
    tier: str
    stored_bytes: int
    key: str | None = None  # a published object's id in a shared L4 (index I7); local copies have none

    @property
    def object_id(self) -> str:
        return self.key or object_id(self.ino, self.gen)

    @classmethod
    def of_row(cls, row) -> "ObjectRef | None":
        """The object an index row names, or None (obj_gen 0: no object)."""
        if not row["obj_gen"]:
            return None
        key = row["published_key"] if "published_key" in row.keys() else None
        return cls(row["id"], row["obj_gen"], row["obj_tier"], row["stored_bytes"],
                   key if key and row["obj_tier"] == SHARED_TIER else None)


@dataclasses.dataclass(frozen=True)
class Layout:
    header: fmt.Header
    frames: list[fmt.FrameEntry]
    cipher: object = dataclasses.field(default=None, compare=False, repr=False)  # opens sealed frames, if held


Placement = Callable[[int, "ObjectRef | None", bool], Awaitable[Tier]]


class Store:
    def __init__(self, tiers: Iterable[Tier], codec_threads: int | None = None, io_threads: int = 8) -> None:
        self.order = list(tiers)  # fastest first
        self.tiers = {t.name: t for t in self.order}
        self.codec_limiter = trio.CapacityLimiter(codec_threads or max(2, os.cpu_count() or 2))
        self.io_limiters = {t.name: trio.CapacityLimiter(io_threads) for t in self.order}
        self.read_bytes = {t.name: 0 for t in self.order}  # stored bytes read for file reads (not moves)
        self.place: Placement = self.place_now
        # Frame tables of private objects (never rewritten: an id is not reused), newest last: a file opened
        # again, or just promoted by its reader (the copy parses its head), reads without a layout hop.
        self._layouts: collections.OrderedDict[ObjectRef, Layout] = collections.OrderedDict()
        self._layout_frames = 0
        self.keyring: crypto.KeyRing | None = None  # encryption at rest (kvfs/sealing.py): set by the daemon
        self.tenants = sealing.Tenants(())  # directories whose files are sealed with keys of their own

    async def cpu(self, fn: Callable[..., T], *args) -> T:
        return await trio.to_thread.run_sync(fn, *args, limiter=self.codec_limiter)

    async def io(self, tier: str, fn: Callable[..., T], *args, size: int = 0) -> T:
        """Run a tier call in a worker thread. A remote tier's call fails at once while the tier is down, and
        with EIO at its deadline (the thread is abandoned; it keeps its limiter slot until it returns, so a
        hung store cannot pile up threads)."""
        t = self.tiers[tier]
        deadline = t.deadline_for(size)
        if deadline is None:
            return await trio.to_thread.run_sync(fn, *args, limiter=self.io_limiters[tier])
        t.admit()
        with trio.move_on_after(deadline):
            return await trio.to_thread.run_sync(fn, *args, limiter=self.io_limiters[tier], abandon_on_cancel=True)
        t.note_timeout(getattr(fn, "__name__", "call"))
        raise OSError(errno.EIO, f"{tier} did not answer within {deadline:.0f} s")

    @staticmethod
    def fits(tier: Tier, size: int, credit: int = 0) -> bool:
        return tier.used_bytes - credit + size <= tier.capacity

    @staticmethod
    def charge(tier: Tier, size: int) -> None:
        tier.used_bytes += size
        tier.files += 1

    def candidates(self, durable: bool) -> list[Tier]:
        """Tiers a new object may go to, fastest first: durable objects only to persistent tiers (if any)."""
        persistent = [t for t in self.order if t.persistent]
        return persistent if durable and persistent else self.order

    async def place_now(self, size: int, replacing: ObjectRef | None, durable: bool) -> Tier:
        """Charge the first tier with room for a new object of `size` bytes; ENOSPC if none has."""
        for tier in self.candidates(durable):
            if self.fits(tier, size, credit_for(tier, replacing)):
                self.charge(tier, size)
                return tier
        raise OSError(errno.ENOSPC, "no tier has room for the object")

    def release(self, tier_name: str, size: int) -> None:
        tier = self.tiers[tier_name]
        tier.used_bytes -= size
        tier.files -= 1

    async def put(self, ino: int, gen: int, parts: list[bytes], replacing: ObjectRef | None,
                  durable: bool) -> ObjectRef:
        size = sum(len(p) for p in parts)
        tier = await self.place(size, replacing, durable)
        oid = object_id(ino, gen)
        try:
            await self.io(tier.name, tier.put, oid, parts, durable or tier.persistent, size=size)
        except BaseException:
            self.release(tier.name, size)
            with trio.CancelScope(shield=True):
                await self.io(tier.name, tier.delete, oid)
            raise
        return ObjectRef(ino, gen, tier.name, size)

    async def put_frames(self, ino: int, gen: int, header: fmt.Header, frames: list, replacing: ObjectRef | None,
                         durable: bool, pending: tuple[int, memoryview] | None = None,
                         encode: Callable | None = None, tenant: str | None = None) -> tuple[ObjectRef, Layout]:
        """Lay out and write a new object from its encoded frames, in one worker-thread hop. `pending`
        (index, raw bytes) is a frame still to encode with `encode(raw, offset)`: in a memory tier it is encoded
        in that same hop, under the codec limiter (a memory tier writes at memory speed), else first, in its
        own. The tier is chosen first, for the size the frames can reach (an encoded frame is never larger than
        its raw bytes); the difference is given back once the object is written. Returns the object and its
        frame table."""
        known = header.data_offset + sum(len(f.payload) for f in frames if f is not None)
        bound = known + (len(pending[1]) if pending is not None else 0)
        if self.keyring is not None:  # room for sealing, should the tier chosen hold sealed objects only
            bound += fmt.SEALED_EXT.size + 4 + crypto.SEAL_OVERHEAD * len(frames)
        tier = await self.place(bound, replacing, durable)
        oid = object_id(ino, gen)
        charged = bound
        cipher = None
        tenant_key = self.keyring.tenant_key(tenant) if self.keyring is not None else None
        if tenant_key is not None or getattr(tier, "sealed", False):
            header, cipher = self._sealed_header(header, tier, tenant_key)
        try:
            job = functools.partial(_encode_build_put, tier, oid, header, frames, durable or tier.persistent,
                                    pending, encode, header.frame_size, cipher)
            if pending is not None and not tier.persistent:
                entries, size = await self.cpu(job)
            else:
                if pending is not None:
                    i, raw = pending
                    frames[i] = await self.cpu(encode, raw, i * header.frame_size)
                    job = functools.partial(_encode_build_put, tier, oid, header, frames, durable or tier.persistent,
                                            None, None, header.frame_size, cipher)
                entries, size = await self.io(tier.name, job, size=bound)
            tier.used_bytes -= bound - size  # what the charge counted beyond the object's size
            charged = size
        except BaseException:
            self.release(tier.name, charged)
            with trio.CancelScope(shield=True):
                await self.io(tier.name, tier.delete, oid)
            raise
        return ObjectRef(ino, gen, tier.name, size), Layout(header, entries, cipher)

    def _sealed_header(self, header: fmt.Header, tier: Tier, key: crypto.Key | None) -> tuple[fmt.Header, object]:
        key = key or (self.keyring.current if self.keyring is not None else None)
        if key is None:
            raise OSError(errno.EIO, f"{tier.name} holds sealed objects only, and no key is loaded")
        return self.keyring.sealed_header(header, key)

    async def copy_plan(self, ref: ObjectRef, dest: Tier, tenant: str | None = None) -> sealing.Transcode | None:
        """How a move of `ref` into `dest` changes the object (sealed or opened), None if not at all. Its
        .size is the copy's size: what the caller charges dest for."""
        if self.keyring is None and not getattr(dest, "sealed", False):
            return None
        layout = await self.load_layout(ref)
        if ref.key is not None and layout.header.sealing is not None:
            return None  # a published object's local copy stays as published: it may switch back to it
        return sealing.plan(layout, dest, self.keyring, tenant)

    async def copy(self, ref: ObjectRef, dest: Tier, plan: sealing.Transcode | None = None) -> ObjectRef:
        """Copy an object into `dest`, which the caller has charged: as it is (no recompression), or as
        `plan` (copy_plan) seals or opens it; durable where dest is persistent. On failure the partial copy is
        gone and the error raised."""
        source = self.tiers[ref.tier]
        slower = max(source, dest, key=self.order.index)  # the copy waits on the slower tier's I/O
        new_id = object_id(ref.ino, ref.gen)  # a published object's local copy is named like any other
        try:
            if plan is not None:
                entries = await self.io(slower.name, sealing.copy, plan, source, ref.object_id, dest, new_id,
                                        dest.persistent, size=ref.stored_bytes)
                size, layout = plan.size, self._opened(Layout(plan.header, entries))
            else:
                size, layout = await self.io(slower.name, _copy_reading_table, dest, source, ref, new_id,
                                             size=ref.stored_bytes)
                if size != ref.stored_bytes:
                    raise fmt.CorruptObject(f"object {ref.object_id} in {ref.tier} has {size} bytes, "
                                            f"the index says {ref.stored_bytes}")
                layout = self._layouts.get(ref) or (self._opened(layout) if layout is not None else None)
        except BaseException:
            with trio.CancelScope(shield=True):
                await self.io(dest.name, dest.delete, new_id)
            raise
        new_ref = ObjectRef(ref.ino, ref.gen, dest.name, size)
        self.keep_layout(new_ref, layout)
        return new_ref

    def opener(self, header: fmt.Header):
        """The cipher that opens a sealed object's frames, None for a plain one or a key not held."""
        return self._opened(Layout(header, [])).cipher

    def _opened(self, layout: Layout) -> Layout:
        """The layout with the cipher that opens its frames, where the object is sealed and its key held."""
        sealing_ = layout.header.sealing
        if sealing_ is None or self.keyring is None or layout.cipher is not None:
            return layout
        try:
            return dataclasses.replace(layout, cipher=self.keyring.cipher(*sealing_))
        except crypto.KeyUnavailable:
            return layout  # reads of its frames fail with KeyUnavailable

    async def quarantine(self, ref: ObjectRef) -> str | None:
        tier = self.tiers[ref.tier]
        return await self.io(ref.tier, tier.quarantine, ref.object_id, size=ref.stored_bytes)

    async def delete(self, ref: ObjectRef) -> None:
        self.release(ref.tier, ref.stored_bytes)
        self.forget_layout(ref)
        tier = self.tiers[ref.tier]
        await self.io(ref.tier, tier.delete, ref.object_id)

    async def load_layout(self, ref: ObjectRef) -> Layout:
        layout = self._layouts.get(ref)
        if layout is not None:
            self._layouts.move_to_end(ref)
            return layout
        tier = self.tiers[ref.tier]
        layout, read = await self.io(ref.tier, _read_layout, tier, ref)
        self.read_bytes[ref.tier] += read
        layout = self._opened(layout)
        self.keep_layout(ref, layout)
        return layout

    def keep_layout(self, ref: ObjectRef, layout: Layout | None) -> None:
        if layout is None or ref.key is not None or ref in self._layouts:
            return  # a published object's name can be published again by another node, with other bytes
        self._layouts[ref] = layout
        self._layout_frames += len(layout.frames)
        while self._layout_frames > LAYOUT_CACHE_FRAMES and len(self._layouts) > 1:
            _, old = self._layouts.popitem(last=False)
            self._layout_frames -= len(old.frames)

    def forget_layout(self, ref: ObjectRef) -> None:
        layout = self._layouts.pop(ref, None)
        if layout is not None:
            self._layout_frames -= len(layout.frames)

    async def read_payload(self, ref: ObjectRef, entry: fmt.FrameEntry) -> bytes:
        if entry.is_hole:
            return b""
        tier = self.tiers[ref.tier]
        self.read_bytes[ref.tier] += entry.stored_len
        return await self.io(ref.tier, tier.read, ref.object_id, entry.offset, entry.stored_len)

    async def read_frame(self, ref: ObjectRef, entry: fmt.FrameEntry, cipher=None) -> bytes:
        """Raw bytes of one frame, verified before and after decoding (CorruptObject otherwise). A sealed frame
        is opened with `cipher` (its layout's): crypto.KeyUnavailable without it."""
        if entry.is_hole:
            return bytes(entry.raw_len)
        if entry.is_sealed and cipher is None:
            raise crypto.KeyUnavailable(f"object {ref.object_id} is sealed with a key this mount does not hold")
        tier = self.tiers[ref.tier]
        if not tier.persistent:
            # a memory-backed tier reads at memory speed: one thread hop instead of two
            self.read_bytes[ref.tier] += entry.stored_len
            return await self.cpu(_read_and_decode, tier, ref.object_id, entry, cipher)
        payload = await self.read_payload(ref, entry)
        return await self.cpu(fmt.decode_frame, entry, payload, cipher)


def credit_for(tier: Tier, replacing: ObjectRef | None) -> int:
    """Room a commit may count on: the object it replaces in that tier is deleted right after."""
    return replacing.stored_bytes if replacing is not None and replacing.tier == tier.name else 0


def _read_layout(tier: Tier, ref: ObjectRef) -> tuple[Layout, int]:
    """An object's frame table and the bytes read for it, read and parsed in one worker-thread hop (parsing
    takes microseconds; each hop back to the trio thread costs milliseconds on a busy machine)."""
    head = tier.read(ref.object_id, 0, PROBE_BYTES)
    read = len(head)
    header = fmt.parse_header(head)
    if header.data_offset > len(head):
        head = tier.read(ref.object_id, 0, header.data_offset)
        read += len(head)
    if len(head) < header.data_offset:
        raise fmt.CorruptObject("object shorter than its frame table")
    return Layout(header, fmt.parse_table(header, memoryview(head)[header.size:], ref.stored_bytes)), read


def _copy_reading_table(dest: Tier, source: Tier, ref: ObjectRef, new_id: str) -> tuple[int, Layout | None]:
    """The move's copy (durable where dest is persistent), and the frame table parsed from the bytes it
    moved, in the same worker thread: None when they do not hold it whole or do not verify (the first read
    then loads the table itself and reports what is wrong)."""
    head = bytearray()
    size = dest.copy_from(source, ref.object_id, ref.stored_bytes, dest.persistent, new_id, head)
    try:
        header = fmt.parse_header(head)
        if header.data_offset > len(head):
            return size, None
        return size, Layout(header, fmt.parse_table(header, memoryview(head)[header.size:], size))
    except fmt.CorruptObject:
        return size, None


def _encode_build_put(tier: Tier, oid: str, header: fmt.Header, frames: list, durable: bool,
                      pending: tuple[int, memoryview] | None, encode: Callable | None,
                      frame_size: int, cipher=None) -> tuple[list[fmt.FrameEntry], int]:
    """(In a worker thread) encode the pending frame, if any, lay out the object (sealed with `cipher`) and
    write it. Returns its frame table and size."""
    if pending is not None:
        i, raw = pending
        frames[i] = encode(raw, i * frame_size)
    parts, entries = fmt.build_object(header, frames, cipher)
    size = sum(len(p) for p in parts)
    written = tier.put(oid, parts, durable)
    if written is not None and written != size:  # a tier that reports its size must have written it all
        raise OSError(errno.EIO, f"object {oid}: {written} bytes written, {size} laid out")
    return entries, size


def _read_and_decode(tier: Tier, oid: str, entry: fmt.FrameEntry, cipher=None) -> bytes | memoryview:
    """One frame of an object in a memory tier, read, verified and decoded. Where the codec kernel decodes
    the frame (entropy, zstd, stored raw), the whole of it — pread, both checksums, decode — runs in one C call
    without the GIL (kvfs_read_frames, as kvfs.direct does), into a fresh buffer that is never changed after.
    A sealed frame is opened in Python first."""
    path = tier.local_path(oid)
    if path is None or entry.is_hole or entry.is_sealed:
        return fmt.decode_frame(entry, tier.read(oid, entry.offset, entry.stored_len), cipher)
    tier.check_readable(oid)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        out = np.empty(entry.raw_len, dtype=np.uint8)
        table = np.frombuffer(fmt.FRAME_ENTRY.pack(*dataclasses.astuple(entry)), dtype=np.uint8)
        done = ctypes.c_int64()
        rc = kernel.lib.kvfs_read_frames(fd, table.ctypes.data, 1, out.ctypes.data, entry.raw_len,
                                         ctypes.byref(done))
        if rc == kernel.READ_OK:
            return memoryview(out)
        if rc == kernel.UNSUPPORTED:  # another codec or transform: decoded in Python
            return fmt.decode_frame(entry, _pread(fd, entry.offset, entry.stored_len))
        if rc == kernel.ERR_IO:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        if rc == kernel.ERR_NOMEM:
            raise MemoryError("no memory for a frame's payload")
        raise fmt.CorruptObject(_KERNEL_ERRORS.get(rc, f"frame read failed ({rc})"))
    finally:
        os.close(fd)


_KERNEL_ERRORS = {kernel.ERR_SHORT: "object shorter than its frame table says",
                  kernel.ERR_PAYLOAD: "frame payload checksum mismatch", kernel.ERR_DECODE: "frame does not decode",
                  kernel.ERR_RAW: "frame raw checksum mismatch"}


def _pread(fd: int, offset: int, length: int) -> bytes:
    data = os.pread(fd, length, offset)
    if len(data) != length:
        raise fmt.CorruptObject("object shorter than its frame table says")
    return data
