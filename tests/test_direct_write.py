"""Direct writes (kvfs.direct.write_file) on real mounts: objects encoded by the writer and adopted by the
daemon read back exactly, are encoded as the daemon would, count against capacity; hostile or garbage staged
objects are refused and never served; writers without rights fall back to the mount; kill -9 of the writer or
the daemon at each step leaves no partial file and no orphan after reconcile; fsck knows the staging place."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import KvfsMount, kv_samples
from kvfs import direct
from kvfs import format as fmt
from kvfs import staging
from kvfs.direct_write import encode_object, staging_offer

KVFS = [sys.executable, "-m", "kvfs"]


def _kv(n: int = 1) -> bytes:
    sample = kv_samples("bf16")[0].read_bytes()
    return b"".join(sample[i * 4096:] + sample[:i * 4096] for i in range(n))


def _staged(m: KvfsMount) -> list[Path]:
    d = m.l2 / staging.STAGING_DIR
    return sorted(d.iterdir()) if d.exists() else []


def _adopt(directory: Path, staged: Path, name: str, **kw) -> None:
    req = staging.AdoptRequest(staged.name, name.encode(), 0o644, **kw)
    os.setxattr(directory, staging.XA_ADOPT, req.encode())


def _stage(m: KvfsMount, directory: Path, data: bytes) -> Path:
    """A writer's staged object, made as write_file makes it."""
    offer = staging_offer(str(directory), fresh=True)
    path = Path(offer.staging) / staging.staged_name()
    path.write_bytes(b"".join(encode_object([memoryview(data)], offer, {})))
    os.chmod(path, 0o600)
    return path


@pytest.mark.parametrize("codec", ["auto", "zstd", "none"])
def test_direct_writes_read_back_exactly_and_match_the_daemons_encoding(make_mount, codec):
    m = make_mount().start("--codec", codec)
    kv = _kv()
    files = {
        "kv": kv,
        "odd": kv[: 3 * (1 << 20) + 12345],  # a short last frame
        "holes": bytes(1 << 20) + kv[:5000] + bytes(2 << 20),  # all-zero frames are holes
        "random": os.urandom((1 << 20) + 7),  # stored raw
        "empty": b"",
    }
    m.path("ns").mkdir()
    for name, data in files.items():
        assert direct.write_file(m.path("ns", name), data) is bool(data), name
        m.path("ns", name + ".fuse").write_bytes(data)  # the same bytes written through the mount
    for name, data in files.items():
        p = m.path("ns", name)
        assert p.read_bytes() == data, name
        assert direct.read_file(p)[0] == data, name
        assert p.stat().st_size == len(data)
        for xa in ("user.kvfs.stored_bytes", "user.kvfs.codec", "user.kvfs.transform"):
            assert os.getxattr(p, xa) == os.getxattr(m.path("ns", name + ".fuse"), xa), (name, xa)
    s = m.stats()
    assert s["direct_writes"] == len(files) - 1 and s["direct_write_bytes"] == sum(map(len, files.values()))
    assert s["adopt_refusals"] == 0 and not _staged(m)
    m.check_accounting()


def test_parts_xattrs_mode_and_replacement(make_mount):
    m = make_mount().start()
    kv = _kv(2)
    cut = [kv[:100], kv[100:(1 << 20) + 5], kv[(1 << 20) + 5:]]  # frames spanning the parts
    shape = b"offset=0 layer=2 kv=2 token=8"
    os.umask(0o022)
    assert direct.write_file(m.path("f.kv"), cut, dtype="bf16", shape=shape, mode=0o666,
                             xattrs={"user.note": b"hello", "user.kvfs.idle": b"3600"})
    p = m.path("f.kv")
    assert p.read_bytes() == kv
    assert os.getxattr(p, "user.kvfs.dtype") == b"bf16" and os.getxattr(p, "user.kvfs.shape") == shape
    assert os.getxattr(p, "user.note") == b"hello" and os.getxattr(p, "user.kvfs.idle") == b"3600"
    assert p.stat().st_mode & 0o777 == 0o644 and p.stat().st_uid == os.getuid()

    with open(p, "rb") as reader:  # a reader keeps the file it opened, as after rename(2) over it
        assert direct.write_file(p, b"new content") is True
        assert reader.read() == kv
    assert p.read_bytes() == b"new content"
    with pytest.raises(FileExistsError):
        direct.write_file(p, b"other", exclusive=True)
    assert p.read_bytes() == b"new content"
    m.path("d").mkdir()
    with pytest.raises(IsADirectoryError):
        direct.write_file(m.path("d"), b"x")
    assert not _staged(m)
    m.check_accounting()


def test_write_files_adopts_a_batch_in_one_request(make_mount):
    """write_files: one adopt request per directory for many files; a batch with an existing name (exclusive)
    is refused whole by the daemon, then each file is written alone and gets its own answer."""
    m = make_mount().start()
    kv = _kv()
    m.path("a").mkdir()
    m.path("b").mkdir()
    m.path("a", "taken").write_bytes(b"first")
    datas = [kv[i * 4096:] + kv[:i * 4096] for i in range(6)]
    files = [direct.FileToWrite(m.path("a", f"f{i}"), d, dtype="bf16", xattrs={"user.i": b"%d" % i})
             for i, d in enumerate(datas)]
    files += [direct.FileToWrite(m.path("b", "empty"), b""), direct.FileToWrite(m.path("b", "g"), [kv[:10], kv[10:]])]
    before = m.stats()["adopt_requests"]
    results = direct.write_files(files)
    assert results == [True] * 6 + [False, True]
    assert m.stats()["adopt_requests"] - before == 2  # one per directory: a/ and b/
    for f, d in zip(files, [*datas, b"", kv]):
        assert Path(f.path).read_bytes() == d
    assert os.getxattr(m.path("a", "f3"), "user.i") == b"3" and os.getxattr(m.path("a", "f3"), "user.kvfs.dtype") == b"bf16"

    again = [direct.FileToWrite(m.path("a", "new1"), datas[0], exclusive=True),
             direct.FileToWrite(m.path("a", "taken"), datas[1], exclusive=True),
             direct.FileToWrite(m.path("a", "new2"), datas[2], exclusive=True)]
    before = m.stats()
    results = direct.write_files(again)
    assert results[0] is True and results[2] is True and isinstance(results[1], FileExistsError), results
    assert m.path("a", "taken").read_bytes() == b"first"
    assert m.path("a", "new1").read_bytes() == datas[0] and m.path("a", "new2").read_bytes() == datas[2]
    after = m.stats()
    assert after["adopt_requests"] - before["adopt_requests"] == 4  # the batch, then each file alone
    assert after["adopt_refusals"] - before["adopt_refusals"] == 2
    assert after["direct_writes"] - before["direct_writes"] == 2
    assert not _staged(m)
    m.check_accounting()


def test_a_batch_with_a_bad_member_adopts_nothing(make_mount):
    m = make_mount().start()
    kv = _kv()
    good, bad = _stage(m, m.mountpoint, kv), _stage(m, m.mountpoint, kv)
    raw = bytearray(bad.read_bytes())
    raw[fmt.parse_header(raw).size] ^= 1  # a byte of its frame table (payloads are checked by the reads)
    bad.write_bytes(bytes(raw))
    batch = [staging.AdoptRequest(good.name, b"good", 0o644), staging.AdoptRequest(bad.name, b"bad", 0o644)]
    with pytest.raises(OSError) as e:
        os.setxattr(m.mountpoint, staging.XA_ADOPT, staging.encode_batch(batch))
    assert e.value.errno == errno.EBADMSG
    assert not m.path("good").exists() and not m.path("bad").exists() and not _staged(m)
    other = _stage(m, m.mountpoint, kv)
    twice = [staging.AdoptRequest(other.name, b"x", 0o644), staging.AdoptRequest(other.name, b"y", 0o644)]
    with pytest.raises(OSError) as e:
        os.setxattr(m.mountpoint, staging.XA_ADOPT, staging.encode_batch(twice))
    assert e.value.errno == errno.EINVAL
    assert m.stats()["direct_writes"] == 0 and m.alive()
    m.check_accounting()


def _valid_object(m: KvfsMount, data: bytes) -> bytes:
    offer = staging_offer(str(m.mountpoint), fresh=True)
    return b"".join(encode_object([memoryview(data)], offer, {}))


def _hostile_objects(m: KvfsMount) -> dict[str, bytes]:
    """Objects a buggy or hostile writer could stage, each one wrong in another way."""
    kv = _kv()
    good = _valid_object(m, kv)
    header = fmt.parse_header(good)
    table_at = header.size
    entries = fmt.parse_table(header, memoryview(good)[table_at:], len(good))

    def with_entries(new_entries, body=None) -> bytes:
        table = b"".join(fmt.FRAME_ENTRY.pack(*dataclasses.astuple(e)) for e in new_entries)
        head = good[:table_at] + table + fmt.CHECKSUM.pack(fmt.xxh3(table))
        return head + (body if body is not None else good[header.data_offset:])

    flipped = bytearray(good)
    flipped[header.data_offset + 100] ^= 1
    e0 = entries[0]
    lying = [dataclasses.replace(e0, raw_xxh3=e0.raw_xxh3 ^ 1), *entries[1:]]
    offer = staging_offer(str(m.mountpoint), fresh=True)
    other_frames = b"".join(encode_object([memoryview(kv)], dataclasses.replace(offer, frame_size=1 << 19), {}))
    sealed = header.sealed_with(b"k" * 8, b"n" * 16)  # a sealing extension, payloads in the clear
    shift = sealed.data_offset - header.data_offset
    sealed_head = fmt.pack_head(sealed, [e if e.is_hole else dataclasses.replace(e, offset=e.offset + shift)
                                         for e in entries])
    return {
        "garbage": os.urandom(5000),
        "empty file": b"",
        "truncated": good[: len(good) - 10],
        "appended": good + b"hidden bytes",
        "payload flipped": bytes(flipped),
        "table checksum": good[:table_at] + bytes([good[table_at] ^ 1]) + good[table_at + 1:],
        "unknown codec": with_entries([dataclasses.replace(e0, codec=99), *entries[1:]]),
        "overlapping frames": with_entries([e0, dataclasses.replace(entries[1], offset=e0.offset), *entries[2:]]),
        # payload checksums right, but the payload does not decode to what its raw checksum says: refused
        # when the daemon decodes at adoption, otherwise caught by the first read of the frame
        "raw checksum lies": with_entries(lying),
        "frame size": other_frames,  # a valid object with frames of another size than the mount's
        "header flags": fmt.pack_head(dataclasses.replace(header, flags=1), entries) + good[header.data_offset:],
        "sealed header": sealed_head + good[header.data_offset:],  # only the daemon seals
        "sealed frame": with_entries([dataclasses.replace(e0, flags=fmt.FRAME_SEALED), *entries[1:]]),
    }


# objects whose header and frame table are right but whose payloads lie: adopted where the daemon does not
# read payloads at adoption, and then refused by the first read (EIO, the file dropped), never served
ACCEPTED_BY_DESIGN = {"table": {"payload flipped", "raw checksum lies"}, "checksums": {"raw checksum lies"},
                      "decode": set()}


@pytest.mark.parametrize("verify", ["table", "checksums", "decode"])
def test_hostile_staged_objects_are_refused_and_never_served(make_mount, tmp_path, verify):
    config = tmp_path / "kvfs.toml"
    config.write_text(f'[mount]\nadopt_verify = "{verify}"\n')
    m = make_mount().start("--config", str(config))
    for name in ACCEPTED_BY_DESIGN[verify]:
        m.expect_log(rf"corrupt object for inode \d+ \(b'{name}'\)")
    refused = 0
    for name, body in _hostile_objects(m).items():
        staged = Path(staging_offer(str(m.mountpoint), fresh=True).staging) / staging.staged_name()
        staged.write_bytes(body)
        if name in ACCEPTED_BY_DESIGN[verify]:
            _adopt(m.mountpoint, staged, name)
            with pytest.raises(OSError) as read:  # the first read checks the frame: EIO, never its bytes
                direct.read_file(m.path(name))
            assert read.value.errno == errno.EIO
            assert not m.path(name).exists()  # dropped
            continue
        with pytest.raises(OSError) as refusal:
            _adopt(m.mountpoint, staged, name)
        assert refusal.value.errno == errno.EBADMSG, (name, refusal.value)
        refused += 1
        assert not staged.exists(), name  # the refused object is gone
        assert not m.path(name).exists(), name
    # the wrong kind of staged file: a symlink, another user's file, a name no writer makes
    target = _stage(m, m.mountpoint, b"x" * 1000)
    link = target.with_name(staging.staged_name())
    link.symlink_to(target)
    with pytest.raises(OSError) as e:
        _adopt(m.mountpoint, link, "link")
    assert e.value.errno == errno.EACCES
    hardlinked = _stage(m, m.mountpoint, b"y" * 1000)
    os.link(hardlinked, tmp_path / "kept")  # its writer could change it after the check
    with pytest.raises(OSError) as e:
        _adopt(m.mountpoint, hardlinked, "hardlinked")
    assert e.value.errno == errno.EACCES
    with pytest.raises(OSError) as e:
        os.setxattr(m.mountpoint, staging.XA_ADOPT, b"adopt 1\nstaged ../../etc/passwd\nmode 644\nexclusive 0\n"
                                                      b"name 6162")
    assert e.value.errno == errno.EINVAL
    s = m.stats()
    assert s["adopt_refusals"] == refused + 3 and s["checksum_failures"] == len(ACCEPTED_BY_DESIGN[verify])
    assert m.alive()
    m.check_accounting()


def test_a_payload_that_lies_is_reported_by_fsck_and_never_served(make_mount):
    """The default adoption reads no payload (adopt_verify "table"): an object whose header and frame table are
    right but one of whose payloads was changed after its checksums were taken is adopted like on-disk
    corruption would be found. fsck reports it; every read of it answers EIO and the file is dropped, never
    its bytes."""
    m = make_mount().start()
    m.expect_log(r"corrupt object for inode \d+ \(b'lying.kv'\)")
    kv = _kv()
    good = _valid_object(m, kv)
    header = fmt.parse_header(good)
    entries = fmt.parse_table(header, memoryview(good)[header.size:], len(good))
    last = entries[-1]
    assert len(entries) > 1 and not last.is_hole
    lying = bytearray(good)
    lying[last.offset + last.stored_len // 2] ^= 0x08  # the last frame: its table entry no longer matches
    staged = Path(staging_offer(str(m.mountpoint), fresh=True).staging) / staging.staged_name()
    staged.write_bytes(lying)
    _adopt(m.mountpoint, staged, "lying.kv")  # adopted: the header and the table are right
    p = m.path("lying.kv")
    assert p.stat().st_size == len(kv) and not staged.exists()

    res = subprocess.run([*KVFS, "fsck", "--json", str(m.mountpoint)], capture_output=True, text=True, timeout=120)
    doc = json.loads(res.stdout)
    assert res.returncode == 4 and doc["counts"]["corrupt"] == 1, (doc, res.stderr)
    (finding,) = doc["findings"]
    assert finding["kind"] == "corrupt" and finding["path"] == "/lying.kv" and "checksum" in finding["detail"]

    loc = direct.locate(p)
    with pytest.raises(fmt.CorruptObject):  # a direct reader checks every frame it decodes
        direct.read_object(loc)
    assert direct.read_object(loc, 0, header.frame_size) == kv[:header.frame_size]  # frame 0 is right: served
    with pytest.raises(OSError) as e:  # then the mount: the daemon checks too, answers EIO and drops the file
        direct.read_file(p)
    assert e.value.errno == errno.EIO
    assert not p.exists()
    assert m.stats()["checksum_failures"] == 1  # the read that dropped it (fsck without --repair keeps it)
    assert m.alive()
    m.check_accounting()


def test_a_staged_file_swapped_or_resized_before_its_rename_is_refused(tmp_path):
    """The daemon checks a staged object through a descriptor and renames it by name: what the rename moved
    must be the file it checked, still of the size it checked, or the adoption is refused."""
    from kvfs.adopt import AdoptRefused, _rename_staged
    from kvfs.tiers.directory import DirectoryTier
    tier = DirectoryTier("L2", tmp_path / "l2", 1 << 30, False)
    staging_dir = tier.make_staging_dir()

    def staged(name: str, body: bytes) -> tuple[Path, int]:
        path = staging_dir / name
        path.write_bytes(body)
        return path, os.open(path, os.O_RDONLY)

    path, fd = staged("a", b"checked")
    (staging_dir / "b").write_bytes(b"swapped")
    os.replace(staging_dir / "b", path)  # the writer put another file under the name after the check
    with pytest.raises(AdoptRefused) as e:
        _rename_staged(tier, path, "10-1", fd, 7)
    assert e.value.errno == errno.EACCES
    os.close(fd)

    path, fd = staged("c", b"checked")
    with open(path, "ab") as f:
        f.write(b" and more")  # a descriptor its writer kept
    with pytest.raises(AdoptRefused):
        _rename_staged(tier, path, "11-1", fd, 7)
    os.close(fd)

    path, fd = staged("d", b"checked")
    _rename_staged(tier, path, "12-1", fd, 7)
    os.close(fd)
    assert Path(tier.local_path("12-1")).read_bytes() == b"checked" and not path.exists()


def test_an_unprivileged_writer_writes_through_the_mount():
    root = Path(tempfile.mkdtemp(prefix="kvfs-dw-"))
    os.chmod(root, 0o755)
    m = KvfsMount(root)
    try:
        m.start("--allow-other")
        m.path("shared").mkdir()
        os.chmod(m.path("shared"), 0o777)
        data = _kv()
        sample = root / "sample.kv"
        sample.write_bytes(data)
        os.chmod(sample, 0o644)
        code = ("import sys; from kvfs import direct; "
                "print(direct.write_file(sys.argv[1], open(sys.argv[2], 'rb').read(), dtype='bf16'))")
        out = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable,
                              "-c", code, str(m.path("shared", "u.kv")), str(sample)], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == ["False"]  # no rights on the staging directory: through the mount
        p = m.path("shared", "u.kv")
        assert p.read_bytes() == data and p.stat().st_uid == 65534
        assert os.getxattr(p, "user.kvfs.dtype") == b"bf16"
        s = m.stats()
        assert s["direct_writes"] == 0 and s["commits"] >= 1
        assert [n for n in os.listdir(m.path("shared"))] == ["u.kv"]  # no temporary name left
        # nor can it adopt another user's staged object, even knowing its name
        staged = _stage(m, m.path("shared"), data)
        code = (f"import os; from kvfs import staging; r = staging.AdoptRequest({staged.name!r}, b'x.kv', 0o644); "
                f"os.setxattr({str(m.path('shared'))!r}, staging.XA_ADOPT, r.encode())")
        out = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable,
                              "-c", code], capture_output=True, text=True)
        assert "PermissionError" in out.stderr, out.stderr
        assert not m.path("shared", "x.kv").exists() and not staged.exists()
    finally:
        if m.proc is not None:
            assert m.stop() == 0
        assert not m.unexpected_log_lines()
        shutil.rmtree(root, ignore_errors=True)


def test_a_mount_without_direct_writes_and_a_plain_directory(make_mount, tmp_path):
    config = tmp_path / "kvfs.toml"
    config.write_text("[mount]\ndirect_writes = false\n")
    m = make_mount().start("--config", str(config))
    data = _kv()
    assert direct.write_file(m.path("a.kv"), data) is False
    assert m.path("a.kv").read_bytes() == data and m.stats()["direct_writes"] == 0
    plain = tmp_path / "plain"
    plain.mkdir()
    assert direct.write_file(plain / "b.kv", data, dtype="bf16") is False
    assert (plain / "b.kv").read_bytes() == data and os.listdir(plain) == ["b.kv"]


def _writer_proc(path: Path, data_file: Path, count: int) -> subprocess.Popen:
    code = ("import sys; from kvfs import direct; d = open(sys.argv[2], 'rb').read()\n"
            "for i in range(int(sys.argv[3])):\n"
            "    assert direct.write_file(f'{sys.argv[1]}-{i}', d[i * 4096:] + d[:i * 4096])\n")
    return subprocess.Popen([sys.executable, "-c", code, str(path), str(data_file), str(count)],
                            stderr=subprocess.PIPE, text=True)


def test_concurrent_direct_writers_overfilling_l2_push_demotion(make_mount, tmp_path):
    """L2 holds a few files: the daemon demotes to L3 to make room for what direct writers stage, as for
    writes through the mount; an object larger than every tier gets ENOSPC; a batch larger than L2 spills
    into L3."""
    m = make_mount().start("--l3", f"{tmp_path / 'l3'}:200M", l2_size="12M")
    data_file = tmp_path / "kv"
    data = _kv()
    data_file.write_bytes(data)
    m.path("w").mkdir()
    writers = [_writer_proc(m.path("w", f"p{k}"), data_file, 12) for k in range(2)]
    for w in writers:
        assert w.wait(120) == 0, w.stderr.read()
    for k in range(2):
        for i in range(12):
            assert m.path("w", f"p{k}-{i}").read_bytes() == data[i * 4096:] + data[:i * 4096]
    s = m.stats()
    assert s["direct_writes"] == 24
    assert s["tiers"]["L2"]["demoted_files"] > 0 and s["tiers"]["L3"]["files"] > 0
    assert s["tiers"]["L2"]["used_bytes"] <= s["tiers"]["L2"]["capacity_bytes"]
    big = os.urandom(16 << 20)  # larger than L2: placed in L3, copied there from the staging directory
    assert direct.write_file(m.path("big"), big)
    assert os.getxattr(m.path("big"), "user.kvfs.tier") == b"L3" and m.path("big").read_bytes() == big
    with pytest.raises(OSError) as e:
        direct.write_file(m.path("huge"), os.urandom(220 << 20))
    assert e.value.errno == errno.ENOSPC
    assert not m.path("huge").exists() and not _staged(m)
    # a batch larger than L2: its objects are charged before any is named (none can be demoted yet), so
    # the ones that no longer fit go to L3
    batch = [direct.FileToWrite(m.path("w", f"batch-{i}"), data[i * 4096:] + data[:i * 4096]) for i in range(8)]
    assert direct.write_files(batch) == [True] * 8
    assert all(Path(f.path).read_bytes() == f.data for f in batch)
    assert not _staged(m)
    m.check_accounting()


WRITER_STEPS = ["writer-writing", "writer-staged"]
DAEMON_STEPS = ["adopt-reserved", "adopt-placed", "adopt-named"]


def _backdate_staged(m: KvfsMount) -> None:
    """Staged files of dead writers are kept for a grace period (pids of other namespaces): skip it."""
    old = time.time() - staging.STAGED_DEAD_GRACE_S - 5
    for p in _staged(m):
        os.utime(p, (old, old))


@pytest.mark.parametrize("step", WRITER_STEPS)
def test_writer_killed_at_each_step(make_mount, tmp_path, step):
    m = make_mount().start()
    data_file = tmp_path / "kv"
    data_file.write_bytes(_kv())
    code = "import sys; from kvfs import direct; direct.write_file(sys.argv[1], open(sys.argv[2], 'rb').read())"
    proc = subprocess.run([sys.executable, "-c", code, str(m.path("f.kv")), str(data_file)],
                          env={**os.environ, "KVFS_CRASH_AT": step})
    assert proc.returncode == -9
    assert not m.path("f.kv").exists()  # no name, no partial file
    (left,) = _staged(m)
    assert not any(s.name == str(left.name) for s in _strays(m))  # not abandoned yet: within its grace
    _backdate_staged(m)
    m.stop()
    m.start()  # reconcile removes the abandoned staged object
    assert not _staged(m) and not m.path("f.kv").exists()
    assert direct.write_file(m.path("f.kv"), data_file.read_bytes())
    m.check_accounting()


def _strays(m: KvfsMount):
    from kvfs.tiers.directory import DirectoryTier
    return list(DirectoryTier("L2", m.l2, 1 << 30, False).strays())


@pytest.mark.parametrize("batch", [1, 3], ids=["file", "batch"])
@pytest.mark.parametrize("step", DAEMON_STEPS)
def test_daemon_killed_at_each_step(make_mount, tmp_path, step, batch):
    m = make_mount().start(env={"KVFS_CRASH_AT": step})
    data = _kv()
    m.path("ns").mkdir()
    names = [m.path("ns", f"f{i}.kv") for i in range(batch)]
    if batch == 1:
        with pytest.raises(OSError):  # the daemon died under the request: ENOTCONN
            direct.write_file(names[0], data)
    else:
        results = direct.write_files([direct.FileToWrite(p, data) for p in names])
        assert all(isinstance(r, OSError) for r in results), results
    assert m.proc.wait(30) == -9
    m.proc = None
    subprocess.run(["fusermount3", "-u", "-z", str(m.mountpoint)], capture_output=True)
    _backdate_staged(m)
    m.start()
    stats = m.stats()
    if step == "adopt-named":  # committed before the reply: the whole batch, or (before it) nothing
        assert all(p.read_bytes() == data for p in names)
    else:
        assert not any(p.exists() for p in names)
        assert stats["reconcile_orphans_removed"] == (batch if step == "adopt-placed" else 0)
    assert not _staged(m)
    m.check_accounting()
    assert direct.write_file(m.path("ns", "g.kv"), data) and m.path("ns", "g.kv").read_bytes() == data


def test_fsck_knows_the_staging_place(make_mount, tmp_path):
    m = make_mount().start()
    live = _stage(m, m.mountpoint, _kv())  # this process is alive: a writer about to adopt it
    dead = _stage(m, m.mountpoint, _kv())
    dead = dead.rename(dead.with_name(f"999999999.{os.urandom(16).hex()}.kvobj"))
    old = time.time() - staging.STAGED_DEAD_GRACE_S - 5
    os.utime(dead, (old, old))
    os.utime(live, (old, old))
    res = subprocess.run([*KVFS, "fsck", "--json", str(m.mountpoint)], capture_output=True, text=True, timeout=120)
    doc = json.loads(res.stdout)
    (finding,) = [f for f in doc["findings"] if f["kind"] == "orphan"]
    assert finding["detail"].startswith(f"abandoned staged object staging/{dead.name}"), finding
    res = subprocess.run([*KVFS, "fsck", "--json", "--repair", str(m.mountpoint)], capture_output=True, text=True,
                         timeout=120)
    assert json.loads(res.stdout)["repaired"] == 1
    assert _staged(m) == [live]
    _adopt(m.mountpoint, live, "live.kv")  # the live writer's object is still adoptable
    assert m.path("live.kv").read_bytes() == _kv()
    m.check_accounting()
