"""The mover: where objects live — placement of new objects, demotion, promotion and eviction.

Policy
- A tier above its high watermark is drained to its low watermark: its least recently used files are
  demoted to the next tier; from the last tier they are evicted (kvfs is a cache: the file disappears and
  its next lookup is a miss).
- Quotas (kvfs/quotas.py): while a tier needs room, a directory at its quota there (within its largest file's
  size) or over it gives up its own least recently used files first; other files go only when that is not
  enough: for the high watermark, when the others' data alone is over it; for a writer, once those directories
  gave what they can (`_drain`). A directory over its quota is brought back to it at every pass.
- A new object goes to the fastest tier it fits in (durable ones — fsync — to the first persistent tier).
  When that tier is momentarily full the writer waits while room is made the same way; it falls back to the
  next tier only when nothing can be freed, and gets ENOSPC when no tier can take the object. An object
  larger than a tier's whole capacity skips that tier.
- A file read from a slower tier is promoted to the fastest after `promotion.after_reads` reads
  (1 = always, 0 = never), in the background: the read itself is served where the file is.
- Files being written or committed (their inode lock is busy) are skipped; open files are never evicted.
- Pinned files (index I8) are promoted to the fastest tier and never demoted or evicted; together they stay
  within its pin limit (its high watermark), checked when pinning. The idle policy moves a file not read for k idle
  periods to at least the k-th tier below the fastest (never out of the last one: that is eviction's job).
- Requests by name (the hot/cold API, kvfs/hotcold.py) use the same moves: `move` with wait=True, and the
  promotion queue for prefetches.

Move protocol (`move`): with the inode lock held, copy the encoded object to the destination (temp name,
fsync where persistent, rename), switch the row's tier in one transaction only if the row still names the
copied object (index I6), point an open file at the new place, then unlink the source. A reader that
opened the source before the unlink keeps reading it; one that finds it gone retries at the new place.
A crash at any step leaves the object in one tier for the index, and a duplicate that reconcile removes.

Capacity: a tier's used bytes only grow through `Store.charge` after `Store.fits` — a tier never holds more
than its capacity, except a commit's new object beside the one it replaces, for as long as the switch takes.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import time
from collections.abc import Awaitable, Callable

import trio

from .config import PromotionPolicy, TierConfig
from .index import Index, object_id
from .locks import InodeLocks
from .quotas import Quotas
from .ratelimit import Throttle
from .stats import Counters
from .store import ObjectRef, Store, credit_for
from .tiers import Tier
from . import events
from .tiers.s3 import encode_xattrs, travels

log = logging.getLogger(__name__)

TICK_S = 1.0  # the mover checks watermarks at least this often
SETTLE_S = 1.0  # write policy through: a file is published this long after its last close
DELETE_GATHER_S = 0.05  # a remote tier's deletions wait this long to go out together …
DELETE_BATCH = 1000  # … up to this many per request (the S3 maximum)
DELETE_DEFER_MAX_S = 5.0  # … and wait while moves run, at most this long (a promotion wave goes first) …
DELETE_QUIET_S = 0.25  # … and until no move has ended for this long (a wave's readers open one file after another)
MOVES_IN_FLIGHT = 4  # concurrent moves (each one a copy in a worker thread)
CANDIDATES = 32  # least recently used files fetched per round
DEFAULT_MAX_BACKLOG = 0.15  # of the fastest tier: with watermarks 90/80 %, congested past 95 % full
IDLE_SWEEP_S = 1.0  # the idle policy looks for idle files this often
LOG_MOVES_EVERY_S = 10.0  # moves out of a tier are logged as one summary line at most this often


class Mover:
    def __init__(self, store: Store, index: Index, tiers: tuple[TierConfig, ...], promotion: PromotionPolicy,
                 counters: Counters, locks: InodeLocks, idle_s: int = 0) -> None:
        self.store = store
        self.index = index
        self.counters = counters
        self.locks = locks
        self.promotion = promotion
        self.order = store.order  # fastest first
        self.watermarks = {t.name: (t.high_watermark, t.low_watermark) for t in tiers}
        self.idle_s = idle_s  # the mount's default idle period (I8); 0 = off
        self._idle_swept = 0.0
        self._writers_waiting = 0  # commits waiting for room now (back-pressure: congested())
        self.max_backlog: int | None = None  # bytes of the fastest tier's backlog that mean congested (daemon)
        self._expiry_swept = 0.0
        # forgets an inode's pages in the kernel (kvfs/frontend/ops)
        self.drop_pages: Callable[[int], None] | None = None
        self._dropping_pages: dict[int, trio.Event] = {}  # inode -> set once its pages are dropped
        self._move_log: dict[str, _MovesOut] = {}  # tier → moves out not logged yet (see _flush_move_log)
        self._move_logged: dict[str, float] = {}
        self._room = {t.name: trio.Lock() for t in self.order}  # one agent frees room in a tier at a time
        self._slots = trio.CapacityLimiter(MOVES_IN_FLIGHT)
        self._wake = trio.Event()
        self._reads: dict[int, int] = {}  # ino → reads from a slower tier since it got there
        self._promotions: dict[int, None] = {}  # queued, in order
        self._draining: set[str] = set()
        self._moving = 0  # moves past their checks, not yet finished
        self._moved_at = 0.0  # trio clock: when a move last ended
        self._last_move_at: float | None = None  # wall clock: when a move last finished (None: none yet)
        self._deleting = 0  # sources of finished moves being deleted in the background (remote tiers)
        self._background: trio.Nursery | None = None
        self._doomed: dict[str, list[str]] = {}  # remote tier → ids of moved objects waiting for deletion
        self._flushing: dict[str, tuple[frozenset[str], trio.Event] | None] = {}  # tiers with a deleter: its batch
        self._conflicts: set[int] = set()  # files a shared L4 will not take (name published by another node)
        self.write_through = False  # publish every committed file to the shared L4 once it has settled
        self._settling: dict[int, float] = {}  # ino → when it may be published (write policy through)
        self._failure_log = Throttle()  # a full disk fails every move: say it once a minute
        # bound by the filesystem: the open file of an inode (or None), and eviction from the namespace
        self.quotas: Quotas | None = None  # directories with quotas (kvfs/quotas.py): set by the daemon
        self.shared = None  # kvfs.shared.SharedNamespace of a shared L4 (its access log): set by the daemon
        self.open_file: Callable[[int], object | None] = lambda ino: None
        self.drop_names: Callable[[int], list[tuple[int, bytes]]] = lambda ino: []
        self.forget_names: Callable[[int, list[tuple[int, bytes]]], Awaitable[None]] = _forget_nothing
        self.drop_file: Callable[[int], Awaitable[bool]] = _drop_nothing  # fs.drop_file: every tier, every name

    # -- the background task ---------------------------------------------------------------------------
    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as background:
            self._background = background
            try:
                task_status.started()
                await self._passes()
            finally:
                self._background = None
                self._flush_move_log(force=True)

    async def _passes(self) -> None:
        self.wake()  # the first pass at once: a restart with smaller capacities has work waiting
        while True:
            with trio.move_on_after(TICK_S):
                await self._wake.wait()
            self._wake = trio.Event()
            try:
                await self._promote_queued()
                await self._publish_settled()
                await self._sweep_idle()
                await self._sweep_expired()
                self._flush_move_log()
                for tier in self.order:
                    high, low = self.watermarks[tier.name]
                    nxt = self._next_tier(tier)
                    if nxt is not None and not nxt.available():
                        continue  # demotion pauses while the next tier is down: this one keeps files while it has room
                    if tier.used_bytes > high * tier.capacity:
                        await self._drain(tier, int(low * tier.capacity), others_above=int(high * tier.capacity))
                    await self._enforce_quotas(tier)
            except Exception:
                self.counters.errors += 1
                log.exception("mover pass failed; retrying at the next tick")

    def wake(self) -> None:
        self._wake.set()

    def backlog(self, tier: Tier) -> int:
        """Bytes a tier holds beyond its low watermark while it drains: what the mover still has to move."""
        high, low = self.watermarks[tier.name]
        if tier.name in self._draining or tier.used_bytes > high * tier.capacity:
            return max(0, tier.used_bytes - int(low * tier.capacity))
        return 0

    def max_backlog_bytes(self) -> int:
        fastest = self.order[0]
        return self.max_backlog if self.max_backlog is not None else int(DEFAULT_MAX_BACKLOG * fastest.capacity)

    def congested(self) -> bool:
        """The mover is behind: new data waits for room, or soon will. Writers that can do without a save
        (the connector) skip it instead of stalling the engine: user.kvfs.congested, adopt requests' shed."""
        return self._writers_waiting > 0 or self.backlog(self.order[0]) > self.max_backlog_bytes()

    def status(self) -> dict:
        """Gauges for .kvfs/stats."""
        return {
            "promotion": str(self.promotion),
            "watermarks": {name: {"high": h, "low": lo} for name, (h, lo) in self.watermarks.items()},
            "draining": sorted(self._draining),
            "backlog_bytes": sum(self.backlog(t) for t in self.order),
            "congested": int(self.congested()),
            "max_backlog_bytes": self.max_backlog_bytes(),
            "writers_waiting": self._writers_waiting,
            "promotions_queued": len(self._promotions),
            "moves_in_flight": self._moving,
            "deletions_in_flight": self._deleting,
            "last_move_unix": self._last_move_at,
            "pin_limit_bytes": self.pin_limit(),
        }

    # -- placement of new objects (Store.place) ------------------------------------------------------------
    async def place(self, size: int, replacing: ObjectRef | None, durable: bool) -> Tier:
        for tier in self.store.candidates(durable):
            if size > tier.capacity or not tier.available():
                continue  # can never fit, or down: straight to the next tier
            if await self._reserve(tier, size, credit_for(tier, replacing), waiting_writer=True):
                return tier
        raise OSError(errno.ENOSPC, f"no tier has room for an object of {size} bytes")

    async def _reserve(self, tier: Tier, size: int, credit: int = 0, waiting_writer: bool = False) -> bool:
        """Charge `tier` for `size` bytes, making room first if needed; False if no room can be made."""
        started = None
        try:
            while not self.store.fits(tier, size, credit):
                if started is None and waiting_writer:
                    started = time.monotonic()
                    self.counters.writer_waits += 1
                    self._writers_waiting += 1
                if not await self._make_room(tier, size - credit):
                    return False
            self.store.charge(tier, size)
            high, _ = self.watermarks[tier.name]
            if tier.used_bytes > high * tier.capacity:
                self.wake()
            return True
        finally:
            if started is not None:
                self._writers_waiting -= 1
                self.counters.writer_wait_s += time.monotonic() - started

    async def _make_room(self, tier: Tier, need: int) -> bool:
        """Demote (or, from the last tier, evict) until `need` bytes fit; False if nothing was freed."""
        async with self._room[tier.name]:
            if self.store.fits(tier, need):
                return True  # another agent made room meanwhile
            freed = await self._drain(tier, tier.capacity - need, locked=True, forced=True)
            return freed > 0 or self.store.fits(tier, need)

    # -- draining a tier -------------------------------------------------------------------------------
    async def _drain(self, tier: Tier, target_used: int, locked: bool = False, forced: bool = False,
                     others_above: int | None = None) -> int:
        """Move least recently used files out of `tier` until it uses at most `target_used` bytes. Returns the
        bytes freed. `forced` (a writer needs the room): while the next tier is down, evict instead.

        Who pays (kvfs/quotas.py, docs/hotcold.md): first the directories over their quota here, down to it;
        then the directories that were at their quota or over it when the drain began, their own least
        recently used files, as many as it takes; other files only when that is not enough. A watermark drain
        (`others_above`: the high watermark) then takes them only while the others' data alone is over it;
        a writer that needs room (others_above None) gets it from them whatever their size: a directory at
        its quota whose files cannot move (pinned, busy) must not send other tenants' writes to a slower tier."""
        if not locked:
            async with self._room[tier.name]:
                return await self._drain(tier, target_used, locked=True, forced=forced, others_above=others_above)
        self._draining.add(tier.name)
        start, started = tier.used_bytes, time.monotonic()
        before = self._moved_out(tier)
        tried: set[int] = set()
        pressing = self._at_quota(tier)  # fixed for the drain: a directory it takes files from stays first
        try:
            while tier.used_bytes > target_used:
                rows = self._quota_victims(tier, tried) or self._pressing_victims(tier, pressing, tried)
                if not rows:
                    if pressing and others_above is not None and self._others_bytes(tier, pressing) <= others_above:
                        break  # the others keep their files: the directories at their quota gave what they had
                    rows = self.index.least_recently_used(tier.name, CANDIDATES, tried)
                if not rows:
                    break  # nothing left to try: whatever remains is busy, open (last tier) or pinned
                async with trio.open_nursery() as nursery:
                    planned = 0
                    for row in rows:
                        if tier.used_bytes - planned <= target_used:
                            break
                        tried.add(row["id"])
                        planned += row["stored_bytes"]
                        nursery.start_soon(self._push_out, tier, row["id"], forced)
        finally:
            self._draining.discard(tier.name)
            self._log_batch(tier, before, started, "drained" if not forced else "made room")
        return max(0, start - tier.used_bytes)

    def _quota_victims(self, tier: Tier, tried: set[int]) -> list:
        """Least recently used files of the directories over their quota in `tier`, up to their excess."""
        if self.quotas is None:
            return []
        rows = []
        for q in self.quotas.over(tier.name):
            need = q.excess(tier.name)
            for row in self.index.tree_lru(q.ino, tier.name, CANDIDATES, tried):
                if need <= 0:
                    break
                rows.append(row)
                need -= row["stored_bytes"]
        return rows

    def _at_quota(self, tier: Tier) -> list:
        """The directories at their quota in `tier` or over it (kvfs/quotas.py)."""
        return [] if self.quotas is None else self.quotas.at_or_over(tier.name)

    def _pressing_victims(self, tier: Tier, pressing: list, tried: set[int]) -> list:
        """Least recently used files of the directories at their quota (or over it) when the drain began."""
        rows, seen = [], set()
        for q in pressing:
            for row in self.index.tree_lru(q.ino, tier.name, CANDIDATES, tried):
                if row["id"] not in seen:  # hard links under two of them
                    seen.add(row["id"])
                    rows.append(row)
        return rows

    def _others_bytes(self, tier: Tier, pressing: list) -> int:
        """Stored bytes in `tier` outside the directories at their quota: the other tenants' data."""
        assert self.quotas is not None
        now = {q.ino: q for q in self.quotas.refresh()}
        theirs = sum(now[q.ino].used.get(tier.name, 0) for q in pressing if q.ino in now)
        return max(0, tier.used_bytes - theirs)

    async def _enforce_quotas(self, tier: Tier) -> None:
        """Move files of directories over their quota in `tier` out of it, least recently used first."""
        nxt = self._next_tier(tier)
        tried: set[int] = set()
        if (nxt is not None and not nxt.available()) or not (rows := self._quota_victims(tier, tried)):
            return
        async with self._room[tier.name]:
            before, started = self._moved_out(tier), time.monotonic()
            while rows:
                async with trio.open_nursery() as nursery:
                    for row in rows:
                        tried.add(row["id"])
                        nursery.start_soon(self._push_out, tier, row["id"])
                rows = self._quota_victims(tier, tried)
            self._log_batch(tier, before, started, "over quota")

    def _moved_out(self, tier: Tier) -> tuple[int, int, int, int]:
        c = self.counters.tier(tier.name)
        return c.demoted_files, c.demoted_bytes, c.evicted_files, c.evicted_bytes

    def _log_batch(self, tier: Tier, before: tuple[int, int, int, int], started: float, why: str) -> None:
        """Account a batch of moves out of `tier` (a drain, room made for a writer, an idle sweep) for the log."""
        moved = [a - b for a, b in zip(self._moved_out(tier), before)]
        if not moved[0] and not moved[2]:
            return
        pending = self._move_log.setdefault(tier.name, _MovesOut())
        pending.demoted += moved[0]
        pending.demoted_bytes += moved[1]
        pending.evicted += moved[2]
        pending.evicted_bytes += moved[3]
        pending.why.add(why)
        pending.busy_s += time.monotonic() - started
        self._flush_move_log()

    def _flush_move_log(self, force: bool = False) -> None:
        """One line per tier and LOG_MOVES_EVERY_S at most, summing its batches: under steady pressure every
        commit may make room, and a line each would be a line per request."""
        now = time.monotonic()
        for name, m in list(self._move_log.items()):
            if not force and now - self._move_logged.get(name, -1e9) < LOG_MOVES_EVERY_S:
                continue
            tier = self.store.tiers[name]
            nxt = self._next_tier(tier)
            parts = [f"{m.demoted} files ({m.demoted_bytes >> 20} MiB) demoted to {nxt.name}"] if m.demoted else []
            parts += [f"{m.evicted} files ({m.evicted_bytes >> 20} MiB) evicted"] if m.evicted else []
            log.info("%s %s: %s in %.1f s; %d of %d MiB used", name, ", ".join(sorted(m.why)), ", ".join(parts),
                     m.busy_s, tier.used_bytes >> 20, tier.capacity >> 20)
            del self._move_log[name]
            self._move_logged[name] = now

    def _next_tier(self, tier: Tier) -> Tier | None:
        i = self.order.index(tier)
        return self.order[i + 1] if i + 1 < len(self.order) else None

    async def _push_out(self, tier: Tier, ino: int, forced: bool = False) -> None:
        dest = self._next_tier(tier)
        if dest is None:
            if not tier.shared:  # a shared store's capacity is kvfs gc's business, not one mount's
                await self.evict(ino, tier)
        elif dest.available():
            if not await self.move(ino, dest) and ino in self._conflicts and await self.evict(ino, tier):
                self._conflicts.discard(ino)  # the name now resolves to what another node published
        elif forced:  # the next tier is down and a writer needs room here: the file becomes a miss
            if await self.evict(ino, tier):
                self.counters.tier(tier.name).evicted_next_down_files += 1

    # -- moves -----------------------------------------------------------------------------------------
    async def move(self, ino: int, dest: Tier, *, wait: bool = False) -> bool:
        """Move a file's object to `dest` by the move protocol. With wait=False a file whose lock is busy is
        skipped. Returns True if the object is now in `dest` because of this call."""
        async with self.locks.holding(ino, wait) as held:
            if not held:
                return False
            return await self._move_counted(ino, dest)

    async def _move_counted(self, ino: int, dest: Tier) -> bool:
        """A move under its file's lock, counted in flight while it runs (deletions wait for moves)."""
        self._moving += 1
        try:
            return await self._move_locked(ino, dest)
        finally:
            self._moving -= 1
            self._moved_at = trio.current_time()

    async def _move_locked(self, ino: int, dest: Tier) -> bool:
        row = self.index.get(ino)
        if row is None:
            self._move_skipped(ino, None, dest)  # deleted since it was chosen
            return False
        if not row["obj_gen"] or row["obj_tier"] == dest.name or row["obj_tier"] not in self.store.tiers:
            return False
        if dest.shared:
            return await self._publish_locked(row, dest)
        ref = ObjectRef.of_row(row)
        planned = await self._copy_plan(ino, ref, dest)
        if planned is None:
            return False
        plan, size = planned
        if size > dest.capacity:
            return False  # can never be there (a file bigger than L2 stays on L3)
        if not await self._reserve(dest, size):
            if self._gone(ino, ref):  # deleted while it waited for room
                self._move_skipped(ino, ref, dest)
                return False
            self.counters.move_failures += 1
            log.debug("no room in %s for inode %d (%d bytes)", dest.name, ino, size)
            return False
        try:
            await self._reclaim(dest, object_id(ref.ino, ref.gen))
            async with self._slots:  # only the copy: never hold a slot while waiting for room
                new_ref = await self.store.copy(ref, dest, plan)
        except Exception as e:
            self.store.release(dest.name, size)
            self._move_failed(ino, ref, dest, e)
            return False
        except BaseException:
            self.store.release(dest.name, size)
            raise
        if not self.index.move_object(ino, ref.gen, ref.tier, dest.name, new_ref.stored_bytes):
            await self.store.delete(new_ref)  # unlinked or evicted meanwhile: the copy is garbage
            if self._gone(ino, ref):
                self._move_skipped(ino, ref, dest)
            return False
        state = self.open_file(ino)
        if state is not None:
            state.relocated(new_ref)
        self._count_move(ref, dest)
        self._forget_pages(ref, dest)
        await self._delete_source(ref)
        return True

    async def _copy_plan(self, ino: int, ref: ObjectRef, dest: Tier):
        """(plan, size) of a move's copy: sealed or opened on the way, it has another size (kvfs/sealing.py).
        None when it cannot be planned (the move failed: counted and logged)."""
        try:
            plan = await self.store.copy_plan(ref, dest, self.store.tenants.of_inode(self.index, ino))
        except Exception as e:
            self._move_failed(ino, ref, dest, e)
            return None
        return plan, plan.size if plan is not None else ref.stored_bytes

    async def _publish_locked(self, row, dest: Tier) -> bool:
        """Demotion to a shared L4: the file is published under its path, once, by whoever is first
        (If-None-Match: *). A file published already (a local copy of it) only switches back to it. A name
        another node published first is a conflict: this node's file is then evicted, and its name resolves
        to the published one at the next lookup."""
        ino, ref = row["id"], ObjectRef.of_row(row)
        if row["published_key"]:
            if not await self._reserve(dest, ref.stored_bytes):
                return False
            if not self.index.move_object(ino, ref.gen, ref.tier, dest.name):
                self.store.release(dest.name, ref.stored_bytes)
                return False
            new_ref = ObjectRef(ino, ref.gen, dest.name, ref.stored_bytes, row["published_key"])
        else:
            key = self._published_key(ino)
            if key is None:
                self._conflicts.add(ino)  # no single path (hard links, odd names): it cannot be shared
                return False
            planned = await self._copy_plan(ino, ref, dest)
            if planned is None:
                return False
            plan, size = planned
            if not await self._reserve(dest, size):
                return False
            meta = self._publish_meta(row)
            try:
                async with self._slots:
                    etag = await self.store.io(dest.name, dest.publish, key, self.store.tiers[ref.tier],
                                               ref.object_id, ref.stored_bytes, meta, plan, size=ref.stored_bytes)
            except FileExistsError:
                self.store.release(dest.name, size)
                self.counters.publish_conflicts += 1
                self._conflicts.add(ino)
                return False
            except Exception as e:
                self.store.release(dest.name, size)
                self._move_failed(ino, ref, dest, e)
                return False
            if not self.index.publish(ino, ref.gen, ref.tier, dest.name, key, etag, size):
                self.store.release(dest.name, size)  # rewritten or unlinked meanwhile; what went up
                return False  # stays published: the first version of that name
            self._note_expiry(row, key)
            new_ref = ObjectRef(ino, ref.gen, dest.name, size, key)
        state = self.open_file(ino)
        if state is not None:
            state.relocated(new_ref)
        self._count_move(ref, dest)
        self._forget_pages(ref, dest)
        await self.store.delete(ref)
        return True

    def _note_expiry(self, row, key: str) -> None:
        if row["ttl_s"] and self.shared is not None:
            self.shared.note_expiry(key, row["mtime_ns"] // 1_000_000_000 + row["ttl_s"])

    def _publish_meta(self, row) -> dict[str, str]:
        """What a published file carries to other nodes: its mode, retention time and user attributes."""
        xattrs = self._user_xattrs(row["id"])
        travelling = encode_xattrs(xattrs)
        if not travelling and any(n == events.XA_BLOCKS for n, _ in xattrs):  # too big: the record without its tokens
            travelling = encode_xattrs([(n, events.without_tokens(v) if n == events.XA_BLOCKS else v)
                                        for n, v in xattrs])
        meta = {"kvfs-mode": oct(row["mode"]), **travelling}
        if row["ttl_s"]:
            meta["kvfs-ttl"] = str(row["ttl_s"])
        return meta

    def _user_xattrs(self, ino: int) -> list[tuple[bytes, bytes]]:
        """What other nodes get of a published file's attributes: user.* but kvfs's own (other tiers' metadata,
        e.g. vLLM's user.vllm.kv_crc32c)."""
        return [(n, self.index.get_xattr(ino, n)) for n in self.index.list_xattrs(ino) if travels(n)]

    def conflicted(self, ino: int) -> bool:
        """The shared L4 refused this file: another node published its name first."""
        return ino in self._conflicts

    def _published_key(self, ino: int) -> str | None:
        parts = self.index.path_of(ino)
        if parts is None:
            return None
        try:
            return "files/" + "/".join(p.decode() for p in parts)
        except UnicodeDecodeError:  # S3 keys are UTF-8
            return None

    async def _delete_source(self, ref: ObjectRef) -> None:
        """The moved object's old copy. A remote store's DELETE costs as much as the copy itself (measured on
        RGW): it runs in the background, off the path of a reader waiting for its promotion. Its space is
        released at once; a copy whose deletion fails is an orphan the next start-up reconcile removes."""
        source = self.store.tiers[ref.tier]
        if ref.key is not None:  # a published object stays for every node: only this mount's claim goes
            self.store.release(ref.tier, ref.stored_bytes)
            return
        if self._background is None or source.local_path(ref.object_id) is not None:
            await self.store.delete(ref)
            return
        self.store.release(ref.tier, ref.stored_bytes)
        self.store.forget_layout(ref)
        self._deleting += 1
        self._doomed.setdefault(source.name, []).append(ref.object_id)
        if source.name not in self._flushing:
            self._flushing[source.name] = None
            self._background.start_soon(self._delete_batches, source)

    async def _delete_batches(self, source: Tier) -> None:
        """Delete moved objects of a remote tier in batches (one multi-object DELETE for up to 1000): single
        DELETEs slowed RGW's GETs by a third while promotions ran. The batch in flight is the list's head."""
        doomed = self._doomed[source.name]
        try:
            while doomed:
                await trio.sleep(DELETE_GATHER_S)
                await self._while_moving(doomed)
                batch = doomed[:DELETE_BATCH]
                if not batch:
                    continue  # reclaimed meanwhile (_reclaim)
                done = trio.Event()
                self._flushing[source.name] = (frozenset(batch), done)
                try:
                    await self.store.io(source.name, source.delete_many, batch)
                except Exception as e:  # a background task must not end the daemon: the objects are orphans now
                    self.counters.move_failures += len(batch)
                    log.warning("deleting %d moved objects from %s failed: %s (reconcile removes them at the "
                                "next start)", len(batch), source.name, e)
                finally:
                    del doomed[:len(batch)]
                    self._deleting -= len(batch)
                    self._flushing[source.name] = None
                    done.set()
        finally:
            del self._flushing[source.name]

    async def _while_moving(self, doomed: list[str]) -> None:
        """Hold deletions back while moves run and until none has ended for DELETE_QUIET_S (up to
        DELETE_DEFER_MAX_S, or until a batch is full): on RGW a DELETE costs about what a GET does, and during a
        wave of promotions each GET has a reader waiting for it. Readers that promote file after file leave
        gaps of milliseconds between moves: without the quiet time each gap sent a batch. Measured: deletions
        beside the wave's GETs took a third to a half of the promotion rate."""
        deadline = trio.current_time() + DELETE_DEFER_MAX_S
        while len(doomed) < DELETE_BATCH and trio.current_time() < deadline and \
                (self._moving or trio.current_time() - self._moved_at < DELETE_QUIET_S):
            await trio.sleep(DELETE_GATHER_S)

    async def _reclaim(self, tier: Tier, oid: str) -> None:
        """An object is about to be written to `tier` under an id whose old copy there still waits for its
        background deletion (promoted, then moved back within the gathering time): that deletion must not
        remove the new copy. A pending one is cancelled; one in flight is waited for."""
        doomed = self._doomed.get(tier.name)
        while doomed and oid in doomed:
            flying = self._flushing.get(tier.name)
            if flying is not None and oid in flying[0]:
                await flying[1].wait()
                continue
            doomed.remove(oid)
            self._deleting -= 1

    def _gone(self, ino: int, ref: ObjectRef) -> bool:
        """The file no longer has the object a move started from: deleted meanwhile. Deletion (unlink, the
        kernel's forget of an unlinked file: frontend/ops/names.py `_maybe_delete`) does not wait for the
        file's lock, so it may remove the source while the mover copies it: the copy fails (ENOENT from a
        directory tier, a missing key from S3), or succeeds and the index refuses the switch."""
        row = self.index.get(ino)
        return row is None or row["obj_gen"] != ref.gen or row["obj_tier"] != ref.tier

    def _move_skipped(self, ino: int, ref: ObjectRef | None, dest: Tier, e: Exception | None = None) -> None:
        """A move whose file was deleted: nothing to move, not a failure."""
        self.counters.moves_skipped += 1
        log.debug("moving inode %d from %s to %s skipped: file deleted%s", ino, ref.tier if ref else "its tier",
                  dest.name, f" ({e})" if e is not None else "")

    def _move_failed(self, ino: int, ref: ObjectRef, dest: Tier, e: Exception) -> None:
        if self._gone(ino, ref):
            self._move_skipped(ino, ref, dest, e)
            return
        self.counters.move_failures += 1
        if self._failure_log.due():
            log.warning("moving inode %d from %s to %s failed: %s (%d failed moves so far)", ino, ref.tier,
                        dest.name, e, self.counters.move_failures)

    def _forget_pages(self, ref: ObjectRef, dest: Tier) -> None:
        """A demoted file leaves the kernel's page cache too (kvfs/pagecache.py keeps what writers wrote
        there): kvfs judged it cold, so its next read reaches the daemon, which counts it (promotion, the
        hot/cold API). In the background, never awaited under the file's lock: the kernel waits for the
        file's reads in flight, and a read may be waiting for that lock (a deadlock, seen in
        tests/test_fsck.py). Until it is done a read may still be served from the cached pages: the same
        bytes. `pages_forgotten` waits for it."""
        source = self.store.tiers[ref.tier]
        if self.drop_pages is None or self._background is None or self.order.index(dest) <= self.order.index(source):
            return
        done = self._dropping_pages[ref.ino] = trio.Event()
        self._background.start_soon(self._drop_pages, ref.ino, done)

    async def _drop_pages(self, ino: int, done: trio.Event) -> None:
        try:
            await trio.to_thread.run_sync(self.drop_pages, ino, abandon_on_cancel=True)
        finally:
            done.set()
            if self._dropping_pages.get(ino) is done:
                del self._dropping_pages[ino]

    async def pages_forgotten(self, ino: int) -> None:
        """Wait until the kernel has dropped the pages of a file just demoted. Not under the file's lock."""
        done = self._dropping_pages.get(ino)
        if done is not None:
            await done.wait()

    def _count_move(self, ref: ObjectRef, dest: Tier) -> None:
        self._last_move_at = time.time()
        source = self.store.tiers[ref.tier]
        if self.order.index(dest) > self.order.index(source):
            c = self.counters.tier(source.name)
            c.demoted_files += 1
            c.demoted_bytes += ref.stored_bytes
        else:
            c = self.counters.tier(dest.name)
            c.promoted_files += 1
            c.promoted_bytes += ref.stored_bytes
            self._reads.pop(ref.ino, None)

    async def evict(self, ino: int, tier: Tier) -> bool:
        """Drop a file from the cache: its names go, then its object. Never an open or busy file."""
        if self.open_file(ino) is not None:
            return False
        async with self.locks.holding(ino, wait=False) as held:
            row = self.index.get(ino) if held else None
            if row is None or not row["obj_gen"] or row["obj_tier"] != tier.name or self.open_file(ino):
                return False
            ref = ObjectRef.of_row(row)
            names = self.drop_names(ino)  # the index first: a crash leaves an orphan object, not a row
            c = self.counters.tier(tier.name)
            c.evicted_files += 1
            c.evicted_bytes += ref.stored_bytes
            self._reads.pop(ino, None)
            await self.store.delete(ref)
        await self.forget_names(ino, names)  # after the lock: the kernel may take its time
        return True

    # -- reads and promotion -----------------------------------------------------------------------------
    def note_read(self, ino: int, tier_name: str) -> bool:
        """A file was read (once per open handle) from `tier_name`: count the hit, maybe queue a promotion.
        True when the file is due for promotion."""
        self.counters.tier(tier_name).hits += 1
        if tier_name == self.order[0].name or not self.promotion.after_reads:
            return False
        reads = self._reads[ino] = self._reads.get(ino, 0) + 1
        if reads < self.promotion.after_reads:
            return False
        self._queue_promotion(ino)
        return True

    def _queue_promotion(self, ino: int) -> None:
        if ino not in self._promotions:
            self._promotions[ino] = None
            self.wake()

    async def promote_now(self, ino: int) -> bool:
        """Promote a queued file in the caller's task (a read from a remote tier waits for one whole-object GET
        and is then served from L2, instead of fetching frames by ranged GETs and the object again)."""
        if self._promotions.pop(ino, False) is False:
            return False  # not queued (any more): the mover has it, or it was never due
        busy: list[int] = []
        await self._promote_now(ino, self.order[0], busy)
        if busy:
            self._promotions.setdefault(ino, None)
        return not busy

    async def _promote_queued(self) -> None:
        fastest = self.order[0]
        busy: list[int] = []
        pipeline = trio.Semaphore(2 * MOVES_IN_FLIGHT)  # a pipeline, not batches: while some copy, others
        async with trio.open_nursery() as nursery:  # finish (index switch, source delete) or start
            while self._promotions:
                await pipeline.acquire()
                ino = next(iter(self._promotions), None)
                if ino is None:
                    pipeline.release()
                    break
                del self._promotions[ino]
                nursery.start_soon(self._promote, ino, fastest, busy, pipeline)
        for ino in busy:  # a flush or commit held the file: try again at the next pass, not now
            self._promotions.setdefault(ino, None)

    async def _promote(self, ino: int, fastest: Tier, busy: list[int], pipeline: trio.Semaphore) -> None:
        try:
            await self._promote_now(ino, fastest, busy)
        finally:
            pipeline.release()

    async def _promote_now(self, ino: int, fastest: Tier, busy: list[int]) -> None:
        async with self.locks.holding(ino, wait=False) as held:
            if not held:
                busy.append(ino)
                return
            await self._move_counted(ino, fastest)

    def prefetch(self, ino: int) -> bool:
        """Queue a promotion to the fastest tier (the caller does not wait). False if there is nothing to do."""
        row = self.index.get(ino)
        if row is None or not row["obj_gen"] or row["obj_tier"] == self.order[0].name:
            return False
        self.index.note_use(ino)  # about to be used: not the first file a drain of L2 picks
        self._queue_promotion(ino)
        return True

    # -- pins and the idle policy (I8) ---------------------------------------------------------------------
    def pin_limit(self) -> int:
        """Pinned files live in the fastest tier, up to its high watermark: past it the mover would drain
        forever and find nothing it may move."""
        fastest = self.order[0]
        return int(self.watermarks[fastest.name][0] * fastest.capacity)

    async def _sweep_idle(self) -> None:
        """Once a second: pinned files not in the fastest tier are queued for promotion; files not read for k
        idle periods go at least k tiers down (k = 1 for L2)."""
        now = time.monotonic()
        if now - self._idle_swept < IDLE_SWEEP_S:
            return
        self._idle_swept = now
        for ino in self.index.pinned_away(self.order[0].name, CANDIDATES):
            self._queue_promotion(ino)
        for k, tier in enumerate(self.order[:-1], start=1):
            dest = self.order[k]
            if not dest.available():
                continue
            rows = self.index.idle_files(tier.name, time.time_ns(), self.idle_s, k, CANDIDATES)
            if not rows:
                continue
            before, started = self._moved_out(tier), time.monotonic()
            async with trio.open_nursery() as nursery:
                for row in rows:
                    nursery.start_soon(self._demote_idle, row["id"], tier, dest)
            self._log_batch(tier, before, started, "idle policy")

    async def _sweep_expired(self) -> None:
        """Files past their retention time (I9) leave every tier, L4 included, pinned or not: a retention
        time is a limit on how long the data is kept, not a placement hint. Swept with the idle policy."""
        now = time.monotonic()
        if now - self._expiry_swept < IDLE_SWEEP_S:
            return
        self._expiry_swept = now
        for row in self.index.expired_files(time.time_ns(), CANDIDATES):
            if await self.drop_file(row["id"]):
                self.counters.expired_files += 1
                self.counters.expired_bytes += row["stored_bytes"]

    async def _demote_idle(self, ino: int, tier: Tier, dest: Tier) -> None:
        if await self.move(ino, dest):
            self.counters.tier(tier.name).idle_demoted_files += 1

    # -- write policy through (shared L4) -----------------------------------------------------------------
    def publish_later(self, ino: int) -> None:
        """The last handle of a file closed: publish it once it has settled (a temp name renamed meanwhile
        is published under its final name, in one upload)."""
        if self.write_through:
            self._settling[ino] = time.monotonic() + SETTLE_S
            self.wake()

    async def _publish_settled(self) -> None:
        now = time.monotonic()
        due = [ino for ino, at in self._settling.items() if at <= now]
        shared = next((t for t in self.order if t.shared), None)
        if not due or shared is None or not shared.available():
            return
        for ino in due:
            del self._settling[ino]
        conflicts: list[int] = []
        async with trio.open_nursery() as nursery:
            for ino in due:
                if self.open_file(ino) is None:  # open again: its next release reschedules it
                    nursery.start_soon(self._publish_in_place, ino, shared, conflicts)
        for ino in conflicts:  # another node published the name first: it is theirs
            row = self.index.get(ino)
            if row is not None and row["obj_tier"] in self.store.tiers:
                await self.evict(ino, self.store.tiers[row["obj_tier"]])

    async def _publish_in_place(self, ino: int, shared: Tier, conflicts: list[int]) -> None:
        """Upload a settled file to the shared L4 under its path; its object stays where it is (a local copy
        of a published file, as after a promotion)."""
        async with self.locks.holding(ino, wait=False) as held:
            if not held:
                self._settling[ino] = time.monotonic() + SETTLE_S
                return
            row = self.index.get(ino)
            if row is None or not row["obj_gen"] or row["published_key"] or row["obj_tier"] == shared.name:
                return
            key = self._published_key(ino)
            if key is None:
                return
            ref = ObjectRef.of_row(row)
            planned = await self._copy_plan(ino, ref, shared)  # sealed on the way where the store is sealed
            if planned is None:
                self._settling[ino] = time.monotonic() + SETTLE_S * 5
                return
            try:
                async with self._slots:
                    etag = await self.store.io(shared.name, shared.publish, key, self.store.tiers[ref.tier],
                                               ref.object_id, ref.stored_bytes, self._publish_meta(row),
                                               planned[0], size=ref.stored_bytes)
            except FileExistsError:
                self.counters.publish_conflicts += 1
                conflicts.append(ino)
                return
            except Exception as e:
                self._move_failed(ino, ref, shared, e)
                self._settling[ino] = time.monotonic() + SETTLE_S * 5  # retried, not lost
                return
            if self.index.publish(ino, ref.gen, ref.tier, ref.tier, key, etag):
                self.counters.published_through += 1
                self._note_expiry(row, key)

    # -- fsync -------------------------------------------------------------------------------------------
    async def make_durable(self, ino: int) -> None:
        """fsync: the file's object must be on a persistent tier when this returns (if one is configured)."""
        persistent = [t for t in self.order if t.persistent]
        row = self.index.get(ino)
        if not persistent or row is None or not row["obj_gen"]:
            return
        if self.store.tiers[row["obj_tier"]].persistent:
            return
        await self.move(ino, persistent[0], wait=True)
        row = self.index.get(ino)
        if row is not None and row["obj_gen"] and not self.store.tiers[row["obj_tier"]].persistent:
            raise OSError(errno.ENOSPC, f"no room to make inode {ino} durable in {persistent[0].name}")


@dataclasses.dataclass
class _MovesOut:
    """Moves out of a tier since its last log line."""
    demoted: int = 0
    demoted_bytes: int = 0
    evicted: int = 0
    evicted_bytes: int = 0
    why: set[str] = dataclasses.field(default_factory=set)  # drained, made room, idle policy
    busy_s: float = 0.0


async def _forget_nothing(ino: int, names: list[tuple[int, bytes]]) -> None:
    """Default until a filesystem binds the mover: nothing caches names."""


async def _drop_nothing(ino: int) -> bool:
    return False
