"""Bulk reads past FUSE (kvfs.direct) on real mounts: the same verified bytes as a read through the mount,
reads counted by the daemon, and every doubtful case (corrupt, moved, unsaved, not kvfs) answered through
the mount, never with wrong bytes."""

from __future__ import annotations

import os
import time
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from kvfs import direct

from conftest import KvfsMount, drop_page_cache, kv_samples


def _write(path, data: bytes, dtype: str | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        if dtype:
            os.setxattr(f.fileno(), "user.kvfs.dtype", dtype.encode())
        f.write(data)


@pytest.mark.parametrize("codec", ["zstd", "none", "deflate", "entropy"])
def test_direct_read_matches_mount_read(make_mount, codec):
    m = make_mount().start("--codec", codec)
    sample = kv_samples("bf16")[0].read_bytes()
    files = {
        "kv": sample,
        "odd": sample[: 3 * (1 << 20) + 12345],  # a short last frame
        "holes": bytes(1 << 20) + sample[:5000] + bytes(2 << 20),  # all-zero frames are holes
        "random": os.urandom((1 << 20) + 7),  # stored raw (incompressible)
    }
    for name, data in files.items():
        _write(m.path("ns", name), data)
    for name, data in files.items():
        got, direct_hit = direct.read_file(m.path("ns", name), expected_size=len(data))
        assert direct_hit, name
        assert got == data, name
        loc = direct.locate(m.path("ns", name))
        assert loc.tier == "L2" and loc.size == len(data) and os.path.exists(loc.path)
        # partial reads decode only what they touch, and match the mount's bytes
        for off, n in [(0, 10), ((1 << 20) - 3, 9), (len(data) - 5, 100), (len(data), 10)]:
            assert direct.read_object(loc, off, n) == data[off:off + n], (name, off, n)
    s = m.stats()
    assert s["direct_reads"] == len(files) * 2  # one per read_file and per locate: each getxattr is a read
    assert s["direct_bytes"] == 2 * sum(len(d) for d in files.values())
    assert s["tiers"]["L2"]["hits"] >= s["direct_reads"]


def test_corrupt_object_is_never_served(make_mount):
    m = make_mount().start()
    data = kv_samples("bf16")[0].read_bytes()
    _write(m.path("a.kv"), data)
    (obj,) = m.objects("L2")
    raw = bytearray(obj.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    obj.write_bytes(raw)
    drop_page_cache(m.path("a.kv"))  # what the writer wrote is still in the page cache
    loc = direct.locate(m.path("a.kv"))
    with pytest.raises(Exception) as e:
        direct.read_object(loc)
    assert e.type.__name__ == "CorruptObject"
    m.expect_log("checksum|corrupt")
    with pytest.raises(OSError) as e:  # read_file falls back to the mount, which answers EIO and drops it
        direct.read_file(m.path("a.kv"))
    assert e.value.errno == 5
    assert m.stats()["checksum_failures"] == 1
    assert not m.path("a.kv").exists()


def test_unsaved_or_foreign_files_are_read_through_the_mount(make_mount, tmp_path):
    m = make_mount().start()
    with open(m.path("open.kv"), "wb") as f:
        f.write(b"x" * 5000)
        f.flush()
        assert direct.locate(m.path("open.kv")) is None  # nothing committed yet
        got, hit = direct.read_file(m.path("open.kv"))
        assert (got, hit) == (bytearray(b"x" * 5000), False)
    _write(m.path("empty.kv"), b"")
    assert direct.read_file(m.path("empty.kv")) == (bytearray(), False)
    plain = tmp_path / "plain.bin"
    plain.write_bytes(b"plain")
    assert direct.read_file(plain) == (bytearray(b"plain"), False)
    with pytest.raises(FileNotFoundError):
        direct.read_file(m.path("missing.kv"))
    # the name is not listed, and setting it changes nothing (cp -a, rsync -X)
    assert direct.XA_OBJECT not in os.listxattr(m.path("empty.kv"))
    os.setxattr(m.path("empty.kv"), direct.XA_OBJECT, b"L2 1 1 /etc/passwd")
    assert direct.locate(m.path("empty.kv")) is None


def test_object_moved_after_locate_still_reads_right(make_mount):
    """A move (here: fsync, which puts the object on L3) after locate: the old path is gone, and read_file
    asks again or reads through the mount; an object already opened keeps its complete bytes. Promotion
    is off: a read of the L3 file would otherwise move it back to L2 at a moment the test cannot know."""
    m = make_mount().start("--promote", "never")
    data = kv_samples("bf16")[1].read_bytes()
    _write(m.path("m.kv"), data)
    old = direct.locate(m.path("m.kv"))
    assert old.tier == "L2"
    fd = os.open(m.path("m.kv"), os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    new = direct.locate(m.path("m.kv"))
    assert new.tier == "L3"
    for _ in range(50):  # the daemon removes the old object's file in a worker thread after the move
        if not os.path.exists(old.path):
            break
        time.sleep(0.1)
    assert not os.path.exists(old.path)
    with pytest.raises(direct.Unavailable):
        direct.read_object(old)
    assert direct.read_file(m.path("m.kv")) == (bytearray(data), True)
    assert m.stats()["tiers"]["L3"]["hits"] >= 1


def test_read_file_asks_again_when_the_object_moved(make_mount, monkeypatch):
    """read_file holding a stale location (the object moved between getxattr and open) asks the mount
    once more and still reads past FUSE."""
    m = make_mount().start("--promote", "never")
    data = kv_samples("bf16")[0].read_bytes()
    _write(m.path("s.kv"), data)
    stale = direct.locate(m.path("s.kv"))
    fd = os.open(m.path("s.kv"), os.O_RDONLY)
    os.fsync(fd)  # moves the object to L3
    os.close(fd)
    for _ in range(50):
        if not os.path.exists(stale.path):
            break
        time.sleep(0.1)
    answers = [stale]
    real_locate = direct.locate
    monkeypatch.setattr(direct, "locate", lambda p: answers.pop() if answers else real_locate(p))
    assert direct.read_file(m.path("s.kv")) == (bytearray(data), True)
    assert not answers


def test_other_users_cannot_open_objects():
    """Tier directories are 0700: a reader without access to them gets its bytes through the mount."""
    root = Path(tempfile.mkdtemp(prefix="kvfs-direct-"))
    os.chmod(root, 0o755)  # the mount must be reachable by the other user; its tier directories are not
    m = KvfsMount(root)
    try:
        m.start("--allow-other")
        data = kv_samples("bf16")[0].read_bytes()
        _write(m.path("p.kv"), data)
        os.chmod(m.path("p.kv"), 0o644)
        code = ("import sys; from kvfs import direct; d, hit = direct.read_file(sys.argv[1]); "
                "print(hit, len(d), d == open(sys.argv[2], 'rb').read())")
        sample = root / "sample.kv"
        sample.write_bytes(data)
        os.chmod(sample, 0o644)
        out = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable,
                              "-c", code, str(m.path("p.kv")), str(sample)], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == ["False", str(len(data)), "True"]
        assert m.stats()["direct_reads"] == 1  # it asked, and could not open the object
    finally:
        if m.proc is not None:
            assert m.stop() == 0
        assert not m.unexpected_log_lines()
        shutil.rmtree(root, ignore_errors=True)


# --- the kernel's run decoder (kvfs_read_frames) on objects built here: every codec and transform a frame
# may have, in one object, decoded by the kernel or (deflate, zstd without libzstd) frame by frame in Python

FRAME = 64 << 10


def _mixed_object(tmp_path, data: bytes) -> tuple[direct.Location, list]:
    from kvfs import codecs
    from kvfs import format as fmt
    from kvfs.codecs import transforms
    from kvfs.codecs.entropy import EntropyCodec
    kinds = [(EntropyCodec(), transforms.IDENTITY), (codecs.by_name("zstd"), transforms.BYTEPLANE2),
             (codecs.by_name("zstd"), transforms.IDENTITY), (codecs.by_name("deflate"), transforms.BYTEPLANE2),
             (codecs.by_name("none"), transforms.IDENTITY)]
    frames = []
    for i, off in enumerate(range(0, len(data), FRAME)):
        codec, transform = kinds[i % len(kinds)]
        frames.append(fmt.encode_frame(data[off:off + FRAME], codec, transform))
    header = fmt.Header(raw_size=len(data), frame_size=FRAME, n_frames=len(frames), element_size=2)
    parts, entries = fmt.build_object(header, frames)
    obj = tmp_path / "object"
    obj.write_bytes(b"".join(parts))
    return direct.Location("L2", obj.stat().st_size, len(data), str(obj)), entries


def _kv_with_holes() -> bytes:
    kv = kv_samples("bf16")[0].read_bytes()[:9 * FRAME]
    return kv[:2 * FRAME] + bytes(FRAME) + kv[2 * FRAME:] + os.urandom(FRAME) + kv[:FRAME // 2 + 3]


@pytest.mark.parametrize("zstd_in_kernel", [True, False])
def test_runs_of_frames_of_every_kind_decode_exactly(tmp_path, zstd_in_kernel):
    import ctypes
    from kvfs.codecs import kernel
    data = _kv_with_holes()
    loc, entries = _mixed_object(tmp_path, data)
    kinds = {(e.codec, e.transform, e.is_hole) for e in entries}
    assert {(4, 0, False), (1, 1, False), (1, 0, False), (2, 1, False), (0, 0, False), (0, 0, True)} <= kinds
    if not zstd_in_kernel:
        kernel.lib.kvfs_use_zstd(None)
    try:
        assert direct.read_object(loc) == data
        buf = bytearray(len(data) + 100)
        assert direct.read_object(loc, into=buf) == data and buf[:len(data)] == data
        for off, n in [(0, FRAME), (FRAME - 1, 2), (FRAME // 2, 5 * FRAME), (3 * FRAME, 2 * FRAME + 1),
                       (FRAME + 9, len(data)), (len(data) - FRAME - 1, 10 * FRAME), (len(data), 4)]:
            assert direct.read_object(loc, off, n) == data[off:off + n], (off, n)
    finally:
        if kernel.ZSTD_IN_KERNEL:
            kernel.lib.kvfs_use_zstd(ctypes.cast(kernel._zstd.ZSTD_decompress, ctypes.c_void_p))


def test_zstd_frames_are_decoded_in_the_kernel_here():
    """Debian's libzstd1 is always installed: the kernel decodes zstd frames without the GIL."""
    from kvfs.codecs import kernel
    assert kernel.ZSTD_IN_KERNEL


@pytest.mark.parametrize("frame_index", [0, 1, 3, 4, 5, 6, 7, 10, 11])  # 2 is the hole: no payload
def test_a_flipped_bit_in_any_frame_is_caught(tmp_path, frame_index):
    from kvfs import format as fmt
    data = _kv_with_holes()
    loc, entries = _mixed_object(tmp_path, data)
    e = entries[frame_index]
    assert not e.is_hole
    raw = bytearray(Path(loc.path).read_bytes())
    raw[e.offset + e.stored_len // 3] ^= 0x08
    Path(loc.path).write_bytes(raw)
    with pytest.raises(fmt.CorruptObject, match=f"frame {frame_index}|checksum"):
        direct.read_object(loc)
    start = frame_index * FRAME  # and a read of that frame alone
    with pytest.raises(fmt.CorruptObject):
        direct.read_object(loc, start, e.raw_len)


def test_an_object_cut_short_is_caught(tmp_path):
    from kvfs import format as fmt
    data = _kv_with_holes()
    loc, entries = _mixed_object(tmp_path, data)
    raw = Path(loc.path).read_bytes()
    Path(loc.path).write_bytes(raw[:entries[4].offset + 10])
    with pytest.raises(fmt.CorruptObject, match="bytes, the index says"):
        direct.read_object(loc)
    cut = direct.Location(loc.tier, entries[4].offset + 10, loc.size, loc.path)  # an index that agrees
    with pytest.raises(fmt.CorruptObject, match="out of bounds"):
        direct.read_object(cut)
