"""KVFSConnector: vLLM's v1 connector API on top of the planner (scheduler side) and the worker side."""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from . import compat, cpus
from . import layout as layouts
from .mount import MountGuard
from .naming import NamespaceKey, seed_identity
from .plan import LoadSpec, Planner, SaveSpec
from .settings import Settings
from .worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = logging.getLogger("vllm.kvfs_connector")


@dataclasses.dataclass
class KVFSMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = dataclasses.field(default_factory=list)
    saves: list[SaveSpec] = dataclasses.field(default_factory=list)


class KVFSConnector(KVConnectorBase_V1):
    """Stores every full chunk of tokens' KV as a file in a kvfs mount and loads the longest existing prefix."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        compat.check_api(KVConnectorBase_V1)  # an interface it does not know: the engine stops here
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.settings = Settings.from_extra(self._kv_transfer_config.kv_connector_extra_config)
        self.guard = MountGuard(self.settings.mount, self.settings.require_mount)
        self.disabled_reason = unsupported(vllm_config, kv_cache_config)
        self.planner: Planner | None = None
        self.worker: WorkerSide | None = None
        if self.disabled_reason:
            log.warning("kvfs connector disabled: %s; the engine runs without it", self.disabled_reason)
            return
        spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
        self.block_size = spec.block_size
        self.chunk_size = self.settings.chunk_tokens(self.block_size)
        self.kv_dtype = spec.dtype
        self.layout_name = engine_layout(vllm_config, spec)
        if role == KVConnectorRole.SCHEDULER:
            if self.settings.on_load_error == "recompute":
                # a cache miss must never fail a request: chunks that fail to load are recomputed
                self._kv_transfer_config.kv_load_failure_policy = "recompute"
            hash_block_size = getattr(kv_cache_config, "hash_block_size", None) or self.block_size
            if self.chunk_size % hash_block_size:
                self.disabled_reason = f"chunk size {self.chunk_size} is not a multiple of the hash block size"
                log.warning("kvfs connector disabled: %s", self.disabled_reason)
                return
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
                                   record_blocks=self.settings.record_blocks)
            log.info("kvfs connector: %s, chunks of %d tokens, layout %s", self.guard.path, self.chunk_size,
                     self.layout_name)

    # wait_for_layer_load makes the forward stream wait on CUDA events between layers: Python must run there,
    # which full CUDA graphs would skip on replay (vLLM then captures piecewise graphs, attention outside).
    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return True

    # A cache: a save that never happens is a later miss, not a lost hand-off.
    @property
    def requires_kv_delivery(self) -> bool:
        return False

    def _namespaces(self) -> list[str]:
        cfg = self._vllm_config
        pc = cfg.parallel_config
        none_hash = compat.none_hash()  # set by the engine core before the first request
        if os.environ.get("PYTHONHASHSEED") is None and cfg.cache_config.prefix_caching_hash_algo not in (
                "sha256", "sha256_cbor"):
            log.warning("kvfs connector: hash algorithm %s without PYTHONHASHSEED: block hashes are random per "
                        "process, so no other engine process can reuse these chunks",
                        cfg.cache_config.prefix_caching_hash_algo)
        spec = self._kv_cache_config.kv_cache_groups[0].kv_cache_spec
        out = []
        for pp_rank in range(pc.pipeline_parallel_size):
            for tp_rank in range(pc.tensor_parallel_size):
                key = NamespaceKey(
                    model=str(cfg.model_config.model), dtype=str(self.kv_dtype).removeprefix("torch."),
                    num_layers=cfg.model_config.get_total_num_hidden_layers(), num_kv_heads=spec.num_kv_heads,
                    head_size=spec.head_size, block_size=self.block_size, chunk_size=self.chunk_size,
                    layout=self.layout_name, tp_rank=tp_rank, tp_size=pc.tensor_parallel_size,
                    pp_rank=pp_rank, pp_size=pc.pipeline_parallel_size,
                    hash_algo=cfg.cache_config.prefix_caching_hash_algo, hash_seed_id=seed_identity(none_hash),
                    **({} if self.settings.lossy_mode == "none" else {"lossy": self.settings.lossy_mode}))
                out.append(key.namespace())
        return out

    # -- scheduler side ----------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self.planner is None:
            return 0, False
        return self.planner.lookup(request, num_computed_tokens), False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        if self.planner is not None:
            self.planner.allocated(request, blocks.get_block_ids()[0], num_external_tokens)

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

    # -- worker side -------------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        if self.disabled_reason:
            return
        names = self._kv_cache_config.kv_cache_groups[0].layer_names
        ordered = sorted((n for n in names if n in kv_caches), key=_layer_number)
        tensors = [kv_caches[n] for n in ordered]
        spec = self._kv_cache_config.kv_cache_groups[0].kv_cache_spec
        geometry = layouts.Geometry(len(tensors), spec.num_kv_heads, spec.head_size, self.block_size,
                                    self.chunk_size, self.kv_dtype)
        engine = engine_layout_of(self._vllm_config, spec, ordered)
        chosen = layouts.choose(geometry, tuple(tensors[0].shape), engine)  # UnknownLayout stops the engine
        if chosen.name != self.layout_name:
            raise layouts.UnknownLayout(
                f"vLLM {engine.vllm_version}: the worker's KV cache layout is {chosen.name} (backend "
                f"{engine.backend}), the scheduler expected {self.layout_name}; refusing to start")
        odd = [n for n, t in zip(ordered, tensors) if t.shape != tensors[0].shape or t.device != tensors[0].device]
        if odd:
            raise layouts.UnknownLayout(f"vLLM {engine.vllm_version}: layers {odd[:3]} have other KV cache shapes "
                                        f"or devices than {ordered[0]}; refusing to start")
        try:
            chosen.gather(tensors, [0] * geometry.blocks_per_chunk)  # the cache can be read in block order
        except ValueError as e:
            raise layouts.UnknownLayout(f"vLLM {engine.vllm_version}: KV cache of layout {chosen.name} cannot "
                                        f"be copied without a copy of the cache: {e}") from e
        rank = compat.worker_rank()
        io_cpus = cpus.io_cpus(self.settings.io_cpus)  # after vLLM bound this worker: "auto" compares with it
        s = self.settings
        readers = s.io_thread_count(tensors[0].is_cuda, len(io_cpus or os.sched_getaffinity(0)))
        self.worker = WorkerSide(chosen, tensors, {n: i for i, n in enumerate(ordered)}, rank, self.guard,
                                 readers, s.max_pending_save_mb << 20, s.direct_reads, s.lossy_mode,
                                 s.demote_after_idle_s, io_cpus, pinned_bytes=s.pinned_memory_mb << 20,
                                 device_staging_bytes=s.device_staging_mb << 20, direct_writes=s.direct_writes,
                                 save_threads=s.save_threads)
        self.worker.warm_up()
        log.info("kvfs connector worker: %d layers on %s, layout %s (backend %s, vLLM %s), rank %d, %d reader "
                 "threads on %s", len(tensors), tensors[0].device, chosen.name, engine.backend, engine.vllm_version,
                 rank, readers,
                 "the worker's CPUs" if io_cpus is None else f"CPUs {cpus.format_cpu_list(io_cpus)}")

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if self.worker is not None and isinstance(meta, KVFSMetadata) and meta.loads:
            self.worker.start_load(meta.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.worker is not None:
            self.worker.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return  # saves happen once per step, in wait_for_save, over all layers

    def wait_for_save(self):
        meta = self._connector_metadata
        if self.worker is None or not isinstance(meta, KVFSMetadata):
            return
        self.worker.finish_loads()
        if meta.saves:
            self.worker.save(meta.saves)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """The step's failed blocks, in this step's output: vLLM then drops what the step sampled from them. With
        defer_finalize (a draft model), vLLM asks before wait_for_save, so the step's loads are settled here."""
        if self.worker is None:
            return set()
        self.worker.finish_loads()  # idempotent: wait_for_save's call then finds nothing left
        return self.worker.take_failed_blocks()

    def shutdown(self):
        if self.worker is not None:
            self.worker.shutdown()
        if self.planner is not None:
            log.info("kvfs connector: %s", self.planner.stats)


def _layer_number(name: str) -> tuple:
    return tuple(int(x) if x.isdigit() else x for x in re.split(r"(\d+)", name))


def unsupported(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> str | None:
    """Why this model or cache layout cannot use the connector (None if it can)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    mc = vllm_config.model_config
    groups = kv_cache_config.kv_cache_groups
    if getattr(mc, "use_mla", False) or any(isinstance(g.kv_cache_spec, MLAAttentionSpec) for g in groups):
        return "MLA attention is not supported"
    if len(groups) != 1:
        return f"{len(groups)} KV-cache groups (hybrid or sliding-window models) are not supported"
    spec = groups[0].kv_cache_spec
    if not isinstance(spec, FullAttentionSpec) or getattr(spec, "sliding_window", None):
        return f"KV cache spec {type(spec).__name__} (sliding window or non-attention layers) is not supported"
    if getattr(mc, "get_sliding_window", lambda: None)():
        return "sliding-window attention is not supported"
    if getattr(spec, "head_size_v", None) not in (None, spec.head_size):
        return "K and V of different head sizes are not supported"
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    if cache_dtype != "auto":
        return f"KV cache dtype {cache_dtype} (quantised KV) is not supported"
    return None


def engine_layout_of(vllm_config: VllmConfig, spec, layer_names: list[str] | None = None) -> layouts.EngineLayout:
    """What the engine runs: its attention backend (from the worker's layers where given; on the scheduler
    the configured one, or the platform's) and, on CPU, the kernel ISA."""
    version = compat.vllm_version()
    device = compat.platform_device_type()
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    if layer_names:
        backends = {compat.attention_backend(vllm_config, n) for n in layer_names}
        if len(backends) != 1:
            raise layouts.UnknownLayout(f"vLLM {version}: the layers run several attention backends "
                                        f"{sorted(backends)}; refusing to start")
        backend = backends.pop()
    elif device == "cpu":
        backend = "CPU_ATTN"
    else:  # the scheduler: the worker checks that its backend gives the same layout
        configured = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
        backend = getattr(configured, "name", None) or (str(configured) if configured else "FLASH_ATTN")
    isa = compat.cpu_attention_isa(spec, cache_dtype) if backend == "CPU_ATTN" else None
    return layouts.EngineLayout(backend, isa, version)


def _tenant_secret(settings: Settings) -> bytes | None:
    """The HMAC key of tenant directory names: the file's bytes (at least 16), or None."""
    if settings.tenant_dir_secret_file is None:
        return None
    secret = open(settings.tenant_dir_secret_file, "rb").read()
    if len(secret) < 16:
        raise ValueError("kvfs connector: tenant_dir_secret_file must hold at least 16 bytes (head -c 32 /dev/urandom)")
    return secret


def engine_layout(vllm_config: VllmConfig, spec) -> str:
    """The byte order of the engine's chunk payloads, as a name (part of the namespace)."""
    return engine_layout_of(vllm_config, spec).layout_name()
