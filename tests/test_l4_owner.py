"""A private L4 belongs to one mount (kvfs/owner.py): the claim on a real Ceph prefix and on a directory L4 —
refusal of a second mount, takeover once the lease has expired or by force, kill -9 of the owner, release at
a clean unmount, a takeover seen by the old owner's renewal; plus the pure rules."""

from __future__ import annotations

import errno
import json
import subprocess
import sys
import time
import uuid

import pytest

from conftest import KvfsMount, s3_client
from kvfs import config as cfg
from kvfs import owner
from kvfs.index import Index
from kvfs.reconcile import reconcile
from kvfs.tiers import DirectoryTier
from test_l4 import fill, l4_keys, sample_bytes, start_with_l4, tier_of, write

OWNER_KEY = "{}/.kvfs-owner"


def owner_record(cluster, prefix: str) -> dict | None:
    try:
        body = s3_client(cluster).get_object(Bucket="kvfs-test", Key=OWNER_KEY.format(prefix))["Body"].read()
    except Exception as e:  # noqa: BLE001
        if "NoSuchKey" in str(e):
            return None
        raise
    return json.loads(body)


def refused(m: KvfsMount, start) -> str:
    """Start a mount that must be refused; returns the daemon's last log line (its reason)."""
    with pytest.raises(AssertionError, match="exited with 1 at start"):
        start()
    m.proc = None  # refused as expected: not a death the fixture reports
    return m.log_text().strip().splitlines()[-1]


def short_lease(tmp_path, seconds: int = 4) -> str:
    toml = tmp_path / f"lease{seconds}.toml"
    toml.write_text(f'[l4]\nlease = "{seconds}s"\n')
    return str(toml)


def l4_objects(cluster, prefix: str) -> dict[str, int]:
    return {k: size for k, size in l4_keys(cluster, prefix).items() if "/objects/" in k}


def test_second_mount_is_refused_and_the_owner_keeps_every_file(make_mount, ceph):
    """The issue's scenario: A fills a private prefix through small L2/L3 (files reach L4); B, with its own
    state directory, starts on the same prefix without --l4-shared and is refused with one line naming A and
    the ways out; --l4-takeover before A's lease has expired is refused too, and so is a shared mount. A then
    reads all 15 files bit-exact and the prefix holds every object it held."""
    prefix = f"t-{uuid.uuid4().hex[:8]}"
    a = start_with_l4(make_mount("a"), ceph, prefix)
    files = fill(a, 0, n=15)
    assert sum(tier_of(a.path(name)) == "L4" for name in files) >= 6
    objects = l4_objects(ceph, prefix)
    rec = owner_record(ceph, prefix)
    assert rec["pid"] == a.proc.pid and rec["lease_s"] == 60

    b = make_mount("b")
    line = refused(b, lambda: start_with_l4(b, ceph, prefix))
    assert f"L4 s3://kvfs-test/{prefix} is owned by kvfs mount {rec['mount_id']} (host {rec['host']}, " \
           f"pid {rec['pid']}, started " in line, line
    for way in ("--l4-takeover once its lease has expired", "--force now", "--l4-shared"):
        assert way in line, line
    line = refused(b, lambda: start_with_l4(b, ceph, prefix, "--l4-takeover"))
    assert "lease until" in line and "--l4-takeover works once the lease has expired" in line, line
    line = refused(b, lambda: start_with_l4(b, ceph, prefix, "--l4-shared"))
    assert f"is the private prefix of kvfs mount {rec['mount_id']}" in line, line

    assert l4_objects(ceph, prefix) == objects
    for name, data in files.items():
        assert a.path(name).read_bytes() == data, name
    assert owner_record(ceph, prefix)["mount_id"] == rec["mount_id"]


def test_a_private_mount_refuses_a_shared_prefix(make_mount, ceph):
    """A prefix that holds published files (a shared namespace) is refused to a private mount, --force
    included: its reconcile would count every other node's objects as orphans. Nothing there is touched."""
    prefix = f"t-{uuid.uuid4().hex[:8]}"
    s3_client(ceph).put_object(Bucket="kvfs-test", Key=f"{prefix}/files/published.kv", Body=b"someone's")
    m = make_mount()
    for flags in ((), ("--force",)):
        line = refused(m, lambda: start_with_l4(m, ceph, prefix, *flags))
        assert f"L4 s3://kvfs-test/{prefix} is a shared prefix (it holds files/): mount it with --l4-shared" in line
    assert owner_record(ceph, prefix) is None
    assert l4_keys(ceph, prefix) == {f"{prefix}/files/published.kv": len(b"someone's")}


def test_clean_unmount_releases_and_a_restart_takes_its_own_claim(make_mount, ceph):
    """kill -9 leaves the claim, but the same state directory takes it back at once; a clean unmount deletes
    the owner object, after which another mount starts with no flag."""
    prefix = f"t-{uuid.uuid4().hex[:8]}"
    a = start_with_l4(make_mount("a"), ceph, prefix)
    first = owner_record(ceph, prefix)["mount_id"]
    a.kill9()
    assert owner_record(ceph, prefix)["mount_id"] == first  # left behind
    start_with_l4(a, ceph, prefix)  # the same index: its own claim
    assert owner_record(ceph, prefix)["mount_id"] != first
    assert a.stop() == 0
    assert owner_record(ceph, prefix) is None
    b = start_with_l4(make_mount("b"), ceph, prefix)
    assert owner_record(ceph, prefix)["pid"] == b.proc.pid
    assert "took over" not in b.log_text()


def test_kill9_of_the_owner_then_a_takeover_once_the_lease_expires(make_mount, ceph, tmp_path):
    """A (8 s lease) is killed with files in L4: B is refused while the lease runs, starts with --l4-takeover
    once it has expired, says so, and (that is what a takeover means) its reconcile deletes A's objects."""
    prefix = f"t-{uuid.uuid4().hex[:8]}"
    lease = short_lease(tmp_path, 8)
    a = start_with_l4(make_mount("a"), ceph, prefix, "--config", lease)
    files = fill(a, 20)
    assert any(tier_of(a.path(name)) == "L4" for name in files)
    killed_at = time.time()
    a.kill9()
    b = make_mount("b")
    line = refused(b, lambda: start_with_l4(b, ceph, prefix, "--config", lease))
    assert "--l4-takeover once its lease has expired" in line, line
    time.sleep(max(0.0, killed_at + 8 + 2 - time.time()))  # the lease, and the store's 1 s clock
    start_with_l4(b, ceph, prefix, "--config", lease, "--l4-takeover")
    assert "took over the claim of kvfs mount" in b.log_text()
    assert owner_record(ceph, prefix)["pid"] == b.proc.pid
    assert l4_objects(ceph, prefix) == {}
    assert b.stats()["reconcile_orphans_removed"] >= 1


def test_force_takes_over_at_once_and_the_old_owner_stops_writing(make_mount, ceph, tmp_path):
    """B takes a live A's prefix with --force; A's next renewal sees the record is not its own: one error, no
    more writes or deletions in L4 (new files are evicted from L3 instead), its clean unmount leaves B's claim;
    B's files in L4 stay intact and read back."""
    prefix = f"t-{uuid.uuid4().hex[:8]}"
    lease = short_lease(tmp_path)
    same_size = ("--config", lease, "--codec", "none")  # equal-sized objects: a collision passes every check
    a = start_with_l4(make_mount("a"), ceph, prefix, *same_size)
    theirs = fill(a, 30)
    a_in_l4 = [name for name in theirs if tier_of(a.path(name)) == "L4"]
    a_objects = l4_objects(ceph, prefix)
    started = time.monotonic()
    b = start_with_l4(make_mount("b"), ceph, prefix, *same_size, "--force")
    assert time.monotonic() - started >= 4 / 4 + 1  # it gave A one check of its claim first
    assert "took over the claim of kvfs mount" in b.log_text() and "(force)" in b.log_text()
    a.expect_log("was taken over by kvfs mount")
    wait_for_log(a, "was taken over by")
    assert a.stats()["tiers"]["L4"]["fenced"].startswith("taken over by kvfs mount")
    ours = fill(b, 60)  # the same inode numbers as A's files: the same object ids, other bytes
    b_objects = l4_objects(ceph, prefix)
    assert b_objects and any(tier_of(b.path(name)) == "L4" for name in ours)
    assert set(a_objects) & set(b_objects)  # A's rows name keys that now hold B's objects
    a.expect_log(r"object \d+-\d+ vanished from L4; file dropped")
    for name in a_in_l4:  # a miss (an error), never B's bytes
        try:
            data = a.path(name).read_bytes()
        except OSError:
            continue
        assert data == theirs[name], name

    puts = a.stats()["tiers"]["L4"]["requests"]["put"]
    for i in range(8):  # past A's small L2 and L3: demotion to L4 would follow, eviction does instead
        write(a.path(f"late{i}.kv"), sample_bytes(50 + i))
    st = a.stats()["tiers"]  # L3 stays above its high watermark: nothing drains it while L4 is fenced
    assert st["L4"]["requests"]["put"] == puts and st["L3"]["evicted_files"] >= 1, st
    assert a.stop() == 0
    assert owner_record(ceph, prefix)["pid"] == b.proc.pid  # not released by A: not A's
    assert l4_objects(ceph, prefix) == b_objects
    for name, data in ours.items():
        assert b.path(name).read_bytes() == data, name


def test_a_store_silent_for_the_lease_fences_until_a_renewal(make_mount, ceph, tmp_path):
    """RGW paused (a hung store) past the lease's last interval: A stops writing to L4 (another mount may take
    over once the lease has expired); once RGW answers and the record is still A's, the renewal lifts it."""
    prefix = f"t-{uuid.uuid4().hex[:8]}"
    a = start_with_l4(make_mount("a"), ceph, prefix, "--config", short_lease(tmp_path))
    ceph.pause_rgw()
    try:
        wait_for_log(a, "no writes or deletions there until a renewal succeeds")
        assert not a.stats()["tiers"]["L4"]["fenced"] is None
    finally:
        ceph.resume_rgw()
    wait_for_log(a, "claim renewed, writing there again")
    assert a.stats()["tiers"]["L4"]["fenced"] is None
    assert owner_record(ceph, prefix)["pid"] == a.proc.pid


def wait_for_log(m: KvfsMount, text: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in m.log_text():
        assert time.monotonic() < deadline, m.log_text()[-3000:]
        time.sleep(0.1)


def directory_mount(m: KvfsMount, l4_dir, *args: str) -> KvfsMount:
    return m.start("--l3", f"{m.root / (m.mountpoint.name + '-l3')}:8M", "--l4", str(l4_dir), *args, l2_size="8M")


def test_directory_l4_is_locked(make_mount, tmp_path):
    """--l4 DIR: the lock file refuses a second mount (naming the owner; --l4-takeover cannot help while the
    owner lives), kill -9 frees it (a plain start then claims), --force takes it from a live owner, which sees
    the swap at its next check; a clean unmount removes the lock file only when it is the holder's."""
    l4 = tmp_path / "l4dir"
    lease = short_lease(tmp_path)
    a = directory_mount(make_mount("a"), l4, "--config", lease)
    held = json.loads((l4 / ".kvfs-owner").read_bytes())
    assert held["pid"] == a.proc.pid
    b = make_mount("b")
    line = refused(b, lambda: directory_mount(b, l4, "--config", lease))
    assert f"L4 {l4} is owned by kvfs mount {held['mount_id']}" in line and "its lock is held" in line, line
    line = refused(b, lambda: directory_mount(b, l4, "--config", lease, "--l4-takeover"))
    assert "--force takes over now" in line, line

    a.kill9()
    directory_mount(b, l4, "--config", lease)
    assert "was free (that mount is gone)" in b.log_text()
    assert json.loads((l4 / ".kvfs-owner").read_bytes())["pid"] == b.proc.pid

    directory_mount(a, l4, "--config", lease, "--force")
    b.expect_log("was taken over by kvfs mount")
    wait_for_log(b, "was taken over by")
    assert b.stop() == 0
    assert json.loads((l4 / ".kvfs-owner").read_bytes())["pid"] == a.proc.pid  # b's exit left a's lock
    assert a.stop() == 0
    assert not (l4 / ".kvfs-owner").exists()


# -- the pure rules ------------------------------------------------------------------------------------------
ME = owner.OwnerInfo("me0000000000", "index-me", "host-a", 10, 1_000.0, 60.0)
OTHER = owner.OwnerInfo("other0000000", "index-other", "host-b", 20, 900.0, 60.0)


def test_decide():
    assert owner.decide("L", owner.OwnerInfo("x", "index-me", "host-a", 1, 0, 60), ME, None, 2_000, 1_000) == "own"
    assert owner.decide("L", OTHER, ME, "force", 2_000, 1_000) == "force"
    assert owner.decide("L", None, ME, "force", None, 1_000) == "force"
    assert owner.decide("L", OTHER, ME, "expired", 999, 1_000) == "expired"
    with pytest.raises(owner.ClaimRefused, match="in 1000 s: --l4-takeover works once"):
        owner.decide("L", OTHER, ME, "expired", 2_000, 1_000)
    with pytest.raises(owner.ClaimRefused, match="its lock is held: it is alive: --force takes over now"):
        owner.decide("L", OTHER, ME, "expired", None, 1_000)
    with pytest.raises(owner.ClaimRefused, match="lease expired .* --l4-takeover once its lease has expired"):
        owner.decide("L", OTHER, ME, None, 999, 1_000)  # expired, but no flag: still refused
    with pytest.raises(owner.ClaimRefused, match="an owner record kvfs cannot read"):
        owner.decide("L", None, ME, "expired", None, 1_000)
    # the same index on another host is another owner (two hosts cannot share one state directory's lock)
    with pytest.raises(owner.ClaimRefused):
        owner.decide("L", owner.OwnerInfo("x", "index-me", "host-b", 1, 0, 60), ME, None, 2_000, 1_000)


def test_owner_record_round_trip_and_garbage():
    assert owner.OwnerInfo.from_json(ME.to_json()) == ME
    for raw in (b"", b"[]", b"{}", b'{"mount_id": 1}', b"\xff"):
        assert owner.OwnerInfo.from_json(raw) is None


def test_index_id_is_stable(tmp_path):
    first = owner.index_id(tmp_path)
    assert owner.index_id(tmp_path) == first and len(first) == 32


def test_lease_and_takeover_configuration(tmp_path):
    mnt = tmp_path / "m"
    assert cfg.build_config(mnt, l4="s3://b/p").l4_lease_s == 60
    toml = tmp_path / "k.toml"
    toml.write_text('[l4]\nurl = "s3://b/p"\nlease = "90s"\n')
    assert cfg.build_config(mnt, config_file=toml).l4_lease_s == 90
    toml.write_text('[l4]\nurl = "s3://b/p"\nlease = "1s"\n')
    with pytest.raises(cfg.ConfigError, match="under 2 s"):
        cfg.build_config(mnt, config_file=toml)
    assert cfg.build_config(mnt, l4="/some/dir", l4_takeover="force").l4_takeover == "force"
    with pytest.raises(cfg.ConfigError, match="a shared one has no owner"):
        cfg.build_config(mnt, l4="s3://b/p", l4_shared=True, l4_takeover="expired")
    with pytest.raises(cfg.ConfigError, match="private L4"):
        cfg.build_config(mnt, l4_takeover="force")


def test_a_fenced_tier_is_read_only_and_reconcile_keeps_its_objects(tmp_path):
    """What the fence does, on a real directory tier and index: reads go on, writes and deletions fail with
    EROFS, moves to it pause (not available), and the start-up reconcile deletes none of its orphans."""
    l2 = DirectoryTier("L2", tmp_path / "l2", 1 << 30, False)
    l4 = DirectoryTier("L4", tmp_path / "l4", 1 << 30, True)
    l4.put("orphan-1", [b"not named by the index"], durable=False)
    l4.fenced = owner.NOT_CLAIMED
    assert not l4.available() and l2.available()
    assert l4.read("orphan-1", 0, 3) == b"not"
    for call in (lambda: l4.put("x-1", [b"x"], False), lambda: l4.delete("orphan-1"),
                 lambda: l4.remove_stray("00/x.tmp")):
        with pytest.raises(OSError) as e:
            call()
        assert e.value.errno == errno.EROFS and owner.NOT_CLAIMED in str(e.value)
    index = Index(tmp_path / "index.sqlite")
    try:
        report = reconcile(index, [l2, l4])
        assert (report.orphans_kept, report.orphans_removed) == (1, 0)
        assert l4.size_of("orphan-1") == len(b"not named by the index")
        l4.fenced = None  # claimed: the orphan is this mount's to delete
        assert reconcile(index, [l2, l4]).orphans_removed == 1
        assert l4.size_of("orphan-1") is None
    finally:
        index.close()


def test_offline_fsck_reads_without_the_claim_and_repairs_only_with_it(make_mount, tmp_path):
    """kvfs fsck of an unmounted state directory whose private L4 another mount owns: the check runs (it only
    reads), --repair (which may delete there) is refused with the owner's line, exit 8."""
    l4 = tmp_path / "l4dir"
    a = directory_mount(make_mount("a"), l4)
    b = make_mount("b")
    directory_mount(b, tmp_path / "b-l4")
    assert b.stop() == 0
    fsck = [sys.executable, "-m", "kvfs", "fsck", "--state-dir", str(b.state), "--l2", f"{b.l2}:8M",
            "--l3", f"{b.root / 'b-l3'}:8M", "--l4", str(l4)]
    check = subprocess.run(fsck, capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    repair = subprocess.run([*fsck, "--repair"], capture_output=True, text=True, timeout=60)
    assert repair.returncode == 8, repair.stdout + repair.stderr
    assert f"L4 {l4} is owned by kvfs mount" in repair.stdout + repair.stderr
    assert a.alive() and json.loads((l4 / ".kvfs-owner").read_bytes())["pid"] == a.proc.pid
