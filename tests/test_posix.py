"""POSIX semantics through a real mount."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import stat
import subprocess
import sys

import pytest

from conftest import KvfsMount


def test_mkdir_create_write_read_stat(kvfs: KvfsMount):
    d = kvfs.path("model-ns", "ab")
    d.mkdir(parents=True)
    f = d / "abcdef.kv"
    data = os.urandom(3_000_000)
    f.write_bytes(data)
    assert f.read_bytes() == data
    st = f.stat()
    assert st.st_size == len(data) and stat.S_ISREG(st.st_mode)
    assert sorted(os.listdir(d)) == ["abcdef.kv"]
    assert kvfs.path("model-ns").stat().st_nlink == 3


def test_random_offset_writes_and_reads(kvfs: KvfsMount):
    f = kvfs.path("rand")
    model = bytearray()
    rng = __import__("random").Random(7)
    with open(f, "wb+") as fh:
        for _ in range(60):
            off = rng.randrange(0, 3 << 20)
            chunk = os.urandom(rng.randrange(1, 300_000))
            fh.seek(off)
            fh.write(chunk)
            if len(model) < off:
                model.extend(bytes(off - len(model)))
            model[off:off + len(chunk)] = chunk
            fh.flush()
            r = rng.randrange(0, len(model))
            fh.seek(r)
            assert fh.read(200_000) == bytes(model[r:r + 200_000])
    assert f.read_bytes() == bytes(model)


def test_reads_at_any_offset_after_reopen(kvfs: KvfsMount):
    data = os.urandom(5 << 20)
    f = kvfs.path("f")
    f.write_bytes(data)
    fd = os.open(f, os.O_RDONLY)
    try:
        for off in (0, 1, (1 << 20) - 1, 1 << 20, 3 * (1 << 20) + 12345, len(data) - 1, len(data), len(data) + 5):
            assert os.pread(fd, 70_000, off) == data[off:off + 70_000]
    finally:
        os.close(fd)


def test_truncate_shrink_then_grow_reads_zeros(kvfs: KvfsMount):
    f = kvfs.path("t")
    data = os.urandom(2_500_000)
    f.write_bytes(data)
    os.truncate(f, 1_500_000)
    assert f.read_bytes() == data[:1_500_000]
    os.truncate(f, 2_200_000)
    assert f.read_bytes() == data[:1_500_000] + bytes(700_000)
    with open(f, "r+b") as fh:
        fh.truncate(10)
        fh.seek(0, os.SEEK_END)
        fh.write(b"tail")
    assert f.read_bytes() == data[:10] + b"tail"
    os.truncate(f, 0)
    assert f.read_bytes() == b"" and f.stat().st_blocks == 0


def test_o_trunc_and_append(kvfs: KvfsMount):
    f = kvfs.path("a")
    f.write_bytes(b"x" * 100_000)
    f.write_bytes(b"short")
    assert f.read_bytes() == b"short"
    with open(f, "ab") as fh:
        fh.write(b"+more")
    assert f.read_bytes() == b"short+more"


def test_rename_atomic_over_existing(kvfs: KvfsMount):
    a, b = kvfs.path("a"), kvfs.path("b")
    a.write_bytes(b"new" * 1000)
    b.write_bytes(b"old" * 1000)
    fd = os.open(b, os.O_RDONLY)  # an open reader of the replaced file keeps its data
    os.rename(a, b)
    assert b.read_bytes() == b"new" * 1000 and not a.exists()
    assert os.pread(fd, 3000, 0) == b"old" * 1000
    os.close(fd)
    kvfs.path("d1").mkdir()
    kvfs.path("d2").mkdir()
    (kvfs.path("d2") / "x").write_bytes(b"1")
    with pytest.raises(OSError) as e:
        os.rename(kvfs.path("d1"), kvfs.path("d2"))
    assert e.value.errno == errno.ENOTEMPTY
    with pytest.raises(IsADirectoryError):
        os.rename(b, kvfs.path("d1"))
    os.rename(kvfs.path("d1"), kvfs.path("d2", "sub"))
    assert kvfs.path("d2").stat().st_nlink == 3
    assert sorted(os.listdir(kvfs.path("d2"))) == ["sub", "x"]


def test_unlink_open_file_keeps_data_until_close(kvfs: KvfsMount):
    f = kvfs.path("u")
    data = os.urandom(2_000_000)
    f.write_bytes(data)
    with open(f, "r+b") as fh:
        os.unlink(f)
        assert not f.exists()
        assert fh.read() == data
        fh.seek(0)
        fh.write(b"still-writable")
        fh.flush()
        fh.seek(0)
        assert fh.read(14) == b"still-writable"
    kvfs.stop()
    kvfs.start(*kvfs.args)
    assert kvfs.objects() == [] and kvfs.stats()["tiers"]["L2"]["files"] == 0


def test_unsaved_writes_shared_by_handles(kvfs: KvfsMount):
    f = kvfs.path("shared")
    w = os.open(f, os.O_CREAT | os.O_RDWR)
    r = os.open(f, os.O_RDONLY)
    os.pwrite(w, b"hello", 0)
    assert os.pread(r, 5, 0) == b"hello"  # before any close
    os.close(w)
    os.close(r)


def test_statfs_and_du(kvfs: KvfsMount):
    sv = os.statvfs(kvfs.mountpoint)
    assert sv.f_namemax == 255
    assert sv.f_blocks * sv.f_frsize == sum(t["capacity_bytes"] for t in kvfs.stats()["tiers"].values())
    assert sv.f_blocks * sv.f_frsize == (512 << 20) + (16 << 30)  # the fixture's L2 and the default L3
    f = kvfs.path("zeros-and-text")
    f.write_bytes(b"abcd" * 500_000)
    used = os.statvfs(kvfs.mountpoint)
    assert used.f_bfree < sv.f_bfree
    st = f.stat()
    assert 0 < st.st_blocks * 512 < st.st_size // 10  # du shows stored bytes, not logical
    out = subprocess.run(["du", "-sB1", str(f)], capture_output=True, text=True, check=True).stdout
    assert int(out.split()[0]) == st.st_blocks * 512


def test_sparse_file_allocates_nothing_and_efbig(kvfs: KvfsMount):
    f = kvfs.path("sparse")
    with open(f, "wb") as fh:
        fh.seek(40 << 30)
        fh.write(b"end")
    st = f.stat()
    assert st.st_size == (40 << 30) + 3
    assert st.st_blocks * 512 < 2 << 20
    with open(f, "rb") as fh:
        fh.seek(20 << 30)
        assert fh.read(4096) == bytes(4096)
        fh.seek(40 << 30)
        assert fh.read() == b"end"
    fd = os.open(kvfs.path("huge"), os.O_CREAT | os.O_WRONLY)
    with pytest.raises(OSError) as e:
        os.pwrite(fd, b"x", 1 << 40)
    os.close(fd)
    assert e.value.errno == errno.EFBIG
    with pytest.raises(OSError) as e:
        os.truncate(kvfs.path("sparse"), 1 << 40)
    assert e.value.errno == errno.EFBIG


def test_fsync_and_zero_length(kvfs: KvfsMount):
    f = kvfs.path("z")
    f.touch()
    assert f.stat().st_size == 0 and f.read_bytes() == b""
    with open(kvfs.path("synced"), "wb") as fh:
        fh.write(b"durable")
        fh.flush()
        os.fsync(fh.fileno())
        os.fdatasync(fh.fileno())
    assert kvfs.path("synced").read_bytes() == b"durable"


def test_chmod_chown_and_permissions(kvfs: KvfsMount):
    f = kvfs.path("p")
    f.write_bytes(b"secret")
    os.chmod(f, 0o600)
    assert stat.S_IMODE(f.stat().st_mode) == 0o600
    os.chown(f, 1234, 5678)
    st = f.stat()
    assert (st.st_uid, st.st_gid) == (1234, 5678)
    os.chown(f, 0, 0)
    # default_permissions: an unprivileged user is refused by the kernel
    res = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "cat", str(f)],
                         capture_output=True)
    assert res.returncode != 0 and b"Permission denied" in res.stderr


def test_user_xattrs_and_kvfs_info(kvfs: KvfsMount):
    f = kvfs.path("x.kv")
    f.write_bytes(b"\x01\x02" * 100_000)
    os.setxattr(f, "user.owner", b"engine-7")
    assert os.getxattr(f, "user.owner") == b"engine-7"
    # where the file lies and how it is stored: readable by name, not listed (cp -a and rsync -X copy only the
    # file's own xattrs: tests/test_hotcold.py::test_copy_in_and_out_with_xattrs)
    assert os.listxattr(f) == ["user.owner"]
    assert os.getxattr(f, "user.kvfs.tier") == b"L2"
    assert os.getxattr(f, "user.kvfs.codec") == b"zstd"
    stored = int(os.getxattr(f, "user.kvfs.stored_bytes"))
    assert 0 < stored < 200_000 and -(-stored // 512) == f.stat().st_blocks
    os.setxattr(f, "user.kvfs.tier", b"L2")  # its current value: nothing happens (cp -a into the mount works)
    for name in ("user.kvfs.codec", "user.kvfs.stored_bytes", "user.kvfs.transform"):  # informational: ignored
        os.setxattr(f, name, b"qat")
        os.removexattr(f, name)
    assert os.getxattr(f, "user.kvfs.tier") == b"L2" and os.getxattr(f, "user.kvfs.codec") == b"zstd"
    assert int(os.getxattr(f, "user.kvfs.stored_bytes")) == stored
    with pytest.raises(OSError) as e:  # a request for a tier this mount has not (tests/test_hotcold.py: moves)
        os.setxattr(f, "user.kvfs.tier", b"L9")
    assert e.value.errno == errno.EINVAL
    os.removexattr(f, "user.owner")
    with pytest.raises(OSError) as e:
        os.getxattr(f, "user.owner")
    assert e.value.errno == errno.ENODATA
    with pytest.raises(OSError) as e:
        os.setxattr(f, "trusted.x", b"1")
    assert e.value.errno == errno.EOPNOTSUPP
    with pytest.raises(OSError) as e:
        os.setxattr(f, "user.kvfs.dtype", b"int3")
    assert e.value.errno == errno.EINVAL
    os.setxattr(f, "user.owner", b"engine-7")
    out = subprocess.run(["getfattr", "-d", "-m", "-", str(f)], capture_output=True, text=True, check=True).stdout
    assert 'user.owner="engine-7"' in out and "user.kvfs." not in out
    out = subprocess.run(["getfattr", "-n", "user.kvfs.tier", str(f)], capture_output=True, text=True,
                         check=True).stdout
    assert 'user.kvfs.tier="L2"' in out
    out = subprocess.run([sys.executable, "-m", "kvfs", "stat", str(f)], capture_output=True, text=True,
                         check=True).stdout
    assert "tier       L2" in out and "codec      zstd" in out and f"stored     {stored} (" in out
    doc = json.loads(subprocess.run([sys.executable, "-m", "kvfs", "stat", "--json", str(f)], capture_output=True,
                                    text=True, check=True).stdout)
    assert (doc["tier"], doc["codec"], doc["stored_bytes"], doc["size"]) == ("L2", "zstd", stored, 200_000)


def test_shape_hint_xattr_is_validated_and_recorded_in_the_object(kvfs: KvfsMount):
    from kvfs import format as fmt

    f = kvfs.path("chunk.kv")
    hint = b"offset=4096 layer=30 kv=2 head=3 channel=64 token=256"
    fd = os.open(f, os.O_WRONLY | os.O_CREAT, 0o644)
    for bad in (b"layer=30", b"offset=1 layer=0", b"offset=1 a=1 a=2", b"offset=1 " + b"x=1 " * 9, b"offset=x"):
        with pytest.raises(OSError) as e:
            os.setxattr(fd, "user.kvfs.shape", bad)
        assert e.value.errno == errno.EINVAL, bad
    os.setxattr(fd, "user.kvfs.dtype", b"bf16")
    os.setxattr(fd, "user.kvfs.shape", hint)  # before the data, like the connector does
    os.write(fd, b"\x3f\x80" * 300_000)
    os.close(fd)
    assert os.getxattr(f, "user.kvfs.shape") == hint
    (obj,) = kvfs.objects()
    header = fmt.parse_header(obj.read_bytes()[:4096])
    assert fmt.parse_tlvs(header.extensions) == {fmt.EXT_SHAPE: hint}
    assert fmt.parse_shape_hint(hint) == (4096, [("layer", 30), ("kv", 2), ("head", 3), ("channel", 64),
                                                 ("token", 256)])


def test_names_long_non_utf8_and_deep(kvfs: KvfsMount):
    root = os.fsencode(kvfs.mountpoint)
    long_name = b"n" * 255
    with open(os.path.join(root, long_name), "wb") as fh:
        fh.write(b"ok")
    with pytest.raises(OSError) as e:
        open(os.path.join(root, b"n" * 256), "wb")
    assert e.value.errno == errno.ENAMETOOLONG
    odd = b"\xff\xfe-not-utf8-\x80"
    with open(os.path.join(root, odd), "wb") as fh:
        fh.write(b"bytes name")
    assert odd in os.listdir(root)
    with open(os.path.join(root, odd), "rb") as fh:
        assert fh.read() == b"bytes name"
    deep = os.path.join(root, *([b"d"] * 200))
    os.makedirs(deep)
    with open(os.path.join(deep, b"leaf"), "wb") as fh:
        fh.write(b"deep")
    with open(os.path.join(deep, b"leaf"), "rb") as fh:
        assert fh.read() == b"deep"


def test_unsupported_operations_give_clear_errno(kvfs: KvfsMount):
    f = kvfs.path("f")
    f.write_bytes(b"x")
    res = subprocess.run(["fallocate", "-l", "1M", str(f)], capture_output=True, text=True)
    assert res.returncode != 0 and "not supported" in res.stderr
    with pytest.raises(OSError) as e:
        os.mknod(kvfs.path("dev"), 0o600 | stat.S_IFCHR, os.makedev(1, 3))
    assert e.value.errno == errno.EPERM
    os.mkfifo(kvfs.path("fifo"))
    assert stat.S_ISFIFO(kvfs.path("fifo").stat().st_mode)
    os.symlink("f", kvfs.path("link"))
    assert os.readlink(kvfs.path("link")) == "f" and kvfs.path("link").read_bytes() == b"x"
    os.link(f, kvfs.path("hard"))
    assert f.stat().st_nlink == 2 and kvfs.path("hard").read_bytes() == b"x"


def test_stats_file_and_virtual_dir_are_read_only(kvfs: KvfsMount):
    kvfs.path("s").write_bytes(b"q" * 10_000)
    doc = json.loads(kvfs.path(".kvfs", "stats").read_bytes())
    assert doc["tiers"]["L2"]["files"] == 1 and doc["bytes_written"] == 10_000
    assert doc["tiers"]["L2"]["capacity_bytes"] == 512 << 20
    assert doc["compression_ratio"] < 0.1
    for bad in (lambda: open(kvfs.path(".kvfs", "stats"), "wb"), lambda: kvfs.path(".kvfs", "x").mkdir(),
                lambda: os.rename(kvfs.path(".kvfs"), kvfs.path("k")), lambda: kvfs.path(".kvfs").rmdir()):
        with pytest.raises(OSError):
            bad()
    assert ".kvfs" in os.listdir(kvfs.mountpoint)


def test_flock_and_posix_locks(kvfs: KvfsMount):
    f = kvfs.path("lock")
    f.write_bytes(b"")
    with open(f, "rb") as a, open(f, "rb") as b:
        fcntl.flock(a, fcntl.LOCK_EX)
        with pytest.raises(BlockingIOError):
            fcntl.flock(b, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(a, fcntl.LOCK_UN)


def test_mmap_write_is_committed(kvfs: KvfsMount):
    import mmap
    f = kvfs.path("m")
    f.write_bytes(bytes(100_000))
    with open(f, "r+b") as fh:
        mm = mmap.mmap(fh.fileno(), 100_000)
        mm[500:505] = b"mmap!"
        mm.flush()
        mm.close()
    assert f.read_bytes()[500:505] == b"mmap!"
    kvfs.stop()
    kvfs.start(*kvfs.args)
    assert f.read_bytes()[500:505] == b"mmap!"


@pytest.mark.parametrize("allow_other", [False, True])
def test_allow_other(allow_other):
    import shutil
    import tempfile
    from pathlib import Path
    root = Path(tempfile.mkdtemp(prefix="kvfs-allow-other-"))  # traversable by other users, unlike tmp_path
    os.chmod(root, 0o755)
    m = KvfsMount(root)
    try:
        m.start(*(["--allow-other"] if allow_other else []))
        os.chmod(m.mountpoint, 0o755)
        m.path("shared").write_bytes(b"for everyone")
        os.chmod(m.path("shared"), 0o644)
        res = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "cat",
                              str(m.path("shared"))], capture_output=True)
        if allow_other:
            assert res.returncode == 0 and res.stdout == b"for everyone"
        else:
            assert res.returncode != 0  # FUSE refuses other users unless allow_other
        assert m.stop() == 0 and not m.unexpected_log_lines()
    finally:
        if m.proc is not None:
            m.stop()
        shutil.rmtree(root, ignore_errors=True)
