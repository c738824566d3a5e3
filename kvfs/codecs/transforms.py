"""Transforms: reversible byte reorderings applied to a frame before its codec.

byteplane2 splits 2-byte little-endian elements (bf16, fp16) into a plane of high bytes (sign + exponent,
low-entropy) followed by a plane of low bytes (mantissa noise), so the codec sees like bytes together.
"""

from __future__ import annotations

import numpy as np

IDENTITY = 0
BYTEPLANE2 = 1
FP8E4M3 = 2  # lossy (kvfs/lossy.py): the stored form holds scales and E4M3 codes; reads get dequantized values
NAMES = {IDENTITY: "identity", BYTEPLANE2: "byteplane2", FP8E4M3: "fp8e4m3"}


def _byteplane2_encode(raw: bytes | bytearray | memoryview) -> memoryview:
    n = len(raw)
    half = n // 2
    elems = np.frombuffer(raw, dtype="<u2", count=half)
    out = np.empty(n, dtype=np.uint8)
    np.right_shift(elems, 8, out=out[:half], casting="unsafe")
    np.copyto(out[half : 2 * half], elems, casting="unsafe")
    if n % 2:
        out[-1] = raw[-1]
    return memoryview(out)  # no copy: the codec reads it once


def _byteplane2_decode(planes: bytes | memoryview) -> bytes | memoryview:
    n = len(planes)
    half = n // 2
    b = np.frombuffer(planes, dtype=np.uint8)
    elems = np.empty(half + n % 2, dtype="<u2")  # one spare element holds an odd trailing byte
    np.left_shift(b[:half], 8, out=elems[:half], dtype="<u2")
    elems[:half] |= b[half : 2 * half]
    out = memoryview(elems).cast("B")  # no copy: frames are 1 MiB and decoded at GB/s
    if n % 2:
        out[-2] = planes[-1]
        return out[:n]
    return out


def apply(transform: int, raw: bytes | bytearray | memoryview) -> bytes | bytearray | memoryview:
    """Lossless transforms only: a lossy stored form needs its parameters (format.encode_frame(lossy=...))."""
    if transform == IDENTITY:
        return raw
    if transform == BYTEPLANE2:
        return _byteplane2_encode(raw)
    raise ValueError(f"unknown transform id {transform}")


def invert(transform: int, data: bytes | memoryview, raw_len: int | None = None) -> bytes | memoryview:
    """The raw bytes (a memoryview where that saves a copy). ValueError if data is not a stored form."""
    if transform == IDENTITY:
        return data
    if transform == BYTEPLANE2:
        return _byteplane2_decode(data)
    if transform == FP8E4M3:
        from .. import lossy  # numpy-heavy and only needed for lossy files
        return lossy.fp8_decode(data, len(data) if raw_len is None else raw_len)
    raise ValueError(f"unknown transform id {transform}")
