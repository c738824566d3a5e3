"""Retention (user.kvfs.ttl, I9) on real mounts: files past their retention time leave every tier — L2, L3 and
a real Ceph RGW's L4 — pinned or not; a rewrite starts the time again; directories pass it on; bad values are
refused."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import time
import uuid

import pytest

from test_l4 import l4_keys, start_with_l4
from test_tiers import start_tiered, tier_of, wait_for

KiB = 1 << 10


def put(path, size: int = 64 * KiB) -> bytes:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = os.urandom(size)
    path.write_bytes(data)
    return data


def test_expired_files_leave_every_tier_pinned_or_not(make_mount):
    m = start_tiered(make_mount(), "32M", "64M")
    keep = put(m.path("keep/f"))
    hot, cold, pinned = m.path("s/hot"), m.path("s/cold"), m.path("s/pinned")
    m.path("s").mkdir()
    os.setxattr(m.path("s"), "user.kvfs.ttl", b"3s")  # the directory: files created in it inherit it
    for p in (hot, cold, pinned):
        put(p)
    os.setxattr(cold, "user.kvfs.tier", b"L3")
    os.setxattr(pinned, "user.kvfs.pin", b"1")
    rewritten = put(m.path("r/again"))
    os.setxattr(m.path("r/again"), "user.kvfs.ttl", b"3")
    assert os.getxattr(hot, "user.kvfs.ttl") == b"3" and os.getxattr(m.path("s"), "user.kvfs.ttl") == b"3"
    with pytest.raises(OSError) as e:
        os.getxattr(m.path("keep/f"), "user.kvfs.ttl")
    assert e.value.errno == errno.ENODATA
    assert tier_of(cold) == "L3" and tier_of(hot) == "L2"
    objects_before = len(m.objects())

    time.sleep(1.5)
    rewritten = put(m.path("r/again"))  # a write starts the retention time again
    wait_for(lambda: not hot.exists() and not cold.exists() and not pinned.exists(), timeout=10, what="expiry")
    assert m.path("r/again").read_bytes() == rewritten  # 3 s after its rewrite only
    assert m.path("keep/f").read_bytes() == keep
    s = m.stats()
    assert s["expired_files"] == 3 and s["expired_bytes"] > 0
    wait_for(lambda: len(m.objects()) == objects_before - 3, what="the expired objects to be deleted")
    wait_for(lambda: not m.path("r/again").exists(), timeout=10, what="the rewritten file's expiry")
    m.check_accounting()

    for bad in (b"soon", b"0.2s", b"-1"):
        with pytest.raises(OSError) as e:
            os.setxattr(m.path("keep/f"), "user.kvfs.ttl", bad)
        assert e.value.errno == errno.EINVAL
    os.setxattr(m.path("keep/f"), "user.kvfs.ttl", b"1")
    os.removexattr(m.path("keep/f"), "user.kvfs.ttl")  # retention off again
    time.sleep(2.5)
    assert m.path("keep/f").read_bytes() == keep


def test_expired_files_leave_a_shared_l4_by_the_node_or_by_kvfs_gc(make_mount, ceph, tmp_path):
    """A shared prefix on a real Ceph RGW: a published file whose retention time ends while its node runs is
    deleted from the bucket by the node; one whose node has gone by then is deleted by kvfs gc (the node
    logged its expiry); a file without one stays."""
    prefix = f"ret-{uuid.uuid4().hex[:8]}"
    toml = tmp_path / "kvfs.toml"
    toml.write_text("[l4]\naccess_log_s = 0.5\n")
    a = start_with_l4(make_mount("a"), ceph, prefix, "--l4-shared", "--l4-write", "through", "--promote", "never",
                      "--config", str(toml), l2="64M")
    a.path("kv").mkdir()
    for name, ttl in (("gone", b"3"), ("short", b"8"), ("long", None)):
        put(a.path("kv", name), 256 * KiB)
        if ttl:
            os.setxattr(a.path("kv", name), "user.kvfs.ttl", ttl)
    wait_for(lambda: a.stats()["published_through"] == 3, timeout=15, what="all three published")

    def published() -> list[str]:
        return sorted(k.rsplit("/", 1)[1] for k in l4_keys(ceph, prefix) if "/files/" in k)

    wait_for(lambda: not a.path("kv/gone").exists(), timeout=15, what="expiry on the node")
    wait_for(lambda: published() == ["long", "short"], timeout=15, what="the node to delete the shared object")
    assert a.stats()["expired_files"] == 1
    assert a.stop() == 0  # nobody holds "short" now: only gc can remove it
    gc = [sys.executable, "-m", "kvfs", "gc", f"s3://kvfs-test/{prefix}"]
    env = {**os.environ, **ceph.env}
    out = subprocess.run(gc, capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0 and "deleted 0" in out.stdout, out.stdout + out.stderr  # not yet
    wait_for(lambda: "deleted 1" in subprocess.run(gc, capture_output=True, text=True, env=env, timeout=60).stdout,
             timeout=20, what="kvfs gc to delete the expired file")
    assert published() == ["long"]
