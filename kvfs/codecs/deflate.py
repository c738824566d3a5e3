"""Deflate in QATzip's gzip format, through ISA-L: the one on-disk format of codecs `deflate` and `qat`.

A frame's payload is a sequence of gzip members (RFC 1952). Each member carries the 'QZ' extra field that
Intel QATzip writes (its GZIP_EXT format), so QAT hardware can decode what ISA-L wrote and ISA-L (or Python's
gzip module) can decode what QAT wrote:

    1f 8b 08 04 | mtime 00000000 | xfl 04 | os ff | xlen 0c 00 | 'Q' 'Z' | 08 00 | src_sz u32 | dest_sz u32
    deflate data (dest_sz bytes) | crc32 of the member's input u32 | input size u32        (all little-endian)

ISA-L writes one member per 64 KiB of input, as QAT hardware does (its request size); QATzip's software
fallback writes one member per call. Readers accept any member sizes, and any standard gzip member.
"""

from __future__ import annotations

import struct

from isal import igzip, isal_zlib

from .base import CodecError

MEMBER_INPUT = 64 << 10  # bytes of input per member: QAT's hardware buffer size
LEVEL = 1  # ISA-L level 1: on byte planes of real bf16 KV it stores 0.699 at ~580 MB/s; levels 2-3 gain nothing
QZ_HEADER = struct.Struct("<BBBBIBBH2sHII")  # id1 id2 cm flg mtime xfl os xlen 'QZ' sublen src_sz dest_sz
TRAILER = struct.Struct("<II")  # crc32, isize
FLG_FEXTRA = 0x04
XFL_FASTEST = 0x04
OS_UNKNOWN = 0xFF


def member(data, body: bytes) -> list[bytes]:
    """The gzip member (header, body, trailer) for `data` deflated (raw) as `body`."""
    header = QZ_HEADER.pack(0x1F, 0x8B, 8, FLG_FEXTRA, 0, XFL_FASTEST, OS_UNKNOWN, 12, b"QZ", 8, len(data), len(body))
    return [header, body, TRAILER.pack(isal_zlib.crc32(data), len(data) & 0xFFFFFFFF)]


def compress_members(data: bytes | memoryview, level: int = LEVEL) -> bytes:
    view = memoryview(data)
    parts: list[bytes] = []
    for start in range(0, len(view), MEMBER_INPUT):
        chunk = view[start:start + MEMBER_INPUT]
        parts += member(chunk, isal_zlib.compress(chunk, level, -15))
    return b"".join(parts)


def decompress_members(data: bytes | memoryview, raw_len: int) -> bytes:
    """Every member, CRC and size checked (ISA-L); CodecError if anything is off or the size differs."""
    try:
        out = igzip.decompress(bytes(data))
    except (OSError, EOFError, ValueError, isal_zlib.error) as e:
        raise CodecError(f"deflate: {e}") from e
    if len(out) != raw_len:
        raise CodecError(f"deflate: {len(out)} bytes decoded, {raw_len} expected")
    return out


class DeflateCodec:
    id = 2
    name = "deflate"

    def compress(self, data):
        return compress_members(data)

    def encoder(self):
        return self

    def decompress(self, data, raw_len):
        return decompress_members(data, raw_len)
