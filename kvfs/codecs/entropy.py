"""Codec 4, `entropy`: Huffman coding of 16-bit floats (bf16, fp16) by exponent class, in C.

Frames of 64 KiB and more (version 3, _classes.c): the elements form blocks of 64, each block's class is
its mean exponent, and the exponents of each class are coded together by zstd's huff0 (vendored in
huf0/), as is the plane of signs; the 7 low bits (9 for fp16: its exponent byte holds 3 mantissa bits)
are stored as they are. Smaller frames (versions 1-2, _entropy.c): each exponent is coded with a table
chosen by the running mean of the channel's previous exponents (stride d apart) and, for stride 1, the
signs four at a time. Payload format: docs/format.md, "codec 4". The kernel (_entropy.c, _classes.c,
huf0) is loaded with ctypes, which releases the GIL.
"""

from __future__ import annotations

import threading

import numpy as np

from . import kernel
from .base import CodecError

WINDOW_LOG = 4  # K = 16 previous exponents (16 vs 8 saves 0.01 bits/element on real KV; 32 gains nothing)
MAX_STRIDE = 4096
OVERHEAD = 16 + 8 * 8 + 64 * 130 + 72 + 16  # v2: fixed header, stream sizes, tables, sign tables, padding
# (version 3 needs at most 16 + 4 per 128 KiB piece of each of its 66 sections beyond the raw planes; a
# payload that does not fit in raw + OVERHEAD is larger than raw anyway and the frame is stored raw)


_lib = kernel.lib
ERRORS = {-1: "output larger than its capacity", -2: "malformed payload header or tables",
          -3: "bitstream does not match its sizes", -4: "bad arguments", -5: "out of memory"}


def xxh3_64(buf) -> int:
    """XXH3-64 of any buffer, computed without holding the GIL (see _xxh3.c)."""
    src, n, keep = _address(buf)
    digest = _lib.kvfs_xxh3_64(src, n)
    del keep
    return digest


def _address(buf) -> tuple[int, int, object]:
    """Address and length of any buffer (read-only ones too); the array keeps it alive."""
    arr = np.frombuffer(buf, dtype=np.uint8)
    return arr.ctypes.data if arr.size else 0, arr.size, arr


_local = threading.local()  # per-thread output buffer of the encoder: fresh MiB buffers cost page faults


def _encode_buffer(cap: int) -> np.ndarray:
    buf = getattr(_local, "buf", None)
    if buf is None or buf.size < cap:
        buf = _local.buf = np.empty(max(cap, 1 << 21), dtype=np.uint8)
    return buf


def encode(data, stride: int = 1, version: int = 0) -> bytes | None:
    """The payload, or None when it would not be smaller than the input (the caller stores raw). `version`
    0 is what kvfs writes (3 for frames of 64 KiB and more); 1-3 force one, for comparisons."""
    return kernel_encode("entropy", ERRORS, data, OVERHEAD,
                         lambda src, n, dst, cap: _lib.kvec_encode_version(src, n, stride, WINDOW_LOG, dst, cap,
                                                                           version))


def kernel_encode(name: str, errors: dict, data, overhead: int, call) -> bytes | None:
    """Run a kernel encoder call(src, n, dst, capacity) -> size into this thread's buffer: the payload, or
    None when it is not smaller than the input (-1: it did not fit). Any other negative size is an error."""
    src, n, keep = _address(data)
    cap = n + overhead
    out = _encode_buffer(cap)
    size = call(src, n, out.ctypes.data, cap)
    del keep
    if size == -1:
        return None
    if size < 0:
        raise CodecError(f"{name} encode: {errors.get(size, size)}")
    return out[:size].tobytes() if size < n else None


def kernel_decode_into(name: str, errors: dict, payload, out, call) -> None:
    """Run a kernel decoder call(src, n, dst, raw_len) -> 0 into a writable buffer of the raw length."""
    src, n, keep = _address(payload)
    arr = np.frombuffer(out, dtype=np.uint8)
    if not arr.flags.writeable:
        raise ValueError("output buffer is read-only")
    rc = call(src, n, arr.ctypes.data if arr.size else 0, arr.size)
    del keep
    if rc:
        raise CodecError(f"{name}: {errors.get(rc, rc)}")


def decode(payload, raw_len: int) -> memoryview:
    """The decoded frame in a new buffer (not zero-filled first: the kernel writes every byte)."""
    out = np.empty(raw_len, dtype=np.uint8)
    decode_into(payload, out)
    return memoryview(out)


def decode_into(payload, out) -> None:
    """Decode into a writable buffer of exactly the raw length. CodecError on any inconsistency."""
    kernel_decode_into("entropy", ERRORS, payload, out, _lib.kvec_decode)


class EntropyCodec:
    id = 4
    name = "entropy"

    def __init__(self, stride: int = 1) -> None:
        if not 1 <= stride <= MAX_STRIDE:
            raise ValueError(f"stride must be 1..{MAX_STRIDE}")
        self.stride = stride

    def with_stride(self, stride: int) -> "EntropyCodec":
        return self if stride == self.stride else EntropyCodec(stride)

    def encoder(self) -> "EntropyCodec":
        return self

    def compress(self, data) -> bytes:
        """The payload; the input itself when coding would not shrink it (format.encode_frame then stores
        the frame raw)."""
        payload = encode(data, self.stride)
        return bytes(data) if payload is None else payload

    def decompress(self, data, raw_len: int) -> memoryview:
        return decode(data, raw_len)

    def decompress_into(self, data, out) -> None:
        decode_into(data, out)


def stride_from_shape(dims: list[tuple[str, int]]) -> int:
    """Elements between neighbouring tokens of one channel: the product of the dimensions inside `token`."""
    names = [name for name, _ in dims]
    if "token" not in names:
        return 1
    stride = 1
    for _, size in dims[names.index("token") + 1:]:
        stride *= size
    return stride if stride <= MAX_STRIDE else 1
