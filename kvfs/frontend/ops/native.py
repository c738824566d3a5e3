"""What the native front end's C threads are handed and report back: reads of committed objects (kvfs/frontend/_loop.c)
and whole files written in order (native_write.py).
"""

from __future__ import annotations

import errno
import os

from ... import format as fmt
from .. import api as fuse
from .. import native_write
from .base import (log, _KERNEL_DECODES, _NATIVE_ERRORS, _guard, _err, Handle, OperationsBase)


class Native(OperationsBase):
    async def _native_open(self, fh: int, h: Handle) -> bool:
        """Hand the handle's reads to the native front end's C threads (kvfs/frontend/_loop.c) when the file is
        its committed object, lossless, unsealed, in a local tier, and nobody writes it: an fd on the object (the
        C side owns it; it keeps reading the immutable object across moves and unlinks), and the frame table
        as verified here. Anything else, or anything unexpected, leaves the reads to OpenFile."""
        state = h.state
        ref = state.ref
        # a writer may be open (its RELEASE can reach the trio thread after this OPEN: the libfuse threads do not
        # keep the kernel's order): what it writes turns the native handles off (write, truncate)
        if ref is None or ref.key is not None or state.modified or state.corrupt:
            return False
        tier = self.store.tiers[ref.tier]
        path = None if tier.sealed or tier.shared else tier.local_path(ref.object_id)
        if path is None:
            return False
        try:
            layout = await state._layout_of(ref)  # a corrupt table marks the file: its first read reports it
        except Exception:  # noqa: BLE001
            return False
        header = layout.header
        if (state.ref is not ref or state.modified or state.corrupt or header.sealing is not None
                or header.lossy_mode or header.raw_size != state.size or len(layout.frames) != header.n_frames
                or any(not e.is_hole and e.transform not in _KERNEL_DECODES.get(e.codec, ()) for e in layout.frames)):
            return False
        pack = fmt.FRAME_ENTRY.pack
        table = b"".join(pack(e.offset, e.stored_len, e.raw_len, e.codec, e.transform, e.flags, e.stored_xxh3,
                              e.raw_xxh3) for e in layout.frames)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return False  # moved meanwhile: OpenFile finds it
        try:
            if os.fstat(fd).st_size != ref.stored_bytes:
                raise ValueError("object size")
        except (OSError, ValueError):
            os.close(fd)
            return False
        try:
            fuse.native.open(fh, h.ino, self.store.order.index(tier), fd, header.raw_size, header.frame_size, table)
        except ValueError as e:  # the fd is closed
            log.warning("inode %d: reads stay in Python: %s", h.ino, e)
            return False
        h.native = True
        state.native_live = True
        return True

    def _native_off(self, ino: int) -> None:
        """The file is being changed: its native handles' reads go to Python (which sees the changes)."""
        if fuse.native is not None:
            fuse.native.disable(ino)
            state = self.open_files.get(ino)
            if state is not None:
                state.native_live = False

    def native_first_read(self, fh: int) -> None:
        """The first read of a native handle was answered in C: count the hit, queue a due promotion, note the
        access (atime, LRU, the idle policy's last read), as `read` does at a handle's first read."""
        h = self.handles.get(fh)
        if h is None or h.state is None:
            return
        self.index.note_access(h.ino)
        if h.read_seen or h.state.ref is None:
            return
        h.read_seen = True
        if self.shared is not None:
            row = self.index.get(h.ino)
            if row is not None and row["published_key"]:
                self.shared.note_read(row["published_key"])
        self.mover.note_read(h.ino, h.state.ref.tier)  # a local tier: the mover promotes, in its own time

    @_guard
    async def native_read_failed(self, fh: int, code: int, frame: int) -> None:
        """A native read found a frame corrupt: drop the file and answer EIO, as for a read of OpenFile's."""
        h = self._handle(fh)
        if h.state is None:
            raise _err(errno.EIO)
        reason = _NATIVE_ERRORS.get(code, f"read failed ({code})")
        log.info("native read of inode %d: frame %d: %s", h.ino, frame, reason)
        raise h.state._mark_corrupt(f"frame {frame}: {reason}")

    def take_native_counts(self) -> None:
        """Add what the native front end's C threads counted since the last call: reads, writes (stats, metrics)."""
        t = fuse.native_counts()
        c = self.counters
        if t["writes"] or t["frames_encoded"] or t["write_fallbacks"] or t["write_budget_fallbacks"]:
            native_write.add_counts(self, t)
        if t["reads"]:
            c.read_requests += t["reads"]
            c.bytes_read += t["bytes"]
            c.frames_decoded += t["frames"]
            c.native_reads += t["reads"]
            c.native_read_bytes += t["bytes"]
            for tier, n in zip(self.store.order, t["stored"]):
                self.store.read_bytes[tier.name] += n
            self.latency.add_reads(t["latency"], t["latency_sum_s"])
