"""The kvfs object format: header, frame table, independently compressed frames.

Pure functions, no I/O. The byte-level specification is docs/format.md; keep the two in step.

    object := header | frame table | frame payloads
    header := fixed part (HEADER_FIXED) | extension TLVs (ext_len bytes) | xxh3-64 of all before it
    table  := n_frames × FRAME_ENTRY | xxh3-64 of the entries
"""

from __future__ import annotations

import dataclasses
import re
import struct
from collections.abc import Sequence

import numpy as np
import xxhash

from . import codecs
from .codecs import entropy, transforms

MAGIC = b"KVFSOBJ\x00"
VERSION = 1
MAX_FILE_SIZE = 64 << 30  # EFBIG beyond; bounds the frame table of a sparse file

# magic, version, header_size, flags, raw_size, frame_size, n_frames, transform, element_size,
# codec, dtype, lossy_mode, lossy_param, ext_len, reserved
HEADER_FIXED = struct.Struct("<8sHHIQIIBBBBBBH18s")
# offset, stored_len, raw_len, codec, transform, flags, stored_xxh3, raw_xxh3
FRAME_ENTRY = struct.Struct("<QIIBBHQQ")
CHECKSUM = struct.Struct("<Q")

FRAME_HOLE = 0x1  # no payload: raw_len zero bytes
FRAME_SEALED = 0x2  # the payload is sealed (AES-256-GCM, kvfs/crypto.py): the header's EXT_SEALED names the key
FRAME_FLAGS = FRAME_HOLE | FRAME_SEALED  # a reader refuses a frame with any other flag
LOSSY_MODES = (0, 1, 2)  # lossless, mantissa rounding, fp8 (kvfs/lossy.py)

DTYPES = {"unknown": 0, "bf16": 1, "fp16": 2, "fp32": 3, "fp8_e4m3": 4, "fp8_e5m2": 5, "int8": 6}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
DTYPE_ELEMENT_SIZE = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8_e4m3": 1, "fp8_e5m2": 1, "int8": 1}


EXT_SHAPE = 1  # shape hint: ASCII "offset=N name=n name=n ..." (outermost dimension first)
EXT_SEALED = 4  # u8 algorithm (1: AES-256-GCM, HKDF-SHA256 working key) | 8-byte key id | 16-byte object nonce
SEALED_EXT = struct.Struct("<B8s16s")
SHAPE_HINT = re.compile(rb"offset=\d{1,12}( [a-z][a-z_]{0,15}=\d{1,9}){1,8}")


def parse_shape_hint(value: bytes) -> tuple[int, list[tuple[str, int]]]:
    """Validate a shape hint; returns (payload offset, [(dimension, size), ...]). Raises ValueError."""
    value = bytes(value).strip()
    if not SHAPE_HINT.fullmatch(value):
        raise ValueError("shape hint must look like 'offset=4096 layer=30 kv=2 head=3 channel=64 token=256'")
    first, *dims = value.decode().split(" ")
    parsed = [(name, int(n)) for name, n in (d.split("=") for d in dims)]
    if any(n == 0 for _, n in parsed) or len({name for name, _ in parsed}) != len(parsed):
        raise ValueError("shape hint dimensions must be positive and distinct")
    return int(first.split("=")[1]), parsed


def tlv(tag: int, value: bytes) -> bytes:
    return struct.pack("<HH", tag, len(value)) + value


def parse_tlvs(ext: bytes) -> dict[int, bytes]:
    """Extension TLVs of a header (unknown tags included; the caller ignores what it does not know)."""
    out, i = {}, 0
    while i + 4 <= len(ext):
        tag, length = struct.unpack_from("<HH", ext, i)
        out[tag] = bytes(ext[i + 4:i + 4 + length])
        i += 4 + length
    return out


class CorruptObject(Exception):
    """An object failed a structural or checksum test; its bytes must never be served."""


GIL_FREE_HASH_MIN = 64 << 10  # below it, python-xxhash's call is cheaper than a ctypes call


def xxh3(data) -> int:
    """XXH3-64, seed 0. Large buffers are hashed by the codec kernel's xxHash through ctypes, without the
    GIL: readers that verify megabytes in parallel threads (kvfs.direct, the connector) then hash in parallel."""
    if len(memoryview(data).cast("B")) >= GIL_FREE_HASH_MIN:
        return entropy.xxh3_64(data)
    return xxhash.xxh3_64_intdigest(data)


@dataclasses.dataclass(frozen=True)
class Header:
    raw_size: int
    frame_size: int
    n_frames: int
    transform: int = transforms.IDENTITY
    element_size: int = 1
    codec: int = 0
    dtype: int = 0
    lossy_mode: int = 0  # 0 = lossless, 1 = mantissa rounding, 2 = fp8 (kvfs/lossy.py)
    lossy_param: int = 0
    flags: int = 0
    extensions: bytes = b""  # TLVs: u16 tag, u16 length, value; unknown tags are skipped by readers

    @property
    def size(self) -> int:
        return HEADER_FIXED.size + len(self.extensions) + CHECKSUM.size

    @property
    def table_size(self) -> int:
        return self.n_frames * FRAME_ENTRY.size + CHECKSUM.size

    @property
    def data_offset(self) -> int:
        return self.size + self.table_size

    @property
    def sealing(self) -> tuple[bytes, bytes] | None:
        """(key id, object nonce) of a sealed object's frames, or None (a plain object)."""
        value = parse_tlvs(self.extensions).get(EXT_SEALED)
        if value is None:
            return None
        if len(value) != SEALED_EXT.size or value[0] != 1:
            raise CorruptObject("unknown sealing algorithm")
        _, key_id, nonce = SEALED_EXT.unpack(value)
        return key_id, nonce

    def sealed_with(self, key_id: bytes, nonce: bytes) -> "Header":
        """This header for a sealed object (any earlier sealing extension replaced)."""
        plain = self.unsealed()
        sealing = tlv(EXT_SEALED, SEALED_EXT.pack(1, key_id, nonce))
        return dataclasses.replace(plain, extensions=plain.extensions + sealing)

    def unsealed(self) -> "Header":
        kept = b"".join(tlv(t, v) for t, v in parse_tlvs(self.extensions).items() if t != EXT_SEALED)
        return dataclasses.replace(self, extensions=kept)


@dataclasses.dataclass(frozen=True)
class FrameEntry:
    offset: int
    stored_len: int
    raw_len: int
    codec: int
    transform: int
    flags: int
    stored_xxh3: int
    raw_xxh3: int

    @property
    def is_hole(self) -> bool:
        return bool(self.flags & FRAME_HOLE)

    @property
    def is_sealed(self) -> bool:
        return bool(self.flags & FRAME_SEALED)

    def sealing_aad(self) -> bytes:
        """What a sealed payload's authentication binds it to: its place, sizes, codec and transform."""
        return FRAME_ENTRY.pack(self.offset, self.stored_len, self.raw_len, self.codec, self.transform,
                                self.flags, 0, 0)


@dataclasses.dataclass(frozen=True)
class Fp8Params:
    """How a lossy FP8 frame is formed (kvfs/lossy.py): the file's dtype, values per scale, exact leading bytes."""

    dtype: str
    group: int
    skip: int = 0


@dataclasses.dataclass(frozen=True)
class EncodedFrame:
    """A frame ready to be placed in an object (offset assigned when the object is laid out)."""

    payload: bytes
    raw_len: int
    codec: int
    transform: int
    flags: int
    stored_xxh3: int
    raw_xxh3: int

    @classmethod
    def hole(cls, raw_len: int) -> "EncodedFrame":
        return cls(b"", raw_len, 0, transforms.IDENTITY, FRAME_HOLE, 0, 0)

    @classmethod
    def from_entry(cls, entry: FrameEntry, payload: bytes) -> "EncodedFrame":
        return cls(payload, entry.raw_len, entry.codec, entry.transform, entry.flags,
                   entry.stored_xxh3, entry.raw_xxh3)

    @property
    def is_hole(self) -> bool:
        return bool(self.flags & FRAME_HOLE)

    def entry_at(self, offset: int) -> FrameEntry:
        """This frame's table entry with its payload at `offset` of the object."""
        return FrameEntry(offset, len(self.payload), self.raw_len, self.codec, self.transform, self.flags,
                          self.stored_xxh3, self.raw_xxh3)


def encode_frame(raw, codec: codecs.Codec, transform: int, fp8: "Fp8Params | None" = None) -> EncodedFrame:
    """Compress one frame; all-zero frames become holes, incompressible ones are stored raw (and then
    exactly: a lossy frame that would not shrink keeps its original bytes). With fp8, the frame is stored in
    the lossy FP8E4M3 form, and its raw checksum covers what reads will return."""
    raw_len = len(raw)
    if raw_len == 0 or not np.frombuffer(raw, dtype=np.uint8).any():
        return EncodedFrame.hole(raw_len)
    if fp8 is not None:
        from . import lossy
        stored = lossy.fp8_encode(raw, fp8.dtype, fp8.group, fp8.skip)
        payload = codec.compress(stored)
        if len(payload) < raw_len:
            return EncodedFrame(payload, raw_len, codec.id, transforms.FP8E4M3, 0, xxh3(payload),
                                xxh3(lossy.fp8_decode(stored, raw_len)))
        transform = transforms.IDENTITY
    raw_hash = xxh3(raw)
    if codec.id != codecs.NoneCodec.id:
        payload = codec.compress(transforms.apply(transform, raw))
        if len(payload) < raw_len:
            return EncodedFrame(payload, raw_len, codec.id, transform, 0, xxh3(payload), raw_hash)
    payload = bytes(raw)
    return EncodedFrame(payload, raw_len, codecs.NoneCodec.id, transforms.IDENTITY, 0, raw_hash, raw_hash)


def decode_frame(entry: FrameEntry, payload: bytes | memoryview, cipher=None) -> bytes:
    """Verify, decompress, invert the transform, verify again. Raises CorruptObject. A sealed frame is opened
    with `cipher` (its object's working cipher, kvfs/crypto.py) first."""
    if entry.is_hole:
        return bytes(entry.raw_len)
    if entry.is_sealed:
        entry, payload = open_sealed(entry, payload, cipher)
    else:
        check_payload(entry, payload)
    try:
        data = transforms.invert(entry.transform, codecs.by_id(entry.codec).decompress(payload, entry.raw_len),
                                 entry.raw_len)
    except (codecs.CodecError, ValueError) as e:  # unreachable unless xxh3 collides; still never data
        raise CorruptObject(f"frame does not decode: {e}") from e
    _check_raw(entry, data)
    return data


def open_sealed(entry: FrameEntry, payload, cipher) -> tuple[FrameEntry, bytes]:
    """A sealed frame's plain entry and payload (its stored checksum then stands for the authentication)."""
    from . import crypto

    check_payload(entry, payload)
    if cipher is None:
        raise crypto.KeyUnavailable("a sealed frame, and no key to open it")
    try:
        raw_xxh3, plain = crypto.unseal(cipher, entry.offset, entry.sealing_aad(), payload)
    except ValueError as e:
        raise CorruptObject(str(e)) from None
    return plain_entry(entry, plain, raw_xxh3), plain


def plain_entry(sealed: FrameEntry, plain: bytes, raw_xxh3: int) -> FrameEntry:
    return FrameEntry(sealed.offset, len(plain), sealed.raw_len, sealed.codec, sealed.transform,
                      sealed.flags & ~FRAME_SEALED, xxh3(plain), raw_xxh3)


def check_payload(entry: FrameEntry, payload) -> None:
    """Before any decoder sees the bytes."""
    if len(payload) != entry.stored_len or xxh3(payload) != entry.stored_xxh3:
        raise CorruptObject("frame payload checksum mismatch")


def _check_raw(entry: FrameEntry, data) -> None:
    if len(data) != entry.raw_len or xxh3(data) != entry.raw_xxh3:
        raise CorruptObject("frame raw checksum mismatch")


def decode_frame_into(entry: FrameEntry, payload: bytes | memoryview, dest: memoryview, cipher=None) -> None:
    """decode_frame into dest (exactly raw_len bytes), with no intermediate buffer where the codec can decode
    in place (entropy). On CorruptObject, dest holds garbage: the caller must not use it."""
    codec = None if entry.is_hole else codecs.REGISTRY.get(entry.codec)
    into = getattr(codec, "decompress_into", None)
    if entry.is_sealed and not entry.is_hole:
        entry, payload = open_sealed(entry, payload, cipher)
    if into is None or entry.transform != transforms.IDENTITY or len(dest) != entry.raw_len:
        dest[:] = memoryview(decode_frame(entry, payload)).cast("B")
        return
    check_payload(entry, payload)
    try:
        into(payload, dest)
    except (codecs.CodecError, ValueError) as e:
        raise CorruptObject(f"frame does not decode: {e}") from e
    _check_raw(entry, dest)


def pack_header(h: Header) -> bytes:
    fixed = HEADER_FIXED.pack(MAGIC, VERSION, h.size, h.flags, h.raw_size, h.frame_size, h.n_frames,
                              h.transform, h.element_size, h.codec, h.dtype, h.lossy_mode, h.lossy_param,
                              len(h.extensions), b"")
    body = fixed + h.extensions
    return body + CHECKSUM.pack(xxh3(body))


def build_object(header: Header, frames: Sequence[EncodedFrame], cipher=None) -> tuple[list[bytes], list[FrameEntry]]:
    """Lay out an object: [header+table, payload, …] ready to be written in order, and its frame table. With
    `cipher` (the working cipher of the header's EXT_SEALED), every payload is sealed in place."""
    if len(frames) != header.n_frames:
        raise ValueError("frame count does not match header")
    if (cipher is None) != (header.sealing is None):
        raise ValueError("a sealed object needs its cipher, and only it")
    if cipher is not None:
        frames = seal_frames(header, frames, cipher)
    entries = []
    offset = header.data_offset
    for f in frames:
        entries.append(f.entry_at(offset))
        offset += len(f.payload)
    return [pack_head(header, entries), *(f.payload for f in frames if f.payload)], entries


def pack_head(header: Header, entries: Sequence[FrameEntry]) -> bytes:
    """Header and frame table: the bytes before an object's first payload."""
    table = b"".join(FRAME_ENTRY.pack(*dataclasses.astuple(e)) for e in entries)
    return pack_header(header) + table + CHECKSUM.pack(xxh3(table))


def seal_frames(header: Header, frames: Sequence[EncodedFrame], cipher) -> list[EncodedFrame]:
    """The frames of a plain layout sealed for their places in the sealed object of `header`."""
    out = []
    offset = header.data_offset
    for f in frames:
        out.append(seal_frame(f, offset, cipher))
        offset += len(out[-1].payload)
    return out


def seal_frame(f: EncodedFrame, offset: int, cipher) -> EncodedFrame:
    """One plain frame sealed for payload offset `offset` of its sealed object (holes stay holes)."""
    from . import crypto

    if f.is_hole:
        return f
    if f.flags & FRAME_SEALED:
        raise ValueError("frame sealed already")
    flags = f.flags | FRAME_SEALED
    size = len(f.payload) + crypto.SEAL_OVERHEAD
    aad = FrameEntry(offset, size, f.raw_len, f.codec, f.transform, flags, 0, 0).sealing_aad()
    sealed = crypto.seal(cipher, offset, aad, f.raw_xxh3, f.payload)
    return EncodedFrame(sealed, f.raw_len, f.codec, f.transform, flags, xxh3(sealed), 0)


def parse_header(buf: bytes | memoryview) -> Header:
    """Parse and verify the header at the start of buf (which must hold at least the whole header)."""
    if len(buf) < HEADER_FIXED.size + CHECKSUM.size:
        raise CorruptObject("object shorter than a header")
    (magic, version, header_size, flags, raw_size, frame_size, n_frames, transform, element_size, codec,
     dtype, lossy_mode, lossy_param, ext_len, _reserved) = HEADER_FIXED.unpack_from(buf)
    if magic != MAGIC:
        raise CorruptObject("bad magic")
    if header_size != HEADER_FIXED.size + ext_len + CHECKSUM.size or len(buf) < header_size:
        raise CorruptObject("bad header size")
    body_end = header_size - CHECKSUM.size
    if CHECKSUM.unpack_from(buf, body_end)[0] != xxh3(buf[:body_end]):
        raise CorruptObject("header checksum mismatch")
    if version != VERSION:
        raise CorruptObject(f"unsupported object version {version}")
    if lossy_mode not in LOSSY_MODES:
        raise CorruptObject(f"unknown lossy mode {lossy_mode}")  # its values could not be interpreted
    if frame_size == 0 or raw_size > MAX_FILE_SIZE or n_frames != -(-raw_size // frame_size):
        raise CorruptObject("inconsistent sizes in header")
    ext = bytes(buf[HEADER_FIXED.size:body_end])
    return Header(raw_size, frame_size, n_frames, transform, element_size, codec, dtype, lossy_mode,
                  lossy_param, flags, ext)


def parse_table(header: Header, buf: bytes | memoryview, object_size: int) -> list[FrameEntry]:
    """Parse and verify the frame table; buf starts right after the header."""
    n = header.n_frames
    body_len = n * FRAME_ENTRY.size
    if len(buf) < body_len + CHECKSUM.size:
        raise CorruptObject("truncated frame table")
    if CHECKSUM.unpack_from(buf, body_len)[0] != xxh3(buf[:body_len]):
        raise CorruptObject("frame table checksum mismatch")
    entries = []
    for i, fields in enumerate(FRAME_ENTRY.iter_unpack(buf[:body_len])):
        e = FrameEntry(*fields)
        expected_raw = min(header.frame_size, header.raw_size - i * header.frame_size)
        if e.raw_len != expected_raw or e.offset + e.stored_len > object_size:
            raise CorruptObject(f"frame {i} entry out of bounds")
        if e.flags & ~FRAME_FLAGS or (e.flags & FRAME_SEALED and header.sealing is None):
            raise CorruptObject(f"frame {i}: flags {e.flags:#x} unknown or without their key")
        entries.append(e)
    return entries
