"""Files that go: corrupt ones dropped and quarantined, evicted ones forgotten; the statistics file; the commit of
everything at unmount.
"""

from __future__ import annotations

import stat

import trio

from ... import stats as stats_mod
from ...openfile import FileCorrupt, PublishedGone
from ...store import ObjectRef
from .base import (log, INVALIDATE_WAIT_S, _invalidate_entry, OperationsBase)


class Lifecycle(OperationsBase):
    async def drop_corrupt(self, err: FileCorrupt) -> None:
        """A checksum failed: count and log it, and make the file a miss for every later caller.

        Several requests can hit the same corrupt file at once (kernel read-ahead sends reads in parallel);
        all of them answer only after the kernel has forgotten the names, so no caller that got EIO can
        still find the file."""
        try:
            with trio.CancelScope(shield=True), trio.move_on_after(INVALIDATE_WAIT_S):
                in_progress = self._dropping.get(err.ino)
                if in_progress is not None:
                    await in_progress.wait()
                    return
                names = self.index.entries_of(err.ino)
                if not names:
                    return  # dropped earlier
                done = self._dropping[err.ino] = trio.Event()
                try:
                    gone = isinstance(err, PublishedGone)
                    if gone:  # not corruption: another node unlinked it
                        log.info("inode %d (%s): %s; file dropped", err.ino,
                                 ", ".join(repr(n) for _, n in names), err.reason)
                    else:
                        self.counters.checksum_failures += 1
                        log.error("corrupt object for inode %d (%s): %s; file dropped", err.ino,
                                  ", ".join(repr(n) for _, n in names), err.reason)
                    ref = ObjectRef.of_row(self.index.get(err.ino))
                    self.index.drop_file(err.ino)
                    if ref is not None and not gone:
                        await self._quarantine(ref)
                    # a worker thread keeps the trio loop serving requests the kernel may need meanwhile
                    for parent, name in names:
                        await trio.to_thread.run_sync(_invalidate_entry, parent, name, err.ino,
                                                      abandon_on_cancel=True)
                finally:
                    del self._dropping[err.ino]
                    done.set()
        except Exception:
            log.exception("dropping corrupt inode %d failed", err.ino)

    async def _quarantine(self, ref: ObjectRef) -> None:
        try:
            where = await self.store.quarantine(ref)
        except OSError as e:
            log.warning("could not quarantine the corrupt object %s in %s: %s", ref.object_id, ref.tier, e)
            return
        if where:
            log.warning("corrupt object %s kept aside as %s", ref.object_id, where)

    async def drop_file(self, ino: int) -> bool:
        """A drop request (user.kvfs.drop): the file leaves every tier now and its names go (the next lookup
        misses). A published file's shared object goes too, if it is still the one this node read. An open
        file keeps its data for its handles until the last one closes, as after unlink."""
        async with self.locks.holding(ino, wait=True):
            row = self.index.get(ino)
            if row is None or not stat.S_ISREG(row["mode"]) or row["nlink"] == 0:
                return False
            if row["published_key"] and self.shared is not None:
                tier = self.shared.tier
                await self.store.io(tier.name, tier.delete_if, row["published_key"], row["published_etag"])
            ref = ObjectRef.of_row(row)
            if ino in self.open_files:
                names = self.index.entries_of(ino)
                self.index.drop_file(ino)  # the object goes at the last release (_maybe_delete)
            else:
                names = self.drop_evicted(ino)
                await self._discard_object(ref)
            if ref is not None:
                c = self.counters.tier(ref.tier)
                c.dropped_files += 1
                c.dropped_bytes += ref.stored_bytes
        await self.forget_names(ino, names)
        return True

    def drop_evicted(self, ino: int) -> list[tuple[int, bytes]]:
        """A file is evicted (or dropped): its names and its object reference go from the index. Returns the names,
        for `forget_names` once the object is deleted."""
        names = self.index.entries_of(ino)
        self.index.drop_file(ino, forget_object=True)
        if ino not in self.lookups:
            self.index.delete_inode(ino)
        return names

    async def forget_names(self, ino: int, names: list[tuple[int, bytes]]) -> None:
        """Make the kernel forget names of a dropped file, so the next lookup is a miss. Waits at most
        INVALIDATE_WAIT_S: a request holding the directory may be in the way (it finishes on its own)."""
        if self.shared is not None:  # a miss the shared store answered before this node had the name (at its
            for parent, name in names:  # creation) is stale now: the name may be published by another node
                self.shared.forget_miss(parent, name)
        with trio.CancelScope(shield=True), trio.move_on_after(INVALIDATE_WAIT_S):
            for parent, name in names:
                try:
                    await trio.to_thread.run_sync(_invalidate_entry, parent, name, ino, abandon_on_cancel=True)
                except Exception:
                    log.debug("invalidating %r of inode %d failed", name, ino, exc_info=True)

    def render_stats(self) -> bytes:
        return stats_mod.to_json(self.stats_doc())

    def stats_doc(self) -> dict:
        """The statistics document (.kvfs/stats, metrics); on the trio thread: the index belongs to it."""
        self.take_native_counts()
        return stats_mod.document(counters=self.counters, tiers=self.store.order, totals=self.index.tier_totals(),
                                  config=self.config, started=self.started, open_files=len(self.open_files),
                                  dirty_bytes=self.dirty_budget.total, read_bytes=self.store.read_bytes,
                                  mover=self.mover.status(),
                                  qat=self.qat.status() if self.qat is not None else {"mode": "not loaded"},
                                  quotas=[q.doc() for q in self.mover.quotas.refresh()] if self.mover.quotas else [],
                                  events=self.events.stats() if self.events is not None else None)

    async def commit_all(self) -> None:
        """At shutdown: commit files still open with unsaved writes (best effort, logged)."""
        for state in list(self.open_files.values()):
            if state.modified and not state.corrupt:
                try:
                    await self._commit(state, durable=False)
                except Exception as e:
                    log.warning("inode %d: unsaved data lost at shutdown: %s", state.ino, e)
