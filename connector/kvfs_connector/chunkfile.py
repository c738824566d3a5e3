"""The chunk file: one chunk of tokens' KV, all layers of one worker, behind a small self-checking header.

    file    := header (HEADER_SIZE bytes, zero-padded) | payload
    header  := FIXED | descriptor (JSON, utf-8) | xxh3-64 of FIXED+descriptor | zero padding
    payload := for layer in layers: for kv in (K, V): [heads][channels][tokens] elements (channel-major)

The header is padded to 4 KiB so the payload starts page- and element-aligned. What is checked on load, before
any byte reaches the paged cache: magic, version, header checksum, that the layout descriptor equals the
loader's own (same model geometry and byte order), that the token digest equals the digest of the request's
tokens up to the end of this chunk (a hash collision or a seed mix-up is a miss), and the payload's xxh3-64
(except for lossy chunks, whose values kvfs changes on purpose and checks frame by frame).
The byte-level spec is docs/connector.md. Pure functions: no torch, no vLLM.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from collections.abc import Sequence

import numpy as np
import xxhash
from kvfs import format as kvfs_format  # xxh3 of large buffers without the GIL

MAGIC = b"KVFSCHK\x00"
VERSION = 1
HEADER_SIZE = 4096
# magic, version, header_size, flags, first_token, n_tokens, token_digest(16), layout_digest(16),
# payload_size, payload_xxh3, descriptor_len
FIXED = struct.Struct("<8sHHIII16s16sQQH")
CHECKSUM = struct.Struct("<Q")


class ChunkMismatch(Exception):
    """The file is not the KV this request asked for (other tokens, other layout, damaged): a miss."""


def token_digest(token_ids: Sequence[int] | np.ndarray) -> bytes:
    """xxh3-128 of the token ids as little-endian uint32, from token 0 to the end of the chunk.

    Covering the whole prefix (not only the chunk's own tokens) makes a chained-hash collision a miss too."""
    arr = np.asarray(token_ids, dtype=np.int64)
    if arr.size and (arr.min() < 0 or arr.max() >= 1 << 32):
        raise ValueError("token ids must fit in uint32")
    return xxhash.xxh3_128_digest(arr.astype("<u4").tobytes())


def layout_digest(descriptor: dict) -> bytes:
    return xxhash.xxh3_128_digest(canonical_json(descriptor))


def canonical_json(obj: dict) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


@dataclasses.dataclass(frozen=True)
class ChunkHeader:
    first_token: int
    n_tokens: int
    token_digest: bytes
    descriptor: dict  # the layout: model geometry, dtype, byte order (see layout.py)
    payload_size: int
    payload_xxh3: int
    flags: int = 0

    def pack(self) -> bytes:
        desc = canonical_json(self.descriptor)
        fixed = FIXED.pack(MAGIC, VERSION, HEADER_SIZE, self.flags, self.first_token, self.n_tokens,
                           self.token_digest, layout_digest(self.descriptor), self.payload_size,
                           self.payload_xxh3, len(desc))
        body = fixed + desc
        out = body + CHECKSUM.pack(xxhash.xxh3_64_intdigest(body))
        if len(out) > HEADER_SIZE:
            raise ValueError(f"chunk header too large ({len(out)} > {HEADER_SIZE})")
        return out + bytes(HEADER_SIZE - len(out))


def parse_header(buf: bytes | memoryview) -> ChunkHeader:
    buf = memoryview(buf)
    if len(buf) < HEADER_SIZE:
        raise ChunkMismatch(f"short file ({len(buf)} bytes)")
    (magic, version, header_size, flags, first_token, n_tokens, tok, lay, payload_size, payload_xxh3,
     desc_len) = FIXED.unpack_from(buf)
    if magic != MAGIC:
        raise ChunkMismatch("not a kvfs chunk file (bad magic)")
    if version != VERSION or header_size != HEADER_SIZE:
        raise ChunkMismatch(f"unsupported chunk version {version} / header size {header_size}")
    body_end = FIXED.size + desc_len
    if body_end + CHECKSUM.size > HEADER_SIZE:
        raise ChunkMismatch("descriptor length out of range")
    (stored,) = CHECKSUM.unpack_from(buf, body_end)
    if xxhash.xxh3_64_intdigest(buf[:body_end]) != stored:
        raise ChunkMismatch("header checksum mismatch")
    try:
        descriptor = json.loads(bytes(buf[FIXED.size:body_end]))
    except ValueError as e:
        raise ChunkMismatch(f"bad descriptor: {e}") from None
    if layout_digest(descriptor) != lay:
        raise ChunkMismatch("layout digest mismatch")
    return ChunkHeader(first_token, n_tokens, tok, descriptor, payload_size, payload_xxh3, flags)


def build(first_token: int, n_tokens: int, tokens_digest: bytes, descriptor: dict, payload) -> list:
    """The parts of a chunk file (header bytes, payload buffer), ready for writing.

    tokens_digest is token_digest() of the token ids from 0 to the end of the chunk."""
    payload = memoryview(payload).cast("B")
    header = ChunkHeader(first_token, n_tokens, tokens_digest, descriptor, len(payload), kvfs_format.xxh3(payload))
    return [header.pack(), payload]


def verify(buf: bytes | bytearray | memoryview, *, first_token: int, n_tokens: int, expected_tokens: bytes,
           descriptor: dict, payload_verified: bool = False) -> memoryview:
    """Check a whole chunk file read into `buf`; return its payload. Raises ChunkMismatch.

    payload_verified: the bytes were checked already, every one against a checksum taken when they were
    written (kvfs.direct verifies every frame of the object it decodes): the payload is not hashed again."""
    buf = memoryview(buf)
    h = parse_header(buf)
    if h.descriptor != descriptor:
        raise ChunkMismatch("layout differs from this engine's")
    if (h.first_token, h.n_tokens) != (first_token, n_tokens):
        raise ChunkMismatch(f"chunk covers tokens {h.first_token}+{h.n_tokens}, expected {first_token}+{n_tokens}")
    if h.token_digest != expected_tokens:
        raise ChunkMismatch("token digest mismatch (hash collision or a different hash seed)")
    payload = buf[HEADER_SIZE:]
    if len(payload) != h.payload_size:
        raise ChunkMismatch(f"payload is {len(payload)} bytes, header says {h.payload_size}")
    # A lossy chunk reads back as other values than were written; kvfs checks every frame of what it returns.
    if not descriptor.get("lossy") and not payload_verified and kvfs_format.xxh3(payload) != h.payload_xxh3:
        raise ChunkMismatch("payload checksum mismatch")
    return payload
