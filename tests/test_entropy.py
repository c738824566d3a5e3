"""Codec 4 (entropy): bit-exact round trips, the never-larger rule, rejection of corrupt input, the mount's choice."""

from __future__ import annotations

import ctypes
import os
import platform
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import kv_samples
from kvfs import codecs, format as fmt
from kvfs.codecs import entropy, transforms
from kvfs.codecs.entropy import EntropyCodec, stride_from_shape


def round_trip(data: bytes, stride: int = 1) -> bytes | None:
    payload = entropy.encode(data, stride)
    if payload is None:
        return None
    assert len(payload) < len(data)
    out = bytearray(len(data))
    entropy.decode_into(payload, out)
    assert bytes(out) == data
    return payload


@pytest.mark.parametrize("stride", [1, 2, 64, 128, 4096])
def test_real_kv_round_trips(stride):
    for src in kv_samples("bf16") + kv_samples("fp16"):
        data = src.read_bytes()
        for start in (0, 1 << 20, 2 << 20):
            frame = data[start:start + (1 << 20)]
            assert round_trip(frame, stride) is not None, (src.name, stride)


def test_real_bf16_compresses_near_the_entropy_limit():
    raw = stored = 0
    for src in kv_samples("bf16"):
        data = src.read_bytes()
        for start in range(0, len(data), 1 << 20):
            raw += len(data[start:start + (1 << 20)])
            stored += len(round_trip(data[start:start + (1 << 20)]))
    assert stored / raw < 0.67


def special_floats(dtype: str, n: int) -> bytes:
    """NaN, ±Inf, ±0, subnormals and normal values mixed, as 16-bit patterns."""
    specials = {"bf16": [0x7F80, 0xFF80, 0x7FC0, 0xFFC1, 0x0000, 0x8000, 0x0001, 0x807F, 0x3F80, 0xBF80],
                "fp16": [0x7C00, 0xFC00, 0x7E00, 0xFE01, 0x0000, 0x8000, 0x0001, 0x83FF, 0x3C00, 0xBC00]}[dtype]
    rng = np.random.default_rng(7)
    values = rng.choice(np.array(specials, dtype="<u2"), size=n)
    values[::3] = rng.normal(0, 1, size=values[::3].size).astype(np.float32).view("<u4") >> 16
    return values.tobytes()


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_nan_inf_zero_patterns(dtype):
    for n in (1, 5, 4095, 4096, 4099, 32_768, 32_769, 100_003, 700_001):
        data = special_floats(dtype, n)
        if entropy.encode(data) is not None:
            round_trip(data)
        frame = fmt.encode_frame(data, EntropyCodec(), transforms.IDENTITY)
        assert bytes(fmt.decode_frame(frame.entry_at(0), frame.payload)) == data


@pytest.mark.parametrize("n", [0, 1, 2, 3, 7, 8, 15, 16, 17, 63, 8191, 8192, 8193, 65_535, 65_536, 65_537, 65_538 + 130,
                               1 << 20, (1 << 20) + 1])
def test_tiny_odd_and_frame_sized_lengths(n):
    rng = np.random.default_rng(n)
    narrow = (rng.integers(0x3C00, 0x3C40, size=(n + 1) // 2, dtype=np.uint16)).tobytes()[:n]
    for data in (narrow, bytes(n), rng.bytes(n)):
        payload = entropy.encode(data)
        if payload is not None:
            round_trip(data)
        frame = fmt.encode_frame(data, EntropyCodec(), transforms.IDENTITY)
        entry = frame.entry_at(0)
        assert bytes(fmt.decode_frame(entry, frame.payload)) == data
        assert len(frame.payload) <= len(data)  # never larger than raw: stored raw (codec 0) or a hole


def test_random_and_zero_data_are_never_stored_larger():
    rand = os.urandom(1 << 20)
    assert entropy.encode(rand) is None
    assert EntropyCodec().compress(rand) == rand  # encode_frame then stores it raw
    frame = fmt.encode_frame(rand, EntropyCodec(), transforms.IDENTITY)
    assert frame.codec == codecs.NoneCodec.id and len(frame.payload) == len(rand)
    assert fmt.encode_frame(bytes(1 << 20), EntropyCodec(), transforms.IDENTITY).is_hole


floats16 = st.integers(0, 40).flatmap(lambda spread: st.lists(
    st.integers(0x3000, 0x3000 + spread * 256).map(lambda v: v.to_bytes(2, "little")), min_size=0, max_size=6000)
).map(b"".join)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.one_of(floats16, st.binary(max_size=20000)), tail=st.binary(max_size=1),
       stride=st.sampled_from([1, 2, 3, 64, 4096]))
def test_property_round_trip_or_not_smaller(data, tail, stride):
    data += tail
    payload = entropy.encode(data, stride)
    if payload is None:
        return
    out = bytearray(len(data))
    entropy.decode_into(payload, out)
    assert bytes(out) == data


@settings(max_examples=300, deadline=None)
@given(cut=st.integers(0, 10_000), flips=st.lists(st.tuples(st.integers(0, 1 << 30), st.integers(1, 255)),
                                                  min_size=1, max_size=8))
def test_corrupt_payloads_fail_cleanly(cut, flips):
    """The kernel itself never crashes or overruns on garbage (kvfs checks xxh3 before it runs anyway)."""
    data = kv_samples("bf16")[0].read_bytes()[:1 << 16]
    payload = bytearray(entropy.encode(data))
    for pos, xor in flips:
        payload[pos % len(payload)] ^= xor
    if cut % 3 == 0:
        payload = payload[:cut % len(payload)]
    out = bytearray(len(data))
    try:
        entropy.decode_into(bytes(payload), out)
    except codecs.CodecError:
        return
    # a flip inside the raw sign/mantissa plane decodes to other bytes: only the raw checksum can tell
    assert bytes(out) != data or bytes(payload) == entropy.encode(data)


def test_corrupt_frame_rejected_before_decoding():
    data = kv_samples("bf16")[0].read_bytes()[:1 << 20]
    frame = fmt.encode_frame(data, EntropyCodec(), transforms.IDENTITY)
    assert frame.codec == EntropyCodec.id
    bad = bytearray(frame.payload)
    bad[len(bad) // 2] ^= 0x10
    with pytest.raises(fmt.CorruptObject, match="payload checksum"):
        fmt.decode_frame(frame.entry_at(0), bytes(bad))


def test_wrong_output_length_is_rejected():
    data = kv_samples("bf16")[0].read_bytes()[:1 << 16]
    payload = entropy.encode(data)
    with pytest.raises(codecs.CodecError):
        entropy.decode_into(payload, bytearray(len(data) - 2))


def test_stride_from_shape_hint():
    def hint(s):
        return fmt.parse_shape_hint(s.encode())[1]
    assert stride_from_shape(hint("offset=4096 layer=30 kv=2 head=3 channel=64 token=256")) == 1
    assert stride_from_shape(hint("offset=0 layer=30 token=128 head=3 channel=64")) == 192
    assert stride_from_shape(hint("offset=0 layer=30 block=2 element=8192")) == 1
    assert stride_from_shape(hint("offset=0 token=16 channel=8192")) == 1  # beyond MAX_STRIDE: no stride


def test_mount_chooses_per_file_and_reads_back_under_any_codec(make_mount):
    """auto: entropy for 2-byte floats, zstd for text, raw for noise; files written so read back on a mount
    configured for another codec (frames carry their codec)."""
    m = make_mount().start()
    kv = kv_samples("bf16")[0].read_bytes()
    text = b"a line of text that is not float data\n" * 50_000
    noise = os.urandom(3 << 20)
    for name, data in (("kv.bin", kv), ("text.txt", text), ("noise.bin", noise)):
        m.path(name).write_bytes(data)
    assert os.getxattr(m.path("kv.bin"), "user.kvfs.codec") == b"entropy"
    assert os.getxattr(m.path("text.txt"), "user.kvfs.codec") == b"zstd"
    assert os.getxattr(m.path("noise.bin"), "user.kvfs.codec") == b"none"
    chunk = m.path("chunk.kv")
    chunk.touch()
    os.setxattr(chunk, "user.kvfs.shape", b"offset=0 layer=30 kv=2 head=3 channel=64 token=128")
    os.setxattr(chunk, "user.kvfs.dtype", b"bf16")
    chunk.write_bytes(kv)
    assert os.getxattr(chunk, "user.kvfs.codec") == b"entropy"
    m.stop()
    m.start("--codec", "zstd")
    for name, data in (("kv.bin", kv), ("text.txt", text), ("noise.bin", noise), ("chunk.kv", kv)):
        assert m.path(name).read_bytes() == data, name
    assert os.getxattr(m.path("kv.bin"), "user.kvfs.codec") == b"entropy"


def test_codec_option_entropy_on_non_float_data_stays_lossless(make_mount):
    m = make_mount().start("--codec", "entropy")
    text = b"plain text " * 100_000
    m.path("t.txt").write_bytes(text)
    assert m.path("t.txt").read_bytes() == text
    kv = kv_samples("fp16")[0].read_bytes()
    m.path("f.kv").write_bytes(kv)
    assert os.getxattr(m.path("f.kv"), "user.kvfs.codec") == b"entropy"
    assert int(os.getxattr(m.path("f.kv"), "user.kvfs.stored_bytes")) < 0.87 * len(kv)


@pytest.mark.parametrize("codec", ["none", "zstd", "deflate", "qat", "entropy"])
@pytest.mark.parametrize("transform", [transforms.IDENTITY, transforms.BYTEPLANE2])
def test_every_codec_round_trips_special_data(codec, transform):
    """Through format.encode_frame/decode_frame as the mount uses them: real KV, NaN/Inf patterns, random,
    zeros, odd and tiny lengths. (qat without libqatzip encodes through ISA-L into the same format.)"""
    impl = codecs.by_name(codec)
    if codec == "qat":
        impl = codecs.by_name("deflate")  # the QAT format's encoder here; id 3 frames decode the same way
    datasets = [kv_samples("bf16")[0].read_bytes()[:1 << 20], kv_samples("fp16")[0].read_bytes()[:300_001],
                special_floats("bf16", 70_001), special_floats("fp16", 9), os.urandom(65_537), bytes(4097),
                b"\x01", b"", b"\x00\x80" * 3 + b"\x7f"]
    for data in datasets:
        frame = fmt.encode_frame(data, impl, transform)
        entry = frame.entry_at(0)
        assert bytes(fmt.decode_frame(entry, frame.payload)) == data
        assert len(frame.payload) <= len(data)


ROOT = Path(__file__).resolve().parent.parent


def connector_chunk(block: bytes) -> tuple[bytes, bytes]:
    """One native KV block laid out as the connector writes a chunk (tools/bench_codec.py), and its hint."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
    from bench_codec import BLOCK, chunk_hint, to_chunk

    return to_chunk(block), chunk_hint(BLOCK).encode()


def test_versions_written_by_frame_size_and_stride():
    """Frames of 64 KiB and more: version 3 (block classes, huff0) whatever the stride, below 0.66 on real bf16
    blocks. Smaller frames: version 2 (signs coded) for stride 1, version 1 otherwise."""
    frame = kv_samples("bf16")[0].read_bytes()[:1 << 20]
    for stride in (1, 64):
        v3 = round_trip(frame, stride)
        assert v3[0] == 3 and len(v3) / len(frame) < 0.66
    small = frame[:65_534]
    assert round_trip(small, 1)[0] == 2 and round_trip(small, 64)[0] == 1
    assert round_trip(frame[:65_536], 1)[0] == 3
    for version, stride in ((1, 64), (2, 1), (3, 1), (3, 64)):  # versions can be asked for (benchmarks
        for data in (frame, small, frame[:65_535]):                # compare them); all decode
            payload = entropy.encode(data, stride, version=version)
            assert payload[0] == version
            out = bytearray(len(data))
            entropy.decode_into(payload, out)
            assert bytes(out) == data
    with pytest.raises(codecs.CodecError):
        entropy.encode(frame, 64, version=2)  # version 2 is for stride 1 only
    with pytest.raises(codecs.CodecError):
        entropy.encode(frame, 1, version=1)  # version 1 is written for strides above 1 only


def test_version_3_keeps_9_low_bits_of_fp16_and_7_of_bf16():
    """fp16's exponent byte holds 3 mantissa bits: version 3 codes 5 exponent bits + 1 mantissa bit and keeps 9
    low bits (faster to decode, and smaller); bf16 keeps the whole exponent coded."""
    for dtype, low_bits, limit in (("bf16", 7, 0.66), ("fp16", 9, 0.845)):
        frame = kv_samples(dtype)[0].read_bytes()[:1 << 20]
        payload = round_trip(frame)
        assert payload[0] == 3 and payload[3] == low_bits and len(payload) / len(frame) < limit, dtype


def test_version_3_rejects_exponents_that_do_not_fit():
    """With 9 low bits an exponent symbol has 6 bits; a class stream holding a larger value is rejected (the
    stored checksum would catch it first; the kernel must not depend on that). The payload is walked as
    docs/format.md describes it: header, low bits, the classes section, then class 0's section."""
    n = 40_000
    rng = np.random.default_rng(5)
    x = (20 << 9) | rng.integers(0, 1 << 9, size=n) | (rng.integers(0, 2, size=n) << 15)
    data = x.astype("<u2").tobytes()
    payload = round_trip(data)
    assert payload[3] == 9 and payload[10] == 1  # 9 low bits, one class
    off = 16 + n + (n + 7) // 8  # header, low bytes, bit-8 plane (no tail: raw_len is even)
    assert int.from_bytes(payload[off:off + 4], "little") == (1 << 2) | 1  # classes: one RLE piece
    off += 5
    assert int.from_bytes(payload[off:off + 4], "little") == (1 << 2) | 1 and payload[off + 4] == 20
    bad = bytearray(payload)
    bad[off + 4] = 64
    with pytest.raises(codecs.CodecError):
        entropy.decode_into(bytes(bad), bytearray(len(data)))
    bad[off + 4] = 63  # fits: decodes (to other values)
    out = bytearray(len(data))
    entropy.decode_into(bytes(bad), out)
    assert out != data


def test_version_3_sections_hold_many_pieces():
    """A frame larger than kvfs's 1 MiB: one class and the sign plane run past huff0's 128 KiB per piece."""
    rng = np.random.default_rng(3)
    x = (rng.normal(0, 1, size=1_500_001).astype(np.float32).view("<u4") >> 16).astype("<u2")
    data = x.tobytes() + b"\x5a"
    payload = round_trip(data)
    assert payload[0] == 3
    wide = (rng.normal(0, 1, size=600_000).astype(np.float32) * np.repeat(rng.choice([1e-3, 1, 1e3], 600_000 // 64), 64))
    assert round_trip((wide.view("<u4") >> 16).astype("<u2").tobytes())[0] == 3


@st.composite
def v3_frames(draw):
    """Frames large enough for version 3: real-looking floats with a drawn spread of magnitudes, specials,
    runs of one value, odd lengths."""
    seed, n = draw(st.integers(0, 2**32 - 1)), draw(st.integers(32_768, 200_000))
    rng = np.random.default_rng(seed)
    scale = np.exp(rng.normal(0, draw(st.floats(0, 8)), size=n // 64 + 1)).repeat(64)[:n]
    values = rng.normal(0, 1, size=n) * scale
    if draw(st.booleans()):  # bf16 (7 low bits)
        x = values.astype(np.float32).view("<u4") >> 16
    else:  # fp16 (usually 9 low bits); large values become Inf, which is wanted
        with np.errstate(over="ignore"):
            x = values.astype(np.float16).view("<u2").astype("<u4")
    if draw(st.booleans()):
        x[rng.integers(0, n, size=n // 10)] = rng.choice([0x7F80, 0xFF80, 0x7FC0, 0, 0x8000, 0x0001], size=n // 10)
    if draw(st.booleans()):
        a = rng.integers(0, n)
        x[a:a + draw(st.integers(1, 70_000))] = draw(st.integers(0, 0xFFFF))
    return x.astype("<u2").tobytes() + draw(st.binary(max_size=1))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=v3_frames())
def test_property_version_3_round_trip_or_not_smaller(data):
    payload = entropy.encode(data)
    if payload is None:
        return
    assert payload[0] == 3 and len(payload) < len(data)
    out = bytearray(len(data))
    entropy.decode_into(payload, out)
    assert bytes(out) == data


def test_version_3_rejects_every_truncation_and_header_change():
    data = kv_samples("bf16")[0].read_bytes()[:1 << 17]
    payload = entropy.encode(data)
    assert payload[0] == 3
    out = bytearray(len(data))
    for cut in list(range(0, 64)) + list(range(64, len(payload), 997)) + [len(payload) - 1]:
        with pytest.raises(codecs.CodecError):
            entropy.decode_into(payload[:cut], out)
    with pytest.raises(codecs.CodecError):
        entropy.decode_into(payload + b"\0", out)
    for pos in range(16):
        bad = bytearray(payload)
        bad[pos] ^= 0x04
        try:
            entropy.decode_into(bytes(bad), out)
        except codecs.CodecError:
            continue
        raise AssertionError(f"header byte {pos} changed and still decoded")


PORTABLE = ["-DKVEC_NO_SIMD", "-DZSTD_DISABLE_ASM"]  # no SSE2, no huff0 assembly: any C11 compiler
SSE2_ONLY = ["-DKV3_NO_AVX512"]  # as on an x86-64 CPU without AVX-512


def build_kernel(out: Path, flags: list[str], *options: str, extra_sources: tuple[Path, ...] = ()) -> Path:
    """Compile the kernel's sources (kvfs/codecs/kernel_sources.py, as setup.py does) with `flags` and
    `options` into `out`; huff0's x86-64 assembly joins them unless ZSTD_DISABLE_ASM is set."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    assert compiler, "a C compiler builds the kernel; it must be here"
    sources = runpy.run_path(str(ROOT / "kvfs/codecs/kernel_sources.py"))
    flags = list(flags)
    asm = []
    if "-DZSTD_DISABLE_ASM" not in flags:
        if platform.machine() == "x86_64":
            asm = [sources["X86_64_ASM"]]
        else:
            flags.append("-DZSTD_DISABLE_ASM")
    subprocess.run([compiler, "-std=c11", *options, *flags, *[str(ROOT / s) for s in sources["C_SOURCES"] + asm],
                    *map(str, extra_sources), "-lm", "-o", str(out)], check=True)
    return out


def test_portable_kernel_writes_and_reads_the_same_bytes(tmp_path):
    """The kernel built without SIMD and without huff0's assembly (as on a machine without SSE2, or not
    x86-64), and with SSE2 but without the AVX-512 join (as on a CPU without it), writes byte-identical
    payloads and decodes what the installed build wrote, and the other way round."""
    builds = [build_kernel(tmp_path / "portable.so", PORTABLE, "-O2", "-shared", "-fPIC"),
              build_kernel(tmp_path / "sse2.so", SSE2_ONLY, "-O2", "-shared", "-fPIC")]
    libs = [entropy._lib] + [ctypes.CDLL(str(path)) for path in builds]
    for lib in libs[1:]:
        lib.kvec_encode.restype = ctypes.c_int64
        lib.kvec_encode.argtypes = entropy._lib.kvec_encode.argtypes
        lib.kvec_decode.argtypes = entropy._lib.kvec_decode.argtypes
    block = kv_samples("bf16")[0].read_bytes()
    datasets = [block[:1 << 20], connector_chunk(block)[0][:(1 << 20) + 3], kv_samples("fp16")[0].read_bytes()[:99_999],
                kv_samples("fp16")[0].read_bytes()[:60_001], special_floats("bf16", 40_099),
                special_floats("fp16", 17), bytes(33), bytes(70_000)]
    for data in datasets:
        for stride in (1, 64):
            src = np.frombuffer(data, dtype=np.uint8)
            payloads = []
            for lib in libs:
                out = np.zeros(len(data) + entropy.OVERHEAD, dtype=np.uint8)
                size = lib.kvec_encode(src.ctypes.data, src.size, stride, entropy.WINDOW_LOG, out.ctypes.data, out.size)
                assert size > 0, (len(data), stride, size)
                payloads.append(out[:size].tobytes())
            assert payloads[0] == payloads[1] == payloads[2], (len(data), stride)
            for lib in libs:
                dec = np.empty(len(data), dtype=np.uint8)
                pay = np.frombuffer(payloads[0], dtype=np.uint8)
                assert lib.kvec_decode(pay.ctypes.data, pay.size, dec.ctypes.data, dec.size) == 0
                assert dec.tobytes() == data


@pytest.mark.parametrize("build", [[], SSE2_ONLY, PORTABLE], ids=["installed", "sse2", "portable"])
def test_kernel_under_sanitizers_never_reads_past_a_corrupt_payload(tmp_path, build):
    """tests/fuzz_entropy.c, built with AddressSanitizer and UBSan around the kernel's sources: 1,200 corrupt
    payloads of real bf16, fp16 and connector-chunk frames (version 3, both low-bit layouts) are each rejected
    or decoded without a byte read or written out of bounds; the round trips before them are exact."""
    exe = build_kernel(tmp_path / "fuzz", build, "-O1", "-g", "-fsanitize=address,undefined",
                       "-fno-sanitize-recover=all", "-fno-omit-frame-pointer",
                       extra_sources=(Path(__file__).with_name("fuzz_entropy.c"),))
    chunk = tmp_path / "chunk.kv"
    chunk.write_bytes(connector_chunk(kv_samples("bf16")[0].read_bytes())[0])
    files = [kv_samples("bf16")[0], kv_samples("fp16")[0], chunk]
    run = subprocess.run([str(exe), "20", *map(str, files)], capture_output=True, text=True,
                         env={**os.environ, "ASAN_OPTIONS": "detect_leaks=0"})
    assert run.returncode == 0, run.stderr[-3000:]
    rejected, _, decoded, _ = run.stdout.split()
    assert int(rejected) > 0 and int(rejected) + int(decoded) == 20 * 20 * len(files)


def test_connector_chunks_store_below_066_through_the_mount(make_mount):
    """The issue's target for connector-written chunks with their shape hint, headers included."""
    m = make_mount().start()
    raw = stored = 0
    for i, src in enumerate(kv_samples("bf16")):
        data, hint = connector_chunk(src.read_bytes())
        path = m.path(f"c{i}.kv")
        path.touch()
        os.setxattr(path, "user.kvfs.shape", hint)
        path.write_bytes(data)
        assert os.getxattr(path, "user.kvfs.codec") == b"entropy"
        assert path.read_bytes() == data
        raw += len(data)
        stored += int(os.getxattr(path, "user.kvfs.stored_bytes"))
    assert stored / raw <= 0.66, stored / raw


def test_version_1_payloads_still_decode():
    """A stride-1 payload written by version 1 of the codec (before signs were coded): files written by
    earlier kvfs releases stay readable. tests/data/entropy-v1-stride1.payload = the first 65,539 bytes of
    bf16-prose-0004.kv, encoded by that version."""
    payload = (Path(__file__).parent / "data" / "entropy-v1-stride1.payload").read_bytes()
    data = (Path(__file__).parent / "data" / "kv" / "bf16-prose-0004.kv").read_bytes()[:65_539]
    assert payload[0] == 1 and payload[3] == 4  # version 1, 4 streams: the fast 4-stream loop runs
    out = bytearray(len(data))
    entropy.decode_into(payload, out)
    assert bytes(out) == data


def test_version_2_payloads_still_decode():
    """A 64 KiB-ish frame as version 2 wrote it (stride 1, signs coded) before version 3 took over frames of
    64 KiB and more: files written by earlier kvfs releases stay readable.
    tests/data/entropy-v2-stride1.payload = the first 65,539 bytes of bf16-prose-0004.kv, encoded by that
    version."""
    payload = (Path(__file__).parent / "data" / "entropy-v2-stride1.payload").read_bytes()
    data = (Path(__file__).parent / "data" / "kv" / "bf16-prose-0004.kv").read_bytes()[:65_539]
    assert payload[0] == 2 and payload[3] == 4
    out = bytearray(len(data))
    entropy.decode_into(payload, out)
    assert bytes(out) == data


def test_threads_that_exit_leave_no_scratch_behind(tmp_path):
    """The kernel's per-thread scratch buffers (~1 MiB each) are freed when their thread exits: trio's worker
    threads and the connector's readers come and go, and each used to leak its buffers (the soak's RSS)."""
    script = tmp_path / "threads.py"
    script.write_text(f"""
import threading, sys
sys.path.insert(0, {str(Path(__file__).resolve().parent.parent)!r})
from kvfs.codecs import entropy
from kvfs.codecs.transforms import BYTEPLANE2
from kvfs import codecs, direct, format as fmt
data = open({str(kv_samples("bf16")[0])!r}, "rb").read()[:1 << 20]
frame = [fmt.encode_frame(data, entropy.EntropyCodec(64), 0), fmt.encode_frame(data, codecs.by_name("zstd"), BYTEPLANE2)]
parts, _ = fmt.build_object(fmt.Header(raw_size=2 * len(data), frame_size=len(data), n_frames=2, element_size=2), frame)
obj = {str(tmp_path / "object")!r}
open(obj, "wb").write(b"".join(parts))
loc = direct.Location("L2", sum(map(len, parts)), 2 * len(data), obj)
def rss_mib():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) / 1024
def work():
    entropy.encode(data, 64)
    assert direct.read_object(loc) == data * 2  # entropy, then zstd on byte planes: the reader's buffers too
for i in range(220):
    if i == 20:
        start = rss_mib()
    t = threading.Thread(target=work)
    t.start()
    t.join()
print(rss_mib() - start)
""")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert float(out.stdout) < 40, f"RSS grew {out.stdout.strip()} MiB over 200 threads (leaked ~1 MiB per thread?)"
