"""The QAT path with the real libqatzip (software fallback on machines without a device) and ISA-L deflate:
one on-disk format, decodable by either and by Python's gzip module."""

from __future__ import annotations

import gzip
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import kv_samples
from kvfs import codecs
from kvfs import format as fmt
from kvfs.codecs import deflate, qat, transforms

MiB = 1 << 20


@pytest.fixture(scope="module")
def qat_codec() -> qat.QatCodec:
    """The real library, as tools/install_qatzip.sh (run by tools/install.sh) left it."""
    library = qat.load()
    return qat.QatCodec(library, qat.probe_hardware(library))


def qat_device_present() -> bool:
    vfio = [p for p in Path("/dev/vfio").glob("*") if p.name != "vfio"] if Path("/dev/vfio").is_dir() else []
    return bool(list(Path("/dev").glob("qat_*")) or vfio)


def kv_frames() -> list[bytes]:
    """Real KV block bytes cut into 1 MiB frames, byte planes applied (what the codec sees)."""
    frames = []
    for src in kv_samples("bf16") + kv_samples("fp16"):
        data = src.read_bytes()
        frames += [bytes(transforms.apply(transforms.BYTEPLANE2, data[i:i + MiB])) for i in range(0, len(data), MiB)]
    return frames


def test_library_loads_from_the_project_prefix_and_reports_its_mode(qat_codec):
    assert qat_codec.library.path.endswith("libqatzip.so.3")
    if not os.environ.get(qat.ENV_LIB):
        assert qat_codec.library.path.startswith(str(qat.LOCAL_PREFIX)) or "/usr/" in qat_codec.library.path
    assert qat_codec.hardware == qat_device_present()
    assert qat_codec.mode == ("hardware" if qat_device_present() else "software fallback")


def test_round_trips_on_real_kv_and_random_data(qat_codec):
    isal = deflate.DeflateCodec()
    for data in [*kv_frames(), os.urandom(MiB), os.urandom(100_000), b"x" * 70_000, bytes(range(256)) * 5]:
        for codec in (qat_codec, isal):
            packed = codec.compress(data)
            assert codec.decompress(packed, len(data)) == data


def test_one_format_cross_decoding(qat_codec):
    isal = deflate.DeflateCodec()
    for data in kv_frames()[:4] + [os.urandom(200_000)]:
        by_qat, by_isal = qat_codec.compress(data), isal.compress(data)
        for packed in (by_qat, by_isal):
            assert gzip.decompress(packed) == data  # Python's gzip reads both
            assert isal.decompress(packed, len(data)) == data  # ISA-L reads QAT's
            assert qat_codec.decompress_with_qatzip(packed, len(data)) == data  # QATzip reads ISA-L's
        # ISA-L writes QAT's member header ('QZ' extra field with sizes), one member per 64 KiB of input
        header = deflate.QZ_HEADER.unpack_from(by_isal)
        assert by_isal[:4] == by_qat[:4] == b"\x1f\x8b\x08\x04" and header[8] == b"QZ"
        assert header[10] == min(len(data), deflate.MEMBER_INPUT)
    standard = gzip.compress(b"standard gzip members are read too" * 1000)
    assert qat_codec.decompress_with_qatzip(standard, 34_000) == isal.decompress(standard, 34_000)


def test_qat_sessions_are_per_thread_and_reused(qat_codec):
    import threading

    data = kv_frames()[0]
    before = qat_codec.sessions
    for _ in range(5):
        qat_codec.compress(data)
    threads = [threading.Thread(target=lambda: [qat_codec.compress(data) for _ in range(3)]) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert qat_codec.sessions - before <= 3  # this thread (maybe already counted) + two new ones


def test_bad_deflate_is_rejected_by_checksum_before_decoding(monkeypatch):
    frame = fmt.encode_frame(kv_samples("bf16")[0].read_bytes()[:MiB], deflate.DeflateCodec(), transforms.BYTEPLANE2)
    assert frame.codec == deflate.DeflateCodec.id
    calls = []
    real = codecs.REGISTRY[deflate.DeflateCodec.id]

    class Counting:
        id, name = real.id, real.name

        def decompress(self, data, raw_len):
            calls.append(len(data))
            return real.decompress(data, raw_len)

    monkeypatch.setitem(codecs.REGISTRY, real.id, Counting())
    entry = frame.entry_at(0)
    damaged = bytearray(frame.payload)
    damaged[len(damaged) // 2] ^= 0x10
    with pytest.raises(fmt.CorruptObject, match="checksum"):
        fmt.decode_frame(entry, bytes(damaged))
    assert calls == []  # never reached the decoder
    assert fmt.decode_frame(entry, frame.payload) == kv_samples("bf16")[0].read_bytes()[:MiB]
    assert calls == [len(frame.payload)]
    # and the decoders themselves refuse garbage rather than returning bytes
    for codec in (deflate.DeflateCodec(), codecs.QatFormatDecoder()):
        with pytest.raises(codecs.CodecError):
            codec.decompress(bytes(damaged), frame.raw_len)


@pytest.mark.parametrize("foreground", [True, False])
def test_codec_qat_without_the_library_fails_at_mount(tmp_path, foreground):
    mnt = tmp_path / "m"
    mnt.mkdir()
    env = dict(os.environ, **{qat.ENV_LIB: str(tmp_path / "nowhere" / "libqatzip.so.3")},
               XDG_CACHE_HOME=str(tmp_path / "cache"))
    res = subprocess.run([sys.executable, "-m", "kvfs", "mount", *(["-f"] if foreground else []), str(mnt),
                          "--codec", "qat", "--l2", f"{tmp_path}/l2:64M"],
                         capture_output=True, text=True, env=env, timeout=60)
    assert res.returncode == 2
    assert "libqatzip" in res.stderr and "install_qatzip.sh" in res.stderr and "nowhere" in res.stderr
    assert not os.path.ismount(mnt)


def test_mounts_with_qat_and_deflate_read_each_other(make_mount):
    """Files written through QAT read back through an ISA-L mount and the other way round, and through zstd."""
    samples = {p.name: p.read_bytes() for p in kv_samples("bf16") + kv_samples("fp16")}
    m = make_mount().start("--codec", "qat")
    for name, data in samples.items():
        m.path(f"qat-{name}").write_bytes(data)
        assert os.getxattr(m.path(f"qat-{name}"), "user.kvfs.codec") == b"qat"
    stats = m.stats()
    assert stats["qat"]["mode"] == ("hardware" if qat_device_present() else "software fallback")
    assert 1 <= stats["qat"]["sessions"] <= max(2, os.cpu_count() or 2) < stats["frames_encoded"]
    assert stats["qat"]["encoder"] == "qat"  # well within the software budget
    assert 0 < stats["qat"]["software_calls"] <= qat.SOFTWARE_CALL_BUDGET or qat_device_present()
    out = subprocess.run([sys.executable, "-m", "kvfs", "stat", str(m.mountpoint)], capture_output=True, text=True,
                         check=True, timeout=60, env=dict(os.environ, COLUMNS="300")).stdout
    assert f"QAT: {stats['qat']['mode']}" in out
    log = m.log_text()
    if not qat_device_present():
        assert "SOFTWARE FALLBACK" in log and "kvfs.native" in log  # QATzip's notices, attributed, not errors
    m.stop()
    m.start("--codec", "deflate")
    for name, data in samples.items():
        assert m.path(f"qat-{name}").read_bytes() == data
        m.path(f"isal-{name}").write_bytes(data)
        assert os.getxattr(m.path(f"isal-{name}"), "user.kvfs.codec") == b"deflate"
    assert m.stats()["qat"] == {"mode": "not loaded"}
    m.stop()
    for codec in ("qat", "zstd"):
        m.start("--codec", codec)
        for name, data in samples.items():
            assert m.path(f"qat-{name}").read_bytes() == data and m.path(f"isal-{name}").read_bytes() == data
        m.stop()


@pytest.mark.parametrize("codec,limit", [("deflate", 0.71), ("qat", 0.71)])
def test_deflate_ratio_on_real_bf16_kv(make_mount, codec, limit):
    """The issue's target (≤ 0.71 stored/raw on bf16 KV in vLLM block order), through the mount, headers
    included (measured here: ISA-L 0.699, QATzip software fallback 0.705)."""
    m = make_mount().start("--codec", codec)
    raw = stored = 0
    for src in kv_samples("bf16"):
        dst = m.path(src.name)
        dst.write_bytes(src.read_bytes())
        raw += dst.stat().st_size
        stored += int(os.getxattr(dst, "user.kvfs.stored_bytes"))
    assert stored / raw <= limit, f"{codec}: {stored / raw:.4f}"


GUARD_SCRIPT = """
import ctypes, logging, os, sys
logging.basicConfig(level=logging.WARNING)
os.dup2(os.open(os.devnull, os.O_WRONLY), 2) if len(sys.argv) > 1 else None
from kvfs.codecs import qat
library = qat.load()
codec = qat.QatCodec(library, qat.probe_hardware(library))
data = bytes(range(256)) * 256
names = set()
for _ in range(1500):
    encoder = codec.encoder()
    names.add(encoder.name)
    assert codec.decompress(encoder.compress(data), len(data)) == data
libc = ctypes.CDLL("libc.so.6")
key = ctypes.c_uint()
print(sorted(names), codec.software_calls, libc.pthread_key_create(ctypes.byref(key), None))
"""


def test_software_fallback_does_not_exhaust_pthread_keys():
    """QATzip 1.3.1 without a device leaks a pthread key per request (1024 per process); kvfs stops calling it
    after SOFTWARE_CALL_BUDGET requests and writes the same format with ISA-L, so the process stays healthy."""
    if qat_device_present():
        pytest.skip("only the software fallback leaks")  # hardware hosts run every other test
    res = subprocess.run([sys.executable, "-c", GUARD_SCRIPT, "quiet"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    names, calls, rc = res.stdout.rsplit(" ", 2)
    assert names.strip() == "['deflate', 'qat']" and int(calls) <= qat.SOFTWARE_CALL_BUDGET + 2 and rc.strip() == "0"
