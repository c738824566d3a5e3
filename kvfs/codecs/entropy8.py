"""Codec 5, `entropy8`: lossless coding of 1-byte floats (fp8 E4M3 and E5M2 KV caches), in C (_entropy8.c).

Each byte is a sign and a 7-bit magnitude (exponent and mantissa as one symbol). The magnitudes form blocks of
64; each block's class is its rounded mean magnitude, and the magnitudes of each class are Huffman-coded
together by zstd's huff0 (vendored in huf0/), with one table per class: in channel-major KV (the connector's
chunks) a block is one channel's run of tokens, which share a magnitude. The signs are packed 8 per byte and
huff0-coded, as they are or XOR-ed with the sign before (whichever is smaller). Payload format:
docs/format.md, "codec 5". The kernel is loaded with ctypes, which releases the GIL.
"""

from __future__ import annotations

import numpy as np

from . import kernel
from .entropy import kernel_decode_into, kernel_encode

# beyond the input: the 16-byte header and, per 128 KiB piece of each of at most 66 sections, a 4-byte piece
# header; a payload that does not fit in raw + OVERHEAD is not smaller than raw and the frame is stored raw
OVERHEAD = 16 + 4 * 66 + 4 * 16  # (the raw low-bit planes are counted in n: at most 3/8 of it)

_lib = kernel.lib
ERRORS = {-1: "output larger than its capacity", -2: "malformed payload", -3: "Huffman data does not match its sizes",
          -4: "bad arguments", -5: "out of memory"}


def encode(data, low_bits: int = -1) -> bytes | None:
    """The payload, or None when it would not be smaller than the input (the caller stores raw). `low_bits`
    -1 is what kvfs writes; 0-3 force that many magnitude bits stored raw, for comparisons."""
    if not memoryview(data).nbytes:
        return None
    return kernel_encode("entropy8", ERRORS, data, OVERHEAD,
                         lambda src, n, dst, cap: _lib.kf8_encode_k(src, n, dst, cap, low_bits))


def decode(payload, raw_len: int) -> memoryview:
    """The decoded frame in a new buffer (the kernel writes every byte)."""
    out = np.empty(raw_len, dtype=np.uint8)
    decode_into(payload, out)
    return memoryview(out)


def decode_into(payload, out) -> None:
    """Decode into a writable buffer of exactly the raw length. CodecError on any inconsistency."""
    kernel_decode_into("entropy8", ERRORS, payload, out, _lib.kf8_decode)


class Entropy8Codec:
    id = 5
    name = "entropy8"

    def encoder(self) -> "Entropy8Codec":
        return self

    def compress(self, data) -> bytes:
        """The payload; the input itself when coding would not shrink it (format.encode_frame then stores
        the frame raw)."""
        payload = encode(data)
        return bytes(data) if payload is None else payload

    def decompress(self, data, raw_len: int) -> memoryview:
        return decode(data, raw_len)

    def decompress_into(self, data, out) -> None:
        decode_into(data, out)
