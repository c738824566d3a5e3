"""Which objects are sealed where, and the copies that seal or open them on the way between tiers.

A tier listed in `[encryption] tiers` holds only sealed objects (docs/format.md, "Sealed frames"): an object
is sealed when it is built for such a tier, or when a move copies it into one. A move into a tier that is not
listed opens it again (so direct reads and the codec kernel's fast path serve it there), when the key is
held; otherwise it stays sealed, and reads it cannot open are misses.

A sealing copy is streamed: the copy's frame table comes first, and it holds every sealed payload's checksum,
so the payloads are sealed once to fill the table, and again while written. Objects up to KEEP_LIMIT keep
the first pass's bytes instead (GCM with the same key and nonce gives the same bytes: the second pass is
checked against the first).
"""

from __future__ import annotations

import dataclasses
import errno
from collections.abc import Iterable, Iterator, Sequence

from . import crypto
from . import format as fmt
from .tiers import Tier

KEEP_LIMIT = 64 << 20


class Layout:  # what the copy needs of kvfs.store.Layout (not imported: the store imports this module)
    header: fmt.Header
    frames: list[fmt.FrameEntry]


@dataclasses.dataclass(frozen=True)
class Transcode:
    """A copy that seals (`cipher_out`) or opens (`cipher_in`) every payload of `source`."""

    source: Layout
    header: fmt.Header  # the copy's
    cipher_in: object | None
    cipher_out: object | None

    @property
    def size(self) -> int:
        delta = crypto.SEAL_OVERHEAD if self.cipher_out is not None else -crypto.SEAL_OVERHEAD
        return self.header.data_offset + sum(e.stored_len + delta for e in self.source.frames if not e.is_hole)

    def body(self, body: bytes) -> bytes:
        """The transcoded copy of an object held in memory (a publish uploads one body): a method, so that the
        tiers that take a Transcode need not import this module (which imports them)."""
        return transcode_body(self, body)


class Tenants:
    """Tenant directories with keys of their own ([encryption] tenant keys): a file below one is sealed with
    its key in every tier, so that deleting the key shreds the tenant's files everywhere, and no one else's."""

    def __init__(self, directories: Iterable[str]) -> None:
        self.prefixes = sorted((tuple(d.encode().split(b"/")) for d in directories), key=len, reverse=True)

    def of_path(self, parts: Sequence[bytes]) -> str | None:
        for prefix in self.prefixes:  # the deepest tenant directory holding the path
            if tuple(parts[:len(prefix)]) == prefix:
                return b"/".join(prefix).decode()
        return None

    def of_inode(self, index, ino: int) -> str | None:
        """The tenant of a file or directory by any of its names (one that is a tenant's decides); None for none,
        or for a file with no name left (unlinked, still open)."""
        if not self.prefixes:
            return None
        for parent, name in index.names_of(ino):
            parent_parts = index.path_of(parent)
            if parent_parts is not None and (tenant := self.of_path([*parent_parts, name])) is not None:
                return tenant
        return None


def plan(layout: Layout, dest: Tier, ring: crypto.KeyRing | None, tenant: str | None = None) -> Transcode | None:
    """How a copy of the object into `dest` must change it; None: copied as it is. A tenant's file is sealed
    with the tenant's key wherever it goes (and never opened on the way)."""
    sealing = layout.header.sealing
    tenant_key = ring.tenant_key(tenant) if ring is not None else None
    if tenant_key is not None:
        return _seal_plan(layout, ring, tenant_key) if sealing is None else None
    if getattr(dest, "sealed", False) and sealing is None:
        if ring is None or ring.current is None:
            raise OSError(errno.EIO, f"{dest.name} holds sealed objects only, and no key is loaded")
        return _seal_plan(layout, ring, ring.current)
    if not getattr(dest, "sealed", False) and sealing is not None and ring is not None:
        if sealing[0] in {k.key_id for k in ring.tenants.values()}:
            return None  # a tenant's object (moved out of its directory?) stays sealed with its key
        try:
            cipher = ring.cipher(*sealing)
        except crypto.KeyUnavailable:
            return None  # copied sealed: still unreadable here, and no less safe
        return Transcode(layout, layout.header.unsealed(), cipher, None)
    return None


def _seal_plan(layout: Layout, ring: crypto.KeyRing, key: crypto.Key) -> Transcode:
    header, cipher = ring.sealed_header(layout.header, key)
    return Transcode(layout, header, None, cipher)


def copy(t: Transcode, source: Tier, object_id: str, dest: Tier, new_id: str,
         durable: bool) -> list[fmt.FrameEntry]:
    """(In a worker thread) write the transcoded copy of `object_id` into `dest` as `new_id`; its frame table
    (its header is t.header)."""
    entries, kept = _first_pass(t, source, object_id)
    written = dest.put(new_id, _second_pass(t, source, object_id, entries, kept), durable)
    if written is not None and written != t.size:
        raise OSError(errno.EIO, f"object {new_id}: {written} bytes written, {t.size} laid out")
    return entries


def transcode_body(t: Transcode, body: bytes) -> bytes:
    """The transcoded copy of an object held in memory (a publish uploads one body)."""
    view = memoryview(body)
    frames = [_plain_frame(t, e, view[e.offset:e.offset + e.stored_len]) for e in t.source.frames]
    return b"".join(fmt.build_object(t.header, frames, t.cipher_out)[0])


def _first_pass(t: Transcode, source: Tier, object_id: str) -> tuple[list[fmt.FrameEntry], list[bytes] | None]:
    """The copy's frame table, and its payloads while they stay within KEEP_LIMIT (else None)."""
    entries: list[fmt.FrameEntry] = []
    kept: list[bytes] | None = []
    offset = t.header.data_offset
    for e in t.source.frames:
        f = _frame_out(t, e, _payload(source, object_id, e), offset)
        entries.append(f.entry_at(offset))
        offset += len(f.payload)
        if kept is not None and offset - t.header.data_offset <= KEEP_LIMIT:
            kept.append(f.payload)
        else:
            kept = None
    return entries, kept


def _second_pass(t: Transcode, source: Tier, object_id: str, entries: list[fmt.FrameEntry],
                 kept: list[bytes] | None) -> Iterator[bytes]:
    yield fmt.pack_head(t.header, entries)
    if kept is not None:
        yield from (p for p in kept if p)
        return
    for e, out in zip(t.source.frames, entries):
        if e.is_hole:
            continue
        f = _frame_out(t, e, _payload(source, object_id, e), out.offset)
        if f.stored_xxh3 != out.stored_xxh3 or len(f.payload) != out.stored_len:
            raise fmt.CorruptObject(f"object {object_id} changed while it was copied")
        yield f.payload


def _frame_out(t: Transcode, e: fmt.FrameEntry, payload, offset: int) -> fmt.EncodedFrame:
    """Frame `e` of the source as the copy holds it, for payload offset `offset` of the copy."""
    plain = _plain_frame(t, e, payload)
    return plain if t.cipher_out is None else fmt.seal_frame(plain, offset, t.cipher_out)


def _plain_frame(t: Transcode, e: fmt.FrameEntry, payload) -> fmt.EncodedFrame:
    """Frame `e` of the source, verified and opened (when sealed): ready to be laid out or sealed again."""
    if e.is_hole:
        return fmt.EncodedFrame.hole(e.raw_len)
    if t.cipher_in is not None:
        plain_entry, plain = fmt.open_sealed(e, payload, t.cipher_in)
        return fmt.EncodedFrame.from_entry(plain_entry, plain)
    fmt.check_payload(e, payload)  # before sealing: sealed, bad bytes would pass for good ones
    return fmt.EncodedFrame.from_entry(e, bytes(payload))


def _payload(source: Tier, object_id: str, e: fmt.FrameEntry) -> bytes:
    if e.is_hole:
        return b""
    data = source.read(object_id, e.offset, e.stored_len)
    if len(data) != e.stored_len:
        raise fmt.CorruptObject(f"object {object_id} shorter than its frame table says")
    return data
