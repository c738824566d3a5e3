"""Opt-in lossy modes: error bounds of the pure functions, never applied without the opt-in, through a real mount."""

from __future__ import annotations

import errno
import os

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import kv_samples
from kvfs import format as fmt
from kvfs import lossy
from kvfs.codecs import REGISTRY, transforms

FLOATS = {"bf16": ml_dtypes.bfloat16, "fp16": np.float16, "fp32": np.float32}


def values(raw: bytes, dtype: str) -> np.ndarray:
    return np.frombuffer(raw, dtype=FLOATS[dtype]).astype(np.float64)


def test_parse():
    assert lossy.parse("none").lossless and lossy.parse(b"").lossless
    assert lossy.parse("mantissa:3") == lossy.Lossy(lossy.MANTISSA, 3)
    assert lossy.parse(b"FP8") == lossy.Lossy(lossy.FP8, 0) and lossy.parse("fp8:128").param == 128
    for bad in ("mantissa", "mantissa:0", "mantissa:x", "fp8:100", "fp8:8", "int4", "none:1"):
        with pytest.raises(ValueError):
            lossy.parse(bad)
    with pytest.raises(ValueError):
        lossy.check_applicable(lossy.parse("mantissa:7"), "bf16")  # bf16 keeps at least one mantissa bit
    with pytest.raises(ValueError):
        lossy.check_applicable(lossy.parse("fp8"), "auto")


@pytest.mark.parametrize("dtype,bits", [("bf16", 1), ("bf16", 3), ("bf16", 6), ("fp16", 4), ("fp32", 19)])
def test_mantissa_rounding_is_nearest_and_idempotent(dtype, bits):
    rng = np.random.default_rng(bits)
    x = rng.normal(0, 3, 50_001).astype(np.float32)
    x[:6] = [np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-30]
    raw = x.astype(FLOATS[dtype]).tobytes()
    out = bytes(lossy.round_mantissa(raw, dtype, bits, skip=10))
    assert out[:10] == raw[:10]  # the skipped prefix (5 elements of bf16/fp16, 3 of fp32) stays exact
    a, b = values(raw, dtype), values(out, dtype)
    assert np.isnan(b[0]) and b[1] == np.inf and b[2] == -np.inf
    assert lossy.round_mantissa(out, dtype, bits, skip=10) == bytearray(out)
    mant = lossy.MANTISSA_BITS[dtype]
    smallest_normal = {"bf16": 2.0 ** -126, "fp16": 2.0 ** -14, "fp32": 2.0 ** -126}[dtype]
    finite = np.isfinite(a) & (np.abs(a) >= smallest_normal)  # subnormals have a fixed ulp
    finite[:6] = False
    ulp = 2.0 ** (np.floor(np.log2(np.abs(a[finite]))) - (mant - bits))
    assert np.all(np.abs(b[finite] - a[finite]) <= ulp / 2 * (1 + 1e-9))
    width = {"bf16": 16, "fp16": 16, "fp32": 32}[dtype]
    ints = np.frombuffer(out, dtype=f"<u{width // 8}")[6:]
    assert not np.any(ints & ((1 << bits) - 1))


def test_mantissa_ties_go_to_even():
    # bf16 0x3F81 (odd last bit) and 0x3F80 (even) with one bit dropped
    raw = np.array([0x3F81, 0x3F83, 0x3F82], dtype="<u2").tobytes()
    out = np.frombuffer(bytes(lossy.round_mantissa(raw, "bf16", 1)), dtype="<u2")
    assert list(out) == [0x3F80, 0x3F84, 0x3F82]


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 3000), group=st.sampled_from([16, 64, 256]), skip=st.integers(0, 40),
       dtype=st.sampled_from(["bf16", "fp16", "fp32"]), spread=st.floats(1e-3, 1e3))
def test_fp8_error_bound_and_exact_prefix(n, group, skip, dtype, spread):
    rng = np.random.default_rng(n)
    x = (rng.standard_normal(n) * spread).astype(np.float32)
    raw = x.astype(FLOATS[dtype]).tobytes() + b"\x07"[: n % 2]
    stored = lossy.fp8_encode(raw, dtype, group, skip)
    out = lossy.fp8_decode(stored, len(raw))
    assert len(out) == len(raw)
    size = np.dtype(FLOATS[dtype]).itemsize
    start = min(len(raw), -(-skip // size) * size)
    assert out[:start] == raw[:start] and out[len(raw) - (len(raw) - start) % size:] == raw[len(raw) - (len(raw) - start) % size:]
    a = values(raw[start:start + (len(raw) - start) // size * size], dtype)
    b = values(out[start:start + (len(raw) - start) // size * size], dtype)
    for g in range(0, len(a), group):
        amax = np.max(np.abs(a[g:g + group])) if len(a[g:g + group]) else 0
        tol = np.abs(a[g:g + group]) * (2 ** -4 + 2 ** -7) + amax / 448 * 2 ** -9 * 1.01 + 1e-45
        assert np.all(np.abs(b[g:g + group] - a[g:g + group]) <= tol * 1.01)


def test_fp8_special_values_and_malformed_stored_forms():
    x = np.array([np.nan, np.inf, 0.0, 1.0, -2.0] + [0.0] * 59, dtype=np.float32)
    raw = x.astype(ml_dtypes.bfloat16).tobytes()
    out = values(lossy.fp8_decode(lossy.fp8_encode(raw, "bf16", 64), len(raw)), "bf16")
    assert np.isnan(out[0]) and np.isnan(out[1]) and out[2] == 0 and out[3] == 1.0 and out[4] == -2.0
    zeros = bytes(256)
    assert lossy.fp8_decode(lossy.fp8_encode(zeros, "bf16", 64), 256) == zeros
    stored = lossy.fp8_encode(raw, "bf16", 64)
    for bad in (stored[:10], stored[:-1], stored + b"\0", b"\x02" + stored[1:]):
        with pytest.raises(ValueError):
            lossy.fp8_decode(bad, len(raw))
    with pytest.raises(ValueError):
        lossy.fp8_decode(stored, len(raw) + 2)


def test_fp8_frame_checksum_covers_what_reads_return():
    raw = kv_samples("bf16")[0].read_bytes()[:1 << 20]
    f = fmt.encode_frame(raw, REGISTRY[1], transforms.IDENTITY, fp8=fmt.Fp8Params("bf16", 64))
    assert f.transform == transforms.FP8E4M3 and len(f.payload) < 0.45 * len(raw)
    entry = f.entry_at(0)
    back = bytes(fmt.decode_frame(entry, f.payload))
    assert back != raw and fmt.xxh3(back) == f.raw_xxh3
    assert back == bytes(fmt.decode_frame(entry, f.payload))


def object_header(m, name) -> fmt.Header:
    """The header of a file's object, read from the tier directory (one object per test file)."""
    loc = os.getxattr(m.path(name), "user.kvfs.object").decode().split(" ")
    with open(loc[3], "rb") as f:
        return fmt.parse_header(f.read(4096))


def test_lossy_is_never_applied_without_the_opt_in(make_mount):
    m = make_mount().start()
    raw = kv_samples("bf16")[0].read_bytes()
    p = m.path("kv.bin")
    p.touch()
    os.setxattr(p, "user.kvfs.dtype", b"bf16")
    p.write_bytes(raw)
    m.stop()
    m.start()
    assert p.read_bytes() == raw
    assert object_header(m, "kv.bin").lossy_mode == 0
    with pytest.raises(OSError) as e:
        os.getxattr(p, "user.kvfs.lossy")
    assert e.value.errno == errno.ENODATA


def test_directory_opt_in_mantissa(make_mount):
    m = make_mount().start()
    raw = kv_samples("bf16")[0].read_bytes()
    lossy_dir, plain_dir = m.path("tenant-lossy"), m.path("tenant-exact")
    lossy_dir.mkdir()
    plain_dir.mkdir()
    os.setxattr(lossy_dir, "user.kvfs.lossy", b"mantissa:3")
    (lossy_dir / "ns").mkdir()  # inherited by subdirectories
    for d in (lossy_dir / "ns", plain_dir):
        f = d / "kv.bin"
        f.touch()
        os.setxattr(f, "user.kvfs.dtype", b"bf16")
        f.write_bytes(raw)
    m.stop()
    m.start()
    got = (lossy_dir / "ns" / "kv.bin").read_bytes()
    assert got == bytes(lossy.round_mantissa(raw, "bf16", 3))
    assert (plain_dir / "kv.bin").read_bytes() == raw
    assert os.getxattr(lossy_dir / "ns" / "kv.bin", "user.kvfs.lossy") == b"mantissa:3"
    h = object_header(m, "tenant-lossy/ns/kv.bin")
    assert (h.lossy_mode, h.lossy_param) == (lossy.MANTISSA, 3)
    stored = int(os.getxattr(lossy_dir / "ns" / "kv.bin", "user.kvfs.stored_bytes"))
    assert stored <= 0.50 * len(raw)


def test_file_opt_in_fp8_keeps_the_header_exact(make_mount):
    m = make_mount().start()
    raw = kv_samples("bf16")[1].read_bytes()
    header = os.urandom(4096)
    p = m.path("chunk.kv")
    p.touch()
    os.setxattr(p, "user.kvfs.dtype", b"bf16")
    os.setxattr(p, "user.kvfs.shape", b"offset=4096 layer=30 kv=2 head=3 channel=64 token=128")
    os.setxattr(p, "user.kvfs.lossy", b"fp8")
    p.write_bytes(header + raw)
    got = p.read_bytes()
    assert got[:4096] == header and got[4096:] != raw
    F = 1 << 20
    data = header + raw
    expected = b"".join(lossy.fp8_decode(lossy.fp8_encode(data[i:i + F], "bf16", 128, max(0, 4096 - i)),
                                         len(data[i:i + F])) for i in range(0, len(data), F))
    assert got == expected  # per-channel scales: groups of the 128 tokens a channel has
    h = object_header(m, "chunk.kv")
    assert (h.lossy_mode, h.lossy_param) == (lossy.FP8, 7)
    assert int(os.getxattr(p, "user.kvfs.stored_bytes")) <= 0.45 * len(data)
    with pytest.raises(OSError) as e:
        os.setxattr(p, "user.kvfs.lossy", b"int3")
    assert e.value.errno == errno.EINVAL


def test_mount_option_applies_only_where_the_dtype_is_known(make_mount):
    m = make_mount().start("--lossy", "mantissa:2")
    raw = kv_samples("fp16")[0].read_bytes()
    unknown, fp16 = m.path("unknown.bin"), m.path("fp16.bin")
    unknown.write_bytes(raw)
    fp16.touch()
    os.setxattr(fp16, "user.kvfs.dtype", b"fp16")
    fp16.write_bytes(raw)
    m.stop()
    m.start("--lossy", "mantissa:2")
    assert unknown.read_bytes() == raw
    assert fp16.read_bytes() == bytes(lossy.round_mantissa(raw, "fp16", 2))
