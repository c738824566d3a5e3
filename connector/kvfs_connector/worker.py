"""Worker side: read chunk files into the paged cache before the layers need them; save new chunks.

Loads: start_load() hands every chunk file of the step to reader threads. Each reads the chunk's object past
FUSE and decodes it in this process where the mount offers that (kvfs.direct; through the mount otherwise),
verifies it, and writes it into the request's blocks of the paged cache in the engine's order: all of it off
the forward thread, which meanwhile runs the step's first layers' projections, and needs no buffer beyond one
per reader. wait_layer() only waits. A chunk that is missing, fails a checksum, or holds other tokens or
another layout is a load error: its blocks are reported to vLLM, which recomputes them.

Saves: after the forward pass (finish_step) each new chunk is copied out of the paged cache into its own
buffer at once — so vLLM may reuse the blocks as soon as the step ends and a save can never store another
request's KV — and written by a writer thread (temp name, rename) off the forward path. Copied-out chunks
waiting for the writer are bounded (max_pending_save_mb); beyond the bound a save is dropped, never waited for.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import logging
import threading
import time

import torch
from kvfs import direct

from . import chunkfile, cpus, files
from .buffers import BufferPool
from .chunkfile import ChunkMismatch
from .layout import ChunkLayout
from .mount import MountGuard
from .plan import LoadSpec, SaveSpec

log = logging.getLogger("vllm.kvfs_connector")

DTYPE_XATTR = {torch.bfloat16: b"bf16", torch.float16: b"fp16", torch.float32: b"fp32"}


class _Load:
    def __init__(self, spec: LoadSpec, future: cf.Future) -> None:
        self.spec = spec
        self.future = future
        self.done = False  # written into the paged cache, every layer
        self.failed = False


class WorkerSide:
    def __init__(self, layout: ChunkLayout, kv_layers: list[torch.Tensor], layer_index: dict[str, int],
                 rank: int, guard: MountGuard, io_threads: int, max_pending_save_bytes: int,
                 direct_reads: bool = True, lossy: str = "none", idle_s: int = 0,
                 io_cpus: frozenset[int] | None = None) -> None:
        self.layout = layout
        self.descriptor = layout.descriptor()
        if lossy != "none":  # kvfs returns other values than were written: chunkfile skips the payload checksum
            self.descriptor["lossy"] = lossy
        self.kv_layers = kv_layers
        self.layer_index = layer_index
        self.rank = rank
        self.guard = guard
        self.readers = cf.ThreadPoolExecutor(io_threads, thread_name_prefix="kvfs-read",
                                             initializer=cpus.pin_current_thread, initargs=(io_cpus,))
        self.writer = cf.ThreadPoolExecutor(2, thread_name_prefix="kvfs-write",
                                            initializer=cpus.pin_current_thread, initargs=(io_cpus,))
        self.max_pending = max_pending_save_bytes
        self.file_size = chunkfile.HEADER_SIZE + layout.payload_elements * layout.g.dtype.itemsize
        self.file_buffers = BufferPool(lambda: bytearray(self.file_size), keep=io_threads)  # one per reader
        self.direct_reads = direct_reads
        self._pending_bytes = 0
        self._in_flight: set[str] = set()
        self._lock = threading.Lock()
        self._loads: list[_Load] = []
        self._layers_waited: set[int] = set()
        self._failed_blocks: set[int] = set()
        self.stats = collections.Counter()
        self._warned: set[str] = set()
        self.xattrs = {files.XA_SHAPE: layout.shape_hint(chunkfile.HEADER_SIZE).encode()}
        if layout.g.dtype in DTYPE_XATTR:
            self.xattrs[files.XA_DTYPE] = DTYPE_XATTR[layout.g.dtype]
        if lossy != "none":
            self.xattrs[files.XA_LOSSY] = lossy.encode()
        if idle_s:  # saved chunks carry the idle policy from the start: saves still in flight at finish too
            self.xattrs[files.XA_IDLE] = str(idle_s).encode()

    def warm_up(self) -> threading.Thread:
        """Fill the readers' buffer pool in a background thread (page faults cost as much as reading)."""
        thread = threading.Thread(target=self.file_buffers.fill, args=(_touch,), name="kvfs-warm-up", daemon=True)
        thread.start()
        return thread

    # -- loads -----------------------------------------------------------------------------------------
    def start_load(self, specs: list[LoadSpec]) -> None:
        self._loads = [_Load(s, self.readers.submit(self._load, s)) for s in specs]
        self._layers_waited = set()

    def _load(self, spec: LoadSpec) -> None:
        """In a reader thread: read and verify one chunk, then write its blocks, every layer, into the paged
        cache. Those blocks belong to the loading request alone, and no attention reads them before
        wait_layer() has seen this finish; nothing is written unless the whole chunk verified."""
        t0 = time.thread_time()
        raw = self.file_buffers.take()
        try:
            path = spec.paths[self.rank]
            if self.direct_reads:
                buf, past_fuse = direct.read_file(path, self.file_size, into=raw)
            else:
                buf, past_fuse = direct.read_through_mount(path, self.file_size, into=raw), False
            payload = chunkfile.verify(buf, first_token=spec.first_token, n_tokens=spec.n_tokens,
                                       expected_tokens=spec.token_digest, descriptor=self.descriptor)
            self.layout.scatter(self.kv_layers, self.layout.payload_view(payload), spec.block_ids,
                                spec.first_block, spec.end_block)
            with self._lock:
                self.stats["direct_loads"] += past_fuse
                self.stats["loaded_chunks"] += 1
                self.stats["loaded_bytes"] += len(payload)
        finally:
            self.file_buffers.give(raw)
            with self._lock:
                self.stats["load_cpu_us"] += int((time.thread_time() - t0) * 1e6)

    def _resolve(self, load: _Load) -> None:
        if load.done or load.failed:
            return
        try:
            load.future.result()
            load.done = True
        except (OSError, ChunkMismatch) as e:
            self._fail(load, e)
        except Exception as e:  # never crash the engine over a cache file
            log.exception("kvfs connector: unexpected error loading %s", load.spec.paths[self.rank])
            self._fail(load, e)

    def _fail(self, load: _Load, err: Exception) -> None:
        load.failed = True
        s = load.spec
        self._failed_blocks.update(s.block_ids[s.first_block:s.end_block])
        self.stats["load_errors"] += 1
        if isinstance(err, OSError):
            self.guard.failed(err)
        log.warning("kvfs connector: chunk %s unusable (%s); vLLM recomputes its %d blocks",
                    s.paths[self.rank], err, s.end_block - s.first_block)

    def wait_layer(self, layer_name: str) -> None:
        """Before a layer's attention: every load of the step is in (the readers wrote all layers)."""
        layer = self.layer_index.get(layer_name)
        if layer is None or not self._loads:
            return
        for load in self._loads:
            self._resolve(load)
        self._layers_waited.add(layer)

    def finish_loads(self) -> None:
        """End of step. If some layer's attention ran without a wait_layer call, the readers may have written
        its blocks after it read them: every load of the step is then a load error, and vLLM recomputes."""
        missed = len(self.kv_layers) - len(self._layers_waited)
        for load in self._loads:
            self._resolve(load)
            if load.done and missed:
                self._fail(load, RuntimeError(f"{missed} layers ran attention before waiting for the load"))
        self._loads = []

    def take_failed_blocks(self) -> set[int]:
        out, self._failed_blocks = self._failed_blocks, set()
        return out

    # -- saves -----------------------------------------------------------------------------------------
    def save(self, specs: list[SaveSpec]) -> None:
        """Right after the forward pass: copy each new chunk out of the paged cache, queue the write."""
        for spec in specs:
            path = spec.paths[self.rank]
            size = self.layout.payload_elements * self.layout.g.dtype.itemsize
            with self._lock:
                if path in self._in_flight:
                    continue
                if self._pending_bytes + size > self.max_pending:
                    self.stats["saves_dropped"] += 1
                    self._warn_once("dropped", "kvfs connector: writer behind (%d MB pending); dropping saves "
                                    "instead of slowing the engine", self._pending_bytes >> 20)
                    continue
                self._pending_bytes += size
                self._in_flight.add(path)
            try:
                payload = self.layout.gather(self.kv_layers, spec.block_ids)
            except Exception:
                self._done(path, size)
                raise
            self.writer.submit(self._write, spec, path, payload, size)

    def _write(self, spec: SaveSpec, path: str, payload: torch.Tensor, size: int) -> None:
        try:
            if not self.guard.usable():
                self.stats["saves_skipped_no_mount"] += 1
                return
            parts = chunkfile.build(spec.first_token, spec.n_tokens, spec.token_digest, self.descriptor,
                                    payload.view(torch.uint8).numpy())
            if files.write_atomic(path, parts, self.xattrs):
                self.stats["saved_chunks"] += 1
                self.stats["saved_bytes"] += size
            else:
                self.stats["saves_existing"] += 1
        except OSError as e:
            self.stats["save_errors"] += 1
            self.guard.failed(e)
            self._warn_once("save-" + str(e.errno), "kvfs connector: saving %s failed: %s", path, e)
        except Exception:
            self.stats["save_errors"] += 1
            log.exception("kvfs connector: saving %s failed", path)
        finally:
            self._done(path, size)

    def _done(self, path: str, size: int) -> None:
        with self._lock:
            self._pending_bytes -= size
            self._in_flight.discard(path)

    def _warn_once(self, key: str, msg: str, *args) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(msg, *args)

    def flush(self, timeout: float | None = None) -> None:
        """Wait for queued saves (used at shutdown and by tests)."""
        self.writer.submit(lambda: None).result(timeout)
        while True:
            with self._lock:
                if not self._in_flight:
                    return
            threading.Event().wait(0.01)

    def shutdown(self) -> None:
        self.writer.shutdown(wait=True)
        self.readers.shutdown(wait=True, cancel_futures=True)
        log.info("kvfs connector: %s", dict(self.stats))


def _touch(buf: bytearray) -> None:
    buf[:] = bytes(len(buf))
