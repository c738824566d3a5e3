"""KVFSConnector: vLLM's v1 connector API on top of the planner (scheduler side) and the worker side."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import TYPE_CHECKING, Any

import torch
import xxhash
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from . import compat, cpus
from . import layout as layouts
from .model import ModelKV, Part, UnsupportedModel, describe_model
from .mount import MountGuard
from .naming import NamespaceKey, seed_identity
from .plan import LoadSpec, Planner, SaveSpec
from .settings import Settings
from .worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = logging.getLogger("vllm.kvfs_connector")

FP8_XATTR = {"fp8_e5m2": b"fp8_e5m2"}  # any other per-tensor fp8 cache holds e4m3 bytes
# How long the end of a step waits for the asynchronous loads it started (hybrid models): they ran beside the
# forward pass, and a request reported in this step's output is scheduled in the next one. Measured on 2
# cores (tools/bench_models.py): without the wait, a full hit polled step after step took 0.17-0.35 s against
# 0.02-0.03 s for the synchronous loads of single-group models, the readers starved of the GIL by the loop.
ASYNC_LOAD_WAIT_S = 2.0


@dataclasses.dataclass
class KVFSMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = dataclasses.field(default_factory=list)
    saves: list[SaveSpec] = dataclasses.field(default_factory=list)


class KVFSConnector(KVConnectorBase_V1, SupportsHMA):
    """Stores every full chunk of tokens' KV as files in a kvfs mount (one per part of the model's KV: full
    attention, sliding window, MLA) and loads the longest existing prefix. Implements vLLM's multi-group
    contract (SupportsHMA), so vLLM's hybrid KV cache manager stays on."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        compat.check_api(KVConnectorBase_V1)  # an interface it does not know: the engine stops here
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.settings = Settings.from_extra(self._kv_transfer_config.kv_connector_extra_config)
        self.guard = MountGuard(self.settings.mount, self.settings.require_mount)
        self.planner: Planner | None = None
        self.workers: list[WorkerSide] = []
        self._async_parts: dict[str, set[int]] = {}  # hybrid loads in flight: request -> parts still loading
        self._async_failed: set[str] = set()
        self._async_started = False  # this step started asynchronous loads: its end waits for them
        self.disabled_reason = None
        cache_dtype = str(vllm_config.cache_config.cache_dtype)
        try:
            pc = vllm_config.parallel_config
            self.model: ModelKV = describe_model(
                kv_cache_config, cache_dtype, getattr(vllm_config.model_config, "use_mla", False),
                max(getattr(pc, "decode_context_parallel_size", 1) or 1,
                    getattr(pc, "prefill_context_parallel_size", 1) or 1))
        except UnsupportedModel as e:
            if self.settings.unsupported == "disable":
                self.disabled_reason = str(e)
                log.warning("kvfs connector disabled: %s; the engine runs without it", e)
                return
            raise UnsupportedModel(f"kvfs connector: {e}; refusing to start (set \"unsupported\": \"disable\" "
                                   "in kv_connector_extra_config to run without kvfs)") from None
        self.block_size = self.model.parts[0].block_size
        self.chunk_size = self.settings.chunk_tokens(self.model.chunk_multiple())
        self.kv_dtype = _spec_dtype(self._spec(self.model.parts[0]))
        self.layout_names = [engine_layout(vllm_config, self._spec(p), p) for p in self.model.parts]
        self.layout_name = self.layout_names[0]
        if role == KVConnectorRole.SCHEDULER:
            if self.settings.on_load_error == "recompute":
                # a cache miss must never fail a request: chunks that fail to load are recomputed
                self._kv_transfer_config.kv_load_failure_policy = "recompute"
            hash_block_size = getattr(kv_cache_config, "hash_block_size", None) or self.block_size
            if self.chunk_size % hash_block_size:
                raise UnsupportedModel(f"kvfs connector: chunk size {self.chunk_size} is not a multiple of the "
                                       f"hash block size {hash_block_size}; refusing to start")
            if (why := compat.salt_isolates(hash_block_size, vllm_config.cache_config.prefix_caching_hash_algo)):
                # chunk names are block hashes: without the salt in them, tenants would share files
                raise compat.UnsupportedEngine(f"kvfs connector: {why}, so requests with different cache_salt "
                                               "would share chunk files; refusing to start (docs/connector.md)")
            self.planner = Planner(mount=self.guard.path, namespaces=self._namespaces, block_size=self.block_size,
                                   hash_block_size=hash_block_size, chunk_size=self.chunk_size,
                                   save_decode=self.settings.save_decode, guard=self.guard,
                                   prefetch=self.settings.prefetch,
                                   demote_after_idle_s=self.settings.demote_after_idle_s,
                                   tenant_dirs=self.settings.tenant_dirs, tenant_secret=_tenant_secret(self.settings),
                                   record_blocks=self.settings.record_blocks, parts=self.model.parts,
                                   groups=len(kv_cache_config.kv_cache_groups), asynchronous=self.model.hybrid)
            log.info("kvfs connector: %s, chunks of %d tokens, %s", self.guard.path, self.chunk_size,
                     "; ".join(f"{_part_name(p)}: layout {n}" for p, n in zip(self.model.parts, self.layout_names)))

    def _spec(self, part: Part):
        return self._kv_cache_config.kv_cache_groups[part.groups[0]].kv_cache_spec

    # wait_for_layer_load makes the forward stream wait on CUDA events between layers: Python must run there,
    # which full CUDA graphs would skip on replay (vLLM then captures piecewise graphs, attention outside).
    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return True

    # A cache: a save that never happens is a later miss, not a lost hand-off.
    @property
    def requires_kv_delivery(self) -> bool:
        return False

    def _namespaces(self) -> list[list[str]]:
        """Per part, one namespace per worker rank (global rank order)."""
        cfg = self._vllm_config
        pc = cfg.parallel_config
        none_hash = compat.none_hash()  # set by the engine core before the first request
        if os.environ.get("PYTHONHASHSEED") is None and cfg.cache_config.prefix_caching_hash_algo not in (
                "sha256", "sha256_cbor"):
            log.warning("kvfs connector: hash algorithm %s without PYTHONHASHSEED: block hashes are random per "
                        "process, so no other engine process can reuse these chunks",
                        cfg.cache_config.prefix_caching_hash_algo)
        plain = len(self.model.parts) == 1 and self.model.parts[0].kind == "full"
        cache_dtype = self.model.kv_cache_dtype
        out = []
        for part, layout_name in zip(self.model.parts, self.layout_names):
            spec = self._spec(part)
            names = []
            for pp_rank in range(pc.pipeline_parallel_size):
                for tp_rank in range(pc.tensor_parallel_size):
                    # a replicated part (MLA's latent) is the same on every TP rank: one file, whatever the TP size
                    tp = (0, 1) if part.replicated_over_tp else (tp_rank, pc.tensor_parallel_size)
                    key = NamespaceKey(
                        model=str(cfg.model_config.model), dtype=str(_spec_dtype(spec)).removeprefix("torch."),
                        num_layers=cfg.model_config.get_total_num_hidden_layers(), num_kv_heads=part.num_kv_heads,
                        head_size=part.head_size, block_size=part.block_size, chunk_size=self.chunk_size,
                        layout=layout_name, tp_rank=tp[0], tp_size=tp[1],
                        pp_rank=pp_rank, pp_size=pc.pipeline_parallel_size,
                        hash_algo=cfg.cache_config.prefix_caching_hash_algo, hash_seed_id=seed_identity(none_hash),
                        **({} if self.settings.lossy_mode == "none" else {"lossy": self.settings.lossy_mode}),
                        part=None if plain else _part_key(part),
                        kv_cache_dtype=cache_dtype if self.model.fp8 else None,
                        backend=self._backend_name(part) if self.model.fp8 else None)
                    names.append(key.namespace())
            out.append(names)
        return out

    def _backend_name(self, part: Part) -> str:
        return engine_layout_of(self._vllm_config, self._spec(part), part).backend

    # -- scheduler side ----------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self.planner is None:
            return 0, False
        hit = self.planner.lookup(request, num_computed_tokens)
        # hybrid models load asynchronously: vLLM takes their load failures per request only
        return hit, bool(hit) and self.model.hybrid

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        if self.planner is not None:
            self.planner.allocated(request, blocks.get_block_ids(), num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        if self.planner is None:
            return KVFSMetadata()
        loads, saves = self.planner.step(scheduler_output)
        for req_id in scheduler_output.finished_req_ids:
            self.planner.finished(req_id)
        return KVFSMetadata(loads, saves)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # Saves copy the KV out during the step that completes a chunk, so the blocks can be freed now.
        if self.planner is not None:
            self.planner.finished(request.request_id)
        return False, None

    def request_finished_all_groups(self, request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict | None]:
        """vLLM's multi-group form (SupportsHMA): the same, with one block list per KV-cache group."""
        return self.request_finished(request, block_ids[0] if block_ids else [])

    # -- worker side -------------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        if self.disabled_reason:
            return
        rank = compat.worker_rank()
        writes_replicated = compat.tp_rank() == 0
        io_cpus = cpus.io_cpus(self.settings.io_cpus)  # after vLLM bound this worker: "auto" compares with it
        for part, layout_name in zip(self.model.parts, self.layout_names):
            self.workers.append(self._part_worker(part, layout_name, kv_caches, rank, io_cpus,
                                                  writes_replicated or not part.replicated_over_tp))
        self._layer_worker = {name: self.workers[p] for name, (p, _) in self.model.part_of_layer().items()}

    def _part_worker(self, part: Part, layout_name: str, kv_caches: dict[str, torch.Tensor], rank: int,
                     io_cpus, writes: bool) -> WorkerSide:
        ordered = [n for n in part.layer_names if n in kv_caches]
        missing = [n for n in part.layer_names if n not in kv_caches]
        if missing:
            raise layouts.UnknownLayout(f"the worker has no KV cache for layers {missing[:3]}; refusing to start")
        tensors = [kv_caches[n] for n in ordered]
        spec = self._spec(part)
        stored_tokens = part.stored_blocks(self.chunk_size) * part.block_size
        engine = engine_layout_of(self._vllm_config, spec, part, ordered)
        if part.kind == "state":  # a block's bytes as vLLM's recurrent kernels keep them (no element type)
            tensors = [t.view(torch.uint8) for t in tensors]
            geometry = layouts.Geometry(len(tensors), 1, part.head_size, part.block_size, stored_tokens, torch.uint8)
            if tensors[0].dim() < 2 or tensors[0][0].numel() != part.head_size:
                raise layouts.UnknownLayout(f"vLLM {engine.vllm_version}: recurrent state tensor of shape "
                                            f"{tuple(tensors[0].shape)} is not one block of {part.head_size} "
                                            "bytes per row; refusing to start")
            chosen = layouts.BlockBytesLayout(geometry, tuple(tensors[0].shape[1:]), layout_name)
        else:
            geometry = layouts.Geometry(len(tensors), spec.num_kv_heads, spec.head_size, part.block_size,
                                        stored_tokens, spec.dtype)
            chosen = layouts.choose(geometry, tuple(tensors[0].shape), engine)  # UnknownLayout stops the engine
        if chosen.name != layout_name:
            raise layouts.UnknownLayout(
                f"vLLM {engine.vllm_version}: the worker's KV cache layout is {chosen.name} (backend "
                f"{engine.backend}), the scheduler expected {layout_name}; refusing to start")
        odd = [n for n, t in zip(ordered, tensors) if t.shape != tensors[0].shape or t.device != tensors[0].device]
        if odd:
            raise layouts.UnknownLayout(f"vLLM {engine.vllm_version}: layers {odd[:3]} have other KV cache shapes "
                                        f"or devices than {ordered[0]}; refusing to start")
        chosen.layer_groups = part.layer_groups
        chosen.extra = self._descriptor_extra(part, ordered, engine.backend)
        try:
            chosen.gather(tensors, [[0] * geometry.blocks_per_chunk] * (max(part.layer_groups) + 1))
        except ValueError as e:  # the cache can be read in block order
            raise layouts.UnknownLayout(f"vLLM {engine.vllm_version}: KV cache of layout {chosen.name} cannot "
                                        f"be copied without a copy of the cache: {e}") from e
        s = self.settings
        readers = s.io_thread_count(tensors[0].is_cuda, len(io_cpus or os.sched_getaffinity(0)))
        worker = WorkerSide(chosen, tensors, {n: i for i, n in enumerate(ordered)}, rank, self.guard,
                            readers, s.max_pending_save_mb << 20, s.direct_reads, s.lossy_mode,
                            s.demote_after_idle_s, io_cpus, pinned_bytes=s.pinned_memory_mb << 20,
                            device_staging_bytes=s.device_staging_mb << 20, direct_writes=s.direct_writes,
                            save_threads=s.save_threads, writes=writes,
                            dtype_hint=FP8_XATTR.get(self.model.kv_cache_dtype, b"fp8_e4m3")
                            if self.model.fp8 and part.kind != "state" else None)
        worker.warm_up()
        log.info("kvfs connector worker: %s, %d layers on %s, layout %s (backend %s, vLLM %s), rank %d%s, %d "
                 "reader threads on %s", _part_name(part), len(tensors), tensors[0].device, chosen.name,
                 engine.backend, engine.vllm_version, rank, "" if writes else " (reads only: rank 0 writes)",
                 readers, "the worker's CPUs" if io_cpus is None else f"CPUs {cpus.format_cpu_list(io_cpus)}")
        return worker

    def _descriptor_extra(self, part: Part, layer_names: list[str], backend: str) -> dict:
        """What a chunk's descriptor says beyond the layout: nothing for a plain model (its chunks stay what
        they were); a part's identity for hybrid and MLA models; for fp8 caches the cache dtype, the backend
        and a digest of every layer's scales, so a chunk saved under other scales is a miss."""
        extra: dict[str, Any] = {}
        if not (len(self.model.parts) == 1 and part.kind == "full"):
            extra["part"] = _part_key(part)
            extra["chunk_tokens"] = self.chunk_size
        if self.model.fp8 and part.kind != "state":
            extra["kv_cache_dtype"] = self.model.kv_cache_dtype
            extra["backend"] = backend
            extra["kv_scales"] = self._scales_digest(layer_names)
        return extra

    def _scales_digest(self, layer_names: list[str]) -> str:
        scales = compat.layer_kv_scales(self._vllm_config, layer_names)
        if scales is None:
            raise UnsupportedModel("kvfs connector: an fp8 KV cache whose layers have no per-tensor k/v scales; "
                                   "refusing to start")
        return xxhash.xxh3_128_hexdigest(json.dumps([[k.hex(), v.hex()] for k, v in scales]).encode())

    def _refresh_scales(self) -> None:
        """fp8 scales the engine computes (calculate_kv_scales) change after start: so does the descriptor."""
        for worker in self.workers:
            if "kv_scales" not in worker.layout.extra:
                continue
            names = list(worker.layer_index)
            digest = self._scales_digest(names)
            if worker.layout.extra.get("kv_scales") != digest:
                worker.layout.extra["kv_scales"] = digest
                worker.refresh_descriptor()

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if not self.workers or not isinstance(meta, KVFSMetadata):
            return
        if self.model.fp8:
            self._refresh_scales()
        by_part: list[list[LoadSpec]] = [[] for _ in self.workers]
        for spec in meta.loads:
            by_part[spec.part].append(spec)
            if spec.asynchronous:
                self._async_parts.setdefault(spec.req_id, set()).add(spec.part)
                self._async_started = True
        for worker, specs in zip(self.workers, by_part):
            worker.start_load(specs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.workers:
            worker = self._layer_worker.get(layer_name)
            if worker is not None:
                worker.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return  # saves happen once per step, in wait_for_save, over all layers

    def wait_for_save(self):
        meta = self._connector_metadata
        if not self.workers or not isinstance(meta, KVFSMetadata):
            return
        for worker in self.workers:
            worker.finish_loads()
        if meta.saves:
            for p, worker in enumerate(self.workers):
                specs = [s for s in meta.saves if s.part == p]
                if specs:
                    worker.save(specs)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """The step's failed blocks, in this step's output: vLLM then drops what the step sampled from them. With
        defer_finalize (a draft model), vLLM asks before wait_for_save, so the step's loads are settled here.
        Hybrid models' loads are asynchronous and fail per request (get_transfer_results)."""
        failed: set[int] = set()
        for worker in self.workers:
            worker.finish_loads()  # idempotent: wait_for_save's call then finds nothing left
            failed |= worker.take_failed_blocks()
        return failed

    def _poll_async(self) -> tuple[set[str], set[str]]:
        """Requests whose asynchronous loads ended in every part, and those of them with a failed load."""
        finished: set[str] = set()
        wait_s, self._async_started = ASYNC_LOAD_WAIT_S if self._async_started else 0.0, False
        for p, worker in enumerate(self.workers):
            done, failed = worker.poll_async(wait_s)
            self._async_failed |= failed
            for req_id in done:
                parts = self._async_parts.get(req_id)
                if parts is None:
                    continue
                parts.discard(p)
                if not parts:
                    del self._async_parts[req_id]
                    finished.add(req_id)
        failed_now = finished & self._async_failed
        self._async_failed -= finished
        return finished, failed_now

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        finished, _ = self._poll_async()
        return None, finished or None

    def get_transfer_results(self, finished_req_ids: set[str]):
        """Hybrid models' loads: finished (and failed) requests. A failed one is recomputed whole by vLLM."""
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

        finished, failed = self._poll_async()
        return KVConnectorTransferResults(finished_sending=set(), finished_recving=finished, failed_recving=failed)

    def shutdown(self):
        for worker in self.workers:
            worker.shutdown()
        if self.planner is not None:
            log.info("kvfs connector: %s", self.planner.stats)


def _part_key(part: Part) -> str:
    """A part's identity, short: kind, block size, window, and a digest of its layer names."""
    layers = xxhash.xxh3_64_hexdigest("\0".join(part.layer_names).encode())
    state = f":s{xxhash.xxh3_64_hexdigest(part.state.encode())}" if part.state else ""
    return f"{part.kind}:bs{part.block_size}" + (f":w{part.window}" if part.window else "") + state + f":{layers}"


def _part_name(part: Part) -> str:
    what = "recurrent state" if part.kind == "state" else f"{part.kind} attention"
    return what + (f" (window {part.window})" if part.window else "") + f", groups {','.join(map(str, part.groups))}"


def _spec_dtype(spec) -> torch.dtype:
    """The element type a part's files hold: the cache's, or bytes for recurrent state (several dtypes)."""
    return spec.dtype if hasattr(spec, "dtype") else torch.uint8


def engine_layout_of(vllm_config: VllmConfig, spec, part: Part | None = None,
                     layer_names: list[str] | None = None) -> layouts.EngineLayout:
    """What the engine runs: its attention backend (from the worker's layers where given; on the scheduler
    the configured one, or the platform's) and, on CPU, the kernel ISA."""
    version = compat.vllm_version()
    device = compat.platform_device_type()
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    mla = part is not None and part.kind == "mla"
    if part is not None and part.kind == "state":  # the bytes as vLLM's kernels of this release keep them
        return layouts.EngineLayout(f"state:{part.state}", None, version)
    if layer_names:
        backends = {compat.attention_backend(vllm_config, n) for n in layer_names}
        if len(backends) != 1:
            raise layouts.UnknownLayout(f"vLLM {version}: the layers run several attention backends "
                                        f"{sorted(backends)}; refusing to start")
        backend = backends.pop()
    elif device == "cpu":
        backend = "CPU_MLA" if mla else "CPU_ATTN"
    else:  # the scheduler: the worker checks that its backend gives the same layout
        configured = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
        backend = getattr(configured, "name", None) or (str(configured) if configured else
                                                        "FLASHMLA" if mla else "FLASH_ATTN")
    isa = compat.cpu_attention_isa(spec, cache_dtype, vllm_config.model_config.dtype) \
        if backend == "CPU_ATTN" else None
    return layouts.EngineLayout(backend, isa, version)


def _tenant_secret(settings: Settings) -> bytes | None:
    """The HMAC key of tenant directory names: the file's bytes (at least 16), or None."""
    if settings.tenant_dir_secret_file is None:
        return None
    secret = open(settings.tenant_dir_secret_file, "rb").read()
    if len(secret) < 16:
        raise ValueError("kvfs connector: tenant_dir_secret_file must hold at least 16 bytes (head -c 32 /dev/urandom)")
    return secret


def engine_layout(vllm_config: VllmConfig, spec, part: Part | None = None) -> str:
    """The byte order of the engine's chunk payloads, as a name (part of the namespace)."""
    engine = engine_layout_of(vllm_config, spec, part)
    if part is not None and part.kind == "state":
        return f"blocks:state@vllm-{engine.vllm_minor}"
    return engine.layout_name()
