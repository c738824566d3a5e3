"""Encryption at rest on a real Ceph RGW: what reaches the bucket is sealed (AES-256-GCM), and reads back.

Files hold a known plaintext pattern and are written with codec none, so a plain object carries them as they
are; every object under the mount's prefix is fetched from RGW and searched. The test without a key finds the
pattern: the search can fail.
"""

from __future__ import annotations

import errno
import os
import uuid

import pytest
from conftest import s3_client
from test_encryption import PATTERN, canary, key_file
from test_l4 import l4_keys, settle, start_with_l4
from test_tiers import wait_for

from kvfs import crypto
from kvfs import format as fmt


def bucket_objects(cluster, prefix: str) -> dict[str, bytes]:
    s3 = s3_client(cluster)
    return {k: s3.get_object(Bucket="kvfs-test", Key=k)["Body"].read() for k in l4_keys(cluster, prefix)}


def demote_to_l4(m, names) -> None:
    for name in names:
        os.setxattr(m.path(name), "user.kvfs.tier", b"L4")
    settle(m)
    assert all(os.getxattr(m.path(n), "user.kvfs.tier") == b"L4" for n in names)


FILES = {f"f{i}": canary((2 << 20) + i * 4099, i) for i in range(3)}


def write_files(m) -> None:
    for name, body in FILES.items():
        m.path(name).write_bytes(body)


def test_no_known_plaintext_reaches_the_bucket(make_mount, ceph, tmp_path):
    prefix = f"enc-{uuid.uuid4().hex[:8]}"
    k = key_file(tmp_path)
    m = start_with_l4(make_mount(), ceph, prefix, "--codec", "none", "--key-file", str(k), l2="64M", l3="64M")
    st = m.stats()["tiers"]
    assert st["L4"]["sealed"] and not st["L3"]["sealed"] and not st["L2"]["sealed"]  # the default: L4
    write_files(m)
    demote_to_l4(m, FILES)
    objects = bucket_objects(ceph, prefix)
    assert len(objects) == len(FILES)
    assert not [k for k, body in objects.items() if PATTERN in body]
    key_id = crypto.load_key_file(k).key_id
    assert all(fmt.parse_header(body).sealing[0] == key_id for body in objects.values())
    assert sum(len(b) for b in objects.values()) == m.stats()["tiers"]["L4"]["used_bytes"]
    for name, body in FILES.items():  # read from L4, then promoted (opened on the way to L2)
        assert m.path(name).read_bytes() == body
    st = settle(m)["tiers"]
    assert all(os.getxattr(m.path(n), "user.kvfs.tier") == b"L2" for n in FILES)
    assert st["L2"]["used_bytes"] == sum(p.stat().st_size for p in m.objects("L2"))  # the opened sizes
    assert st["L4"]["files"] == st["L4"]["used_bytes"] == 0


def test_without_a_key_the_bucket_holds_the_plaintext(make_mount, ceph):
    prefix = f"enc-{uuid.uuid4().hex[:8]}"
    m = start_with_l4(make_mount(), ceph, prefix, "--codec", "none", l2="64M", l3="64M")
    write_files(m)
    demote_to_l4(m, FILES)
    objects = bucket_objects(ceph, prefix)
    assert len(objects) == len(FILES) and all(PATTERN in body for body in objects.values())


def test_a_flipped_bit_in_the_bucket_is_eio(make_mount, ceph, tmp_path):
    prefix = f"enc-{uuid.uuid4().hex[:8]}"
    k = key_file(tmp_path)
    m = start_with_l4(make_mount(), ceph, prefix, "--codec", "none", "--key-file", str(k), "--promote", "never",
                      l2="64M", l3="64M")
    m.expect_log(r"corrupt|checksum|quarantine")
    m.path("f").write_bytes(FILES["f0"])
    demote_to_l4(m, ["f"])
    (key,) = l4_keys(ceph, prefix)
    body = bytearray(s3_client(ceph).get_object(Bucket="kvfs-test", Key=key)["Body"].read())
    body[-5000] ^= 0x01
    s3_client(ceph).put_object(Bucket="kvfs-test", Key=key, Body=bytes(body))
    with pytest.raises(OSError) as err:
        m.path("f").read_bytes()
    assert err.value.errno == errno.EIO
    assert m.stats()["checksum_failures"] == 1


def test_the_wrong_key_is_eio_and_rotation_keeps_both_keys_readable(make_mount, ceph, tmp_path):
    prefix = f"enc-{uuid.uuid4().hex[:8]}"
    k1, k2 = key_file(tmp_path, "k1"), key_file(tmp_path, "k2")
    m = make_mount()
    start_with_l4(m, ceph, prefix, "--codec", "none", "--key-file", str(k1), l2="64M", l3="64M")
    m.path("old").write_bytes(FILES["f0"])
    demote_to_l4(m, ["old"])
    m.stop()

    start_with_l4(m, ceph, prefix, "--codec", "none", "--key-file", str(k2), "--promote", "never",
                  l2="64M", l3="64M")
    m.expect_log(r"sealed with key .* which this mount does not hold")
    with pytest.raises(OSError) as err:
        m.path("old").read_bytes()
    assert err.value.errno == errno.EIO and m.stats()["key_unavailable"] >= 1
    m.stop()

    start_with_l4(m, ceph, prefix, "--codec", "none", "--key-file", str(k2), "--old-key-file", str(k1),
                  "--promote", "never", l2="64M", l3="64M")
    m.path("new").write_bytes(FILES["f1"])
    demote_to_l4(m, ["new"])
    ids = {fmt.parse_header(body).sealing[0] for body in bucket_objects(ceph, prefix).values()}
    assert ids == {crypto.load_key_file(k1).key_id, crypto.load_key_file(k2).key_id}
    assert m.path("old").read_bytes() == FILES["f0"] and m.path("new").read_bytes() == FILES["f1"]
    assert m.stats()["checksum_failures"] == 0


def test_a_shared_prefix_publishes_sealed_objects_other_mounts_open(make_mount, ceph, tmp_path):
    prefix = f"enc-{uuid.uuid4().hex[:8]}"
    k = key_file(tmp_path)
    a = start_with_l4(make_mount("a"), ceph, prefix, "--l4-shared", "--codec", "none", "--key-file", str(k),
                      "--promote", "never", l2="64M", l3="64M")
    b = start_with_l4(make_mount("b"), ceph, prefix, "--l4-shared", "--codec", "none", "--key-file", str(k),
                      l2="64M", l3="64M")
    a.path("ns").mkdir()
    a.path("ns", "x.kv").write_bytes(FILES["f2"])
    demote_to_l4(a, ["ns/x.kv"])
    objects = bucket_objects(ceph, prefix)
    assert f"{prefix}/files/ns/x.kv" in objects
    assert not [key for key, body in objects.items() if PATTERN in body]
    assert b.path("ns", "x.kv").read_bytes() == FILES["f2"]

    # write policy through: published right after the close, while the local copy stays in L2 (unsealed)
    c = start_with_l4(make_mount("c"), ceph, prefix, "--l4-shared", "--l4-write", "through", "--codec", "none",
                      "--key-file", str(k), "--promote", "never", l2="64M", l3="64M")
    c.path("ns", "y.kv").write_bytes(FILES["f1"])
    wait_for(lambda: c.stats()["published_through"] == 1, what="the write-through publish")
    objects = bucket_objects(ceph, prefix)
    assert f"{prefix}/files/ns/y.kv" in objects
    assert not [key for key, body in objects.items() if PATTERN in body]
    assert b.path("ns", "y.kv").read_bytes() == FILES["f1"]


def test_deleting_a_tenant_key_shreds_its_files_in_the_bucket_and_no_one_elses(make_mount, ceph, tmp_path):
    prefix = f"enc-{uuid.uuid4().hex[:8]}"
    k, ka = key_file(tmp_path, "default"), key_file(tmp_path, "acme")
    m = make_mount()
    start_with_l4(m, ceph, prefix, "--codec", "none", "--key-file", str(k), "--tenant-key", f"acme={ka}",
                  "--promote", "never", l2="64M", l3="64M")
    for d in ("acme", "other"):
        m.path(d).mkdir()
        m.path(d, "f").write_bytes(FILES["f0"])
    demote_to_l4(m, ["acme/f", "other/f"])
    ids = {fmt.parse_header(body).sealing[0] for body in bucket_objects(ceph, prefix).values()}
    assert ids == {crypto.load_key_file(k).key_id, crypto.load_key_file(ka).key_id}
    m.stop()
    start_with_l4(m, ceph, prefix, "--codec", "none", "--key-file", str(k), "--promote", "never",
                  l2="64M", l3="64M")
    m.expect_log(r"sealed with key .* which this mount does not hold")
    with pytest.raises(OSError) as err:
        m.path("acme", "f").read_bytes()
    assert err.value.errno == errno.EIO
    assert m.path("other", "f").read_bytes() == FILES["f0"]
