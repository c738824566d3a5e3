"""The catalog's invariants (written beside the schema in kvfs/index.py) hold after real use of a mount."""

from __future__ import annotations

import os
import sqlite3
import stat

from kvfs.index import FIRST_USER_INODE, ROOT_INODE, Index, object_id


def check_invariants(db_path, tier_dirs: dict) -> None:
    db = sqlite3.connect(db_path)
    db.row_factory = sqlite3.Row
    inodes = {r["id"]: r for r in db.execute("SELECT * FROM inodes")}
    entries = db.execute("SELECT parent, name, inode FROM entries").fetchall()
    # I1
    for e in entries:
        assert e["inode"] in inodes and stat.S_ISDIR(inodes[e["parent"]]["mode"])
    # I2
    for ino, row in inodes.items():
        names = sum(1 for e in entries if e["inode"] == ino)
        if stat.S_ISDIR(row["mode"]):
            subdirs = sum(1 for e in entries if e["parent"] == ino and stat.S_ISDIR(inodes[e["inode"]]["mode"]))
            assert row["nlink"] == 2 + subdirs, ino
        else:
            assert row["nlink"] == names, ino
        assert row["nlink"] > 0 or ino == ROOT_INODE
    # I3 + I4: exactly the objects the rows name, with their sizes
    on_disk = {(tier, p.name): p.stat().st_size for tier, d in tier_dirs.items() for p in d.glob("*/*")}
    named = {(r["obj_tier"], object_id(i, r["obj_gen"])): r["stored_bytes"] for i, r in inodes.items()
             if r["obj_gen"]}
    assert on_disk == named
    for r in inodes.values():
        assert r["obj_gen"] > 0 or r["size"] == 0
    # I5
    assert all(i >= FIRST_USER_INODE for i in inodes if i != ROOT_INODE)


def test_invariants_after_use(make_mount):
    m = make_mount().start()
    m.path("a", "b").mkdir(parents=True)
    for i in range(5):
        m.path("a", "b", f"f{i}").write_bytes(os.urandom(100_000 * (i + 1)))
    os.rename(m.path("a", "b", "f0"), m.path("a", "f0"))
    os.rename(m.path("a", "b", "f1"), m.path("a", "b", "f2"))
    os.link(m.path("a", "f0"), m.path("hard"))
    m.path("a", "b", "f3").unlink()
    m.path("c").mkdir()
    os.rename(m.path("c"), m.path("a", "c"))
    m.path("a", "b", "f4").write_bytes(b"rewritten")
    m.path("empty").touch()
    m.stop()
    check_invariants(m.state / "index.sqlite", {"L2": m.l2, "L3": m.l3})


def test_index_unit_namespace_operations(tmp_path):
    idx = Index(tmp_path / "i.sqlite")
    d = idx.create(ROOT_INODE, b"d", stat.S_IFDIR | 0o755, 0, 0)
    f = idx.create(d, b"f", stat.S_IFREG | 0o644, 0, 0)
    assert idx.lookup(d, b"f") == f and idx.get(ROOT_INODE)["nlink"] == 3
    idx.link(f, ROOT_INODE, b"g")
    assert idx.get(f)["nlink"] == 2
    idx.rename(ROOT_INODE, b"g", d, b"f", moved_is_dir=False, replaced=(f, False))
    assert idx.get(f)["nlink"] == 1
    idx.switch_object(f, gen=3, tier="L2", size=10, stored_bytes=7, codec="zstd", transform="identity", mtime_ns=1)
    assert [tuple(r) for r in idx.objects()] == [(f, 3, "L2", 7)]
    idx.remove_entry(d, b"f", f, is_dir=False)
    assert idx.get(f)["nlink"] == 0
    idx.delete_inode(f)
    idx.remove_entry(ROOT_INODE, b"d", d, is_dir=True)
    assert idx.get(ROOT_INODE)["nlink"] == 2
    idx.close()
