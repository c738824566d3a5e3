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

from test_l4 import l4_keys, settle, start_with_l4
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


def test_expired_files_leave_l4(make_mount, ceph):
    prefix = f"ret-{uuid.uuid4().hex[:8]}"
    m = start_with_l4(make_mount(), ceph, prefix, "--promote", "never")
    put(m.path("d/a"), 256 * KiB)
    keep = put(m.path("d/b"), 256 * KiB)
    for name in ("a", "b"):
        os.setxattr(m.path("d", name), "user.kvfs.tier", b"L4")
    os.setxattr(m.path("d/a"), "user.kvfs.ttl", b"2s")
    settle(m)
    assert len(l4_keys(ceph, prefix)) == 2
    wait_for(lambda: not m.path("d/a").exists(), timeout=15, what="expiry")
    wait_for(lambda: len(l4_keys(ceph, prefix)) == 1, timeout=15, what="the object's deletion from the bucket")
    assert m.path("d/b").read_bytes() == keep and m.stats()["expired_files"] == 1


def test_kvfs_gc_deletes_published_files_past_their_retention(make_mount, ceph, tmp_path):
    """A shared prefix: the node that published a file with a retention time is gone; kvfs gc deletes the
    file when the time is up (the publishing node logged it), and keeps the others."""
    prefix = f"ret-{uuid.uuid4().hex[:8]}"
    toml = tmp_path / "kvfs.toml"
    toml.write_text("[l4]\naccess_log_s = 0.5\n")
    a = start_with_l4(make_mount("a"), ceph, prefix, "--l4-shared", "--l4-write", "through", "--promote", "never",
                      "--config", str(toml), l2="64M")
    a.path("kv").mkdir()
    put(a.path("kv/short"))
    put(a.path("kv/long"))
    os.setxattr(a.path("kv/short"), "user.kvfs.ttl", b"4")
    wait_for(lambda: a.stats()["published_through"] == 2, timeout=15, what="both published")
    assert a.stop() == 0  # nobody holds the files now: only gc can remove them
    files = [k for k in l4_keys(ceph, prefix) if "/files/" in k]
    assert len(files) == 2 and any("/access/" in k for k in l4_keys(ceph, prefix))
    gc = [sys.executable, "-m", "kvfs", "gc", f"s3://kvfs-test/{prefix}"]
    env = {**os.environ, **ceph.env}
    out = subprocess.run(gc, capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0 and "deleted 0" in out.stdout, out.stdout + out.stderr  # not yet
    time.sleep(4)
    out = subprocess.run(gc, capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0 and "deleted 1" in out.stdout, out.stdout + out.stderr
    assert [k for k in l4_keys(ceph, prefix) if "/files/" in k] == [f"{prefix}/files/kv/long"]
