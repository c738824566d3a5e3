"""One namespace for every mount on a shared L4 prefix: names this mount lacks are looked up in the store.

A file is published in the shared store under its path (`<prefix>/files/<path>`) when it is first demoted
there, by whoever is first (the mover's conditional PUT). Here, the other direction: a lookup of a name this
mount does not know asks the store (HEAD for a file; a one-key LIST for a directory) and adopts what it finds
as an index row pointing at the published object; readdir merges the store's listing. A miss is remembered
for NEGATIVE_TTL_S, so a burst of stats of absent names costs one round trip each, not one per call; it is
forgotten when this mount drops a file of that name (the miss was typically recorded at the file's creation,
and the name may now be published: a publish conflict evicts the local file). While the store is down, its
names are simply not found (a miss, never a hang).
"""

from __future__ import annotations

import logging
import os
import stat
import time
import uuid

import trio

from .events import XA_BLOCKS, parse_record
from .index import ROOT_INODE, Index
from .store import Store
from .tiers import Tier
from .tiers.s3 import EXPIRES, travels

log = logging.getLogger(__name__)

NEGATIVE_TTL_S = 1.0
DIR_MODE = stat.S_IFDIR | 0o755


class SharedNamespace:
    def __init__(self, index: Index, store: Store, tier: Tier) -> None:
        self.index = index
        self.store = store
        self.tier = tier
        self.uid, self.gid = os.getuid(), os.getgid()
        self._misses: dict[tuple[int, bytes], float] = {}
        self.adopted = 0  # names found in the store (files and directories)
        self._reads: dict[str, int] = {}  # published file id → last read (unix seconds), not yet logged
        self._expiries: dict[str, int] = {}  # published file id → end of its retention time (I9), not yet logged
        self._node = uuid.uuid4().hex[:12]  # names this daemon's access logs

    # -- the access log (kvfs gc's LRU order) -------------------------------------------------------------
    def note_read(self, file_id: str) -> None:
        self._reads[file_id] = int(time.time())

    def note_expiry(self, file_id: str, at: int) -> None:
        """A file published with a retention time: kvfs gc deletes it at `at` (unix seconds) even if no node
        holds it then."""
        self._expiries[file_id] = at

    async def log_reads_periodically(self, interval_s: float) -> None:
        while True:
            await trio.sleep(interval_s)
            await self.flush_reads()

    async def flush_reads(self) -> None:
        """Write the reads since the last flush as one log object; kept for the next flush if the store fails."""
        if not self._reads and not self._expiries:
            return
        reads, self._reads = self._reads, {}
        expiries, self._expiries = self._expiries, {}
        lines = "".join(f"{fid}\t{t}\n" for fid, t in reads.items())
        lines += "".join(f"{fid}\t{EXPIRES}\t{t}\n" for fid, t in expiries.items())
        try:
            await self.store.io(self.tier.name, self.tier.put_access_log, f"{self._node}-{time.time_ns()}.log", lines)
        except OSError as e:
            log.debug("access log not written: %s", e)
            for fid, t in reads.items():
                self._reads[fid] = max(t, self._reads.get(fid, 0))
            for fid, t in expiries.items():
                self._expiries.setdefault(fid, t)

    def _dir_id(self, ino: int) -> str | None:
        if ino == ROOT_INODE:
            return "files/"
        parts = self.index.path_of(ino)
        try:
            return None if parts is None else "files/" + "".join(p.decode() + "/" for p in parts)
        except UnicodeDecodeError:
            return None

    async def lookup(self, parent: int, name: bytes) -> int | None:
        """The inode of `name` in `parent` as the shared store has it, adopted into the index; None if absent."""
        now = time.monotonic()
        if self._misses.get((parent, name), 0.0) > now or not self.tier.available():
            return None
        dir_id = self._dir_id(parent)
        try:
            file_id = None if dir_id is None else dir_id + name.decode()
        except UnicodeDecodeError:
            file_id = None
        if file_id is None:
            return None
        try:
            facts = await self.store.io(self.tier.name, self.tier.head, file_id)
            is_dir = facts is None and await self.store.io(self.tier.name, self.tier.has_children, file_id + "/")
        except OSError as e:
            log.debug("shared lookup of %s: %s", file_id, e)
            return None  # the store cannot answer now: a miss
        existing = self.index.lookup(parent, name)  # created here while we asked
        if existing is not None:
            return existing
        if facts is not None:
            return self._adopt_file(parent, name, file_id, facts)
        if is_dir:
            self.adopted += 1
            return self.index.create(parent, name, DIR_MODE, self.uid, self.gid)
        if len(self._misses) > 100_000:
            self._misses = {k: t for k, t in self._misses.items() if t > now}
        self._misses[(parent, name)] = now + NEGATIVE_TTL_S
        return None

    async def merge_dir(self, ino: int) -> None:
        """Adopt every name the store lists under directory `ino` that the index does not have yet."""
        dir_id = self._dir_id(ino)
        if dir_id is None or not self.tier.available():
            return
        try:
            files, dirs = await self.store.io(self.tier.name, self.tier.list_dir, dir_id)
        except OSError as e:
            log.debug("shared listing of %s: %s", dir_id, e)
            return
        for d in dirs:
            if self.index.lookup(ino, d.encode()) is None:
                self.adopted += 1
                self.index.create(ino, d.encode(), DIR_MODE, self.uid, self.gid)
        for f in files:
            if self.index.lookup(ino, f.encode()) is not None:
                continue
            try:
                facts = await self.store.io(self.tier.name, self.tier.head, dir_id + f)
            except OSError:
                return
            if facts is not None and self.index.lookup(ino, f.encode()) is None:
                self._adopt_file(ino, f.encode(), dir_id + f, facts)

    def _adopt_file(self, parent: int, name: bytes, file_id: str, facts: dict) -> int:
        mode = facts["mode"] if stat.S_ISREG(facts["mode"]) else stat.S_IFREG | 0o644
        ino = self.index.adopt_published(parent, name, mode=mode, uid=self.uid, gid=self.gid, size=facts["size"],
                                         stored_bytes=facts["stored_bytes"], tier=self.tier.name, key=file_id,
                                         etag=facts["etag"], mtime_ns=facts["mtime_ns"])
        for key, value in facts.get("xattrs", []):  # other tiers' metadata, as the publishing node had it
            if travels(key) and (key != XA_BLOCKS or _valid_record(value)):
                self.index.set_xattr(ino, key, value)
        if facts.get("ttl_s"):  # I9: it expires here too (counted from its publication)
            self.index.set_ttl([ino], facts["ttl_s"])
        self.store.charge(self.tier, facts["stored_bytes"])
        self.adopted += 1
        return ino

    def forget_miss(self, parent: int, name: bytes) -> None:
        self._misses.pop((parent, name), None)


def _valid_record(value: bytes) -> bool:
    try:
        parse_record(value)
    except ValueError:
        return False
    return True
