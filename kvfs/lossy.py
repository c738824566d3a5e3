"""Opt-in lossy modes for float KV: applied before the lossless stage, and only where a user asked for them.

A mode is asked for with the `user.kvfs.lossy` xattr on a file or a directory (new files and directories
inherit it from their parent when created), or with the mount's `lossy` setting; the default is lossless.
It applies to files whose dtype is known (bf16, fp16, fp32), from the shape hint's payload offset on (the
bytes before it, e.g. the connector's chunk header, stay exact). The object header records it (lossy_mode,
lossy_param), so does `user.kvfs.lossy` on the file once it is committed. Specification: docs/format.md.

    mantissa:K   round each value to K fewer mantissa bits (to nearest, ties to even); NaN and Inf kept.
                 The stored values are ordinary floats with K zero low bits; the lossless codec does the rest.
    fp8[:G]      FP8 E4M3 (OCP e4m3fn) with one float32 scale per group of G values (amax / 448); groups are
                 a channel's run of tokens when the shape hint has `token` innermost, else G = 64.
                 Reads return the dequantized values in the file's dtype. Inf becomes NaN.
"""

from __future__ import annotations

import dataclasses
import functools
import struct

import numpy as np

NONE, MANTISSA, FP8 = 0, 1, 2
MODE_NAMES = {NONE: "none", MANTISSA: "mantissa", FP8: "fp8"}
MANTISSA_BITS = {"bf16": 7, "fp16": 10, "fp32": 23}
UINT = {"bf16": np.dtype("<u2"), "fp16": np.dtype("<u2"), "fp32": np.dtype("<u4")}
DTYPE_IDS = {"bf16": 1, "fp16": 2, "fp32": 3}
DTYPE_BY_ID = {v: k for k, v in DTYPE_IDS.items()}
E4M3_MAX = 448.0
DEFAULT_GROUP = 64
MAX_GROUP = 4096
# stored form of an fp8 frame: version, dtype id, reserved, group, elements, exact leading bytes
FP8_HEADER = struct.Struct("<BBHIII")


@dataclasses.dataclass(frozen=True)
class Lossy:
    mode: int = NONE
    param: int = 0  # mantissa: bits dropped; fp8: group size (0 = from the shape hint)

    @property
    def lossless(self) -> bool:
        return self.mode == NONE

    def describe(self) -> str:
        if self.mode == MANTISSA:
            return f"mantissa:{self.param}"
        if self.mode == FP8:
            return f"fp8:{self.param}" if self.param else "fp8"
        return "none"

    def header_param(self, group: int) -> int:
        """lossy_param of the object header (one byte): mantissa bits, or log2 of the fp8 group size."""
        return self.param if self.mode == MANTISSA else (group.bit_length() - 1 if self.mode == FP8 else 0)


LOSSLESS = Lossy()


def parse(spec: str | bytes) -> Lossy:
    """'none', 'mantissa:K' or 'fp8[:G]' (G a power of two, 16..4096). ValueError otherwise."""
    text = (spec.decode(errors="replace") if isinstance(spec, (bytes, bytearray)) else spec).strip().lower()
    name, _, arg = text.partition(":")
    if name in ("none", "lossless", "") and not arg:
        return LOSSLESS
    if name == "mantissa" and arg.isdigit() and 1 <= int(arg) <= 22:
        return Lossy(MANTISSA, int(arg))
    if name == "fp8" and (not arg or (arg.isdigit() and int(arg) in {1 << k for k in range(4, 13)})):
        return Lossy(FP8, int(arg) if arg else 0)
    raise ValueError("lossy mode must be none, mantissa:K (bits to drop) or fp8[:G] (G a power of two, 16..4096)")


def check_applicable(lossy: Lossy, dtype: str) -> None:
    """ValueError unless the mode can apply to data of this dtype."""
    if lossy.lossless:
        return
    if dtype not in MANTISSA_BITS:
        raise ValueError(f"lossy modes need a float dtype (bf16, fp16, fp32), not {dtype!r}")
    if lossy.mode == MANTISSA and lossy.param >= MANTISSA_BITS[dtype]:
        raise ValueError(f"{dtype} has {MANTISSA_BITS[dtype]} mantissa bits: drop at most {MANTISSA_BITS[dtype] - 1}")


def _first_element(length: int, skip: int, itemsize: int) -> int:
    """Byte offset of the first whole element at or after `skip`."""
    return min(length, -(-skip // itemsize) * itemsize)


def round_mantissa(raw, dtype: str, bits: int, skip: int = 0) -> bytearray:
    """raw with every element from byte `skip` on rounded to `bits` fewer mantissa bits (nearest, ties to even)."""
    out = bytearray(raw)
    it = UINT[dtype]
    start = _first_element(len(out), skip, it.itemsize)
    n = (len(out) - start) // it.itemsize
    u = np.frombuffer(out, dtype=it, count=n, offset=start)
    exp_mask = {"bf16": 0x7F80, "fp16": 0x7C00, "fp32": 0x7F800000}[dtype]
    finite = (u & exp_mask) != exp_mask
    wide = u.astype(np.uint64)
    lsb = (wide >> bits) & 1
    rounded = ((wide + (1 << (bits - 1)) - 1 + lsb) >> bits) << bits
    u[...] = np.where(finite, rounded.astype(it), u)
    return out


@functools.cache
def float_dtype(dtype: str) -> np.dtype:
    """The numpy float type of a kvfs dtype. ml_dtypes is imported on first use: it costs every `kvfs`
    command ~1 s to import, and only fp8 frames need it."""
    if dtype == "bf16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype({"fp16": "<f2", "fp32": "<f4"}[dtype])


@functools.cache
def _e4m3() -> np.dtype:
    import ml_dtypes
    return np.dtype(ml_dtypes.float8_e4m3fn)


def fp8_encode(raw, dtype: str, group: int, skip: int = 0) -> bytes:
    """The stored form of one frame: header, float32 scales, E4M3 codes, then any trailing bytes."""
    ft = float_dtype(dtype)
    start = _first_element(len(raw), skip, ft.itemsize)
    n = (len(raw) - start) // ft.itemsize
    x = np.frombuffer(raw, dtype=ft, count=n, offset=start).astype(np.float32)
    groups = -(-n // group)
    padded = np.zeros(groups * group, dtype=np.float32)
    padded[:n] = x
    g = padded.reshape(groups, group)
    amax = np.max(np.where(np.isfinite(g), np.abs(g), 0), axis=1)
    scale = np.where(amax > 0, amax / E4M3_MAX, 1.0).astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        q = (g / scale[:, None]).astype(_e4m3())  # non-finite -> NaN
    head = FP8_HEADER.pack(1, DTYPE_IDS[dtype], 0, group, n, start)
    tail = bytes(raw[start + n * ft.itemsize:])
    return b"".join([head, bytes(raw[:start]), scale.tobytes(), q.reshape(-1)[:n].view(np.uint8).tobytes(), tail])


def fp8_decode(stored, raw_len: int) -> bytes:
    """The frame's raw bytes: exact leading bytes, dequantized values in the file's dtype, trailing bytes.
    ValueError when the stored form does not describe a frame of raw_len bytes."""
    view = memoryview(stored)
    if len(view) < FP8_HEADER.size:
        raise ValueError("fp8 frame shorter than its header")
    version, dtype_id, _, group, n, start = FP8_HEADER.unpack_from(view)
    dtype = DTYPE_BY_ID.get(dtype_id)
    if version != 1 or dtype is None or not 1 <= group <= MAX_GROUP:
        raise ValueError("bad fp8 frame header")
    ft = float_dtype(dtype)
    groups = -(-n // group)
    tail = raw_len - start - n * ft.itemsize
    if not 0 <= tail < ft.itemsize or len(view) != FP8_HEADER.size + start + 4 * groups + n + tail:
        raise ValueError("fp8 frame sizes do not add up")
    pos = FP8_HEADER.size
    exact = view[pos:pos + start]
    pos += start
    scale = np.frombuffer(view, dtype="<f4", count=groups, offset=pos)
    pos += 4 * groups
    q = np.frombuffer(view, dtype=_e4m3(), count=n, offset=pos).astype(np.float32)
    x = q * np.repeat(scale, group)[:n]
    return b"".join([bytes(exact), x.astype(ft).tobytes(), bytes(view[pos + n:])])
