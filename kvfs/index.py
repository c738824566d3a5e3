"""The catalog: inodes, names, attributes and where each file's object lives, in SQLite (WAL).

All statements run on the trio thread: with WAL and synchronous=NORMAL a commit is an append to the WAL in
the page cache (no fsync; measured tens of µs), which survives kill -9 of the daemon. Durability against power
loss comes from `sync()` (fsync of the WAL, in a worker thread), called by fsync() and at unmount. Checkpoints
run from a worker thread too (auto-checkpoint is off so a commit never pays for one). Last-access times are
batched in memory and written every few seconds.
"""

from __future__ import annotations

import os
import sqlite3
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path

ROOT_INODE = 1
FIRST_USER_INODE = 16  # 2..15 are reserved for virtual files (.kvfs/)

SCHEMA = """
-- Invariants (checked by tests/test_index.py and restored by reconcile at start):
-- I1  every entries.inode and entries.parent exists in inodes; a parent is a directory.
-- I2  a non-directory's nlink = number of its entries; a directory's nlink = 2 + its subdirectories.
--     nlink = 0 only while the kernel or an open handle still references the inode; such rows are
--     deleted at last forget/release, or at the next start.
-- I3  a regular file with obj_gen > 0 has exactly one object '<ino hex>-<obj_gen>' in tier obj_tier, of
--     stored_bytes bytes, decoding to size bytes. obj_gen = 0 means no object and size = 0.
-- I4  objects that no row names are garbage (superseded generations, interrupted puts): removed at start.
-- I5  object ids are never reused: obj_gen only grows for an inode, and inode ids are AUTOINCREMENT.
--     (An evicted file's doomed row — nlink 0 — is reset to obj_gen 0; it never gets another object.)
-- I6  a move changes only obj_tier, and only if the row still names the object that was copied
--     (same obj_gen and source tier): a commit, unlink or eviction racing with the copy wins.
-- I7  published_key (a shared L4's 'files/<path>') marks a file published there: immutable, its object in
--     the shared store under that key with ETag published_etag. While obj_tier is that L4 the key is the
--     object's id (I3's '<ino hex>-<obj_gen>' names local copies only); a local copy may exist meanwhile.
-- I8  pinned = 1 files belong in the fastest tier: the mover promotes them there and never demotes or evicts
--     them (a drop still removes them). Their stored bytes together stay within that tier's pin limit.
--     idle_policy_s: NULL = the mount's default, 0 = never, T > 0 = a file not read for k*T seconds sits
--     at least k tiers below the fastest. New entries take their directory's idle_policy_s at create.
-- I9  ttl_s (retention, kvfs/retention.py): NULL = none, T > 0 = the file expires T seconds after mtime_ns and
--     is dropped from every tier, pinned or not. New entries take their directory's ttl_s at create.
CREATE TABLE IF NOT EXISTS inodes (
    id             INTEGER PRIMARY KEY AUTOINCREMENT,
    mode           INTEGER NOT NULL,
    uid            INTEGER NOT NULL,
    gid            INTEGER NOT NULL,
    rdev           INTEGER NOT NULL DEFAULT 0,
    nlink          INTEGER NOT NULL,
    size           INTEGER NOT NULL DEFAULT 0,
    atime_ns       INTEGER NOT NULL,
    mtime_ns       INTEGER NOT NULL,
    ctime_ns       INTEGER NOT NULL,
    target         BLOB,
    obj_gen        INTEGER NOT NULL DEFAULT 0,
    obj_tier       TEXT,
    stored_bytes   INTEGER NOT NULL DEFAULT 0,
    codec          TEXT,
    transform      TEXT,
    last_access_ns INTEGER NOT NULL DEFAULT 0,
    pinned         INTEGER NOT NULL DEFAULT 0,   -- I8
    idle_policy_s  INTEGER,                      -- I8
    published_key  TEXT,                         -- I7
    published_etag TEXT,
    ttl_s          INTEGER                       -- I9
);
CREATE TABLE IF NOT EXISTS entries (
    id     INTEGER PRIMARY KEY AUTOINCREMENT,    -- stable readdir cookie
    parent INTEGER NOT NULL,
    name   BLOB NOT NULL,
    inode  INTEGER NOT NULL,
    UNIQUE (parent, name)
);
CREATE INDEX IF NOT EXISTS entries_by_inode ON entries (inode);
CREATE INDEX IF NOT EXISTS entries_by_parent ON entries (parent, id);  -- readdir pages in cookie order
CREATE INDEX IF NOT EXISTS inodes_lru ON inodes (obj_tier, last_access_ns) WHERE obj_gen > 0;  -- mover
CREATE INDEX IF NOT EXISTS inodes_pinned ON inodes (obj_tier) WHERE pinned = 1;  -- the pin budget
CREATE INDEX IF NOT EXISTS inodes_idle ON inodes (obj_tier, last_access_ns) WHERE idle_policy_s > 0;  -- sweeps
CREATE TABLE IF NOT EXISTS xattrs (
    inode INTEGER NOT NULL,
    name  BLOB NOT NULL,
    value BLOB NOT NULL,
    PRIMARY KEY (inode, name)
) WITHOUT ROWID;
-- directories with a quota (kvfs/quotas.py), found by the mover every pass without a scan
CREATE INDEX IF NOT EXISTS xattrs_quota ON xattrs (inode) WHERE name = X'757365722e6b7666732e71756f7461';
"""

# Per-tier totals of committed objects, kept by triggers as the inodes change, so that .kvfs/stats (metrics
# scrapes, kvfs top once a second) costs no scan: GROUP BY over 1M inodes took 0.75 s of the trio thread,
# during which no FUSE request was served. TEMP (this connection's, in memory): rebuilt from inodes at open,
# so the on-disk schema is unchanged, and rolled back with the transaction that changed the inodes.
# Invariant: for each tier, the sums over inodes with obj_gen > 0 in it (rows with files = 0 are stale).
TIER_TOTALS = """
CREATE TEMP TABLE tier_totals (
    tier          TEXT PRIMARY KEY,
    files         INTEGER NOT NULL,
    size          INTEGER NOT NULL,
    stored        INTEGER NOT NULL,
    pinned        INTEGER NOT NULL,
    pinned_stored INTEGER NOT NULL
);
INSERT INTO tier_totals
    SELECT obj_tier, COUNT(*), SUM(size), SUM(stored_bytes), SUM(pinned),
           SUM(CASE WHEN pinned THEN stored_bytes ELSE 0 END)
    FROM main.inodes WHERE obj_gen > 0 GROUP BY obj_tier;
CREATE TEMP TRIGGER tier_totals_insert AFTER INSERT ON main.inodes WHEN NEW.obj_gen > 0 BEGIN
    INSERT OR IGNORE INTO tier_totals VALUES (NEW.obj_tier, 0, 0, 0, 0, 0);
    UPDATE tier_totals SET files = files + 1, size = size + NEW.size, stored = stored + NEW.stored_bytes,
        pinned = pinned + NEW.pinned, pinned_stored = pinned_stored + NEW.pinned * NEW.stored_bytes
    WHERE tier = NEW.obj_tier;
END;
CREATE TEMP TRIGGER tier_totals_delete AFTER DELETE ON main.inodes WHEN OLD.obj_gen > 0 BEGIN
    UPDATE tier_totals SET files = files - 1, size = size - OLD.size, stored = stored - OLD.stored_bytes,
        pinned = pinned - OLD.pinned, pinned_stored = pinned_stored - OLD.pinned * OLD.stored_bytes
    WHERE tier = OLD.obj_tier;
END;
CREATE TEMP TRIGGER tier_totals_update AFTER UPDATE OF obj_gen, obj_tier, size, stored_bytes, pinned
ON main.inodes BEGIN
    UPDATE tier_totals SET files = files - 1, size = size - OLD.size, stored = stored - OLD.stored_bytes,
        pinned = pinned - OLD.pinned, pinned_stored = pinned_stored - OLD.pinned * OLD.stored_bytes
    WHERE tier = OLD.obj_tier AND OLD.obj_gen > 0;
    INSERT OR IGNORE INTO tier_totals SELECT NEW.obj_tier, 0, 0, 0, 0, 0 WHERE NEW.obj_gen > 0;
    UPDATE tier_totals SET files = files + 1, size = size + NEW.size, stored = stored + NEW.stored_bytes,
        pinned = pinned + NEW.pinned, pinned_stored = pinned_stored + NEW.pinned * NEW.stored_bytes
    WHERE tier = NEW.obj_tier AND NEW.obj_gen > 0;
END;
"""

# KV events (kvfs/events.py): a file with a user.kvfs.blocks record is announced in obj_tier while it has an
# object and a name. Every change of that state, with the record, is logged here in the transaction that
# makes it (so a rollback leaves no event); EventSource drains the log. TEMP, in memory, made only when the
# mount publishes events.
EVENT_LOG = """
CREATE TEMP TABLE IF NOT EXISTS event_log (
    id       INTEGER PRIMARY KEY,
    old_tier TEXT,
    new_tier TEXT,
    value    BLOB NOT NULL
);
CREATE TEMP TRIGGER IF NOT EXISTS events_inode_update AFTER UPDATE OF obj_gen, obj_tier, nlink ON main.inodes
WHEN (CASE WHEN OLD.obj_gen > 0 AND OLD.nlink > 0 THEN OLD.obj_tier END)
     IS NOT (CASE WHEN NEW.obj_gen > 0 AND NEW.nlink > 0 THEN NEW.obj_tier END) BEGIN
    INSERT INTO event_log (old_tier, new_tier, value)
    SELECT CASE WHEN OLD.obj_gen > 0 AND OLD.nlink > 0 THEN OLD.obj_tier END,
           CASE WHEN NEW.obj_gen > 0 AND NEW.nlink > 0 THEN NEW.obj_tier END, value
    FROM main.xattrs WHERE inode = NEW.id AND name = X'{blocks}';
END;
CREATE TEMP TRIGGER IF NOT EXISTS events_inode_delete AFTER DELETE ON main.inodes
WHEN OLD.obj_gen > 0 AND OLD.nlink > 0 BEGIN
    INSERT INTO event_log (old_tier, new_tier, value)
    SELECT OLD.obj_tier, NULL, value FROM main.xattrs WHERE inode = OLD.id AND name = X'{blocks}';
END;
CREATE TEMP TRIGGER IF NOT EXISTS events_record_insert AFTER INSERT ON main.xattrs
WHEN NEW.name = X'{blocks}' BEGIN
    INSERT INTO event_log (old_tier, new_tier, value)
    SELECT NULL, obj_tier, NEW.value FROM main.inodes WHERE id = NEW.inode AND obj_gen > 0 AND nlink > 0;
END;
CREATE TEMP TRIGGER IF NOT EXISTS events_record_delete AFTER DELETE ON main.xattrs
WHEN OLD.name = X'{blocks}' BEGIN
    INSERT INTO event_log (old_tier, new_tier, value)
    SELECT obj_tier, NULL, OLD.value FROM main.inodes WHERE id = OLD.inode AND obj_gen > 0 AND nlink > 0;
END;
CREATE TEMP TRIGGER IF NOT EXISTS events_record_update AFTER UPDATE OF value ON main.xattrs
WHEN NEW.name = X'{blocks}' AND NEW.value IS NOT OLD.value BEGIN
    INSERT INTO event_log (old_tier, new_tier, value)
    SELECT obj_tier, NULL, OLD.value FROM main.inodes WHERE id = NEW.inode AND obj_gen > 0 AND nlink > 0;
    INSERT INTO event_log (old_tier, new_tier, value)
    SELECT NULL, obj_tier, NEW.value FROM main.inodes WHERE id = NEW.inode AND obj_gen > 0 AND nlink > 0;
END;
""".replace("{blocks}", b"user.kvfs.blocks".hex())

EXPIRY = "mtime_ns + ttl_s * 1000000000"  # I9: when a file with a retention time expires (ns)

# Columns that setattr-like updates may touch.
_ATTR_COLUMNS = frozenset({"mode", "uid", "gid", "size", "atime_ns", "mtime_ns", "ctime_ns"})
ATIME_SET_MEMORY_NS = 60 * 1_000_000_000  # how long an explicit atime outranks a late-arriving read (note_access)


def object_id(ino: int, gen: int) -> str:
    return f"{ino:x}-{gen}"


def parse_object_id(oid: str) -> tuple[int, int] | None:
    ino, sep, gen = oid.partition("-")
    try:
        return (int(ino, 16), int(gen)) if sep else None
    except ValueError:
        return None


class Index:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.path.touch(mode=0o600, exist_ok=True)
        os.chmod(self.path, 0o600)
        self.db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self.db.row_factory = sqlite3.Row
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.execute("PRAGMA wal_autocheckpoint=0")
        self.db.execute("PRAGMA journal_size_limit=%d" % (64 << 20))
        self.db.execute("PRAGMA foreign_keys=OFF")
        self.db.executescript(SCHEMA)
        self._migrate()
        self.db.execute("PRAGMA temp_store=MEMORY")
        self.db.executescript(TIER_TOTALS)
        self._sync_lock = threading.Lock()
        self._pending_access: dict[int, int] = {}  # reads: atime and the LRU's last access
        self._atime_set: dict[int, int] = {}  # inode → when its atime was last set explicitly (recent ones)
        self._pending_use: dict[int, int] = {}  # prefetches and promotions: the LRU's last access only
        self._ensure_root()

    def _migrate(self) -> None:
        """Columns added since the first schema (an older index gains them, empty)."""
        have = {r[1] for r in self.db.execute("PRAGMA table_info(inodes)")}
        for column, kind in (("published_key", "TEXT"), ("published_etag", "TEXT"), ("ttl_s", "INTEGER")):
            if column not in have:
                self.db.execute(f"ALTER TABLE inodes ADD COLUMN {column} {kind}")
        # I9's sweep: files with a retention time, by when they expire (after the column exists)
        self.db.execute(f"CREATE INDEX IF NOT EXISTS inodes_expiry ON inodes ({EXPIRY}) WHERE ttl_s > 0")

    # -- transactions -------------------------------------------------------------------------
    def transaction(self):
        return _Transaction(self.db)

    def _ensure_root(self) -> None:
        if self.get(ROOT_INODE) is None:
            now = time.time_ns()
            with self.transaction():
                self.db.execute(
                    "INSERT INTO inodes (id, mode, uid, gid, nlink, atime_ns, mtime_ns, ctime_ns) "
                    "VALUES (?, ?, ?, ?, 2, ?, ?, ?)",
                    (ROOT_INODE, stat.S_IFDIR | 0o755, os.getuid(), os.getgid(), now, now, now))
                # the explicit root insert created the sequence row; user inodes start above the virtual ones
                self.db.execute("UPDATE sqlite_sequence SET seq = ? WHERE name = 'inodes'", (FIRST_USER_INODE - 1,))

    # -- queries ------------------------------------------------------------------------------
    def get(self, ino: int) -> sqlite3.Row | None:
        return self.db.execute("SELECT * FROM inodes WHERE id = ?", (ino,)).fetchone()

    def lookup(self, parent: int, name: bytes) -> int | None:
        row = self.db.execute("SELECT inode FROM entries WHERE parent = ? AND name = ?", (parent, name)).fetchone()
        return row[0] if row else None

    def parent_of(self, ino: int) -> int | None:
        row = self.db.execute("SELECT parent FROM entries WHERE inode = ? LIMIT 1", (ino,)).fetchone()
        return row[0] if row else None

    def has_children(self, ino: int) -> bool:
        return self.db.execute("SELECT 1 FROM entries WHERE parent = ? LIMIT 1", (ino,)).fetchone() is not None

    def readdir(self, parent: int, after_id: int, limit: int = 256) -> list[sqlite3.Row]:
        return self.db.execute(
            "SELECT e.id AS cookie, e.name, i.* FROM entries e JOIN inodes i ON i.id = e.inode "
            "WHERE e.parent = ? AND e.id > ? ORDER BY e.id LIMIT ?", (parent, after_id, limit)).fetchall()

    def count_inodes(self) -> int:
        return self.db.execute("SELECT COUNT(*) FROM inodes").fetchone()[0]

    def tier_totals(self) -> dict[str, tuple[int, int, int, int, int]]:
        """tier → (files, logical bytes, stored bytes, pinned files, pinned stored bytes) of committed objects."""
        rows = self.db.execute("SELECT tier, files, size, stored, pinned, pinned_stored FROM temp.tier_totals "
                               "WHERE files > 0").fetchall()
        return {r[0]: tuple(r[1:]) for r in rows}

    def pinned_bytes(self) -> int:
        """Stored bytes of every pinned file, wherever it is now (pins are the fastest tier's: I8)."""
        row = self.db.execute("SELECT SUM(stored_bytes) FROM inodes WHERE pinned = 1 AND obj_gen > 0").fetchone()
        return row[0] or 0

    def pinned_away(self, fastest: str, limit: int) -> list[int]:
        """Pinned files not in the fastest tier (yet): they are to be promoted."""
        rows = self.db.execute("SELECT id FROM inodes WHERE pinned = 1 AND obj_gen > 0 AND obj_tier != ? LIMIT ?",
                               (fastest, limit)).fetchall()
        return [r[0] for r in rows]

    def tree_files(self, ino: int) -> list[int]:
        """The regular files of a directory tree (or the file itself), each once (hard links)."""
        rows = self.db.execute(
            "WITH RECURSIVE tree(id) AS (SELECT ? UNION SELECT e.inode FROM entries e JOIN tree t ON e.parent = t.id "
            "JOIN inodes d ON d.id = t.id WHERE (d.mode & 61440) = 16384) "
            "SELECT i.id FROM tree t JOIN inodes i ON i.id = t.id WHERE (i.mode & 61440) = 32768 ORDER BY i.id",
            (ino,)).fetchall()
        return [r[0] for r in rows]

    _TREE = ("WITH RECURSIVE tree(id) AS (SELECT ? UNION SELECT e.inode FROM entries e JOIN tree t ON e.parent = t.id "
             "JOIN inodes d ON d.id = t.id WHERE (d.mode & 61440) = 16384) ")

    def tree_usage(self, ino: int) -> dict[str, int]:
        """Stored bytes of the files below a directory, per tier (a quota's usage: kvfs/quotas.py)."""
        return {tier: used for tier, (used, _) in self.tree_tiers(ino).items()}

    def tree_tiers(self, ino: int) -> dict[str, tuple[int, int]]:
        """(stored bytes, largest file's stored bytes) of the files below a directory, per tier."""
        rows = self.db.execute(self._TREE + "SELECT i.obj_tier, SUM(i.stored_bytes), MAX(i.stored_bytes) FROM tree t "
                               "JOIN inodes i ON i.id = t.id WHERE i.obj_gen > 0 GROUP BY i.obj_tier",
                               (ino,)).fetchall()
        return {r[0]: (r[1], r[2]) for r in rows}

    def tree_lru(self, ino: int, tier: str, limit: int, skip: frozenset[int] | set[int] = frozenset()
                 ) -> list[sqlite3.Row]:
        """Files below a directory with an object in `tier`, least recently used first (pinned ones never)."""
        self.flush_access()
        rows = self.db.execute(
            self._TREE + "SELECT i.id, i.obj_gen, i.obj_tier, i.stored_bytes, i.nlink FROM tree t JOIN inodes i "
            "ON i.id = t.id WHERE i.obj_tier = ? AND i.obj_gen > 0 AND i.pinned = 0 ORDER BY i.last_access_ns "
            "LIMIT ?", (ino, tier, limit + len(skip))).fetchall()
        return [r for r in rows if r["id"] not in skip][:limit]

    def quota_dirs(self) -> list[tuple[int, bytes]]:
        """(inode, user.kvfs.quota) of every directory with a quota (the partial index xattrs_quota)."""
        return [(r[0], r[1]) for r in self.db.execute(
            "SELECT inode, value FROM xattrs WHERE name = X'757365722e6b7666732e71756f7461'")]

    def resolve_path(self, parts: list[bytes]) -> int | None:
        ino = ROOT_INODE
        for part in parts:
            found = self.lookup(ino, part)
            if found is None:
                return None
            ino = found
        return ino

    def tree_dirs(self, ino: int) -> list[int]:
        """The directories of a tree rooted at `ino`, itself included."""
        rows = self.db.execute(
            "WITH RECURSIVE tree(id) AS (SELECT ? UNION SELECT e.inode FROM entries e JOIN tree t ON e.parent = t.id "
            "JOIN inodes c ON c.id = e.inode WHERE (c.mode & 61440) = 16384) SELECT id FROM tree", (ino,)).fetchall()
        return [r[0] for r in rows]

    def idle_files(self, tier: str, now_ns: int, default_s: int, periods: int, limit: int) -> list[sqlite3.Row]:
        """Files in `tier`, not pinned, not read for `periods` times their idle period (I8), idlest first."""
        self.flush_access()
        if not default_s:  # only files with a policy of their own: a small partial index, not the whole tier
            return self.db.execute(
                "SELECT id FROM inodes WHERE obj_tier = ? AND idle_policy_s > 0 AND obj_gen > 0 AND pinned = 0 "
                "AND last_access_ns < ? - idle_policy_s * ? ORDER BY last_access_ns LIMIT ?",
                (tier, now_ns, periods * 1_000_000_000, limit)).fetchall()
        return self.db.execute(
            "SELECT id FROM inodes WHERE obj_tier = ? AND obj_gen > 0 AND pinned = 0 "
            "AND COALESCE(idle_policy_s, ?) > 0 AND last_access_ns < ? - COALESCE(idle_policy_s, ?) * ? "
            "ORDER BY last_access_ns LIMIT ?",
            (tier, default_s, now_ns, default_s, periods * 1_000_000_000, limit)).fetchall()

    def least_recently_used(self, tier: str, limit: int, skip: frozenset[int] | set[int] = frozenset()
                            ) -> list[sqlite3.Row]:
        """Files with an object in `tier`, least recently used first (pinned ones never)."""
        self.flush_access()
        rows = self.db.execute(
            "SELECT id, obj_gen, obj_tier, stored_bytes, nlink FROM inodes WHERE obj_tier = ? AND obj_gen > 0 "
            "AND pinned = 0 ORDER BY last_access_ns LIMIT ?", (tier, limit + len(skip))).fetchall()
        return [r for r in rows if r["id"] not in skip][:limit]

    def unpublished_files(self) -> list[int]:
        """Committed files without a published_key (I7): what a shared L4's write policy through still owes."""
        return [r[0] for r in self.db.execute(
            "SELECT id FROM inodes WHERE obj_gen > 0 AND published_key IS NULL AND nlink > 0")]

    def objects(self) -> Iterator[sqlite3.Row]:
        return iter(self.db.execute("SELECT id, obj_gen, obj_tier, stored_bytes FROM inodes WHERE obj_gen > 0")
                    .fetchall())

    # -- namespace changes (each one transaction) ------------------------------------------------
    def create(self, parent: int, name: bytes, mode: int, uid: int, gid: int, rdev: int = 0,
               target: bytes | None = None) -> int:
        now = time.time_ns()
        is_dir = stat.S_ISDIR(mode)
        with self.transaction():
            cur = self.db.execute(
                "INSERT INTO inodes (mode, uid, gid, rdev, nlink, size, atime_ns, mtime_ns, ctime_ns, target, "
                "last_access_ns, idle_policy_s, ttl_s) SELECT ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, idle_policy_s, ttl_s "
                "FROM inodes WHERE id = ?",
                (mode, uid, gid, rdev, 2 if is_dir else 1, len(target) if target else 0,
                 now, now, now, target, now, parent))
            ino = cur.lastrowid
            self.db.execute("INSERT INTO entries (parent, name, inode) VALUES (?, ?, ?)", (parent, name, ino))
            self._touch_dir(parent, now, nlink_delta=1 if is_dir else 0)
        return ino

    def link(self, ino: int, parent: int, name: bytes) -> None:
        now = time.time_ns()
        with self.transaction():
            self.db.execute("INSERT INTO entries (parent, name, inode) VALUES (?, ?, ?)", (parent, name, ino))
            self.db.execute("UPDATE inodes SET nlink = nlink + 1, ctime_ns = ? WHERE id = ?", (now, ino))
            self._touch_dir(parent, now)

    def remove_entry(self, parent: int, name: bytes, ino: int, is_dir: bool) -> None:
        """unlink/rmdir: drop the name, decrement the link count (the inode row stays until forgotten)."""
        now = time.time_ns()
        with self.transaction():
            self.db.execute("DELETE FROM entries WHERE parent = ? AND name = ?", (parent, name))
            # a removed directory keeps no links at all; a file loses one
            self.db.execute("UPDATE inodes SET nlink = CASE WHEN ? THEN 0 ELSE nlink - 1 END, ctime_ns = ? "
                            "WHERE id = ?", (is_dir, now, ino))
            self._touch_dir(parent, now, nlink_delta=-1 if is_dir else 0)

    def rename(self, old_parent: int, old_name: bytes, new_parent: int, new_name: bytes,
               moved_is_dir: bool, replaced: tuple[int, bool] | None) -> None:
        """Move an entry, dropping the one it replaces (replaced = (inode, is_dir))."""
        now = time.time_ns()
        with self.transaction():
            if replaced is not None:
                r_ino, r_is_dir = replaced
                self.db.execute("DELETE FROM entries WHERE parent = ? AND name = ?", (new_parent, new_name))
                if r_is_dir:
                    self.db.execute("UPDATE inodes SET nlink = 0, ctime_ns = ? WHERE id = ?", (now, r_ino))
                    self._touch_dir(new_parent, now, nlink_delta=-1)
                else:
                    self.db.execute("UPDATE inodes SET nlink = nlink - 1, ctime_ns = ? WHERE id = ?", (now, r_ino))
            self.db.execute("UPDATE entries SET parent = ?, name = ? WHERE parent = ? AND name = ?",
                            (new_parent, new_name, old_parent, old_name))
            moved = self.lookup(new_parent, new_name)
            self.db.execute("UPDATE inodes SET ctime_ns = ? WHERE id = ?", (now, moved))
            if moved_is_dir and old_parent != new_parent:
                self._touch_dir(old_parent, now, nlink_delta=-1)
                self._touch_dir(new_parent, now, nlink_delta=1)
            else:
                self._touch_dir(old_parent, now)
                self._touch_dir(new_parent, now)

    def exchange(self, parent_a: int, name_a: bytes, parent_b: int, name_b: bytes) -> None:
        """RENAME_EXCHANGE: swap what two names point at."""
        now = time.time_ns()
        a, b = self.lookup(parent_a, name_a), self.lookup(parent_b, name_b)
        with self.transaction():
            self.db.execute("UPDATE entries SET inode = ? WHERE parent = ? AND name = ?", (b, parent_a, name_a))
            self.db.execute("UPDATE entries SET inode = ? WHERE parent = ? AND name = ?", (a, parent_b, name_b))
            self.db.execute("UPDATE inodes SET ctime_ns = ? WHERE id IN (?, ?)", (now, a, b))
            a_dir, b_dir = (stat.S_ISDIR(self.get(x)["mode"]) for x in (a, b))
            if parent_a != parent_b and a_dir != b_dir:
                self._touch_dir(parent_a, now, nlink_delta=1 if b_dir else -1)
                self._touch_dir(parent_b, now, nlink_delta=1 if a_dir else -1)
            else:
                self._touch_dir(parent_a, now)
                self._touch_dir(parent_b, now)

    def _touch_dir(self, ino: int, now: int, nlink_delta: int = 0) -> None:
        self.db.execute("UPDATE inodes SET mtime_ns = ?, ctime_ns = ?, nlink = nlink + ? WHERE id = ?",
                        (now, now, nlink_delta, ino))

    def delete_inode(self, ino: int) -> None:
        self.purge([ino])

    def purge(self, inodes: list[int]) -> None:
        """Delete inodes with their names and xattrs, in one transaction."""
        if not inodes:
            return
        with self.transaction():
            for ino in inodes:
                self.db.execute("DELETE FROM entries WHERE inode = ?", (ino,))
                self.db.execute("DELETE FROM inodes WHERE id = ?", (ino,))
                self.db.execute("DELETE FROM xattrs WHERE inode = ?", (ino,))

    def drop_file(self, ino: int, forget_object: bool = False) -> None:
        """Make a file a miss: remove every name of it; the row goes once nothing references it.
        With forget_object the row also stops naming its object (eviction deletes it at once)."""
        with self.transaction():
            self.db.execute("DELETE FROM entries WHERE inode = ?", (ino,))
            self.db.execute("UPDATE inodes SET nlink = 0 WHERE id = ?", (ino,))
            if forget_object:
                self.db.execute("UPDATE inodes SET obj_gen = 0, obj_tier = NULL, size = 0, stored_bytes = 0 "
                                "WHERE id = ?", (ino,))

    def entries_of(self, ino: int) -> list[tuple[int, bytes]]:
        return [(r[0], r[1]) for r in self.db.execute("SELECT parent, name FROM entries WHERE inode = ?", (ino,))]

    # -- attributes and objects -------------------------------------------------------------------
    def set_attrs(self, ino: int, **fields: int) -> None:
        if not fields:
            return
        bad = set(fields) - _ATTR_COLUMNS
        if bad:
            raise ValueError(f"not settable: {bad}")
        if "atime_ns" in fields:
            self.flush_access()  # an earlier read's batched atime must not overwrite the one set now
            self._atime_set[ino] = time.time_ns()
        cols = ", ".join(f"{k} = ?" for k in fields)
        with self.transaction():
            self.db.execute(f"UPDATE inodes SET {cols} WHERE id = ?", (*fields.values(), ino))

    def switch_object(self, ino: int, *, gen: int, tier: str | None, size: int, stored_bytes: int,
                      codec: str | None, transform: str | None, mtime_ns: int, ctime_ns: int | None = None) -> None:
        """Point a file at a new object (or none: gen 0) in one transaction. ctime (default: mtime) only moves
        forward: a chmod or utimensat after the last write is a later status change."""
        with self.transaction():
            self.db.execute(
                "UPDATE inodes SET obj_gen = ?, obj_tier = ?, size = ?, stored_bytes = ?, codec = ?, "
                "transform = ?, mtime_ns = ?, ctime_ns = MAX(ctime_ns, ?), last_access_ns = ? WHERE id = ?",
                (gen, tier, size, stored_bytes, codec, transform, mtime_ns, ctime_ns or mtime_ns, time.time_ns(), ino))

    def names_of(self, ino: int) -> list[tuple[int, bytes]]:
        """Every (parent, name) of an inode."""
        return [(r[0], r[1]) for r in self.db.execute("SELECT parent, name FROM entries WHERE inode = ?", (ino,))]

    def path_of(self, ino: int) -> list[bytes] | None:
        """The names from the root to a file with exactly one name (hard links have no one path)."""
        parts: list[bytes] = []
        while ino != ROOT_INODE:
            rows = self.db.execute("SELECT parent, name FROM entries WHERE inode = ?", (ino,)).fetchall()
            if len(rows) != 1:
                return None
            parts.append(rows[0]["name"])
            ino = rows[0]["parent"]
        return parts[::-1]

    def publish(self, ino: int, gen: int, source: str, dest: str, key: str, etag: str,
                stored_bytes: int | None = None) -> bool:
        """The switch after a file's first upload to a shared L4 (I6 and I7 in one transaction); stored_bytes:
        the upload's size where it was sealed on the way."""
        with self.transaction():
            cur = self.db.execute(
                "UPDATE inodes SET obj_tier = ?, published_key = ?, published_etag = ?, "
                "stored_bytes = COALESCE(?, stored_bytes) WHERE id = ? AND obj_gen = ? AND obj_tier = ?",
                (dest, key, etag, stored_bytes, ino, gen, source))
        return cur.rowcount == 1

    def adopt_published(self, parent: int, name: bytes, *, mode: int, uid: int, gid: int, size: int,
                        stored_bytes: int, tier: str, key: str, etag: str, mtime_ns: int) -> int:
        """A file another node published, found in the shared L4: a row and a name pointing at it."""
        now = time.time_ns()
        with self.transaction():
            cur = self.db.execute(
                "INSERT INTO inodes (mode, uid, gid, nlink, size, atime_ns, mtime_ns, ctime_ns, obj_gen, obj_tier, "
                "stored_bytes, last_access_ns, published_key, published_etag) "
                "VALUES (?, ?, ?, 1, ?, ?, ?, ?, 1, ?, ?, ?, ?, ?)",
                (mode, uid, gid, size, now, mtime_ns, mtime_ns, tier, stored_bytes, now, key, etag))
            ino = cur.lastrowid
            self.db.execute("INSERT INTO entries (parent, name, inode) VALUES (?, ?, ?)", (parent, name, ino))
            self._touch_dir(parent, now)
        return ino

    def reserve_inodes(self, count: int) -> list[int]:
        """Inode ids for direct writes' objects, with no name yet (nlink 0: reconcile deletes them, and an
        object, if the daemon stops before `adopt_objects` names them). Reserved in batches: one transaction
        fewer per adoption."""
        now = time.time_ns()
        with self.transaction():
            ids = [self.db.execute(
                "INSERT INTO inodes (mode, uid, gid, nlink, atime_ns, mtime_ns, ctime_ns) VALUES (?, 0, 0, 0, ?, ?, ?)",
                (stat.S_IFREG | 0o600, now, now, now)).lastrowid for _ in range(count)]
        return ids

    def adopt_objects(self, files: list[dict]) -> None:
        """Reserved inodes get their objects (generation 1) and their names in one transaction, each dropping
        the file its name pointed at (`replaced`), as rename(2) over it would. Each dict holds the keyword
        arguments of `_adopt_row`."""
        now = time.time_ns()
        with self.transaction():
            for f in files:
                self._adopt_row(now, **f)

    def _adopt_row(self, now: int, ino: int, parent: int, name: bytes, replaced: int | None, *, mode: int,
                   uid: int, gid: int, tier: str, size: int, stored_bytes: int, codec: str, transform: str,
                   xattrs: list[tuple[bytes, bytes]]) -> None:
        if replaced is not None:
            self.db.execute("DELETE FROM entries WHERE parent = ? AND name = ?", (parent, name))
            self.db.execute("UPDATE inodes SET nlink = nlink - 1, ctime_ns = ? WHERE id = ?", (now, replaced))
        self.db.execute(
            "UPDATE inodes SET mode = ?, uid = ?, gid = ?, nlink = 1, obj_gen = 1, obj_tier = ?, size = ?, "
            "stored_bytes = ?, codec = ?, transform = ?, atime_ns = ?, mtime_ns = ?, ctime_ns = ?, "
            "last_access_ns = ?, idle_policy_s = (SELECT idle_policy_s FROM inodes WHERE id = ?), "
            "ttl_s = (SELECT ttl_s FROM inodes WHERE id = ?) WHERE id = ?",
            (mode, uid, gid, tier, size, stored_bytes, codec, transform, now, now, now, now, parent, parent, ino))
        self.db.execute("INSERT INTO entries (parent, name, inode) VALUES (?, ?, ?)", (parent, name, ino))
        self.db.executemany("INSERT OR REPLACE INTO xattrs (inode, name, value) VALUES (?, ?, ?)",
                            [(ino, k, v) for k, v in xattrs])
        self._touch_dir(parent, now)

    def move_object(self, ino: int, gen: int, source: str, dest: str, stored_bytes: int | None = None) -> bool:
        """The switch of the move protocol (I6): False when the row no longer names that object. stored_bytes:
        the copy's size where the move sealed or opened it (kvfs/sealing.py)."""
        with self.transaction():
            cur = self.db.execute("UPDATE inodes SET obj_tier = ?, stored_bytes = COALESCE(?, stored_bytes) "
                                  "WHERE id = ? AND obj_gen = ? AND obj_tier = ?",
                                  (dest, stored_bytes, ino, gen, source))
        return cur.rowcount == 1

    def set_pinned(self, inodes: list[int], pinned: bool) -> None:
        with self.transaction():
            self.db.executemany("UPDATE inodes SET pinned = ? WHERE id = ?", [(int(pinned), i) for i in inodes])

    def set_idle_policy(self, inodes: list[int], seconds: int | None) -> None:
        """I8: None = the mount's default, 0 = never."""
        with self.transaction():
            self.db.executemany("UPDATE inodes SET idle_policy_s = ? WHERE id = ?", [(seconds, i) for i in inodes])

    def set_ttl(self, inodes: list[int], seconds: int | None) -> None:
        """I9: None = no retention time."""
        with self.transaction():
            self.db.executemany("UPDATE inodes SET ttl_s = ? WHERE id = ?", [(seconds, i) for i in inodes])

    def expired_files(self, now_ns: int, limit: int) -> list[sqlite3.Row]:
        """Files past their retention time (I9), longest expired first."""
        return self.db.execute(
            f"SELECT id, obj_tier, stored_bytes FROM inodes WHERE ttl_s > 0 AND {EXPIRY} < ? AND nlink > 0 "
            f"AND (mode & 61440) = 32768 ORDER BY {EXPIRY} LIMIT ?", (now_ns, limit)).fetchall()

    # -- xattrs ---------------------------------------------------------------------------------
    def get_xattr(self, ino: int, name: bytes) -> bytes | None:
        row = self.db.execute("SELECT value FROM xattrs WHERE inode = ? AND name = ?", (ino, name)).fetchone()
        return row[0] if row else None

    def list_xattrs(self, ino: int) -> list[bytes]:
        return [r[0] for r in self.db.execute("SELECT name FROM xattrs WHERE inode = ? ORDER BY name", (ino,))]

    def set_xattr(self, ino: int, name: bytes, value: bytes) -> None:
        with self.transaction():
            self.db.execute("INSERT INTO xattrs (inode, name, value) VALUES (?, ?, ?) "
                            "ON CONFLICT (inode, name) DO UPDATE SET value = excluded.value",  # an UPDATE: events
                            (ino, name, value))
            self.db.execute("UPDATE inodes SET ctime_ns = ? WHERE id = ?", (time.time_ns(), ino))

    def remove_xattr(self, ino: int, name: bytes) -> bool:
        with self.transaction():
            cur = self.db.execute("DELETE FROM xattrs WHERE inode = ? AND name = ?", (ino, name))
            if cur.rowcount:
                self.db.execute("UPDATE inodes SET ctime_ns = ? WHERE id = ?", (time.time_ns(), ino))
        return cur.rowcount > 0

    # -- KV events (kvfs/events.py) --------------------------------------------------------------
    def enable_event_log(self) -> None:
        self.db.executescript(EVENT_LOG)

    def drain_event_log(self) -> list[tuple[str | None, str | None, bytes]]:
        """The announcement changes committed since the last drain, oldest first: (old tier, new tier, record)."""
        rows = self.db.execute("SELECT id, old_tier, new_tier, value FROM temp.event_log ORDER BY id").fetchall()
        if rows:
            self.db.execute("DELETE FROM temp.event_log WHERE id <= ?", (rows[-1][0],))
        return [(r[1], r[2], r[3]) for r in rows]

    def announced_blocks(self) -> Iterator[tuple[str, bytes]]:
        """(tier, record) of every announced file: the state the event log changes."""
        yield from self.db.execute(
            "SELECT i.obj_tier, x.value FROM main.xattrs x JOIN main.inodes i ON i.id = x.inode "
            "WHERE x.name = ? AND i.obj_gen > 0 AND i.nlink > 0", (b"user.kvfs.blocks",))

    # -- batched access times, durability --------------------------------------------------------
    def note_access(self, ino: int, at_ns: int | None = None) -> None:
        """A read (of a file, or readdir), now or at `at_ns` (wall clock): its atime and its place in the LRU. A
        read older than an atime set explicitly since (set_attrs) leaves the atime alone: a native reader's
        RELEASE can reach the daemon after a later utimensat (docs/frontend.md)."""
        t = at_ns or time.time_ns()
        if t <= self._atime_set.get(ino, 0):
            self._pending_use[ino] = max(self._pending_use.get(ino, 0), t)
            return
        self._pending_access[ino] = max(self._pending_access.get(ino, 0), t)

    def note_use(self, ino: int) -> None:
        """About to be used (prefetched, promoted): recent for the LRU, but not read, so its atime stays."""
        self._pending_use[ino] = time.time_ns()

    def pending_access(self, ino: int) -> int | None:
        """A read's access time not yet written (getattr shows it: atime moves with the read, not the flush)."""
        return self._pending_access.get(ino)

    def flush_access(self) -> int:
        if self._atime_set:  # a RELEASE later than this is not expected: forget explicit atimes' times
            old = time.time_ns() - ATIME_SET_MEMORY_NS
            self._atime_set = {i: t for i, t in self._atime_set.items() if t > old}
        pending, self._pending_access = self._pending_access, {}
        used, self._pending_use = self._pending_use, {}
        if pending or used:
            with self.transaction():
                self.db.executemany("UPDATE inodes SET last_access_ns = MAX(last_access_ns, ?) WHERE id = ?",
                                    [(t, ino) for ino, t in used.items()])
                self.db.executemany("UPDATE inodes SET last_access_ns = MAX(last_access_ns, ?), atime_ns = ? "
                                    "WHERE id = ?", [(t, t, ino) for ino, t in pending.items()])
        return len(pending) + len(used)

    def sync(self) -> None:
        """Make every committed transaction durable (blocking: call from a worker thread)."""
        with self._sync_lock:
            for path in (self.path.with_name(self.path.name + "-wal"), self.path):
                try:
                    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                except FileNotFoundError:
                    continue
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)

    def checkpoint(self) -> None:
        """Copy the WAL into the database file (blocking: a worker thread, with its own connection)."""
        with self._sync_lock:
            con = sqlite3.connect(self.path, isolation_level=None)
            try:
                con.execute("PRAGMA wal_checkpoint(PASSIVE)")
            finally:
                con.close()

    def wal_bytes(self) -> int:
        try:
            return os.stat(self.path.with_name(self.path.name + "-wal")).st_size
        except FileNotFoundError:
            return 0

    def truncate_wal(self) -> None:
        """Checkpoint what is left and reset the WAL file. On the trio thread, so no write can interleave
        and the checkpoint completes; call it after `checkpoint()` has copied the bulk in a thread."""
        self.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    def close(self) -> None:
        self.flush_access()
        self.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        self.db.close()


class _Transaction:
    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def __enter__(self):
        self.db.execute("BEGIN IMMEDIATE")
        return self.db

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.db.execute("COMMIT")
        else:
            self.db.execute("ROLLBACK")
        return False
