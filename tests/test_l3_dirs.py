"""L3 over several directories (`--l3 DIR:SIZE` repeated, [l3] directories), on real mounts: objects spread over
the members by weight, bit-exact after demotion and restart; a member that fails for real — EIO (ext4 shut
down), ENOSPC (a tmpfs smaller than its capacity), its filesystem unmounted under the mount — takes out only
its own files while the others read and new demotions go elsewhere; fsck, stats, `kvfs stat` and the metrics
show each directory."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import KvfsMount
from kvfs import metrics
from kvfs.config import ConfigError, build_config
from kvfs.tiers import SpreadTier
from test_tiers import content, read_uncached, tier_of, wait_for

KVFS = [sys.executable, "-m", "kvfs"]
SIZE = 200_000  # random bytes per file: stored size ≈ logical size
EXT4_IOC_SHUTDOWN = 0x8004587D  # _IOR('X', 125, __u32): every later I/O of the filesystem fails with EIO
SHUTDOWN_NOLOGFLUSH = 2

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounts tmpfs and loop filesystems (root)")


# -- helpers ---------------------------------------------------------------------------------------------
@pytest.fixture
def filesystems():
    """mount(kind, path, size): a tmpfs or an ext4 image on a loop device at `path`, unmounted at the end."""
    mounted: list[Path] = []

    def mount(kind: str, path: Path, size: str) -> Path:
        path.mkdir(parents=True, exist_ok=True)
        if kind == "tmpfs":
            cmd = ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)]
        else:
            image = path.with_suffix(".img")
            subprocess.run(["truncate", "-s", size, str(image)], check=True)
            subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True, capture_output=True)
            cmd = ["mount", "-o", "loop", str(image), str(path)]
        subprocess.run(cmd, check=True, capture_output=True)
        mounted.append(path)
        return path

    yield mount
    for path in reversed(mounted):
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def shut_down(path: Path) -> None:
    """ext4 shutdown: from now on every read and write there fails with EIO, as on a dying disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.ioctl(fd, EXT4_IOC_SHUTDOWN, struct.pack("I", SHUTDOWN_NOLOGFLUSH))
    finally:
        os.close(fd)


def objects_in(directory: Path) -> set[str]:
    return {p.name for p in directory.glob("*/*") if p.is_file() and p.parent.name not in ("staging", "lost+found")
            and not p.name.endswith(".tmp")}


def start(m: KvfsMount, *dirs: tuple[Path, str], l2: str = "64M", args: tuple[str, ...] = ()) -> KvfsMount:
    spec = [a for d, size in dirs for a in ("--l3", f"{d}:{size}")]
    return m.start(*spec, "--promote", "never", *args, l2_size=l2)


def write_and_demote(m: KvfsMount, names: list[str]) -> None:
    for name in names:
        m.path(name).write_bytes(content(name, SIZE))
        os.setxattr(m.path(name), "user.kvfs.tier", b"L3")
        assert tier_of(m.path(name)) == "L3"


def spread_over(m: KvfsMount, a: Path, b: Path) -> tuple[KvfsMount, list[str], dict[str, Path]]:
    """A mount with L3 over a and b (24M each), 16 files demoted there, and where each one lies."""
    m = start(m, (a, "24M"), (b, "24M"))
    names = [f"f{i:02d}" for i in range(16)]
    write_and_demote(m, names)
    return m, names, where(m, [a, b], names)


def directories(m: KvfsMount) -> dict[str, dict]:
    return {d["path"]: d for d in m.stats()["tiers"]["L3"]["directories"]}


def where(m: KvfsMount, dirs: list[Path], names: list[str]) -> dict[str, Path]:
    """name → the member directory holding its object (object ids are '<inode hex>-<generation>')."""
    by_id = {oid: d for d in dirs for oid in objects_in(d)}
    out = {}
    for name in names:
        oid = f"{os.stat(m.path(name)).st_ino:x}-"
        matches = [d for o, d in by_id.items() if o.startswith(oid)]
        assert len(matches) == 1, (name, oid, matches)
        out[name] = matches[0]
    return out


def read_errno(path: Path) -> int | None:
    try:
        read_uncached(path)
    except OSError as e:
        return e.errno
    return None


def live_fsck(m: KvfsMount) -> tuple[int, dict]:
    res = subprocess.run([*KVFS, "fsck", str(m.mountpoint), "--json"], capture_output=True, text=True, timeout=60)
    return res.returncode, json.loads(res.stdout)


# -- configuration ---------------------------------------------------------------------------------------
def test_config_several_l3_directories(tmp_path):
    a, b, l2 = tmp_path / "a", tmp_path / "b", f"{tmp_path / 'l2'}:1G"
    cfg = build_config(tmp_path / "m", l2=l2, l3=(f"{a}:100G", f"{b}:50G"))
    assert cfg.l3.directories == ((a, 100 << 30), (b, 50 << 30)) and cfg.l3.capacity == 150 << 30
    assert cfg.l3.path == a and cfg.l3.describe() == f"{a}, {b}"
    one = build_config(tmp_path / "m", l2=l2, l3=(f"{a}:1G",))  # one directory: the tier as before
    assert one.l3.directories == () and one.l3.path == a
    toml = tmp_path / "kvfs.toml"
    toml.write_text(f'[l3]\nhigh_watermark = 0.7\nlow_watermark = 0.5\ndirectories = [\n'
                    f'  {{ path = "{a}", capacity = "2G" }},\n  {{ path = "{b}", capacity = "1G" }},\n]\n')
    cfg = build_config(tmp_path / "m", l2=l2, config_file=toml)
    assert cfg.l3.directories == ((a, 2 << 30), (b, 1 << 30)) and cfg.l3.high_watermark == 0.7
    assert build_config(tmp_path / "m", l2=l2, config_file=toml, l3=f"{b}:3G").l3.directories == ()  # flag wins
    bad = [((f"{a}:1G", f"{a}:1G"), "overlap"), ((f"{a}:1G", f"{a}/x:1G"), "overlap"),
           ((f"{a}:1G", "none"), "none"), ((f"{tmp_path / 'l2'}/x:1G", f"{b}:1G"), "overlap")]
    for spec, message in bad:
        with pytest.raises(ConfigError, match=message):
            build_config(tmp_path / "m", l2=l2, l3=spec)
    toml.write_text(f'[l3]\npath = "{a}"\ndirectories = [{{ path = "{b}", capacity = "1G" }}]\n')
    with pytest.raises(ConfigError, match="not path"):
        build_config(tmp_path / "m", l2=l2, config_file=toml)


# -- spreading ---------------------------------------------------------------------------------------------
def test_placement_follows_capacity(tmp_path):
    """Weighted rendezvous hashing: 3000 objects over directories of 1 and 3 units land about 1:3, each
    where a fresh tier over the same directories (a restart) looks for it first."""
    dirs = [(tmp_path / "small", 100 << 20), (tmp_path / "large", 300 << 20)]
    tier = SpreadTier("L3", dirs, persistent=False)
    ids = [f"{i:x}-1" for i in range(3000)]
    for oid in ids:
        tier.put(oid, [b"x"], durable=False)
    small = len(objects_in(tmp_path / "small"))
    assert 600 < small < 900 and small + len(objects_in(tmp_path / "large")) == 3000, small  # 750 ± 6 sd
    again = SpreadTier("L3", dirs, persistent=False)
    assert all(again.where(oid) == tier.where(oid) for oid in ids)
    assert [(d["files"], d["used_bytes"]) for d in tier.directories()] == [(small, small), (3000 - small, 3000 - small)]


def test_files_spread_and_survive_restart(make_mount, tmp_path):
    """24 files demoted to two directories of 64M and 32M: both hold objects; every figure per directory
    equals what it holds; reads are bit-exact before and after a restart; fsck (live and offline),
    kvfs stat and the metrics show both."""
    a, b = tmp_path / "ssd-a", tmp_path / "ssd-b"
    m = start(make_mount(), (a, "64M"), (b, "32M"))
    names = [f"f{i:02d}" for i in range(24)]
    write_and_demote(m, names)
    held = {d: objects_in(d) for d in (a, b)}
    assert len(held[a]) + len(held[b]) == 24 and held[a] and held[b], held  # the split is random: per-run ids
    for path, d in directories(m).items():
        assert d["state"] == "up" and d["files"] == len(held[Path(path)]), d
        assert d["used_bytes"] == sum(p.stat().st_size for p in Path(path).glob("*/*")), d
    assert all(read_uncached(m.path(n)) == content(n, SIZE) for n in names)

    table = subprocess.run([*KVFS, "stat", str(m.mountpoint)], capture_output=True, text=True, check=True).stdout
    assert "L3 directories" in table and str(a) in table and str(b) in table, table
    families = {f.name: f for f in metrics.families(m.stats())}
    used = {s.labels["directory"]: s.value for s in families["kvfs_directory_used_bytes"].samples}
    assert used == {str(a): directories(m)[str(a)]["used_bytes"], str(b): directories(m)[str(b)]["used_bytes"]}
    states = {(s.labels["directory"], s.labels["state"]): s.value for s in families["kvfs_directory_state"].samples}
    assert states[(str(a), "up")] == states[(str(b), "up")] == 1 and states[(str(b), "down")] == 0
    code, report = live_fsck(m)
    assert code == 0 and [(d["path"], d["objects"]) for d in report["directories"]] == \
        [(str(a), len(held[a])), (str(b), len(held[b]))], report

    assert m.stop() == 0
    offline = subprocess.run([*KVFS, "fsck", "--state-dir", str(m.state), "--l2", f"{m.l2}:64M", "--l3",
                              f"{a}:64M", "--l3", f"{b}:32M", "--json"], capture_output=True, text=True, timeout=60)
    assert offline.returncode == 0, offline.stdout + offline.stderr
    assert sum(d["objects"] for d in json.loads(offline.stdout)["directories"]) == 24
    start(m, (a, "64M"), (b, "32M"))
    assert all(read_uncached(m.path(n)) == content(n, SIZE) for n in names)
    assert {p: (d["files"], d["state"]) for p, d in directories(m).items()} == \
        {str(a): (len(held[a]), "up"), str(b): (len(held[b]), "up")}


# -- failures --------------------------------------------------------------------------------------------
def test_a_directory_failing_with_eio_takes_only_its_files(filesystems, make_mount, tmp_path):
    """Member a (ext4 on a loop device) is shut down under the mount: its files read EIO — never other
    bytes — and the daemon goes on; b's read bit-exact; new demotions all go to b; fsck reports a down and
    its files unchecked (not dropped). After a restart a is unusable from the start: its files are misses."""
    a = filesystems("ext4", tmp_path / "ssd-a", "32M")
    b = filesystems("tmpfs", tmp_path / "ssd-b", "32M")
    m, names, placed = spread_over(make_mount(), a, b)
    on_a = [n for n in names if placed[n] == a]
    on_b = [n for n in names if placed[n] == b]
    assert on_a and on_b, placed

    shut_down(a)
    for name in on_a:
        assert read_errno(m.path(name)) == errno.EIO, name
    for name in on_b:
        assert read_uncached(m.path(name)) == content(name, SIZE), name
    state = directories(m)
    assert state[str(a)]["state"] == "down" and state[str(b)]["state"] == "up", state

    later = [f"g{i:02d}" for i in range(8)]
    before = objects_in(b)
    write_and_demote(m, later)
    assert len(objects_in(b) - before) == len(later)  # every one, including those whose first choice is a
    assert all(read_uncached(m.path(n)) == content(n, SIZE) for n in later)
    stats = m.stats()
    assert stats["errors"] == 0 and stats["checksum_failures"] == 0 and stats["commit_failures"] == 0, stats

    code, report = live_fsck(m)
    assert code == 4 and report["unavailable"] == len(on_a) and not report["findings"], report
    down = {d["path"]: d for d in report["directories"]}[str(a)]
    assert down["state"] == "down" and down["unavailable"] == len(on_a), report
    assert read_errno(m.path(on_a[0])) == errno.EIO  # not dropped by the check

    assert m.stop() == 0
    start(m, (a, "24M"), (b, "24M"))
    assert directories(m)[str(a)]["state"] == "down"
    for name in on_a:
        assert not m.path(name).exists(), name  # a miss: reconcile could not find its object
    for name in on_b + later:
        assert read_uncached(m.path(name)) == content(name, SIZE), name


def test_a_directory_that_answers_again_comes_back(filesystems, make_mount, tmp_path):
    """Member a (ext4) fails, then its filesystem is mounted again (same data, same marker): within a probe
    period its files read bit-exact again, and the deletion asked while it was down is done."""
    a = filesystems("ext4", tmp_path / "ssd-a", "32M")
    b = tmp_path / "ssd-b"
    m, names, placed = spread_over(make_mount(), a, b)
    on_a = [n for n in names if placed[n] == a]
    assert len(on_a) >= 2, placed
    gone = {o for o in objects_in(a) if o.startswith(f"{os.stat(m.path(on_a[0])).st_ino:x}-")}

    shut_down(a)
    assert read_errno(m.path(on_a[1])) == errno.EIO
    m.path(on_a[0]).unlink()  # its object's deletion waits for a
    subprocess.run(["umount", str(a)], check=True)
    subprocess.run(["mount", "-o", "loop", str(a.with_suffix(".img")), str(a)], check=True)
    wait_for(lambda: read_errno(m.path(on_a[1])) is None, timeout=15, what="a to answer again")
    assert all(read_uncached(m.path(n)) == content(n, SIZE) for n in on_a[1:])
    back = directories(m)[str(a)]
    assert back["state"] == "up" and back["pending_deletions"] == 0, back
    assert not gone & objects_in(a)


def test_a_full_directory_sends_new_objects_to_the_other(filesystems, make_mount, tmp_path):
    """Member a is a 1 MiB tmpfs given 32M: its disk says ENOSPC long before its capacity. Every demotion
    still succeeds (the object goes to b), nothing fails, everything reads bit-exact."""
    a = filesystems("tmpfs", tmp_path / "ssd-a", "1M")
    b = tmp_path / "ssd-b"
    m = start(make_mount(), (a, "32M"), (b, "32M"))
    names = [f"f{i:02d}" for i in range(20)]
    write_and_demote(m, names)
    assert 0 < len(objects_in(a)) <= 5 and len(objects_in(a)) + len(objects_in(b)) == 20
    assert all(read_uncached(m.path(n)) == content(n, SIZE) for n in names)
    stats = m.stats()
    assert stats["move_failures"] == 0 and stats["errors"] == 0, stats
    full = directories(m)[str(a)]
    assert full["files"] == len(objects_in(a)) and full["state"] in ("full", "up"), full


def test_a_directory_unmounted_under_the_mount(filesystems, make_mount, tmp_path):
    """Member b's tmpfs is unmounted lazily under the mount: the path now shows the empty directory beneath.
    Its files read EIO (not ENOENT: nothing is dropped), a's read bit-exact, and new demotions go to a —
    none lands in the directory beneath."""
    a = filesystems("tmpfs", tmp_path / "ssd-a", "32M")
    b = filesystems("tmpfs", tmp_path / "ssd-b", "32M")
    m, names, placed = spread_over(make_mount(), a, b)
    assert set(placed.values()) == {a, b}, placed
    subprocess.run(["umount", "-l", str(b)], check=True)
    for name in names:
        if placed[name] == b:
            assert read_errno(m.path(name)) == errno.EIO, name
        else:
            assert read_uncached(m.path(name)) == content(name, SIZE), name
    later = [f"g{i:02d}" for i in range(6)]
    write_and_demote(m, later)
    assert not list(b.iterdir()), list(b.iterdir())  # nothing written beneath the vanished filesystem
    assert all(read_uncached(m.path(n)) == content(n, SIZE) for n in later)
    down = directories(m)[str(b)]
    assert down["state"] == "down" and "vanished" in down["reason"], down
    table = subprocess.run([*KVFS, "stat", str(m.mountpoint)], capture_output=True, text=True, check=True).stdout
    assert "vanished" in table and str(b) in table, table
    wait_for(lambda: m.stats()["mover"]["moves_in_flight"] == 0, what="moves to end")
