"""Worker side: read chunk files into the paged cache before the layers need them; save new chunks.

Loads: start_load() hands every chunk file of the step to reader threads. Each reads the chunk's object past
FUSE and decodes it in this process where the mount offers that (kvfs.direct; through the mount otherwise),
straight into a staging buffer of its own (pinned where the cache is on a GPU), verifies it, and copies it into
the request's blocks of the paged cache in the engine's order, layer by layer (transfer.py: on the CPU at
once; on a GPU asynchronously on a side stream, an event per layer). wait_layer() waits for the step's reads
and, before each layer's attention, for that layer's copies. A chunk that is missing, fails a checksum, or
holds other tokens or another layout is a load error: its blocks are reported to vLLM, which recomputes them.

Saves: after the forward pass each new chunk is copied out of the paged cache into a host slot of its own
(transfer.py: on a GPU gathered on the device, then copied to a pinned slot asynchronously, and the forward
stream waits for the gathers before vLLM can reuse the blocks) — so a save can never store another request's
KV — and written by a writer thread (temp name, rename) once its copy is done, off the forward path.
Copied-out chunks waiting for the writer are bounded (max_pending_save_mb); beyond the bound a save is
dropped, never waited for.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import errno
import logging
import os
import threading
import time

import torch
from kvfs import direct

from . import chunkfile, cpus, files, transfer
from .buffers import BufferPool, HostMemory
from .chunkfile import ChunkMismatch
from .layout import ChunkLayout
from .mount import MountGuard
from .plan import LoadSpec, SaveSpec

log = logging.getLogger("vllm.kvfs_connector")

DTYPE_XATTR = {torch.bfloat16: b"bf16", torch.float16: b"fp16", torch.float32: b"fp32"}
PINNED_MB = 1024  # default bound on a worker's pinned staging memory (readers' buffers + save slots)
DEVICE_STAGING_MB = 128  # default device memory a GPU worker gathers a step's saves into


class _Load:
    def __init__(self, spec: LoadSpec, future: cf.Future) -> None:
        self.spec = spec
        self.future = future  # -> one event per layer: that layer's blocks are in the paged cache
        self.events: list | None = None
        self.done = False  # read, verified, and its copies into the paged cache queued (or done), every layer
        self.failed = False


class WorkerSide:
    def __init__(self, layout: ChunkLayout, kv_layers: list[torch.Tensor], layer_index: dict[str, int],
                 rank: int, guard: MountGuard, io_threads: int, max_pending_save_bytes: int,
                 direct_reads: bool = True, lossy: str = "none", idle_s: int = 0,
                 io_cpus: frozenset[int] | None = None, pinned_bytes: int = PINNED_MB << 20,
                 device_staging_bytes: int = DEVICE_STAGING_MB << 20, direct_writes: bool = True,
                 save_threads: int = 2, writes: bool = True, dtype_hint: bytes | None = None) -> None:
        self.layout = layout
        self.lossy = lossy
        self.writes = writes  # False on the ranks that only read a replicated part (MLA beyond TP rank 0)
        self.descriptor = self._descriptor()
        self.kv_layers = kv_layers
        self.layer_index = layer_index
        self.rank = rank
        self.guard = guard
        self.congested = files.Congestion(guard.path)  # back-pressure from kvfs's mover
        self.copies = transfer.for_cache(layout, kv_layers, device_staging_bytes)
        self.memory = HostMemory(pinned=self.copies.device_side, limit_bytes=pinned_bytes)
        self.readers = cf.ThreadPoolExecutor(io_threads, thread_name_prefix="kvfs-read",
                                             initializer=cpus.pin_current_thread, initargs=(io_cpus,))
        self.save_threads = save_threads
        self.writer = cf.ThreadPoolExecutor(save_threads, thread_name_prefix="kvfs-write",
                                            initializer=cpus.pin_current_thread, initargs=(io_cpus,))
        self.max_pending = max_pending_save_bytes
        self.payload_bytes = layout.payload_bytes
        self.file_size = chunkfile.HEADER_SIZE + self.payload_bytes
        # one file buffer per reader; save slots up to the pending bound (pinned first: readers', then saves')
        self.file_buffers = BufferPool(lambda: self.memory.allocate(self.file_size), keep=io_threads,
                                       drop=self.memory.free)
        self.save_slots = BufferPool(lambda: self.memory.allocate(self.payload_bytes),
                                     keep=max(1, max_pending_save_bytes // max(1, self.payload_bytes)),
                                     drop=self.memory.free)
        self.direct_reads = direct_reads
        self.direct_writes = direct_writes  # encode chunks here and have kvfs adopt them (kvfs.direct.write_file)
        self._pending_bytes = 0
        self._in_flight: set[str] = set()
        self._lock = threading.Lock()
        self._loads: list[_Load] = []
        self._async: dict[str, list[_Load]] = {}  # hybrid models' loads, per request, until get_finished
        self._layers_waited: set[int] = set()
        self._failed_blocks: set[int] = set()
        self.stats = collections.Counter()
        self._warned: set[str] = set()
        self.xattrs = {files.XA_SHAPE: layout.shape_hint(chunkfile.HEADER_SIZE).encode()}
        if dtype_hint or layout.g.dtype in DTYPE_XATTR:
            self.xattrs[files.XA_DTYPE] = dtype_hint or DTYPE_XATTR[layout.g.dtype]
        if lossy != "none":
            self.xattrs[files.XA_LOSSY] = lossy.encode()
        if idle_s:  # saved chunks carry the idle policy from the start: saves still in flight at finish too
            self.xattrs[files.XA_IDLE] = str(idle_s).encode()

    def _descriptor(self) -> dict:
        out = self.layout.descriptor()
        if self.lossy != "none":  # kvfs returns other values than were written: chunkfile skips the payload checksum
            out["lossy"] = self.lossy
        return out

    def refresh_descriptor(self) -> None:
        """The layout's descriptor again (fp8 scales computed by the engine after start change it): chunks
        saved under other scales are then a miss, never loaded."""
        self.descriptor = self._descriptor()

    def warm_up(self) -> threading.Thread:
        """Fill the readers' buffer pool in a background thread (page faults cost as much as reading)."""
        thread = threading.Thread(target=self.file_buffers.fill, args=(_touch,), name="kvfs-warm-up", daemon=True)
        thread.start()
        return thread

    # -- loads -----------------------------------------------------------------------------------------
    def start_load(self, specs: list[LoadSpec]) -> None:
        """On the forward thread, before the step's forward pass. Asynchronous loads (hybrid models) go on
        beyond the step, until poll_async() reports their request."""
        after = self.copies.mark_forward()  # the step's blocks may still be read by earlier kernels
        self._loads = []
        for spec in specs:
            result: cf.Future = cf.Future()
            self.readers.submit(self._load, spec, after, result)
            if spec.asynchronous:
                self._async.setdefault(spec.req_id, []).append(_Load(spec, result))
            else:
                self._loads.append(_Load(spec, result))
        self._layers_waited = set()

    def poll_async(self, wait_s: float = 0.0) -> tuple[set[str], set[str]]:
        """Requests whose asynchronous loads have all ended (read, verified and copied into the paged cache,
        or failed), and those among them with a failed load: vLLM recomputes them whole. wait_s: wait that
        long at most for the reads still running (the forward thread then gives the readers the GIL and
        the CPU, and the request is reported in this step's output instead of a later one)."""
        if wait_s > 0:
            pending = [ld.future for loads in self._async.values() for ld in loads if not ld.future.done()]
            if pending:
                cf.wait(pending, timeout=wait_s)
        finished, failed = set(), set()
        for req_id, loads in list(self._async.items()):
            if not all(ld.future.done() for ld in loads):
                continue
            for load in loads:
                self._resolve(load)
                if load.done and not all(e.query() for e in load.events):
                    break  # device copies still running: next step
            else:
                del self._async[req_id]
                finished.add(req_id)
                if any(ld.failed for ld in loads):
                    failed.add(req_id)
        return finished, failed

    def _load(self, spec: LoadSpec, after, result: cf.Future) -> None:
        """In a reader thread: read and verify one chunk, then hand it to the copies into the paged cache,
        every layer (transfer.py), which complete `result` with one event per layer. Those blocks belong to
        the loading request alone, and no attention reads them before wait_layer() has waited for that
        layer's copies; nothing is copied unless the whole chunk verified."""
        t0 = time.thread_time()
        buf = self.file_buffers.take()
        try:
            if not spec.paths:
                raise ChunkMismatch("the scheduler found no loadable blocks for it (null block in its range)")
            path = spec.paths[self.rank]
            into = buf.numpy()
            if self.direct_reads:
                raw, past_fuse = direct.read_file(path, self.file_size, into=into)
            else:
                raw, past_fuse = direct.read_through_mount(path, self.file_size, into=into), False
            # past FUSE, every frame was checked against the checksums kvfs took of the written bytes: hashing
            # the payload again would cost the reader ~0.4 ms per 6 MB for nothing
            chunkfile.verify(raw, first_token=spec.first_token, n_tokens=spec.n_tokens,
                             expected_tokens=spec.token_digest, descriptor=self.descriptor,
                             payload_verified=past_fuse)
        except BaseException as e:
            self.file_buffers.give(buf)
            result.set_exception(e)
            return
        finally:
            with self._lock:
                self.stats["load_cpu_us"] += int((time.thread_time() - t0) * 1e6)

        def copied(events: list | None, error: Exception | None) -> None:
            self.file_buffers.give(buf, events[-1] if events else None)
            if error is not None:
                result.set_exception(error)
                return
            with self._lock:
                self.stats["direct_loads"] += past_fuse
                self.stats["loaded_chunks"] += 1
                self.stats["loaded_bytes"] += self.payload_bytes
            result.set_result(events)

        payload = buf[chunkfile.HEADER_SIZE:self.file_size].view(self.layout.g.dtype)
        self.copies.load(transfer.LoadCopy(payload, spec.groups, spec.first_block, spec.end_block, after, copied))

    def _resolve(self, load: _Load) -> None:
        if load.done or load.failed:
            return
        try:
            load.events = load.future.result()
            load.done = True
        except (OSError, ChunkMismatch) as e:
            self._fail(load, e)
        except Exception as e:  # never crash the engine over a cache file
            log.exception("kvfs connector: unexpected error loading %s", load.spec.paths[self.rank]
                          if load.spec.paths else "-")
            self._fail(load, e)

    def _fail(self, load: _Load, err: Exception) -> None:
        load.failed = True
        s = load.spec
        if not s.asynchronous:  # vLLM takes block ids only from single-group models (else per request)
            self._failed_blocks.update(s.block_ids[s.first_block:s.end_block])
        self.stats["load_errors"] += 1
        if isinstance(err, OSError):
            self.guard.failed(err)
        log.warning("kvfs connector: chunk %s unusable (%s); vLLM recomputes its %d blocks",
                    s.paths[self.rank] if s.paths else "-", err, s.end_block - s.first_block)

    def wait_layer(self, layer_name: str) -> None:
        """Before a layer's attention (on the forward thread): every load of the step is read and verified,
        and the forward stream waits for this layer's copies."""
        layer = self.layer_index.get(layer_name)
        if layer is None or not self._loads:
            return
        waited = set()  # a batch of loads shares its events
        for load in self._loads:
            self._resolve(load)
            if load.done and id(load.events[layer]) not in waited:
                waited.add(id(load.events[layer]))
                self.copies.forward_waits(load.events[layer])
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
        """Right after the forward pass (forward thread): copy each new chunk out of the paged cache into a
        slot of its own, and queue the writes for when the copies are done: one job per writer thread, whose
        chunks kvfs adopts together."""
        if not self.writes:
            return
        accepted = [(spec, spec.paths[self.rank]) for spec in specs if self._admit(spec.paths[self.rank])]
        if not accepted:
            return
        jobs: list[list] = [[] for _ in range(min(self.save_threads, len(accepted)))]
        try:
            with self.copies.saving():
                for n, (spec, path) in enumerate(accepted):
                    try:
                        slot = self.save_slots.take()
                        copied = self.copies.chunk_to_host(spec.groups, slot)
                    except Exception:
                        for _, later in accepted[n:]:
                            self._done(later)
                        raise
                    jobs[n % len(jobs)].append((spec, path, slot, copied))
        finally:
            for job in jobs:
                if job:
                    self.writer.submit(self._write, job)

    def _shed(self, path: str) -> None:
        self.stats["saves_shed"] += 1
        self._warn_once("shed", "kvfs connector: kvfs's mover is behind its tiers; skipping saves (%s) until "
                        "it catches up", os.path.basename(path))

    def _admit(self, path: str) -> bool:
        with self._lock:
            if path in self._in_flight:
                return False
            if self._pending_bytes + self.payload_bytes > self.max_pending:
                self.stats["saves_dropped"] += 1
                self._warn_once("dropped", "kvfs connector: writer behind (%d MB pending); dropping saves "
                                "instead of slowing the engine", self._pending_bytes >> 20)
                return False
            self._pending_bytes += self.payload_bytes
            self._in_flight.add(path)
            return True

    def _write(self, job: list[tuple[SaveSpec, str, torch.Tensor, object]]) -> None:
        """Write a job's chunks (writer thread), adopted by kvfs in one request where it takes direct writes."""
        paths = [path for _, path, _, _ in job]
        try:
            for _, _, _, copied in job:
                copied.synchronize()  # the chunk's copy into its slot (a device copy: its event)
            if not self.guard.usable():
                self.stats["saves_skipped_no_mount"] += len(job)
                return
            if self.congested():  # kvfs's mover is behind: skip the saves rather than queue behind it
                for path in paths:
                    self._shed(path)
                self.congested.report_shed(len(paths))  # (a refused adoption, below, kvfs counts itself)
                return
            writes = [(path, self._file_parts(spec, slot), self._file_xattrs(spec)) for spec, path, slot, _ in job]
            for path, how in zip(paths, files.write_atomic_many(writes, self.direct_writes, shed=True)):
                self._count(path, how)
        except Exception:
            self.stats["save_errors"] += len(job)
            log.exception("kvfs connector: saving %s failed", ", ".join(paths))
        finally:
            for _, path, slot, _ in job:
                self.save_slots.give(slot)
                self._done(path)

    def _file_parts(self, spec: SaveSpec, slot: torch.Tensor) -> list:
        return chunkfile.build(spec.first_token, spec.n_tokens, spec.token_digest, self.descriptor,
                               slot[:self.payload_bytes].numpy())

    def _file_xattrs(self, spec: SaveSpec) -> dict[str, bytes]:
        if spec.blocks is not None and self.rank == 0:  # one announcement per chunk, not one per rank
            return {**self.xattrs, files.XA_BLOCKS: spec.blocks}
        return self.xattrs

    def _count(self, path: str, how: str | None | OSError) -> None:
        if isinstance(how, OSError):
            if how.errno == errno.EBUSY:  # the daemon shed it: it became congested meanwhile
                self._shed(path)
                return
            self.stats["save_errors"] += 1
            self.guard.failed(how)
            self._warn_once("save-" + str(how.errno), "kvfs connector: saving %s failed: %s", path, how)
        elif how is not None:
            self.stats["saved_chunks"] += 1
            self.stats["saved_bytes"] += self.payload_bytes
            self.stats["saved_direct"] += how == "direct"
        else:
            self.stats["saves_existing"] += 1

    def _done(self, path: str) -> None:
        with self._lock:
            self._pending_bytes -= self.payload_bytes
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
        self.copies.close()
        log.info("kvfs connector: %s; staging memory: %d MB pinned, %d MB pageable", dict(self.stats),
                 self.memory.pinned_bytes >> 20, self.memory.pageable_bytes >> 20)


def _touch(buf: torch.Tensor) -> None:
    buf.zero_()
