"""L4 on a real Ceph cluster (RGW, S3 API) and on a directory: demotion, promotion, restart, faults at mount,
corruption, multipart and ranged reads, configuration."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
import uuid

import pytest

from conftest import KvfsMount, kv_samples, running_ceph, s3_client
from kvfs import config as cfg
from kvfs.tiers.s3 import S3Location

FILE_BYTES = 3_000_000


def sample_bytes(i: int) -> bytes:
    """Real KV bytes, distinct per i (a sample and its index: stored objects differ)."""
    samples = kv_samples("bf16")
    data = samples[i % len(samples)].read_bytes()
    return (i.to_bytes(4, "little") + data)[:FILE_BYTES]


def start_with_l4(m: KvfsMount, cluster, prefix: str, *args: str, l2: str = "8M", l3: str = "8M") -> KvfsMount:
    return m.start("--l3", f"{m.root / (m.mountpoint.name + '-l3')}:{l3}", "--l4", f"s3://kvfs-test/{prefix}",
                   *args, l2_size=l2, env=cluster.env)


def l4_keys(cluster, prefix: str) -> dict[str, int]:
    """Every key under the prefix but the owner record of its claim (tests/test_l4_owner.py)."""
    s3 = s3_client(cluster)
    keys = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket="kvfs-test", Prefix=f"{prefix}/"):
        keys.update({item["Key"]: item["Size"] for item in page.get("Contents", [])})
    keys.pop(f"{prefix}/.kvfs-owner", None)
    return keys


def settle(m: KvfsMount, timeout: float = 30.0) -> dict:
    """Stats once the mover is idle: no moves or deletions in flight, no backlog, no promotions queued."""
    deadline = time.monotonic() + timeout
    while True:
        st = m.stats()
        mover = st["mover"]
        if not (mover["moves_in_flight"] or mover["backlog_bytes"] or mover["promotions_queued"]
                or mover["deletions_in_flight"]):
            return st
        assert time.monotonic() < deadline, mover
        time.sleep(0.1)


def settled_downloads(m: KvfsMount, quiet_s: float = 0.5, timeout: float = 10.0) -> int:
    """L4's downloaded bytes once no read-ahead has added to them for `quiet_s`."""
    deadline = time.monotonic() + timeout
    last, since = m.stats()["tiers"]["L4"]["bytes_downloaded"], time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = m.stats()["tiers"]["L4"]["bytes_downloaded"]
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            break
    return last


def fill(m: KvfsMount, first: int, n: int = 10, folder: str = "") -> dict[str, bytes]:
    """Write n distinct real-KV files (sample_bytes(first), …) and wait until the mover has placed them."""
    files = {f"{folder}f{i}.kv": sample_bytes(i + first) for i in range(n)}
    for name, data in files.items():
        write(m.path(name), data)
    settle(m)
    return files


def tier_of(path) -> str:
    return os.getxattr(path, "user.kvfs.tier").decode()


def write(path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def test_l3_demotes_to_l4_and_reads_come_back(make_mount, ceph):
    """Small L2 and L3: older files go down to L4 (the bucket holds their objects, accounted in stats); every
    file reads back exactly, and a file read from L4 is promoted to L2."""
    prefix = f"t-{uuid.uuid4().hex[:8]}"
    m = start_with_l4(make_mount(), ceph, prefix)
    files = fill(m, 0)  # the mover drains in the background
    st = settle(m)["tiers"]
    tiers = {name: tier_of(m.path(name)) for name in files}
    assert "L4" in tiers.values(), tiers
    keys = l4_keys(ceph, prefix)
    assert st["L4"]["files"] == len(keys) == sum(t == "L4" for t in tiers.values())
    assert st["L4"]["used_bytes"] == sum(keys.values())
    assert st["L3"]["demoted_files"] >= st["L4"]["files"]
    assert st["L4"]["requests"]["put"] >= st["L4"]["files"]
    assert st["L4"]["path"] == f"s3://kvfs-test/{prefix}"
    in_l4 = [name for name, t in tiers.items() if t == "L4"]
    promoted = st["L2"]["promoted_files"]
    assert m.path(in_l4[0]).read_bytes() == files[in_l4[0]]  # the first read (later ones hit the page cache)
    st = settle(m)["tiers"]
    assert tier_of(m.path(in_l4[0])) == "L2"  # and stays: the read made it the most recent file
    assert st["L2"]["promoted_files"] == promoted + 1 and st["L4"]["hits"] == 1
    for name, data in files.items():  # the churn of small tiers: promotions push other files down again
        assert m.path(name).read_bytes() == data, name
    assert m.stats()["tiers"]["L4"]["hits"] >= len(in_l4) - 1


def test_l4_files_survive_a_restart(make_mount, ceph):
    """Objects in L4 are kept by the start-up reconcile and read back after a remount; a lost L2 (tmpfs at
    reboot) loses only what was there."""
    prefix = f"t-{uuid.uuid4().hex[:8]}"
    m = start_with_l4(make_mount(), ceph, prefix)
    files = fill(m, 20)
    in_l4 = {name for name in files if tier_of(m.path(name)) == "L4"}
    assert in_l4
    assert m.stop() == 0
    start_with_l4(m, ceph, prefix)
    assert m.stats()["reconcile_orphans_removed"] == 0
    for name in in_l4:
        assert tier_of(m.path(name)) == "L4"
        assert m.path(name).read_bytes() == files[name]


def test_multipart_upload_and_ranged_reads(make_mount, ceph, tmp_path):
    """A file above the multipart threshold goes up in parts; reading 4 KiB of it from L4 downloads the header,
    the frame it touches and the read-ahead's, not the object."""
    prefix = f"t-{uuid.uuid4().hex[:8]}"
    toml = tmp_path / "kvfs.toml"
    toml.write_text('[l4]\nmultipart_threshold = "5M"\npart_size = "5M"\n[mount]\npromote = "never"\n')
    m = start_with_l4(make_mount(), ceph, prefix, "--config", str(toml), "--codec", "none", l2="4M", l3="4M")
    data = b"".join(sample_bytes(i) for i in range(4))[:11_000_000]
    write(m.path("big.kv"), data)
    write(m.path("push.kv"), sample_bytes(99))  # a second file pushes big.kv down
    for _ in range(100):
        if tier_of(m.path("big.kv")) == "L4":
            break
        time.sleep(0.1)
    assert tier_of(m.path("big.kv")) == "L4"
    s3 = s3_client(ceph)
    key = next(k for k, size in l4_keys(ceph, prefix).items() if size > 10_000_000)
    head = s3.head_object(Bucket="kvfs-test", Key=key)
    assert head["ETag"].strip('"').endswith("-3"), head["ETag"]  # 11 MB in 5 MiB parts
    assert head["Metadata"]["kvfs-size"] == str(len(data))
    before = m.stats()["tiers"]["L4"]["bytes_downloaded"]
    fd = os.open(m.path("big.kv"), os.O_RDONLY)
    try:
        # no kernel read-ahead: its READs reach into later frames (1.25 MiB of them on this kernel, some
        # arriving after the read returns), and each one ending past a frame's middle starts kvfs's own
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        assert os.pread(fd, 4096, 5_000_000) == data[5_000_000:5_004_096]
    finally:
        os.close(fd)
    downloaded = settled_downloads(m) - before
    # frame 4 (the read ends past its middle) and kvfs's read-ahead of frames 5 and 6; the table was kept
    assert 0 < downloaded <= 3 * (1 << 20) + (64 << 10) < len(data) / 3, downloaded
    assert m.path("big.kv").read_bytes() == data


def test_corrupt_l4_object_is_an_error_not_data(make_mount, ceph):
    """An object changed in the bucket fails its checksum: EIO, the file is dropped, never wrong bytes; the
    object is kept aside under quarantine/, where no restart adopts it."""
    prefix = f"t-{uuid.uuid4().hex[:8]}"
    m = start_with_l4(make_mount(), ceph, prefix, "--promote", "never")
    files = fill(m, 40)
    victim = next(name for name in files if tier_of(m.path(name)) == "L4")
    stored = int(os.getxattr(m.path(victim), "user.kvfs.stored_bytes"))
    s3 = s3_client(ceph)
    key = next(k for k, size in l4_keys(ceph, prefix).items() if size == stored)
    body = bytearray(s3.get_object(Bucket="kvfs-test", Key=key)["Body"].read())
    body[len(body) // 2] ^= 0x40
    s3.put_object(Bucket="kvfs-test", Key=key, Body=bytes(body))
    m.expect_log("corrupt")
    with pytest.raises(OSError) as e:
        m.path(victim).read_bytes()
    assert e.value.errno == errno.EIO
    st = m.stats()
    assert st["checksum_failures"] >= 1 and st["tiers"]["L4"]["quarantined"] == 1
    assert not m.path(victim).exists()
    quarantined = [k for k in l4_keys(ceph, prefix) if k.startswith(f"{prefix}/quarantine/")]
    assert len(quarantined) == 1
    assert s3.get_object(Bucket="kvfs-test", Key=quarantined[0])["Body"].read() == bytes(body)
    assert m.stop() == 0  # a restart does not adopt the quarantined object
    start_with_l4(m, ceph, prefix, "--promote", "never")
    assert not m.path(victim).exists()
    assert [k for k in l4_keys(ceph, prefix) if k.startswith(f"{prefix}/quarantine/")] == quarantined
    assert m.stats()["tiers"]["L4"]["files"] == len([k for k in l4_keys(ceph, prefix) if "/objects/" in k])


def test_unreachable_endpoint_at_mount_is_a_clear_error(tmp_path, ceph):
    """Mounting with an endpoint nobody answers fails at once, saying which L4 and why; the secret key never
    appears in the output or the log."""
    env = {**ceph.env, "AWS_ENDPOINT_URL": "http://127.0.0.1:9"}
    m = KvfsMount(tmp_path)
    out = subprocess.run([sys.executable, "-m", "kvfs", "mount", str(m.mountpoint), "--l4", "s3://kvfs-test/x",
                          "--state-dir", str(m.state), "--l2", f"{m.l2}:8M"], capture_output=True, text=True,
                         env={**os.environ, **env}, timeout=60)
    assert out.returncode != 0
    text = out.stdout + out.stderr + m.state.joinpath("kvfs.log").read_text()
    assert "L4 s3://kvfs-test/x at http://127.0.0.1:9 is not usable" in text, text
    assert ceph.env["AWS_SECRET_ACCESS_KEY"] not in text
    assert not os.path.ismount(m.mountpoint)


def test_directory_l4(make_mount, tmp_path):
    """--l4 DIR: a directory on a distributed filesystem, through the same tier interface."""
    m = make_mount()
    l4 = tmp_path / "shared-fs"
    m.start("--l3", f"{tmp_path / 'l3'}:8M", "--l4", str(l4), l2_size="8M")
    files = fill(m, 60)
    assert "L4" in {tier_of(m.path(name)) for name in files}
    assert m.stats()["tiers"]["L4"]["files"] == len([p for p in l4.glob("*/*") if p.is_file()]) > 0
    for name, data in files.items():
        assert m.path(name).read_bytes() == data


def test_l4_configuration():
    """URL, TOML options and their checks; credentials never in a repr."""
    c = cfg.build_config("/mnt/x", l4="s3://bucket/some/prefix/", l4_capacity="2T")
    assert c.l4.s3 == S3Location("bucket", "some/prefix") and c.l4.capacity == 2 << 40 and c.l4.persistent
    assert [t.name for t in c.tiers] == ["L2", "L3", "L4"]
    assert cfg.build_config("/mnt/x").l4 is None
    assert cfg.build_config("/mnt/x", l4="/mnt/cephfs/kv").l4.path.as_posix() == "/mnt/cephfs/kv"
    loc = S3Location.parse_url("s3://b/p", access_key_id="AKIA", secret_access_key="very-secret")
    assert "very-secret" not in repr(loc) and "AKIA" not in repr(loc)
    with pytest.raises(cfg.ConfigError, match="no bucket"):
        cfg.build_config("/mnt/x", l4="s3:///p")


def test_l4_toml_options(tmp_path):
    toml = tmp_path / "k.toml"
    toml.write_text('[l4]\nurl = "s3://b/p"\nendpoint_url = "http://127.0.0.1:7480"\npath_style = true\n'
                    'secret_access_key = "s"\naccess_key_id = "a"\npart_size = "16M"\n')
    c = cfg.build_config("/mnt/x", config_file=toml)
    assert c.l4.s3.endpoint_url == "http://127.0.0.1:7480" and c.l4.s3.path_style and c.l4.s3.part_size == 16 << 20
    toml.write_text('[l4]\nurl = "s3://b/p"\npart_size = "1M"\n')
    with pytest.raises(cfg.ConfigError, match="part_size"):
        cfg.build_config("/mnt/x", config_file=toml)
    toml.write_text('[l4]\nurl = "s3://b/p"\nendpoint = "x"\n')
    with pytest.raises(cfg.ConfigError, match="unknown keys"):
        cfg.build_config("/mnt/x", config_file=toml)
    toml.write_text('[l4]\nurl = "/some/dir"\npath_style = true\n')
    with pytest.raises(cfg.ConfigError, match="S3 options"):
        cfg.build_config("/mnt/x", config_file=toml)


def test_store_down_fails_fast_writes_go_on_and_it_recovers(make_mount, ceph, tmp_path):
    """RGW stopped: reading a file that lives only in L4 answers EIO within the deadline; after a few failures
    the circuit opens and such reads fail at once. Local files still read, and writes go on: with L4 down, L3
    keeps its files until a writer needs room, then evicts (counted apart). RGW back: a probe closes the
    circuit, the L4 file reads right and demotion resumes."""
    prefix = f"t-{uuid.uuid4().hex[:8]}"
    toml = tmp_path / "kvfs.toml"
    toml.write_text("[l4]\nbreaker_failures = 2\nprobe_s = 1\n")
    m = start_with_l4(make_mount(), ceph, prefix, "--promote", "never", "--config", str(toml))
    files = fill(m, 80)
    remote = [name for name in files if tier_of(m.path(name)) == "L4"]
    local = next(name for name in files if tier_of(m.path(name)) == "L2")
    demoted = m.stats()["tiers"]["L3"]["demoted_files"]
    ceph.stop_rgw()
    try:
        for name in remote[:2]:
            t = time.monotonic()
            with pytest.raises(OSError) as e:
                m.path(name).read_bytes()
            assert e.value.errno == errno.EIO
            assert time.monotonic() - t < 15
        st = m.stats()["tiers"]["L4"]
        assert st["breaker"] == "open" and st["failures"] >= 2, st
        t = time.monotonic()
        with pytest.raises(OSError):
            m.path(remote[-1]).read_bytes()
        assert time.monotonic() - t < 0.5  # fails fast: no network call while the circuit is open
        assert m.path(local).read_bytes() == files[local]
        more = {f"g{i}.kv": sample_bytes(i + 100) for i in range(6)}
        for name, data in more.items():  # L2 and L3 are full: L3 must evict, L4 cannot take anything
            write(m.path(name), data)
        assert m.path("g5.kv").read_bytes() == more["g5.kv"]
        st = m.stats()["tiers"]
        assert st["L3"]["evicted_next_down_files"] >= 1 and st["L3"]["demoted_files"] == demoted
        assert m.alive()
    finally:
        ceph.start_rgw()
    back = next(name for name in remote if m.path(name).exists())
    deadline = time.monotonic() + 20
    while True:  # the first calls after the restart are probes; the one that succeeds closes the circuit
        try:
            assert m.path(back).read_bytes() == files[back]
            break
        except OSError:
            assert time.monotonic() < deadline
            time.sleep(0.5)
    assert m.stats()["tiers"]["L4"]["breaker"] == "closed"
    more2 = {f"h{i}.kv": sample_bytes(i + 120) for i in range(4)}
    for name, data in more2.items():
        write(m.path(name), data)
    settle(m)
    assert m.stats()["tiers"]["L3"]["demoted_files"] > demoted  # demotion resumed


def test_hung_store_answers_eio_at_the_deadline(make_mount, ceph, tmp_path):
    """RGW frozen (it accepts connections and never answers): a read of an L4 file gets EIO at the deadline,
    not after botocore's timeouts and retries; the store unfrozen, the file reads right."""
    prefix = f"t-{uuid.uuid4().hex[:8]}"
    toml = tmp_path / "kvfs.toml"
    toml.write_text("[l4]\ndeadline_s = 2\ntimeout_s = 30\nprobe_s = 1\n")
    m = start_with_l4(make_mount(), ceph, prefix, "--promote", "never", "--config", str(toml))
    files = fill(m, 140)
    remote = next(name for name in files if tier_of(m.path(name)) == "L4")
    ceph.pause_rgw()
    try:
        t = time.monotonic()
        with pytest.raises(OSError) as e:
            m.path(remote).read_bytes()
        elapsed = time.monotonic() - t
        assert e.value.errno == errno.EIO and 1.5 < elapsed < 6, elapsed
        assert m.stats()["tiers"]["L4"]["timeouts"] >= 1
    finally:
        ceph.resume_rgw()
    deadline = time.monotonic() + 40
    while True:
        try:
            assert m.path(remote).read_bytes() == files[remote]
            break
        except OSError:
            assert time.monotonic() < deadline
            time.sleep(0.5)


def test_commit_to_a_hung_store_fails_at_the_deadline_and_says_why(make_mount, ceph, tmp_path):
    """A file too big for L2 and L3 is committed straight to L4. The store frozen (as a full Ceph OSD blocks
    writes): close() gets EIO at the deadline, the log says which commit failed and why, the mount stays up,
    and the next commit after the store comes back succeeds."""
    prefix = f"t-{uuid.uuid4().hex[:8]}"
    toml = tmp_path / "kvfs.toml"
    toml.write_text("[l4]\ndeadline_s = 2\ntimeout_s = 30\nprobe_s = 1\nbreaker_failures = 5\n")
    m = start_with_l4(make_mount(), ceph, prefix, "--config", str(toml), l2="1M", l3="1M")
    data = sample_bytes(170)
    ceph.pause_rgw()
    try:
        t = time.monotonic()
        with pytest.raises(OSError) as e:
            write(m.path("big.kv"), data)
        elapsed = time.monotonic() - t
        assert e.value.errno == errno.EIO and 1.5 < elapsed < 6, elapsed
    finally:
        ceph.resume_rgw()
    warnings = [line for line in m.log_text().splitlines() if "commit of inode" in line]
    assert len(warnings) == 1 and "the writer got EIO" in warnings[0] and "L4 did not answer within" in warnings[0], \
        warnings
    assert m.stats()["commit_failures"] == 1
    deadline = time.monotonic() + 40
    while True:  # the breaker may hold L4 down until its next probe
        try:
            write(m.path("big.kv"), data)
            break
        except OSError:
            assert time.monotonic() < deadline
            time.sleep(0.5)
    assert tier_of(m.path("big.kv")) == "L4" and m.path("big.kv").read_bytes() == data


@pytest.fixture(scope="module")
def replicated_ceph(tmp_path_factory):
    """A cluster of 3 bluestore OSDs with 3-way replication, beside the session's cluster (other ports)."""
    yield from running_ceph(tmp_path_factory.mktemp("ceph3"), osds=3, store="bluestore", port=7481,
                            mon_ports=(3301, 6790))


def test_an_osd_killed_mid_run_loses_nothing(make_mount, replicated_ceph):
    """3 OSDs, 3 copies: one OSD killed while kvfs demotes to L4. Writes never fail (they land on L2/L3);
    reads during the OSD's failover may fail (EIO: never wrong bytes); once the cluster has marked it down,
    every file reads back exactly, and after it restarts too."""
    ceph = replicated_ceph
    pool = json.loads(ceph.ceph("osd", "pool", "get", "default.rgw.buckets.data", "size", "-f", "json"))
    assert pool["size"] == 3
    prefix = f"t-{uuid.uuid4().hex[:8]}"
    m = start_with_l4(make_mount(), ceph, prefix)
    files = {}
    for i in range(16):
        files[f"f{i}.kv"] = sample_bytes(i + 160)
        write(m.path(f"f{i}.kv"), files[f"f{i}.kv"])
        if i == 8:
            ceph.kill_osd(1)
    deadline = time.monotonic() + 90
    while ceph.osds_up() != 2:
        assert time.monotonic() < deadline
        time.sleep(0.5)
    settle(m, timeout=90)
    in_l4 = [name for name in files if tier_of(m.path(name)) == "L4"]
    assert in_l4
    for name, data in files.items():
        deadline = time.monotonic() + 60
        while True:  # placement groups may still be peering: EIO is allowed for a while, wrong bytes never
            try:
                assert m.path(name).read_bytes() == data, name
                break
            except OSError as e:
                assert e.errno == errno.EIO and time.monotonic() < deadline, e
                time.sleep(1)
    ceph.start_osd(1)
    while ceph.osds_up() != 3:
        assert time.monotonic() < deadline + 60
        time.sleep(0.5)
    for name in in_l4:
        if m.path(name).exists() and tier_of(m.path(name)) == "L4":
            assert m.path(name).read_bytes() == files[name]
    assert m.alive()


def test_mounts_share_one_prefix(make_mount, ceph):
    """Two mounts (own daemons, L2 and L3) on one shared prefix see one namespace: what A demotes is
    published by path, and B lists and reads it; published files are immutable on both (EPERM, EXDEV), their
    names cannot be created again (EEXIST); of two mounts that wrote one name, the first to publish wins and
    the other then reads the published bytes; an unlink deletes the published object."""
    prefix = f"t-{uuid.uuid4().hex[:8]}"
    a = start_with_l4(make_mount("a"), ceph, prefix, "--l4-shared", "--promote", "never")
    b = start_with_l4(make_mount("b"), ceph, prefix, "--l4-shared", "--promote", "never")
    b.path("ns", "ab").mkdir(parents=True)
    write(b.path("ns", "ab", "same.kv"), sample_bytes(299))  # B's version of a name, not published yet
    a.path("ns", "ab").mkdir(parents=True)
    write(a.path("ns", "ab", "same.kv"), sample_bytes(300))
    files = fill(a, 200, folder="ns/ab/")
    published = [name for name in files if tier_of(a.path(name)) == "L4"]
    assert published and tier_of(a.path("ns/ab/same.kv")) == "L4"
    keys = l4_keys(ceph, prefix)
    assert all(f"{prefix}/files/{name}" in keys for name in published), keys

    listed = set(os.listdir(b.path("ns", "ab")))
    assert {n.rsplit("/", 1)[1] for n in published} <= listed
    for name in published:
        assert b.path(name).read_bytes() == files[name]
        assert tier_of(b.path(name)) == "L4"
    assert b.path("ns/ab/same.kv").read_bytes() == sample_bytes(299)  # B's own file, still local
    for m in (a, b):
        with pytest.raises(PermissionError):
            open(m.path(published[0]), "r+b")
        with pytest.raises(PermissionError):
            os.truncate(m.path(published[0]), 0)
        with pytest.raises(OSError) as e:
            os.rename(m.path(published[0]), m.path("ns", "ab", "moved.kv"))
        assert e.value.errno == errno.EXDEV
    with pytest.raises(FileExistsError):
        os.open(b.path(published[1]),
                os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    from kvfs_connector import files as chunk_files
    real_exists = chunk_files.exists
    answers = []  # the race: published by A after B's first check (through the mount, then direct)
    chunk_files.exists = lambda path: answers.pop() if answers else real_exists(path)
    try:
        for direct_writes in (False, True):
            answers[:] = [False]
            assert chunk_files.write_atomic(str(b.path(published[2])), [b"other bytes"], {}, direct_writes) is None
            assert not answers
    finally:
        chunk_files.exists = real_exists
    assert b.path(published[2]).read_bytes() == files[published[2]]
    assert not [p for p in os.listdir(b.path("ns", "ab")) if p.endswith(".tmp")]

    for i in range(10):  # B's tiers fill: its same.kv goes down, finds the name published, and yields
        write(b.path(f"ns/ab/g{i}.kv"), sample_bytes(i + 400))
    st = settle(b)
    assert st["publish_conflicts"] == 1
    assert b.path("ns/ab/same.kv").read_bytes() == sample_bytes(300)  # A was first

    victim = published[-1]
    os.unlink(b.path(victim))
    assert f"{prefix}/files/{victim}" not in l4_keys(ceph, prefix)
    assert not b.path(victim).exists()
    with pytest.raises(FileNotFoundError):  # A still had the name: a miss now, not an error
        a.path(victim).read_bytes()
    assert not a.path(victim).exists() and a.stats()["checksum_failures"] == 0


def test_write_through_publishes_a_settled_file_once(make_mount, ceph):
    """Write policy through: a file written under a temp name and renamed is published under its final name,
    in one upload, about a second after its last close, and stays on A's L2; B reads it from L4 at once."""
    prefix = f"t-{uuid.uuid4().hex[:8]}"
    args = ("--l4-shared", "--l4-write", "through", "--promote", "never")
    a = start_with_l4(make_mount("a"), ceph, prefix, *args, l2="512M")
    b = start_with_l4(make_mount("b"), ceph, prefix, *args)
    a.path("ns", "cd").mkdir(parents=True)
    data = sample_bytes(500)
    puts = a.stats()["tiers"]["L4"]["requests"]["put"]
    write(a.path("ns", "cd", "chunk.kv.tmp"), data)
    os.rename(a.path("ns", "cd", "chunk.kv.tmp"), a.path("ns", "cd", "chunk.kv"))
    deadline = time.monotonic() + 15
    while a.stats()["published_through"] < 1:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    st = a.stats()
    assert st["tiers"]["L4"]["requests"]["put"] == puts + 1 and tier_of(a.path("ns", "cd", "chunk.kv")) == "L2"
    assert list(k for k in l4_keys(ceph, prefix) if "/files/" in k) == [f"{prefix}/files/ns/cd/chunk.kv"]
    assert b.path("ns", "cd", "chunk.kv").read_bytes() == data
    with pytest.raises(PermissionError):
        open(a.path("ns", "cd", "chunk.kv"), "ab")
    assert a.path("ns", "cd", "chunk.kv").read_bytes() == data


def test_gc_keeps_a_shared_prefix_within_its_size(make_mount, ceph, tmp_path):
    """kvfs gc deletes the least recently used published files first: a file read (by any mount, from its
    access log) outlives newer files nobody read; the logs read are compacted into one."""
    prefix = f"t-{uuid.uuid4().hex[:8]}"
    toml = tmp_path / "kvfs.toml"
    toml.write_text("[l4]\naccess_log_s = 0.5\n")
    args = ("--l4-shared", "--l4-write", "through", "--promote", "never", "--config", str(toml))
    a = start_with_l4(make_mount("a"), ceph, prefix, *args, l2="512M")
    b = start_with_l4(make_mount("b"), ceph, prefix, *args, l2="512M")
    a.path("kv").mkdir()
    for i in range(3):
        write(a.path("kv", f"f{i}.kv"), sample_bytes(600 + i))
        deadline = time.monotonic() + 15
        while a.stats()["published_through"] < i + 1:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        time.sleep(1.1)  # LastModified has whole seconds
    assert b.path("kv", "f0.kv").read_bytes() == sample_bytes(600)  # the oldest, but read now
    deadline = time.monotonic() + 15
    while not [k for k in l4_keys(ceph, prefix) if "/access/" in k]:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    sizes = {k.rsplit("/", 1)[1]: v for k, v in l4_keys(ceph, prefix).items() if "/files/" in k}
    out = subprocess.run([sys.executable, "-m", "kvfs", "gc", f"s3://kvfs-test/{prefix}", "--max-size",
                          str(sizes["f0.kv"] + 1000)], capture_output=True, text=True, env={**os.environ, **ceph.env},
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert "deleted 2" in out.stdout, out.stdout
    left = l4_keys(ceph, prefix)
    assert [k for k in left if "/files/" in k] == [f"{prefix}/files/kv/f0.kv"]
    logs = [k for k in left if "/access/" in k]
    assert len(logs) == 1 and "/access/gc-" in logs[0]
    assert not b.path("kv", "f1.kv").exists()  # gone for mounts that never had it
    assert b.path("kv", "f0.kv").read_bytes() == sample_bytes(600)


def test_moved_back_before_its_old_copy_is_deleted(make_mount, ceph):
    """A file promoted from L4 and sent back at once (the hot/cold API makes that easy): the background
    deletion of its old L4 copy — the same object id, gathered for 50 ms — must not delete the new one."""
    prefix = f"t-{uuid.uuid4().hex[:8]}"
    m = start_with_l4(make_mount(), ceph, prefix, "--promote", "never", l2="64M", l3="64M")
    files = {f"b{i}.kv": sample_bytes(40 + i) for i in range(4)}
    for name, data in files.items():
        write(m.path(name), data)
    for _ in range(3):
        for name in files:
            for tier in (b"L4", b"L2", b"L4"):  # each call returns once the object is there
                os.setxattr(m.path(name), "user.kvfs.tier", tier)
    st = settle(m)
    assert len(l4_keys(ceph, prefix)) == len(files) == st["tiers"]["L4"]["files"]
    for name, data in files.items():
        assert tier_of(m.path(name)) == "L4"
        fd = os.open(m.path(name), os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # from L4, not the page cache
        os.close(fd)
        assert m.path(name).read_bytes() == data, name


def test_direct_gets_match_the_client_on_awkward_keys(ceph, monkeypatch):
    """L4's GETs skip the client's per-call work (kvfs/tiers/s3_get.py) but must fetch what the client fetches:
    whole objects and ranges, keys with spaces, '+', '%', unicode; a missing key and a range past the end
    are the store's own errors, sorted as the client's are."""
    from botocore.exceptions import ClientError

    from kvfs.tiers.s3 import S3Tier

    env = ceph.env
    location = S3Location.parse_url(f"s3://kvfs-test/direct-{uuid.uuid4().hex[:8]}",
                                    endpoint_url=env["AWS_ENDPOINT_URL"], region="us-east-1",
                                    access_key_id=env["AWS_ACCESS_KEY_ID"],
                                    secret_access_key=env["AWS_SECRET_ACCESS_KEY"])
    tier = S3Tier("L4", location, 1 << 30)
    assert tier._direct is not None
    s3 = s3_client(ceph)
    data = sample_bytes(7)
    for object_id in ("files/a b/c+d%20e.kv", "files/ünï/кв ☃.kv", "files/x~y/(1)&[2].kv", "0000000000001a-1"):
        key = tier._key(object_id)
        s3.put_object(Bucket="kvfs-test", Key=key, Body=data)
        assert tier._direct.get(key) == s3.get_object(Bucket="kvfs-test", Key=key)["Body"].read() == data
        assert tier.read(object_id, 12_345, 100_000) == data[12_345:112_345]
        assert tier.read(object_id, len(data) - 10, 100) == data[-10:]  # a range running past the end: what is
        assert tier.read(object_id, len(data) + 5, 100) == b""  # there; starting past it: nothing
        assert b"".join(tier.chunks(object_id, len(data))) == data
    with monkeypatch.context() as small:  # an object above COPY_WHOLE_MAX is copied by ranged GETs of it
        small.setattr("kvfs.tiers.s3.COPY_WHOLE_MAX", 1 << 20)
        pieces = list(tier.chunks(object_id, len(data)))
        assert b"".join(pieces) == data and [len(p) for p in pieces[:-1]] == [1 << 20] * (len(pieces) - 1)
    with pytest.raises(ClientError) as e:
        tier._direct.get(tier._key("files/absent.kv"))
    assert e.value.response["Error"]["Code"] == "NoSuchKey"
    with pytest.raises(FileNotFoundError):
        tier.read("files/absent.kv", 0, 10)
    assert tier.stats()["failures"] == 0  # answers from the store, not failures of it


def test_direct_gets_retry_what_the_store_asks_to_and_report_the_rest():
    """A real HTTP server answering 503 SlowDown first, then the object: the GET is retried and succeeds;
    a 403 is not retried and keeps its code; a server that keeps failing gives up after `attempts`; a
    redirect (a bucket in another region) sends the tier's GETs through the S3 client."""
    import http.server
    import threading

    import boto3
    from botocore.config import Config
    from botocore.exceptions import ClientError

    from kvfs.tiers.s3_get import DirectGet

    answers: list[tuple[int, bytes]] = []
    seen: list[dict] = []

    class Store(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            seen.append(dict(self.headers))
            status, body = answers.pop(0) if answers else (200, b"the object")
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Store)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        session = boto3.session.Session(aws_access_key_id="AK", aws_secret_access_key="SK", region_name="us-east-1")
        client = session.client("s3", endpoint_url=f"http://127.0.0.1:{server.server_port}",
                                config=Config(s3={"addressing_style": "path"}))
        get = DirectGet(client, session.get_credentials(), "bucket", attempts=3)
        error = b"<Error><Code>%s</Code></Error>"
        answers[:] = [(503, error % b"SlowDown"), (500, error % b"InternalError")]
        assert get.get("k") == b"the object"
        assert len(seen) == 3 and seen[-1]["Authorization"].startswith("AWS4-HMAC-SHA256 Credential=AK/")
        seen.clear()
        answers[:] = [(403, error % b"AccessDenied")]
        with pytest.raises(ClientError) as e:
            get.get("k", 5, 9)
        assert e.value.response["Error"]["Code"] == "AccessDenied" and len(seen) == 1
        assert seen[0]["Range"] == "bytes=5-9"
        seen.clear()
        answers[:] = [(503, error % b"SlowDown")] * 5
        with pytest.raises(ClientError) as e:
            get.get("k")
        assert e.value.response["Error"]["Code"] == "SlowDown" and len(seen) == 3

        # a bucket in another region (AWS answers 301): the tier's GETs go through the client, which follows
        # a bucket's region, from then on
        from kvfs.tiers.s3 import S3Tier

        tier = S3Tier("L4", S3Location("bucket", endpoint_url=f"http://127.0.0.1:{server.server_port}",
                                       region="us-east-1", access_key_id="AK", secret_access_key="SK"), 1 << 30)
        assert tier._direct is not None
        seen.clear()
        answers[:] = [(301, error % b"PermanentRedirect")]
        assert tier.read("0000000000000a-1", 0, 10) == b"the object"
        assert tier._direct is None and len(seen) == 2
    finally:
        server.shutdown()
