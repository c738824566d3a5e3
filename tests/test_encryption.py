"""Encryption at rest on real mounts (local tiers; the Ceph RGW tests are in test_encryption_l4.py).

Files are written through a real FUSE mount, moved between L2 and a sealed L3 with user.kvfs.tier, and the tier
directories are searched for a known plaintext pattern (codec none: a plain object holds the bytes as they are,
so the search can fail).
"""

from __future__ import annotations

import errno
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from kvfs import crypto
from kvfs import format as fmt

PATTERN = b"KVFS-PLAINTEXT-CANARY:"  # repeated, with a counter, so any 4 KiB of a file holds one


def canary(n: int, seed: int = 0) -> bytes:
    line = lambda i: PATTERN + b"%08d-%04d;" % (i, seed)  # noqa: E731
    return b"".join(line(i) for i in range(n // len(line(0)) + 1))[:n]


def key_file(dir_: Path, name: str = "k1") -> Path:
    path = dir_ / f"{name}.key"
    crypto.write_key_file(path)
    return path


def objects_holding(tier_dir: Path, needle: bytes) -> list[Path]:
    return [p for p in tier_dir.rglob("*") if p.is_file() and needle in p.read_bytes()]


def settle(m, f: Path, tier: str) -> None:
    os.setxattr(f, "user.kvfs.tier", tier.encode())
    assert os.getxattr(f, "user.kvfs.tier") == tier.encode()


def test_a_sealed_l3_holds_no_plaintext_and_reads_back(make_mount, tmp_path):
    k = key_file(tmp_path)
    m = make_mount().start("--codec", "none", "--key-file", str(k), "--encrypt", "L3")
    data = {f"f{i}": canary(3 << 20 | i * 777, i) for i in range(3)}
    for name, body in data.items():
        m.path(name).write_bytes(body)
    assert objects_holding(m.l2, PATTERN)  # L2 is not sealed here: the test can see plaintext
    for name in data:
        settle(m, m.path(name), "L3")
    assert not objects_holding(m.l3, PATTERN)
    assert not objects_holding(m.l2, PATTERN)  # the L2 copies are gone
    assert m.stats()["tiers"]["L3"]["sealed"] and not m.stats()["tiers"]["L2"]["sealed"]
    for name, body in data.items():
        assert m.path(name).read_bytes() == body
    settle(m, m.path("f1"), "L2")  # opened on the way up: L2 is not sealed
    assert objects_holding(m.l2, PATTERN)
    assert m.path("f1").read_bytes() == data["f1"]
    m.check_accounting()


def test_without_encryption_the_same_search_finds_the_plaintext(make_mount):
    m = make_mount().start("--codec", "none")
    m.path("f").write_bytes(canary(2 << 20))
    settle(m, m.path("f"), "L3")
    assert objects_holding(m.l3, PATTERN)


def test_objects_committed_straight_into_a_sealed_tier_are_sealed(make_mount, tmp_path):
    """L2 sealed too (every tier): new objects are sealed as they are built, and direct writes are not offered
    (writers hold no key): kvfs.direct.write_file goes through the mount, kvfs.direct reads fall back too."""
    from kvfs import direct

    k = key_file(tmp_path)
    m = make_mount().start("--codec", "none", "--key-file", str(k), "--encrypt", "L2,L3")
    body = canary(5 << 20)
    assert direct.write_file(m.path("d"), body) is False  # written through the mount
    m.path("w").write_bytes(body)
    assert not objects_holding(m.l2, PATTERN)
    assert direct.read_file(m.path("d")) == (body, False)  # through the mount, which opens it
    assert m.stats()["direct_reads"] == 0
    settle(m, m.path("w"), "L3")
    assert not objects_holding(m.l3, PATTERN)
    assert m.path("w").read_bytes() == body
    with open(m.path("w"), "r+b") as f:  # a partial rewrite of a sealed file: its clean frames are reused
        f.seek(1 << 20)
        f.write(b"x" * 100)
    expected = body[:1 << 20] + b"x" * 100 + body[(1 << 20) + 100:]
    assert m.path("w").read_bytes() == expected
    assert not objects_holding(m.l2, PATTERN) and not objects_holding(m.l3, PATTERN)


def test_flipped_bit_in_a_sealed_object_is_eio(make_mount, tmp_path):
    k = key_file(tmp_path)
    m = make_mount().start("--codec", "none", "--key-file", str(k), "--encrypt", "L3")
    m.expect_log(r"corrupt|checksum|authentication")
    m.path("f").write_bytes(canary(2 << 20))
    settle(m, m.path("f"), "L3")
    (obj,) = m.objects("L3")
    raw = bytearray(obj.read_bytes())
    header = fmt.parse_header(raw)
    entry = fmt.parse_table(header, memoryview(raw)[header.size:], len(raw))[1]
    raw[entry.offset + 1000] ^= 0x10
    # the stored checksum fixed up too, as someone who can write the tier could: only GCM can tell
    pos = header.size + fmt.FRAME_ENTRY.size + 20
    struct.pack_into("<Q", raw, pos, fmt.xxh3(bytes(raw[entry.offset:entry.offset + entry.stored_len])))
    table_len = header.n_frames * fmt.FRAME_ENTRY.size
    struct.pack_into("<Q", raw, header.size + table_len, fmt.xxh3(bytes(raw[header.size:header.size + table_len])))
    obj.write_bytes(raw)
    subprocess.run(["sh", "-c", "echo 3 > /proc/sys/vm/drop_caches"], check=False)
    with pytest.raises(OSError) as err:
        m.path("f").read_bytes()
    assert err.value.errno == errno.EIO
    assert m.stats()["checksum_failures"] == 1


def test_wrong_or_missing_key_is_eio_and_the_file_is_kept(make_mount, tmp_path):
    k1, k2 = key_file(tmp_path, "k1"), key_file(tmp_path, "k2")
    m = make_mount().start("--codec", "none", "--key-file", str(k1), "--encrypt", "L3")
    body = canary(2 << 20)
    m.path("f").write_bytes(body)
    settle(m, m.path("f"), "L3")
    m.stop()
    m.start("--codec", "none", "--key-file", str(k2), "--encrypt", "L3", "--promote", "never")
    m.expect_log(r"sealed with key .* which this mount does not hold")
    with pytest.raises(OSError) as err:
        m.path("f").read_bytes()
    assert err.value.errno == errno.EIO
    assert m.stats()["key_unavailable"] >= 1 and m.stats()["checksum_failures"] == 0
    m.stop()
    m.start("--codec", "none", "--key-file", str(k1), "--encrypt", "L3")
    assert m.path("f").read_bytes() == body  # kept: its key is listed again


def test_rotation_new_objects_use_the_new_key_and_old_ones_stay_readable(make_mount, tmp_path):
    k1, k2 = key_file(tmp_path, "k1"), key_file(tmp_path, "k2")
    m = make_mount().start("--codec", "none", "--key-file", str(k1), "--encrypt", "L3")
    old = canary(2 << 20, 1)
    m.path("old").write_bytes(old)
    settle(m, m.path("old"), "L3")
    m.stop()
    m.start("--codec", "none", "--key-file", str(k2), "--old-key-file", str(k1), "--encrypt", "L3",
            "--promote", "never")
    new = canary(2 << 20, 2)
    m.path("new").write_bytes(new)
    settle(m, m.path("new"), "L3")
    ids = {fmt.parse_header(p.read_bytes()).sealing[0] for p in m.objects("L3")}
    assert ids == {crypto.load_key_file(k1).key_id, crypto.load_key_file(k2).key_id}
    assert m.path("old").read_bytes() == old and m.path("new").read_bytes() == new
    fsck = subprocess.run([sys.executable, "-m", "kvfs", "fsck", str(m.mountpoint), "--json"],
                          capture_output=True, text=True, timeout=120)  # opens and decodes every sealed frame
    assert fsck.returncode == 0, fsck.stdout[-2000:] + fsck.stderr[-2000:]
    assert json.loads(fsck.stdout)["objects_checked"] == 2


def test_key_files_other_users_can_read_are_refused(tmp_path):
    k = key_file(tmp_path)
    os.chmod(k, 0o644)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    res = subprocess.run([sys.executable, "-m", "kvfs", "mount", "--foreground", str(mnt), "--key-file", str(k),
                          "--state-dir", str(tmp_path / "state"), "--l2", f"{tmp_path / 'l2'}:64M"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode != 0 and "chmod 600" in res.stderr and not os.path.ismount(mnt)
    secret = k.read_bytes()
    assert secret.hex() not in res.stderr and secret.hex() not in res.stdout


def test_key_from_the_environment(make_mount, monkeypatch):
    monkeypatch.setenv("KVFS_KEY", os.urandom(32).hex())
    m = make_mount().start("--codec", "none", "--encrypt", "L3")
    m.path("f").write_bytes(canary(1 << 20))
    settle(m, m.path("f"), "L3")
    assert not objects_holding(m.l3, PATTERN)
    assert m.path("f").read_bytes() == canary(1 << 20)


def needle(seed: int) -> bytes:
    return PATTERN + b"00000000-%04d;" % seed


def test_tenant_keys_seal_in_every_tier_and_deleting_one_shreds_only_that_tenant(make_mount, tmp_path):
    """Tenant directories with keys of their own: their files are sealed in L2 already (L3 seals the rest with
    the default key); each tenant's objects carry its key id; a remount without one tenant's key makes that
    tenant's files unreadable (EIO) in every tier, and no one else's."""
    from kvfs import direct

    k, ka, kb = key_file(tmp_path, "default"), key_file(tmp_path, "acme"), key_file(tmp_path, "beta")
    tenants = ["--tenant-key", f"tenants/acme={ka}", "--tenant-key", f"tenants/beta={kb}"]
    m = make_mount().start("--codec", "none", "--key-file", str(k), "--encrypt", "L3", *tenants)
    for d in ("tenants/acme/ab", "tenants/beta", "open"):
        m.path(d).mkdir(parents=True)
    files = {"tenants/acme/ab/x.kv": 1, "tenants/beta/y.kv": 2, "open/z.kv": 3}
    for name, seed in files.items():
        assert direct.write_file(m.path(name), canary(2 << 20, seed)) is (name == "open/z.kv")
    assert not objects_holding(m.l2, needle(1)) and not objects_holding(m.l2, needle(2))
    assert objects_holding(m.l2, needle(3))  # L2 is not sealed for files outside tenant directories
    assert direct.read_file(m.path("tenants/acme/ab/x.kv")) == (canary(2 << 20, 1), False)
    for name in files:
        settle(m, m.path(name), "L3")
    assert not any(objects_holding(m.l3, needle(s)) for s in files.values())
    ids = {fmt.parse_header(p.read_bytes()).sealing[0] for p in m.objects("L3")}
    assert ids == {crypto.load_key_file(p).key_id for p in (k, ka, kb)}
    settle(m, m.path("tenants/acme/ab/x.kv"), "L2")  # promoted: a tenant's file stays sealed
    assert not objects_holding(m.l2, needle(1))
    m.stop()

    m.start("--codec", "none", "--key-file", str(k), "--encrypt", "L3", "--tenant-key", f"tenants/beta={kb}")
    m.expect_log(r"sealed with key .* which this mount does not hold")
    with pytest.raises(OSError) as err:
        m.path("tenants/acme/ab/x.kv").read_bytes()  # in L2, sealed with the deleted key
    assert err.value.errno == errno.EIO
    assert m.path("tenants/beta/y.kv").read_bytes() == canary(2 << 20, 2)
    assert m.path("open/z.kv").read_bytes() == canary(2 << 20, 3)
