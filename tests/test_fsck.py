"""kvfs fsck on real mounts: live through the daemon and offline on the stopped state, finding and repairing an
injected corrupt object, orphans (a copy under an unused id, a temp file) and a missing object; no false
findings while writers rewrite files during a live check."""

from __future__ import annotations

import errno
import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvfs import format as fmt
from kvfs.tiers.directory import hash_shard

KVFS = [sys.executable, "-m", "kvfs"]
ORPHAN_ID = f"{0xfff0:x}-1"  # inode ids are handed out from 16 upwards: these are never a test's
TEMP_ID = f"{0xfff1:x}-3"


def fsck(*args: str | Path) -> tuple[int, dict | None, str]:
    res = subprocess.run([*KVFS, "fsck", "--json", *map(str, args)], capture_output=True, text=True, timeout=120)
    return res.returncode, json.loads(res.stdout) if res.stdout.strip() else None, res.stderr


def objects_of(m, names) -> dict[str, Path]:
    """The object files of committed files (ids are '<inode hex>-<generation>')."""
    found = {}
    for name in names:
        prefix = f"{os.stat(m.path(name)).st_ino:x}-"
        (found[name],) = [p for p in m.objects() if p.name.startswith(prefix) and not p.name.endswith(".tmp")]
    return found


def in_shard(tier_dir: Path, name: str, oid: str) -> Path:
    shard = tier_dir / f"{hash_shard(oid):02x}"
    shard.mkdir(exist_ok=True)
    return shard / name


def write_files(m) -> dict[str, bytes]:
    rng = random.Random(7)
    contents = {}
    for name in ("corrupt.kv", "missing.kv", "ok-a.kv", "ok-b.kv"):
        # three frames: compressible text, incompressible bytes, and a hole
        contents[name] = (b"kv cache " * 120_000)[:1 << 20] + rng.randbytes(1 << 20) + bytes(500_000)
        m.path(name).write_bytes(contents[name])
    return contents


def damage(objects: dict[str, Path]) -> dict:
    """A flipped byte in a frame of one object, a deleted object, a copy of an object under an unused id and a
    temp file left by an interrupted put. Returns what fsck must report."""
    victim = objects["corrupt.kv"]
    raw = bytearray(victim.read_bytes())
    raw[fmt.parse_header(raw).data_offset + 1000] ^= 0x10
    victim.write_bytes(bytes(raw))
    objects["missing.kv"].unlink()
    template = objects["ok-a.kv"]
    in_shard(template.parent.parent, ORPHAN_ID, ORPHAN_ID).write_bytes(template.read_bytes())
    in_shard(template.parent.parent, TEMP_ID + ".tmp", TEMP_ID).write_bytes(b"half an object")
    return {"corrupt": (victim.name, "/corrupt.kv"), "orphans": {ORPHAN_ID, TEMP_ID}}


def assert_findings(doc: dict, expected: dict) -> None:
    assert doc["counts"] == {"corrupt": 1, "missing": 1, "orphan": 2, "duplicate": 0, "index": 0}, doc
    by_kind = {}
    for f in doc["findings"]:
        by_kind.setdefault(f["kind"], []).append(f)
    (corrupt,) = by_kind["corrupt"]
    assert (corrupt["object_id"], corrupt["path"], corrupt["tier"]) == (*expected["corrupt"], "L2")
    assert "checksum" in corrupt["detail"]
    (missing,) = by_kind["missing"]
    assert missing["path"] == "/missing.kv" and missing["detail"] == "no such object"
    assert {f["object_id"] for f in by_kind["orphan"]} == expected["orphans"]
    assert any("temp file" in f["detail"] for f in by_kind["orphan"])


def assert_repaired(m, contents: dict[str, bytes]) -> None:
    assert not m.path("corrupt.kv").exists() and not m.path("missing.kv").exists()  # misses now
    with pytest.raises(FileNotFoundError):
        m.path("corrupt.kv").read_bytes()
    for name in ("ok-a.kv", "ok-b.kv"):
        assert m.path(name).read_bytes() == contents[name]
    names = {p.name for p in m.objects()}
    assert not names & {ORPHAN_ID, TEMP_ID + ".tmp"}


def test_clean_mount_checks_every_object(make_mount):
    m = make_mount().start()
    write_files(m)
    code, doc, err = fsck(m.mountpoint)
    assert code == 0, (doc, err)
    assert doc["state"] == "done" and doc["findings"] == [] and doc["exit_status"] == 0
    assert doc["objects_checked"] == doc["objects_total"] == 4
    assert doc["bytes_checked"] == doc["bytes_total"] == sum(p.stat().st_size for p in m.objects())
    assert "fsck 1 done: 4 objects" in m.log_text()


def test_live_fsck_finds_then_repairs(make_mount):
    m = make_mount().start()
    # the flipped byte is in frame 0 when the codec choice stored it raw (see EncodingPolicy), else in frame 1
    m.expect_log(r"corrupt object for inode \d+ \(b'corrupt.kv'\): frame \d+: .*found by fsck")
    contents = write_files(m)
    expected = damage(objects_of(m, contents))
    before = {p: p.read_bytes() for p in m.objects()}

    code, doc, err = fsck(m.mountpoint)
    assert code == 4, (doc, err)
    assert_findings(doc, expected)
    assert not any(f["repair"] for f in doc["findings"])
    assert {p: p.read_bytes() for p in m.objects()} == before  # a check changes nothing
    assert sorted(os.listdir(m.mountpoint)) == sorted([".kvfs", *contents])

    code, doc, err = fsck(m.mountpoint, "--repair")
    assert code == 1, (doc, err)
    assert_findings(doc, expected)
    assert all(f["repair"] for f in doc["findings"]) and doc["repaired"] == 4
    assert_repaired(m, contents)
    m.check_accounting()
    code, doc, err = fsck(m.mountpoint)
    assert code == 0 and doc["findings"] == [] and doc["objects_checked"] == 2, (doc, err)
    assert m.stats()["checksum_failures"] == 1  # the corrupt object, counted as a read would count it


def write_toml(m, path: Path) -> Path:
    path.write_text(f'[mount]\nstate_dir = "{m.state}"\n[l2]\npath = "{m.l2}"\ncapacity = "512M"\n'
                    f'[l3]\npath = "{m.l3}"\ncapacity = "16G"\n')
    return path


def test_offline_fsck_finds_then_repairs(make_mount, tmp_path):
    m = make_mount().start()
    contents = write_files(m)
    objects = objects_of(m, contents)
    m.stop()
    expected = damage(objects)
    config = write_toml(m, tmp_path / "kvfs.toml")
    before = {p: p.read_bytes() for p in m.objects()}

    code, doc, err = fsck("--config", config)
    assert code == 4, (doc, err)
    assert_findings(doc, expected)
    assert {p: p.read_bytes() for p in m.objects()} == before

    code, doc, err = fsck("--config", config, "--repair")
    assert code == 1 and doc["repaired"] == 4, (doc, err)
    code, doc, err = fsck("--config", config)
    assert code == 0 and doc["objects_checked"] == 2, (doc, err)

    m.start()
    stats = m.stats()
    assert (stats["reconcile_orphans_removed"], stats["reconcile_rows_dropped"]) == (0, 0)  # nothing left over
    assert_repaired(m, contents)
    m.check_accounting()


def test_offline_fsck_refuses_a_mounted_state(make_mount, tmp_path):
    m = make_mount().start()
    code, doc, err = fsck("--config", write_toml(m, tmp_path / "kvfs.toml"))
    assert code == 8 and doc is None
    assert "mounted: run kvfs fsck" in err and err.count("\n") == 1
    assert m.alive()


def test_control_channel(make_mount):
    m = make_mount().start("--allow-other")  # other users reach the mount: the permissions are what stop them
    control = m.path(".kvfs")
    assert sorted(os.listdir(control)) == ["fsck", "stats"]
    assert json.loads(m.path(".kvfs", "fsck").read_bytes()) == {"id": 0, "state": "idle"}
    assert os.getxattr(control, "user.kvfs.fsck") == b"idle"
    with pytest.raises(OSError) as e:
        os.setxattr(control, "user.kvfs.fsck", b"fix everything")
    assert e.value.errno == errno.EINVAL
    m.path("f").write_bytes(b"x" * 100_000)
    os.setxattr(control, "user.kvfs.fsck", b"check")
    with pytest.raises(OSError) as e:  # a live check takes at least a second (deletions in flight settle)
        os.setxattr(control, "user.kvfs.fsck", b"repair")
    assert e.value.errno == errno.EBUSY
    assert os.getxattr(control, "user.kvfs.fsck") == b"running"
    deadline = time.monotonic() + 20
    while os.getxattr(control, "user.kvfs.fsck") == b"running" and time.monotonic() < deadline:
        time.sleep(0.1)
    doc = json.loads(m.path(".kvfs", "fsck").read_bytes())
    assert (doc["id"], doc["state"], doc["mode"], doc["objects_checked"]) == (1, "done", "check", 1)
    for attempt in ("os.setxattr(fd, 'user.kvfs.fsck', b'check')", "os.open('fsck', os.O_RDONLY, dir_fd=fd)"):
        # another user (the directory opened before dropping root: the test's tmp_path is root's alone)
        other = subprocess.run([sys.executable, "-c", f"import os; fd = os.open({str(control)!r}, os.O_RDONLY); "
                                f"os.setuid(65534); {attempt}"], capture_output=True)
        assert other.returncode != 0 and b"PermissionError" in other.stderr, other.stderr
    assert json.loads(m.path(".kvfs", "fsck").read_bytes())["id"] == 1
    with pytest.raises(OSError):
        m.path(".kvfs", "fsck").write_bytes(b"{}")


def test_live_fsck_during_writes_reports_nothing_false(make_mount):
    """Writers rewrite, create and unlink files while the check runs; a small L2 keeps the mover demoting to
    L3 meanwhile. Neither a check nor a repair run may find (or fix) anything."""
    m = make_mount().start(l2_size="6M")
    stop = threading.Event()
    latest: dict[str, bytes] = {}
    errors: list[BaseException] = []

    def writer(seed: int) -> None:
        rng = random.Random(seed)
        try:
            while not stop.is_set():
                name = f"w{seed}-{rng.randrange(6)}"
                if rng.random() < 0.15 and name in latest:
                    m.path(name).unlink()
                    del latest[name]
                    continue
                data = rng.randbytes(rng.randrange(1, 1_500_000))
                m.path(name).write_bytes(data)
                latest[name] = data
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(seed,)) for seed in (1, 2)]
    for t in threads:
        t.start()
    try:
        time.sleep(0.5)
        runs = [fsck(m.mountpoint), fsck(m.mountpoint, "--repair"), fsck(m.mountpoint)]
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors, errors
    for code, doc, err in runs:
        assert code == 0 and doc["findings"] == [], (doc, err)
        assert doc["objects_checked"] > 0
    stats = m.stats()
    assert sum(t["demoted_files"] for t in stats["tiers"].values()) > 0  # moves ran during the checks
    for name, data in latest.items():
        assert m.path(name).read_bytes() == data
    m.check_accounting()


def write_durable(m, name: str, data: bytes) -> None:
    with open(m.path(name), "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())  # the object goes to L3
    assert os.getxattr(m.path(name), "user.kvfs.tier") == b"L3"


def test_live_fsck_adopts_a_complete_copy_and_removes_a_spare_one(make_mount):
    """Copies of L3 objects in L2, as a move cut short leaves them: the one whose L3 original is corrupt is
    adopted (the file stays readable), the other is removed; the accounting follows."""
    m = make_mount().start()
    rng = random.Random(3)
    contents = {name: rng.randbytes(1_200_000) for name in ("rescued.kv", "spare.kv")}
    for name, data in contents.items():
        write_durable(m, name, data)
    objects = objects_of(m, contents)
    for name, original in objects.items():
        in_shard(m.l2, original.name, original.name).write_bytes(original.read_bytes())
    raw = bytearray(objects["rescued.kv"].read_bytes())
    raw[-10] ^= 0x01
    objects["rescued.kv"].write_bytes(bytes(raw))

    code, doc, err = fsck(m.mountpoint)
    assert code == 4 and doc["counts"]["corrupt"] == 1 and doc["counts"]["duplicate"] == 2, (doc, err)
    adoptable = [f for f in doc["findings"] if f["kind"] == "duplicate" and "adoptable" in f["detail"]]
    assert [(f["path"], f["tier"]) for f in adoptable] == [("/rescued.kv", "L2")]

    code, doc, err = fsck(m.mountpoint, "--repair")
    assert code == 1 and doc["repaired"] == 3, (doc, err)
    assert os.getxattr(m.path("rescued.kv"), "user.kvfs.tier") == b"L2"
    assert os.getxattr(m.path("spare.kv"), "user.kvfs.tier") == b"L3"
    for name, data in contents.items():
        assert m.path(name).read_bytes() == data
    m.check_accounting()
    code, doc, err = fsck(m.mountpoint)
    assert code == 0 and doc["objects_checked"] == 2, (doc, err)


def test_offline_fsck_fixes_the_index_links(make_mount, tmp_path):
    """I1 (a name of a missing inode), I2 (a wrong link count) and an unlinked inode left by a crash, whose
    object is then an orphan."""
    import sqlite3

    m = make_mount().start()
    for name in ("a", "b", "gone"):
        m.path(name).write_bytes(name.encode() * 50_000)
    m.path("dir").mkdir()
    ino_a, ino_gone = os.stat(m.path("a")).st_ino, os.stat(m.path("gone")).st_ino
    m.stop()
    db = sqlite3.connect(m.state / "index.sqlite")
    with db:
        db.execute("UPDATE inodes SET nlink = 3 WHERE id = ?", (ino_a,))
        db.execute("INSERT INTO entries (parent, name, inode) VALUES (1, ?, 9999)", (b"dangling",))
        db.execute("DELETE FROM entries WHERE inode = ?", (ino_gone,))
        db.execute("UPDATE inodes SET nlink = 0 WHERE id = ?", (ino_gone,))
    db.close()
    config = write_toml(m, tmp_path / "kvfs.toml")

    code, doc, err = fsck("--config", config)
    assert code == 4, (doc, err)
    assert doc["counts"] == {"corrupt": 0, "missing": 0, "orphan": 1, "duplicate": 0, "index": 3}, doc
    details = sorted(f["detail"] for f in doc["findings"] if f["kind"] == "index")
    assert details[0].startswith("I1: entry 'dangling'") and details[1] == "I2: link count 3, 1 expected"
    assert details[2] == "unlinked inode left by an unclean stop"
    (orphan,) = [f for f in doc["findings"] if f["kind"] == "orphan"]
    assert orphan["object_id"].startswith(f"{ino_gone:x}-") and "unlinked" in orphan["detail"]

    code, doc, err = fsck("--config", config, "--repair")
    assert code == 1, (doc, err)
    assert fsck("--config", config)[0] == 0
    m.start()
    assert m.stats()["reconcile_orphans_removed"] == 0
    assert os.stat(m.path("a")).st_nlink == 1 and m.path("a").read_bytes() == b"a" * 50_000
    assert sorted(os.listdir(m.mountpoint)) == [".kvfs", "a", "b", "dir"]
    m.check_accounting()


def test_offline_configuration_without_a_mountpoint(tmp_path):
    from kvfs.config import ConfigError, build_config

    toml = tmp_path / "kvfs.toml"
    toml.write_text(f'[mount]\nstate_dir = "{tmp_path / "s"}"\n[l2]\npath = "{tmp_path / "l2"}"\n')
    cfg = build_config(None, config_file=toml)
    assert (cfg.mountpoint, cfg.state_dir, cfg.l2.path, cfg.l3.path) == (None, tmp_path / "s", tmp_path / "l2",
                                                                          tmp_path / "s" / "l3")
    toml.write_text(f'[mount]\nmountpoint = "{tmp_path / "m"}"\n')
    assert build_config(None, config_file=toml).mountpoint == tmp_path / "m"
    toml.write_text(f'[mount]\nstate_dir = "{tmp_path / "s"}"\n')
    with pytest.raises(ConfigError, match="no mountpoint"):
        build_config(None, config_file=toml)
    code, doc, err = fsck("--state-dir", tmp_path / "nowhere", "--l2", f"{tmp_path / 'l2'}:1G")
    assert code == 8 and "no kvfs state directory" in err
