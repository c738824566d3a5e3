"""Keep what a writer just wrote in the kernel's page cache, as a plain directory does.

Why: a write through FUSE leaves the written pages in the kernel's page cache, but the kernel throws them
away at the next attribute refresh of the file (the writer's close, a reader's open or stat): libfuse asks for
`auto_inval_data`, so a refresh that finds a new mtime invalidates the whole cache of the file, and every
write changes the mtime the kernel last saw (the one of the create). pyfuse3 offers no way to turn that
off. So the first reader of a freshly written file read it all through the daemon (decoding every frame),
where a plain directory serves the same read from the page cache: LMCache's `fs` L2 adapter (write a chunk
file, read it back later) had 4.7x the TTFT of a plain directory (docs/engines.md).

What this does, on the close (flush) of a file written in full by its only handle: after the commit, the
daemon stats the file through its own mount (the kernel refreshes the attributes now, with the committed
mtime, and drops the pages), then stores the committed bytes, still in memory as the dirty frames, back
into the page cache (`pyfuse3.notify_store`). Later refreshes find the same mtime and keep the pages.

Only when nothing else can be writing to the file's pages meanwhile: the closing handle is the only open
one and is write-only (an mmap needs a readable descriptor), the whole content is in the dirty frames, the
file is lossless (a lossy file must read back its stored values) and has one name. Not after O_DIRECT
writes: such a writer keeps its data out of the page cache, on any filesystem. Opens and truncations of
the file wait until the store is done; a write that slips in anyway (another thread on the same descriptor)
is seen afterwards and the pages are invalidated again. At most STAT_SLOTS stores run at once, others skip
(their files are read through the daemon the first time): each store holds one of pyfuse3's request tasks (99
at most) while its stat is answered by another. LMCache's fs adapter closes up to 6 files at once (its thread
pool on 2 cores); 4 slots were too few there (measured: 4 of 64 files not kept).
Kept pages are a cache in front of L2, never of a colder tier: a file committed elsewhere (too large for
L2) is not kept, and a demotion drops the file's pages (Mover._forget_pages), so kvfs sees the next read (its
promotion, and in a shared L4 whether another node unlinked the file; fs.Operations._may_keep).
`KVFS_KEEP_WRITTEN_PAGES=0` in the daemon's environment turns it off (for comparisons).
"""

from __future__ import annotations

import dataclasses
import logging
import os

import pyfuse3
import trio

log = logging.getLogger(__name__)

ENABLED = os.environ.get("KVFS_KEEP_WRITTEN_PAGES", "1") != "0"
STAT_SLOTS = 32


@dataclasses.dataclass
class Written:
    ino: int
    size: int
    changes: int  # the file's write/truncate count when the content below was taken
    frames: list  # the dirty frame buffers, in order (the committed content, once committed)


class PageKeeper:
    def __init__(self, mountpoint, index, frame_size: int, fastest_tier: str) -> None:
        self.mountpoint = os.fsencode(mountpoint)
        self.fastest_tier = fastest_tier  # only files committed there: a file too large for it is cold already
        self.index = index
        self.frame_size = frame_size
        self.enabled = ENABLED
        self.slots = trio.Semaphore(STAT_SLOTS)
        self.busy: dict[int, trio.Event] = {}  # inode -> set when its store is done

    def snapshot(self, state, flags: int) -> Written | None:
        """Before the commit of a flush: the content about to be committed, if it may be kept afterwards."""
        if not self.enabled or not state.modified or state.handles != 1 or state.corrupt:
            return None
        if flags & os.O_ACCMODE != os.O_WRONLY or flags & os.O_DIRECT or not state.policy.effective_lossy.lossless:
            return None  # O_DIRECT: the writer keeps its data out of the page cache, as it would elsewhere
        n = -(-state.size // self.frame_size)
        if n == 0 or any(i not in state.dirty for i in range(n)):
            return None
        return Written(state.ino, state.size, state.changes, [state.dirty[i].buf for i in range(n)])

    async def settled(self, ino: int) -> None:
        """Opens and truncations wait for a store of the file's pages in progress."""
        done = self.busy.get(ino)
        if done is not None:
            await done.wait()

    async def keep(self, state, w: Written) -> None:
        """After the commit: refresh the kernel's attributes, then put the committed bytes in its page cache."""
        if state.changes != w.changes or state.modified or state.handles != 1 or w.ino in self.busy:
            return
        if state.ref is None or state.ref.tier != self.fastest_tier:
            return
        try:
            self.slots.acquire_nowait()
        except trio.WouldBlock:
            log.debug("inode %d: its written pages are not kept, %d stores in progress", w.ino, STAT_SLOTS)
            return
        done = self.busy[w.ino] = trio.Event()
        try:
            path = self._path(w.ino)
            if path is None:
                return
            if not await trio.to_thread.run_sync(self._refresh, path, w, abandon_on_cancel=True):
                return
            await trio.to_thread.run_sync(self._store, w, abandon_on_cancel=True)
            if state.changes != w.changes:  # a write got in: the kernel may hold older bytes than the daemon
                await trio.to_thread.run_sync(forget_pages, w.ino, abandon_on_cancel=True)
        except OSError as e:  # the page cache stays as the kernel left it: correct, only slower to read
            log.debug("keeping the written pages of inode %d: %s", w.ino, e)
        finally:
            del self.busy[w.ino]
            done.set()
            self.slots.release()

    def _path(self, ino: int) -> bytes | None:
        names = self.index.path_of(ino)
        return None if names is None else os.path.join(self.mountpoint, *names)

    @staticmethod
    def _refresh(path: bytes, w: Written) -> bool:
        st = os.lstat(path)  # the kernel asks the daemon for the attributes: the mtime it keeps is now current
        return st.st_ino == w.ino and st.st_size == w.size

    def _store(self, w: Written) -> None:
        F = self.frame_size
        for i, buf in enumerate(w.frames):
            pyfuse3.notify_store(w.ino, i * F, memoryview(buf)[: min(F, w.size - i * F)])


def forget_pages(ino: int) -> None:
    """Drop the kernel's cached pages of an inode (from a worker thread: the kernel may wait for reads that
    the daemon has yet to answer)."""
    try:
        pyfuse3.invalidate_inode(ino)
    except OSError:
        pass
