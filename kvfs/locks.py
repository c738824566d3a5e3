"""One trio.Lock per inode in use, shared by its open file (writes, commits) and the mover (moves), so a
move never interleaves with a commit of the same file. Locks exist only while someone holds a reference."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio


class InodeLocks:
    def __init__(self) -> None:
        self._locks: dict[int, tuple[trio.Lock, int]] = {}  # ino → (lock, references)

    def take(self, ino: int) -> trio.Lock:
        lock, users = self._locks.get(ino, (None, 0))
        if lock is None:
            lock = trio.Lock()
        self._locks[ino] = (lock, users + 1)
        return lock

    def give_back(self, ino: int) -> None:
        lock, users = self._locks[ino]
        if users > 1:
            self._locks[ino] = (lock, users - 1)
        else:
            del self._locks[ino]

    @asynccontextmanager
    async def holding(self, ino: int, wait: bool) -> AsyncIterator[bool]:
        """Hold the inode's lock for the block; with wait=False yield False at once if it is busy."""
        lock = self.take(ino)
        try:
            if wait:
                await lock.acquire()
            else:
                try:
                    lock.acquire_nowait()
                except trio.WouldBlock:
                    yield False
                    return
            try:
                yield True
            finally:
                lock.release()
        finally:
            self.give_back(ino)

    def __len__(self) -> int:
        return len(self._locks)
