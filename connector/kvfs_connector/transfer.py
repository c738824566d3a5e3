"""Copies between the paged KV cache and host staging buffers, ordered against the engine's forward stream.

One interface, two implementations chosen by the cache's device:
- `HostCopies` (the cache is in host memory, vLLM on CPU): copies run at once in the calling thread, and every
  event is already done.
- `CudaCopies`: copies run on two side streams of the worker's own (one for loads, one for saves), so they
  overlap the forward pass; CUDA events order them against it. The ordering rules, each a known failure of
  peers when missing (vLLM #45704: KV read before its copy finished):

  save  1. the save stream waits for the forward stream: the step's KV is written before it is gathered;
        2. the chunk's blocks are gathered on the device into a staging area of the connector's own, then
           copied to a pinned host slot asynchronously; the writer thread waits on that copy's event,
           never on the forward stream;
        3. the forward stream waits for the gathers (not the host copies) before its next kernel: vLLM may
           hand a block to another request as soon as the step ends (a finished, preempted or aborted
           request), and the next step's KV writes into it are queued on the forward stream after this wait.
  load  1. the load stream waits for the forward stream as of start_load: blocks just allocated to a request
           may still be read by the previous step's kernels (a request that finished in it);
        2. verified chunks (read and checked by the reader threads) are copied from their pinned buffers to
           a device staging area and scattered into their blocks layer by layer, an event per layer;
        3. the forward stream waits on layer N's events just before layer N's attention (vLLM's layer-wise
           hook), so the copies of layer N+1 overlap the compute of layer N;
        4. a pinned buffer goes back to its pool with the last copy's event, and is reused only after it.
  One copier thread issues every load's CUDA calls, in batches of the chunks the readers have verified
  meanwhile: one scatter per layer per batch instead of per chunk. Each torch call costs host time under the
  GIL, and reader threads that also issued them (about a hundred per chunk) slowed each other down as more
  were added (measured on an H200 host: 2.05 GB/s with 4 readers, 1.42 with 16, no decoding at all).
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import threading
from collections.abc import Callable

import torch

from .layout import ChunkLayout


class Done:
    """An event that has already happened (host copies)."""

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


DONE = Done()


class HostCopies:
    device_side = False

    def __init__(self, layout: ChunkLayout, kv_layers: list[torch.Tensor]) -> None:
        self.layout = layout
        self.kv_layers = kv_layers

    def mark_forward(self) -> Done:
        return DONE

    def forward_waits(self, event) -> None:
        pass

    @contextlib.contextmanager
    def saving(self):
        yield

    def chunk_to_host(self, block_ids: list[int], slot: torch.Tensor):
        """Copy a chunk's blocks into `slot` (payload order). Returns the event the writer waits for."""
        self.layout.gather_into(self.kv_layers, block_ids, slot.view(self.layout.g.dtype))
        return DONE

    def load(self, item: "LoadCopy") -> None:
        """Scatter a verified chunk's blocks first..end into the cache, layer by layer, then call
        item.done(events): one event per layer, the last of which also tells when the payload's buffer may
        be reused; or item.done(None, error)."""
        try:
            ids = self.layout.group_index(item.block_ids, item.payload.device)
            for _ in self.layout.scatter_layers(self.kv_layers, item.payload, ids, item.first, item.end):
                pass
        except Exception as e:
            item.done(None, e)
            return
        item.done([DONE] * len(self.kv_layers), None)

    def close(self) -> None:
        pass


@dataclasses.dataclass(eq=False)  # compared by identity (its payload is a tensor)
class LoadCopy:
    payload: torch.Tensor  # the verified chunk's payload, in host memory (pinned on a GPU worker)
    block_ids: list  # one list, or one per KV-cache group of the part (LoadSpec.groups)
    first: int
    end: int
    after: object  # the forward stream's event as of start_load
    done: Callable[[list | None, Exception | None], None]


class CudaCopies(HostCopies):
    device_side = True

    def __init__(self, layout: ChunkLayout, kv_layers: list[torch.Tensor], staging_bytes: int) -> None:
        super().__init__(layout, kv_layers)
        self.device = kv_layers[0].device
        self.load_stream = torch.cuda.Stream(self.device)
        self.save_stream = torch.cuda.Stream(self.device)
        # Device staging for saves: whole chunks, so the forward stream waits only for the gathers; when a
        # step saves more chunks than fit, the ring wraps and later gathers queue behind earlier host copies.
        chunk = layout.payload_bytes
        self.regions = max(1, staging_bytes // chunk)
        self.staging = torch.empty(self.regions * chunk, dtype=torch.uint8, device=self.device)
        self._next_region = 0
        self._gathered: torch.cuda.Event | None = None
        # Device staging for loads: a batch of whole chunks (the ring's size again, at least one chunk).
        self.load_slots = self.regions
        self.load_staging = torch.empty(self.load_slots * layout.payload_elements, dtype=layout.g.dtype,
                                        device=self.device)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._copier: threading.Thread | None = None

    def _event(self, stream: torch.cuda.Stream) -> torch.cuda.Event:
        event = torch.cuda.Event(blocking=True)  # host waits on it sleep instead of spinning
        event.record(stream)
        return event

    def mark_forward(self) -> torch.cuda.Event:
        return self._event(torch.cuda.current_stream(self.device))

    def forward_waits(self, event) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)

    @contextlib.contextmanager
    def saving(self):
        """Around one step's saves (on the forward thread): rules 1 and 3."""
        self.save_stream.wait_stream(torch.cuda.current_stream(self.device))
        self._gathered = None
        try:
            yield
        finally:
            if self._gathered is not None:
                self.forward_waits(self._gathered)

    def chunk_to_host(self, block_ids, slot):
        chunk = self.layout.payload_bytes
        start = self._next_region * chunk
        self._next_region = (self._next_region + 1) % self.regions
        region = self.staging[start:start + chunk]
        with torch.cuda.device(self.device), torch.cuda.stream(self.save_stream):
            self.layout.gather_into(self.kv_layers, block_ids, region.view(self.layout.g.dtype))
            self._gathered = self._event(self.save_stream)
            slot[:chunk].copy_(region, non_blocking=True)
            return self._event(self.save_stream)

    def load(self, item: LoadCopy) -> None:
        if self._copier is None:
            self._copier = threading.Thread(target=self._copy_loads, name="kvfs-copy", daemon=True)
            self._copier.start()
        self._queue.put(item)

    def close(self) -> None:
        if self._copier is not None:
            self._queue.put(None)
            self._copier.join()
            self._copier = None

    def _copy_loads(self) -> None:
        while True:
            batch = [self._queue.get()]
            if batch[0] is None:
                return
            while len(batch) < self.load_slots:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stop = batch[-1] is None
            batch = [b for b in batch if b is not None]
            try:
                with torch.cuda.device(self.device), torch.cuda.stream(self.load_stream):
                    events, error = self._copy_batch(batch), None
            except Exception as e:  # reported per load: vLLM recomputes those blocks
                events, error = None, e
            for item in batch:
                item.done(events, error)
            if stop:
                return

    def _copy_batch(self, batch: list[LoadCopy]) -> list:
        """Every layer of every chunk of the batch: one host-to-device copy per chunk, then per layer one
        scatter of all the whole chunks and one per partial chunk, and an event."""
        lay = self.layout
        for after in {id(b.after): b.after for b in batch}.values():
            self.load_stream.wait_event(after)
        is_whole = [(b.first, b.end) == (0, lay.g.blocks_per_chunk) for b in batch]
        whole = [b for b, w in zip(batch, is_whole) if w]
        partial = [b for b, w in zip(batch, is_whole) if not w]
        E = lay.payload_elements
        for k, item in enumerate(whole + partial):
            self.load_staging[k * E:(k + 1) * E].copy_(item.payload, non_blocking=True)
        sources = lay.batch_sources(self.load_staging[:len(whole) * E], len(whole)) if whole else None
        groups = max(lay.layer_groups) + 1
        ids = [lay.index([i for b in whole for i in _groups(b.block_ids)[g]], self.device)
               for g in range(groups)] if whole else None
        parts = [(self.load_staging[(len(whole) + j) * E:(len(whole) + j + 1) * E],
                  lay.group_index(b.block_ids, self.device), b.first, b.end) for j, b in enumerate(partial)]
        events = []
        for layer, kv in enumerate(self.kv_layers):
            if whole:
                lay.scatter_batch_layer(kv, sources, layer, ids[lay.layer_groups[layer]])
            for src, pids, first, end in parts:
                lay.scatter_layer(kv, lay.layer_slice(src, layer), pids[lay.layer_groups[layer]], first, end)
            events.append(self._event(self.load_stream))
        return events


def _groups(block_ids) -> list:
    return block_ids if len(block_ids) and isinstance(block_ids[0], (list, tuple)) else [block_ids]


def for_cache(layout: ChunkLayout, kv_layers: list[torch.Tensor], staging_bytes: int) -> HostCopies:
    if kv_layers[0].device.type == "cuda":
        return CudaCopies(layout, kv_layers, staging_bytes)
    return HostCopies(layout, kv_layers)
