"""kvfs fsck: check the index against every tier and every object's checksums; optionally repair.

One checker serves both modes: inside the daemon while the mount serves requests (kvfs/fsck_live.py) and on an
unmounted state directory (kvfs/fsck_offline.py). A `Host` says what differs: offline nothing else runs, so
nothing is locked and repairs write the index and the tiers directly; live, suspicious objects are looked at
again under their inode lock and repairs go through the daemon's own paths.

Phases: list every tier (a shared L4 is never listed: only the objects its rows name are read), verify every
row's object (header, frame table and every frame decoded, both checksums, as a read would), look again at
whatever looked wrong, check the index's link invariants (I1, I2). Finding kinds:

- corrupt:   a row's object fails a checksum, a structural test or its sizes disagree with the row;
- missing:   a row names an object its tier does not have, or one of another size;
- orphan:    an object no row names (superseded generation, interrupted put) or a leftover temp file;
- duplicate: a complete copy of a row's object in another tier (a move cut short); adopted when the row's
             own copy is missing or corrupt and the copy verifies;
- index:     a name of a missing inode or in a non-directory (I1), a wrong link count (I2), an unlinked
             inode left by an unclean stop (offline).

A tier spread over several directories (L3 on several SSDs) is reported per directory (`directories`: its
state, what the listing found there). A directory that is down is not read: the rows whose object lies
there are counted `unavailable`, never dropped (they read again once it is back), and the run does not
end clean.

Exit status, after e2fsck: 0 nothing found, 1 everything found was repaired, 4 findings left (a check without
--repair, or a repair that could not be done), 8 the check could not run or finish (see EXIT_*).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable
from typing import AsyncContextManager

import trio

from . import format as fmt
from .index import ROOT_INODE, Index, object_id, parse_object_id
from .store import PROBE_BYTES, ObjectRef, Store
from .staging import STAGING_DIR
from .tiers import MemberDown, Stray, Tier

KINDS = ("corrupt", "missing", "orphan", "duplicate", "index")
EXIT_CLEAN, EXIT_CORRECTED, EXIT_UNCORRECTED, EXIT_FAILED = 0, 1, 4, 8
VERIFY_CHUNK = 8 << 20  # stored bytes of frames read and decoded per worker-thread call
VERIFY_PARALLEL = 2  # objects verified at once: enough to overlap I/O and decoding, little next to the mount
S_IFMT, S_IFDIR = 0o170000, 0o040000


@dataclasses.dataclass
class Finding:
    kind: str
    detail: str
    tier: str | None = None
    object_id: str | None = None
    ino: int | None = None
    path: str | None = None
    repair: str | None = None  # what was done about it; None: nothing (yet)
    directory: str | None = None  # where the object is, in a tier spread over several directories


@dataclasses.dataclass
class Report:
    """The state of one run, updated as it goes (the live status file renders it while it runs)."""

    mode: str  # check | repair
    phase: str = "listing"
    objects_total: int = 0
    objects_checked: int = 0
    bytes_total: int = 0
    bytes_checked: int = 0
    skipped: int = 0  # files busy (being written, moved) when looked at: left for the next run
    unavailable: int = 0  # files whose object lies in a directory that is down: not checked
    findings: list[Finding] = dataclasses.field(default_factory=list)
    directories: list[dict] = dataclasses.field(default_factory=list)  # of spread tiers: state, objects listed

    @property
    def repaired(self) -> int:
        return sum(1 for f in self.findings if f.repair)

    @property
    def exit_status(self) -> int:
        if self.unavailable or any(d["state"] == "down" for d in self.directories):
            return EXIT_UNCORRECTED  # a directory down: not everything could be checked
        if not self.findings:
            return EXIT_CLEAN
        return EXIT_CORRECTED if self.repaired == len(self.findings) else EXIT_UNCORRECTED

    def counts(self) -> dict[str, int]:
        return {kind: sum(1 for f in self.findings if f.kind == kind) for kind in KINDS}

    def to_dict(self) -> dict:
        return {"mode": self.mode, "phase": self.phase, "objects_total": self.objects_total,
                "objects_checked": self.objects_checked, "bytes_total": self.bytes_total,
                "bytes_checked": self.bytes_checked, "skipped": self.skipped, "unavailable": self.unavailable,
                "counts": self.counts(), "repaired": self.repaired, "exit_status": self.exit_status,
                "findings": [dataclasses.asdict(f) for f in self.findings], "directories": self.directories}


@dataclasses.dataclass(frozen=True)
class Problem:
    kind: str  # corrupt | missing
    detail: str


class Host:
    """An offline check: the state directory is locked, nothing else runs. Subclassed for a live check."""

    live = False
    settle_s = 0.0  # how long after listing a tier its unnamed objects are looked at again

    def __init__(self, index: Index, store: Store) -> None:
        self.index = index
        self.store = store

    def exclusive(self, ino: int) -> AsyncContextManager[bool]:
        """Hold off commits and moves of `ino` for the block; yields False when it is busy."""
        return contextlib.nullcontext(True)

    def writing(self, ino: int) -> bool:
        """The file is open with unsaved data: skipped this run."""
        return False

    def names_object(self, row) -> bool:
        """Whether a row's object counts as named. Offline an unlinked row (nlink 0) is a leftover."""
        return row["nlink"] > 0

    async def drop_file(self, ino: int, ref: ObjectRef, reason: str, corrupt: bool) -> None:
        """Make a file with a bad object a miss: names and row gone, a corrupt object kept aside where the
        tier can (a shared L4), the object deleted."""
        tier = self.store.tiers.get(ref.tier)
        if tier is not None and corrupt:
            await self.store.io(tier.name, tier.quarantine, ref.object_id)
        self.index.purge([ino])
        if tier is not None and ref.key is None:  # a published object is the shared store's
            await self.store.io(tier.name, tier.delete, ref.object_id)

    def charge(self, tier: str, size: int) -> None:
        """Tier accounting (live only: offline the next mount counts at start)."""

    def release(self, tier: str, size: int) -> None:
        """Tier accounting (live only)."""

    def relocated(self, ino: int, ref: ObjectRef) -> None:
        """A row now names a copy in another tier (live: an open file reads it there)."""

    async def forget_names(self, ino: int, names: list[tuple[int, bytes]]) -> None:
        """Names removed from the index (live: the kernel forgets them)."""


@dataclasses.dataclass
class _Candidates:
    """What the listing found for one inode that is not its row's object where the row says."""

    objects: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (tier, object id)
    strays: list[tuple[str, Stray]] = dataclasses.field(default_factory=list)  # (tier, temp file)


class Checker:
    def __init__(self, index: Index, store: Store, host: Host, repair: bool,
                 on_progress: Callable[[Report], None] | None = None) -> None:
        self.index = index
        self.store = store
        self.host = host
        self.repair = repair
        self.report = Report("repair" if repair else "check")
        self._on_progress = on_progress or (lambda report: None)
        self._problems: dict[int, tuple[ObjectRef, Problem]] = {}  # first pass: rows whose object looked bad
        self._verified: dict[int, ObjectRef] = {}  # first pass: rows whose object verified
        self._candidates: dict[int, _Candidates] = {}
        self._loose: list[tuple[str, str | None, Stray | None]] = []  # unparsable names: (tier, id, stray)

    async def run(self) -> Report:
        await self._list_tiers()
        listed_at = trio.current_time()
        rows = self._rows()
        self._progress("verifying")
        await self._verify_rows(rows)
        await trio.sleep_until(listed_at + self.host.settle_s)  # deletions in flight at listing are done
        self._progress("rechecking")
        for ino in sorted(set(self._problems) | set(self._candidates)):
            await self._recheck(ino)
        for tier_name, oid, stray in self._loose:
            await self._recheck_loose(self.store.tiers[tier_name], oid, stray)
        self._progress("index")
        await self._check_index()
        for d in self.report.directories:  # as they are now: a directory may have failed during the run
            now = next(n for n in self.store.tiers[d["tier"]].directories() if n["path"] == d["path"])
            d["state"], d["reason"] = now["state"], now["reason"]
        self._progress("done")
        return self.report

    def _progress(self, phase: str | None = None) -> None:
        if phase is not None:
            self.report.phase = phase
        self._on_progress(self.report)

    # -- listing ----------------------------------------------------------------------------------------
    async def _list_tiers(self) -> None:
        self._found: dict[str, dict[str, int]] = {}  # object id → {tier: size}
        for tier in self.store.order:
            if tier.shared:
                continue  # other nodes' files too: only this mount's rows' objects are read
            # no deadline: listing a large remote prefix takes as long as it takes
            limiter = self.store.io_limiters[tier.name]
            strays = await trio.to_thread.run_sync(lambda t=tier: list(t.strays()), limiter=limiter)
            objects = await trio.to_thread.run_sync(lambda t=tier: list(t.scan()), limiter=limiter)
            for info in objects:
                self._found.setdefault(info.object_id, {})[tier.name] = info.size
            for stray in strays:
                parsed = parse_object_id(stray.object_id) if stray.object_id else None
                if parsed is None:
                    self._loose.append((tier.name, None, stray))
                else:
                    self._candidates.setdefault(parsed[0], _Candidates()).strays.append((tier.name, stray))
            self._list_directories(tier, objects)

    def _list_directories(self, tier: Tier, objects: list) -> None:
        """Per directory of a spread tier: its state and what the listing found there."""
        if not tier.directories():
            return
        found: dict[str, list[int]] = {}
        for info in objects:
            counts = found.setdefault(tier.where(info.object_id), [0, 0])
            counts[0] += 1
            counts[1] += info.size
        for d in tier.directories():
            objects_, bytes_ = found.get(d["path"], (0, 0))
            self.report.directories.append({"tier": tier.name, "path": d["path"], "state": d["state"],
                                            "reason": d["reason"], "objects": objects_, "bytes": bytes_,
                                            "unavailable": 0})

    def _rows(self) -> list:
        """Rows with an object; those whose object is elsewhere than where the listing found it, and every
        object the listing found that no row names where it lies, become candidates for a second look."""
        rows = self.index.db.execute(
            "SELECT id, nlink, size, obj_gen, obj_tier, stored_bytes, published_key FROM inodes "
            "WHERE obj_gen > 0").fetchall()
        named = {}
        for row in rows:
            ref = ObjectRef.of_row(row)
            if self.host.names_object(row):
                named[ref.object_id] = ref.tier
        for oid, places in self._found.items():
            parsed = parse_object_id(oid)
            for tier_name in places:
                if named.get(oid) == tier_name:
                    continue
                if parsed is None:
                    self._loose.append((tier_name, oid, None))
                else:
                    self._candidates.setdefault(parsed[0], _Candidates()).objects.append((tier_name, oid))
        to_verify = [r for r in rows if r["nlink"] > 0]  # unlinked but open: going away, not served by name
        self.report.objects_total = len(to_verify)
        self.report.bytes_total = sum(r["stored_bytes"] for r in to_verify)
        return to_verify

    # -- verification -----------------------------------------------------------------------------------
    async def _verify_rows(self, rows: list) -> None:
        pending = iter(rows)
        failures: list[OSError] = []

        async def worker(cancel_scope: trio.CancelScope) -> None:
            try:
                for row in pending:
                    await self._verify_row(row)
            except OSError as e:  # a tier failed: the run cannot finish (raised below, not as a group)
                failures.append(e)
                cancel_scope.cancel()

        async with trio.open_nursery() as nursery:
            for _ in range(VERIFY_PARALLEL):
                nursery.start_soon(worker, nursery.cancel_scope)
        if failures:
            raise failures[0]

    async def _verify_row(self, row) -> None:
        if self.host.writing(row["id"]):
            self.report.skipped += 1
            return
        ref = ObjectRef.of_row(row)
        problem = await self.verify(ref, row["size"])
        if problem is not None and problem.kind == "unavailable":
            self._unavailable(ref)  # not checked
            self._progress()
            return
        self.report.objects_checked += 1
        if problem is None:
            self._verified[row["id"]] = ref
        else:
            self._problems[row["id"]] = (ref, problem)
        self._progress()

    async def verify(self, ref: ObjectRef, size: int, count: bool = True) -> Problem | None:
        """Read and decode the whole object as a read would; None when it is intact. I/O and decoding run in
        worker threads under the store's limiters."""
        tier = self.store.tiers.get(ref.tier)
        if tier is None:
            return Problem("missing", f"tier {ref.tier} is not configured")
        try:
            actual = await self.store.io(tier.name, tier.size_of, ref.object_id)
            if actual is None:
                return Problem("missing", "no such object")
            if actual != ref.stored_bytes:
                return Problem("missing", f"{actual} bytes, the index says {ref.stored_bytes}")
            header, frames = await self.store.io(tier.name, _read_layout, tier, ref.object_id, ref.stored_bytes)
            cipher = self.store.opener(header)  # sealed frames: opened where the key is held, else checked sealed
            if header.raw_size != size:
                return Problem("corrupt", f"holds {header.raw_size} bytes, the index says {size}")
            for start, batch in _batches(frames):
                last = batch[-1][1]
                length = last.offset + last.stored_len - start
                payload = await self.store.io(tier.name, tier.read, ref.object_id, start, length, size=length)
                await self.store.cpu(_decode_frames, batch, payload, start, cipher)
                if count:
                    self.report.bytes_checked += length
        except fmt.CorruptObject as e:
            return Problem("corrupt", str(e))
        except FileNotFoundError:
            return Problem("missing", "vanished while being read")
        except OSError as e:
            if not tier.directories():
                raise  # the tier failed: the run cannot finish
            return Problem("unavailable", str(e))  # its directory failed: neither intact nor bad
        if count:
            self.report.bytes_checked += header.data_offset
        return None

    def _unavailable(self, ref: ObjectRef) -> None:
        self.report.unavailable += 1
        where = self.store.tiers[ref.tier].where(ref.object_id)
        for d in self.report.directories:
            if (d["tier"], d["path"]) == (ref.tier, where):
                d["unavailable"] += 1

    async def _size_of(self, tier: Tier, oid: str) -> int | None:
        """An object's size now; None when absent or in a directory that went down since the listing."""
        try:
            return await self.store.io(tier.name, tier.size_of, oid)
        except MemberDown:
            return None

    # -- the second look --------------------------------------------------------------------------------
    async def _recheck(self, ino: int) -> None:
        """Under the inode lock (live), from the current row: what is really wrong, and its repair."""
        async with self.host.exclusive(ino) as held:
            if not held or self.host.writing(ino):
                self.report.skipped += 1
                return
            row = self.index.get(ino)
            named = ObjectRef.of_row(row) if row is not None and self.host.names_object(row) else None
            problem = await self._current_problem(ino, row, named)
            copies, orphans = await self._sort_candidates(ino, row, named)
            adoptable = None
            if problem is not None and named.key is None:
                for tier_name in copies:
                    copy = dataclasses.replace(named, tier=tier_name)
                    if await self.verify(copy, row["size"], count=False) is None:
                        adoptable = copy
                        break
            path = _path_of(self.index, ino) if row is not None else None
            if problem is not None:
                await self._bad_object(ino, named, problem, adoptable, path)
            for tier_name in copies:
                if adoptable is None or tier_name != adoptable.tier:
                    await self._duplicate(named, tier_name, path)
            for finding, removal in orphans:
                await self._add(finding, removal)

    async def _current_problem(self, ino: int, row, named: ObjectRef | None) -> Problem | None:
        if named is None or row["nlink"] == 0:
            return None
        if self._verified.get(ino) == named:
            return None  # verified in the first pass, and the row has not changed since
        problem = await self.verify(named, row["size"], count=False)
        return None if problem is not None and problem.kind == "unavailable" else problem

    async def _sort_candidates(self, ino: int, row, named: ObjectRef | None):
        """The listing's candidates for `ino`, looked at now: complete copies of its object in other tiers,
        and orphans (each a finding and the call that removes it). Whatever is gone since is forgotten."""
        found = self._candidates.get(ino, _Candidates())
        copies: list[str] = []
        orphans = []
        own_id = object_id(ino, named.gen) if named is not None else None
        for tier_name, oid in found.objects:
            tier = self.store.tiers[tier_name]
            size = await self._size_of(tier, oid)
            if size is None or (named is not None and (tier_name, oid) == (named.tier, named.object_id)):
                continue
            if oid == own_id and size == named.stored_bytes:
                copies.append(tier_name)
                continue
            finding = self._located(Finding("orphan", _why_orphan(oid, row, named, size), tier_name, oid, ino))
            orphans.append((finding, lambda t=tier, o=oid: self.store.io(t.name, t.delete, o)))
        for tier_name, stray in found.strays:
            tier = self.store.tiers[tier_name]
            if await self.store.io(tier_name, tier.stray_size, stray.name) is None:
                continue  # the put finished (or failed and cleaned up) since the listing
            finding = Finding("orphan", f"temp file {stray.name} of an interrupted put ({stray.size} bytes)",
                              tier_name, stray.object_id, ino)
            orphans.append((finding, lambda t=tier, n=stray.name: self.store.io(t.name, t.remove_stray, n)))
        return copies, orphans

    async def _recheck_loose(self, tier: Tier, oid: str | None, stray: Stray | None) -> None:
        """A file in a tier whose name is no object id (or misplaced): no inode to lock, only looked at again."""
        if stray is not None:
            if await self.store.io(tier.name, tier.stray_size, stray.name) is None:
                return
            what = "abandoned staged object" if stray.name.startswith(STAGING_DIR + "/") else "stray file"
            finding = Finding("orphan", f"{what} {stray.name} ({stray.size} bytes)", tier.name)
            await self._add(finding, lambda: self.store.io(tier.name, tier.remove_stray, stray.name))
            return
        size = await self._size_of(tier, oid)
        if size is not None:
            finding = self._located(Finding("orphan", f"{oid} is no object id ({size} bytes)", tier.name, oid))
            await self._add(finding, lambda: self.store.io(tier.name, tier.delete, oid))

    async def _bad_object(self, ino: int, ref: ObjectRef, problem: Problem, adoptable: ObjectRef | None,
                          path: str | None) -> None:
        finding = self._located(Finding(problem.kind, problem.detail, ref.tier, ref.object_id, ino, path))
        if adoptable is not None:
            copy = self._located(Finding("duplicate", f"a complete copy of {ref.object_id} (a move cut short) "
                                         "that verifies: adoptable", adoptable.tier, adoptable.object_id, ino, path))
            self.report.findings += [finding, copy]
            if self.repair and await self._adopt(ino, ref, adoptable, problem):
                finding.repair = f"replaced by the copy in {adoptable.tier}"
                copy.repair = "adopted"
            return
        self.report.findings.append(finding)
        if self.repair:
            reason = f"{problem.detail} (object {ref.object_id} in {ref.tier}, found by fsck)"
            await self.host.drop_file(ino, ref, reason, corrupt=problem.kind == "corrupt")
            finding.repair = "file dropped (a miss)"

    async def _adopt(self, ino: int, ref: ObjectRef, copy: ObjectRef, problem: Problem) -> bool:
        """Point the row at the verified copy (the move protocol's switch, I6), then remove the bad one."""
        if not self.index.move_object(ino, ref.gen, ref.tier, copy.tier):
            return False
        self.host.charge(copy.tier, copy.stored_bytes)
        self.host.relocated(ino, copy)
        tier = self.store.tiers.get(ref.tier)
        if tier is not None:
            if problem.kind == "corrupt":
                await self.store.io(tier.name, tier.quarantine, ref.object_id)
            self.host.release(tier.name, ref.stored_bytes)
            await self.store.io(tier.name, tier.delete, ref.object_id)
        return True

    async def _duplicate(self, named: ObjectRef, tier_name: str, path: str | None) -> None:
        tier = self.store.tiers[tier_name]
        oid = object_id(named.ino, named.gen)
        finding = self._located(Finding("duplicate", f"a second copy of the object in {named.tier} (a move cut "
                                        "short)", tier_name, oid, named.ino, path))
        await self._add(finding, lambda: self.store.io(tier_name, tier.delete, oid))

    def _located(self, finding: Finding) -> Finding:
        """The finding with its object's directory, in a tier spread over several (a stray's name is its path)."""
        tier = self.store.tiers.get(finding.tier or "")
        if tier is not None and finding.object_id and tier.directories():
            finding.directory = tier.where(finding.object_id)
        return finding

    async def _add(self, finding: Finding, removal: Callable[[], object]) -> None:
        self.report.findings.append(finding)
        if self.repair:
            await removal()
            finding.repair = "removed"

    # -- the index (I1, I2) -----------------------------------------------------------------------------
    async def _check_index(self) -> None:
        db = self.index.db
        bad_entries = db.execute(
            "SELECT e.parent, e.name, e.inode, i.id IS NULL, p.id IS NULL FROM entries e "
            "LEFT JOIN inodes i ON i.id = e.inode LEFT JOIN inodes p ON p.id = e.parent "
            "WHERE i.id IS NULL OR p.id IS NULL OR (p.mode & ?) != ?", (S_IFMT, S_IFDIR)).fetchall()
        findings = []
        for parent, name, ino, no_inode, no_parent in bad_entries:
            what = ("its inode does not exist" if no_inode else "its directory does not exist" if no_parent
                    else "its parent is not a directory")
            findings.append(Finding("index", f"I1: entry {os.fsdecode(name)!r} (inode {ino} in {parent}): {what}",
                                    ino=ino))
        wrong_links = db.execute(
            "SELECT id, nlink, CASE WHEN (mode & ?) = ? THEN 2 + (SELECT COUNT(*) FROM entries e JOIN inodes c "
            "ON c.id = e.inode WHERE e.parent = inodes.id AND (c.mode & ?) = ?) ELSE (SELECT COUNT(*) FROM "
            "entries e WHERE e.inode = inodes.id) END AS links FROM inodes WHERE nlink > 0 AND nlink != links",
            (S_IFMT, S_IFDIR, S_IFMT, S_IFDIR)).fetchall()
        for ino, nlink, links in wrong_links:
            findings.append(Finding("index", f"I2: link count {nlink}, {links} expected", ino=ino,
                                    path=_path_of(self.index, ino)))
        unlinked = [] if self.host.live else [r[0] for r in db.execute(
            "SELECT id FROM inodes WHERE nlink = 0 AND id != ?", (ROOT_INODE,))]
        for ino in unlinked:
            findings.append(Finding("index", "unlinked inode left by an unclean stop", ino=ino))
        self.report.findings += findings
        if self.repair and findings:
            await self._repair_index(bad_entries, bool(wrong_links or bad_entries), unlinked)
            for f in findings:
                f.repair = "fixed"

    async def _repair_index(self, bad_entries: list, recount: bool, unlinked: list[int]) -> None:
        with self.index.transaction() as db:
            for parent, name, *_ in bad_entries:
                db.execute("DELETE FROM entries WHERE parent = ? AND name = ?", (parent, name))
            if recount:
                db.execute(
                    "UPDATE inodes SET nlink = CASE WHEN (mode & ?) = ? THEN 2 + (SELECT COUNT(*) FROM entries e "
                    "JOIN inodes c ON c.id = e.inode WHERE e.parent = inodes.id AND (c.mode & ?) = ?) ELSE "
                    "(SELECT COUNT(*) FROM entries e WHERE e.inode = inodes.id) END WHERE nlink > 0",
                    (S_IFMT, S_IFDIR, S_IFMT, S_IFDIR))
        self.index.purge(unlinked)
        for parent, name, ino, *_ in bad_entries:
            await self.host.forget_names(ino, [(parent, name)])


def _read_layout(tier: Tier, oid: str, stored_bytes: int) -> tuple[fmt.Header, list[fmt.FrameEntry]]:
    """Header and frame table, verified; the frames must account for every byte of the object."""
    head = tier.read(oid, 0, min(PROBE_BYTES, stored_bytes))
    header = fmt.parse_header(head)
    if header.data_offset > len(head):
        head = tier.read(oid, 0, header.data_offset)
    if len(head) < header.data_offset:
        raise fmt.CorruptObject("object shorter than its frame table")
    frames = fmt.parse_table(header, memoryview(head)[header.size:], stored_bytes)
    end = header.data_offset + sum(e.stored_len for e in frames if not e.is_hole)
    if end != stored_bytes:
        raise fmt.CorruptObject(f"frames account for {end} bytes of {stored_bytes}")
    return header, frames


def _batches(frames: list[fmt.FrameEntry]):
    """(first offset, [frames]) of consecutive payloads, up to VERIFY_CHUNK stored bytes each (one read)."""
    batch: list[tuple[int, fmt.FrameEntry]] = []
    for i, entry in enumerate(frames):
        if entry.is_hole:
            continue
        if batch and (entry.offset != batch[-1][1].offset + batch[-1][1].stored_len
                      or entry.offset + entry.stored_len - batch[0][1].offset > VERIFY_CHUNK):
            yield batch[0][1].offset, batch
            batch = []
        batch.append((i, entry))
    if batch:
        yield batch[0][1].offset, batch


def _decode_frames(batch: list[tuple[int, fmt.FrameEntry]], payload: bytes, start: int, cipher=None) -> None:
    view = memoryview(payload)
    for i, entry in batch:
        at = entry.offset - start
        try:
            if entry.is_sealed and cipher is None:  # no key here: the sealed bytes' checksum is what can be checked
                fmt.check_payload(entry, view[at:at + entry.stored_len])
            else:
                fmt.decode_frame(entry, view[at:at + entry.stored_len], cipher)
        except fmt.CorruptObject as e:
            raise fmt.CorruptObject(f"frame {i}: {e}") from None


def _why_orphan(oid: str, row, named: ObjectRef | None, size: int) -> str:
    _, gen = parse_object_id(oid)
    if row is None:
        why = "its inode does not exist"
    elif named is None:
        why = "its inode has no object" if not row["obj_gen"] else "its inode was unlinked"
    elif gen < named.gen:
        why = f"superseded by generation {named.gen}"
    elif gen > named.gen:
        why = f"newer than the inode's generation {named.gen} (an interrupted commit)"
    else:
        why = f"an incomplete copy ({size} bytes of {named.stored_bytes})"
    return f"no row names it: {why}"


def _path_of(index: Index, ino: int) -> str | None:
    """A name of the inode from the root (the first one, for hard links); None when it has none."""
    parts: list[bytes] = []
    seen = set()
    while ino != ROOT_INODE:
        names = index.entries_of(ino)
        if not names or ino in seen:
            return None
        seen.add(ino)
        ino, name = names[0]
        parts.append(name)
    return "/" + "/".join(os.fsdecode(p) for p in reversed(parts))

