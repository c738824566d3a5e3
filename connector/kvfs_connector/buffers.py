"""Host buffers the connector stages chunks in: pinned where the KV cache is on a GPU, bounded, reused.

A fresh buffer of several MB costs a page fault per 4 KiB page the first time it is written; measured here,
filling a fresh 5.9 MB buffer took about 1.7x as long as filling a reused one. Pinned (page-locked) memory is
what lets a GPU copy run asynchronously (DMA) instead of staging through the driver, but it is a scarce,
unswappable resource that peers leak (LMCache #1285, #2017): HostMemory hands out at most `limit_bytes` of
it per worker and pageable memory beyond, and a failed pinned allocation degrades to pageable memory with one
warning, never an error. Buffers are kept in pools and reused; a buffer handed back while a device copy may
still read or write it carries that copy's event, and is only handed out again once the event is done.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

import torch

log = logging.getLogger("vllm.kvfs_connector")

T = TypeVar("T")


class HostMemory:
    """Allocates 1-D uint8 CPU tensors: pinned while `pinned` and within `limit_bytes`, pageable otherwise."""

    def __init__(self, pinned: bool, limit_bytes: int) -> None:
        self.pinned = pinned
        self.limit_bytes = limit_bytes
        self.pinned_bytes = 0  # live pinned bytes handed out (buffers are kept for the worker's lifetime)
        self.pageable_bytes = 0
        self._lock = threading.Lock()
        self._told_limit = False

    def allocate(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            want_pinned = self.pinned and self.pinned_bytes + nbytes <= self.limit_bytes
            if self.pinned and not want_pinned and not self._told_limit:
                self._told_limit = True
                log.info("kvfs connector: pinned staging memory at its limit (%d MB); further buffers are pageable",
                         self.limit_bytes >> 20)
            if want_pinned:
                try:
                    buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
                    self.pinned_bytes += nbytes
                    return buf
                except RuntimeError as e:  # out of page-locked memory, or no device to pin for
                    self.pinned = False
                    log.warning("kvfs connector: pinned allocation of %d MB failed (%s); using pageable memory "
                                "from now on (device copies become synchronous)", nbytes >> 20,
                                str(e).splitlines()[0])
            self.pageable_bytes += nbytes
        return torch.empty(nbytes, dtype=torch.uint8)

    def free(self, buf: torch.Tensor) -> None:
        with self._lock:
            if buf.is_pinned():
                self.pinned_bytes -= buf.numel()
            else:
                self.pageable_bytes -= buf.numel()


class BufferPool(Generic[T]):
    """Equal-sized buffers reused from one chunk to the next. give() may pass the event of a device copy
    still using the buffer; take() waits for it before handing the buffer out again."""

    def __init__(self, make: Callable[[], T], keep: int, drop: Callable[[T], None] | None = None) -> None:
        self._make = make
        self._drop = drop
        self._free: collections.deque[tuple[T, object | None]] = collections.deque()
        self.keep = keep  # buffers kept for reuse at most; more are made when needed and dropped after

    def take(self) -> T:
        try:
            buf, busy = self._free.pop()  # deque append and pop are atomic in CPython
        except IndexError:
            return self._make()
        if busy is not None:
            busy.synchronize()
        return buf

    def fill(self, touch: Callable[[T], None]) -> None:
        """Make the kept buffers now and write every page once (a background thread at engine start), so the
        first chunks do not pay the page faults."""
        while len(self._free) < self.keep:
            buf = self._make()
            touch(buf)
            self._free.append((buf, None))

    def give(self, buf: T, busy: object | None = None) -> None:
        if len(self._free) < self.keep:
            self._free.append((buf, busy))
            return
        if busy is not None:
            busy.synchronize()
        if self._drop is not None:
            self._drop(buf)

    @property
    def kept(self) -> int:
        return len(self._free)
