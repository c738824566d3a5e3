"""Unit tests of the object format and codecs: round trips, holes, and corruption never yielding data."""

from __future__ import annotations

import os
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfs import codecs
from kvfs import format as fmt
from kvfs.codecs import transforms


def _object(data: bytes, frame_size: int, codec="zstd", transform=transforms.BYTEPLANE2) -> bytes:
    n = -(-len(data) // frame_size)
    frames = [fmt.encode_frame(data[i * frame_size:(i + 1) * frame_size], codecs.by_name(codec), transform)
              for i in range(n)]
    parts, _ = fmt.build_object(fmt.Header(len(data), frame_size, n, transform, 2, codecs.by_name(codec).id), frames)
    return b"".join(parts)


def _decode_all(obj: bytes) -> bytes:
    header = fmt.parse_header(obj)
    table = fmt.parse_table(header, memoryview(obj)[header.size:], len(obj))
    return b"".join(fmt.decode_frame(e, obj[e.offset:e.offset + e.stored_len]) for e in table)


@given(data=st.binary(max_size=20000), frame_pow=st.integers(8, 13), codec=st.sampled_from(["zstd", "none"]),
       transform=st.sampled_from([transforms.IDENTITY, transforms.BYTEPLANE2]))
@settings(max_examples=200, deadline=None)
def test_round_trip_any_bytes(data, frame_pow, codec, transform):
    assert _decode_all(_object(data, 1 << frame_pow, codec, transform)) == data


@given(st.binary(max_size=4097))
def test_byteplane_inverts_odd_lengths(data):
    assert transforms.invert(transforms.BYTEPLANE2, transforms.apply(transforms.BYTEPLANE2, data)) == data


def test_zero_frames_are_holes_and_store_nothing():
    data = bytes(3 << 16) + b"x" * 100
    obj = _object(data, 1 << 16)
    header = fmt.parse_header(obj)
    table = fmt.parse_table(header, memoryview(obj)[header.size:], len(obj))
    assert [e.is_hole for e in table] == [True, True, True, False]
    assert len(obj) < 400
    assert _decode_all(obj) == data


def test_incompressible_frame_stored_raw():
    data = os.urandom(1 << 16)
    frame = fmt.encode_frame(data, codecs.by_name("zstd"), transforms.BYTEPLANE2)
    assert frame.codec == codecs.NoneCodec.id and frame.transform == transforms.IDENTITY
    assert frame.payload == data


def test_every_flipped_byte_is_detected():
    """Flip each byte of a small object in turn: parsing or decoding must fail, never return other data."""
    rng = random.Random(1)
    data = bytes(rng.getrandbits(8) & 0x0F for _ in range(3000))  # compressible
    obj = bytearray(_object(data, 1024))
    for pos in range(len(obj)):
        corrupt = bytearray(obj)
        corrupt[pos] ^= 1 << rng.randrange(8)
        with pytest.raises(fmt.CorruptObject):
            _decode_all(bytes(corrupt))


def test_truncated_object_is_corrupt():
    obj = _object(b"abc" * 5000, 4096)
    for cut in (0, 10, 70, len(obj) // 2, len(obj) - 1):
        with pytest.raises(fmt.CorruptObject):
            _decode_all(obj[:cut])


def test_header_records_what_later_readers_need():
    h = fmt.Header(raw_size=5, frame_size=4096, n_frames=1, transform=transforms.BYTEPLANE2, element_size=2,
                   codec=1, dtype=fmt.DTYPES["bf16"], lossy_mode=0, extensions=b"\x01\x00\x02\x00hi")
    parsed = fmt.parse_header(fmt.pack_header(h))
    assert parsed == h


def test_unknown_version_rejected():
    raw = bytearray(fmt.pack_header(fmt.Header(0, 4096, 0)))
    raw[8] = 99
    body = bytes(raw[:-8])
    raw[-8:] = fmt.CHECKSUM.pack(fmt.xxh3(body))
    with pytest.raises(fmt.CorruptObject, match="version"):
        fmt.parse_header(bytes(raw))


def test_codec_registry_ids_are_stable():
    assert codecs.by_name("none").id == 0 and codecs.by_name("zstd").id == 1
    with pytest.raises(codecs.CodecError):
        codecs.by_id(200)


def test_gil_free_xxh3_equals_python_xxhash():
    """format.xxh3 hashes large buffers with the kernel's vendored xxHash (through ctypes, without the GIL):
    the same values as python-xxhash, for any length and any buffer type."""
    import os

    import numpy as np
    import xxhash
    from kvfs.codecs import entropy

    for n in [0, 1, 3, 15, 16, 17, 128, 129, 240, 241, 4095, 65535, 65536, 65537, 1 << 20, 5_898_253]:
        data = os.urandom(n)
        expected = xxhash.xxh3_64_intdigest(data)
        assert entropy.xxh3_64(data) == expected, n
        assert fmt.xxh3(memoryview(data)) == expected == fmt.xxh3(bytearray(data)), n
        assert fmt.xxh3(np.frombuffer(data, dtype=np.uint8)) == expected, n
