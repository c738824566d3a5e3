"""The catalog's invariants (written beside the schema in kvfs/index.py) hold after real use of a mount."""

from __future__ import annotations

import os
import sqlite3
import stat
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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


def _scanned_totals(idx: Index) -> dict:
    """tier_totals the slow way: what the triggers must keep equal to."""
    rows = idx.db.execute("SELECT obj_tier, COUNT(*), SUM(size), SUM(stored_bytes), SUM(pinned), "
                          "SUM(CASE WHEN pinned THEN stored_bytes ELSE 0 END) FROM inodes "
                          "WHERE obj_gen > 0 GROUP BY obj_tier").fetchall()
    return {r[0]: tuple(r[1:]) for r in rows}


TIERS = ("L2", "L3", "L4")
OPS = st.lists(st.tuples(st.sampled_from(["create", "commit", "empty", "move", "pin", "unpin", "size", "evict",
                                          "purge", "fail"]),
                         st.integers(0, 7), st.sampled_from(TIERS), st.integers(0, 1 << 40)), max_size=60)


@given(ops=OPS)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_tier_totals_follow_every_change(tmp_path, ops):
    """The trigger-kept totals (.kvfs/stats reads them without a scan) equal a scan after any sequence of the
    index's own operations, a rolled-back transaction included, and after a reopen."""
    path = Path(tempfile.mkdtemp(dir=tmp_path)) / "i.sqlite"  # a fresh index per example (tmp_path is shared)
    idx = Index(path)
    files: list[int] = []
    gen = created = 0
    for op, k, tier, n in ops:
        ino = files[k % len(files)] if files else None
        if op == "create" or ino is None:
            created += 1
            files.append(idx.create(ROOT_INODE, f"f{created}".encode(), stat.S_IFREG | 0o644, 0, 0))
        elif op == "commit":
            gen += 1
            idx.switch_object(ino, gen=gen, tier=tier, size=n, stored_bytes=n // 3, codec="entropy",
                              transform="identity", mtime_ns=1)
        elif op == "empty":
            idx.switch_object(ino, gen=0, tier=None, size=0, stored_bytes=0, codec=None, transform=None, mtime_ns=1)
        elif op == "move":
            row = idx.get(ino)
            idx.move_object(ino, row["obj_gen"], row["obj_tier"], tier)
        elif op in ("pin", "unpin"):
            idx.set_pinned([ino], op == "pin")
        elif op == "size":
            idx.set_attrs(ino, size=n)
        elif op == "evict":
            idx.drop_file(ino, forget_object=bool(n & 1))
        elif op == "purge":
            idx.purge([ino])
            files.remove(ino)
        else:  # a transaction that fails after changing rows: the totals roll back with them
            try:
                with idx.transaction():
                    idx.db.execute("UPDATE inodes SET obj_tier = ?, pinned = 1 WHERE id = ?", (tier, ino))
                    raise RuntimeError("abort")
            except RuntimeError:
                pass
        assert idx.tier_totals() == _scanned_totals(idx), (op, ino)
    expected = _scanned_totals(idx)
    idx.close()
    again = Index(path)
    assert again.tier_totals() == expected
    again.close()
