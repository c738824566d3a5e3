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
into the page cache (`fuse.notify_store`). Later refreshes find the same mtime and keep the pages.

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

The stat runs in a helper process (StatHelpers), never in a thread of the daemon: a daemon killed (-9) while
one of its own threads waits for its answer could never finish exiting (a request the daemon has read cannot
be interrupted, and /dev/fuse stays open until every thread is gone), and the mount would hang. A helper's
stat fails with ENOTCONN once the daemon is gone, and the helper exits at the end of its input.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import queue
import subprocess
import sys
import threading

import trio

from .frontend import api as fuse

log = logging.getLogger(__name__)

ENABLED = os.environ.get("KVFS_KEEP_WRITTEN_PAGES", "1") != "0"
STAT_SLOTS = 32


# the helper: one path (hex) per line in, "INO SIZE" or "E ERRNO" per line out; -S: no site import, fast start
_HELPER = ("import os, sys\n"
           "for line in sys.stdin:\n"
           "    try:\n"
           "        st = os.lstat(bytes.fromhex(line.strip()))\n"
           "        print(st.st_ino, st.st_size, flush=True)\n"
           "    except OSError as e:\n"
           "        print('E', e.errno, flush=True)\n")
MAX_HELPERS = 4


class StatHelpers:
    """lstat(2) through the mount, from separate processes (see the module's docstring); blocking calls, from
    worker threads. A pool of MAX_HELPERS at most, started as needed."""

    def __init__(self) -> None:
        self._idle: queue.SimpleQueue[subprocess.Popen] = queue.SimpleQueue()
        self._all: list[subprocess.Popen] = []
        self._lock = threading.Lock()

    def lstat(self, path: bytes) -> tuple[int, int]:
        """(st_ino, st_size) of path; OSError as lstat raises it."""
        proc = self._take()
        try:
            proc.stdin.write(path.hex() + "\n")
            proc.stdin.flush()
            answer = proc.stdout.readline().split()
        except (OSError, ValueError):
            answer = []
        if len(answer) != 2:
            self._drop(proc)
            raise OSError(errno.EIO, "the stat helper process is gone")
        self._idle.put(proc)
        if answer[0] == "E":
            raise OSError(int(answer[1]), os.strerror(int(answer[1])))
        return int(answer[0]), int(answer[1])

    def _take(self) -> subprocess.Popen:
        try:
            return self._idle.get_nowait()
        except queue.Empty:
            pass
        with self._lock:
            if len(self._all) < MAX_HELPERS:
                # stderr discarded: a helper whose daemon was killed dies writing its last answer (EPIPE)
                proc = subprocess.Popen([sys.executable, "-S", "-c", _HELPER], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, bufsize=1,
                                        close_fds=True)
                self._all.append(proc)
                return proc
        return self._idle.get()

    def _drop(self, proc: subprocess.Popen) -> None:
        with self._lock:
            if proc in self._all:
                self._all.remove(proc)
        proc.kill()
        proc.wait()

    def close(self) -> None:
        with self._lock:
            procs, self._all = self._all, []
        for proc in procs:
            try:
                proc.stdin.close()
            except OSError:
                pass
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


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
        self.helpers = StatHelpers()

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

    def _refresh(self, path: bytes, w: Written) -> bool:
        # the kernel asks the daemon for the attributes: the mtime it keeps is now current
        ino, size = self.helpers.lstat(path)
        return ino == w.ino and size == w.size

    def _store(self, w: Written) -> None:
        F = self.frame_size
        for i, buf in enumerate(w.frames):
            fuse.notify_store(w.ino, i * F, memoryview(buf)[: min(F, w.size - i * F)])


def forget_pages(ino: int) -> None:
    """Drop the kernel's cached pages of an inode (from a worker thread: the kernel may wait for reads that
    the daemon has yet to answer)."""
    try:
        fuse.invalidate_inode(ino)
    except OSError:
        pass
