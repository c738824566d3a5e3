"""What a model's KV cache is made of, as the connector stores it: the KV-cache groups vLLM built, sorted into
parts, and the reasons a cache cannot be stored (a refusal at start, never a silent guess).

vLLM's hybrid KV cache manager (HMA) gives every group of layers its own block table. A **part** is a set of
groups whose layers are stored alike (same attention kind, window, block size and cache dtype): one chunk
file per part per chunk, so a chunk of a Gemma-3-style model (sliding window + full attention) is two files,
of a plain GQA or MLA model one. Parts of kind:

- ``full``: full attention (MHA/GQA); the file holds every block of the chunk;
- ``window``: sliding-window attention; the file holds only the chunk's last ``stored_blocks`` blocks, the
  ones a hit ending at the chunk's end needs (positions from end - window + 1 on; vLLM frees the rest, and
  puts the null block 0 in their place);
- ``mla``: multi-head latent attention (DeepSeek V2/V3, Kimi K2): one latent (kv_lora_rank + rope dims) per
  token and layer, the same on every tensor-parallel rank: one rank writes it, every rank reads it;
- ``state``: recurrent state (Mamba, GDN, linear attention) under vLLM's ``mamba_cache_mode`` "align": each
  block holds the state after the tokens up to its end. The file holds the state at the chunk's end (the
  chunk's last block, as vLLM's kernels keep it), and a hit must end exactly there: a state that already
  includes a token vLLM will recompute is never restored (vLLM PRs #44599, #51102).

Pure logic over vLLM's spec objects (matched by class name, so 0.32 and 0.34 alike); no torch needed.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any


class UnsupportedModel(ValueError):
    """This model's KV cache is one the connector cannot store faithfully: the engine does not start with it
    (unless the setting `unsupported` says "disable")."""


# per-tensor fp8: the cache holds 1-byte floats and each layer one k_scale and one v_scale (constants)
FP8_PER_TENSOR = ("fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc")
MLA_SPECS = ("MLAAttentionSpec",)
FULL_SPECS = ("FullAttentionSpec",)
WINDOW_SPECS = ("SlidingWindowSpec",)
RECURRENT_SPECS = ("MambaSpec",)


@dataclasses.dataclass(frozen=True)
class Part:
    """Layers stored together in one chunk file per chunk."""

    kind: str  # "full", "window", "mla" or "state"
    groups: tuple[int, ...]  # vLLM KV-cache group ids, in order
    layer_names: tuple[str, ...]  # every layer of those groups, in model order
    layer_groups: tuple[int, ...]  # per layer: its group's index in `groups`
    block_size: int
    num_kv_heads: int
    head_size: int
    window: int | None = None  # tokens a query attends to (sliding window), None for full attention
    state: str | None = None  # recurrent state: its kind, shapes and dtypes (what the bytes of a block mean)

    @property
    def replicated_over_tp(self) -> bool:
        """The same bytes on every tensor-parallel rank (MLA's latent): one file for all ranks."""
        return self.kind == "mla"

    def blocks_per_chunk(self, chunk_size: int) -> int:
        return chunk_size // self.block_size

    def stored_blocks(self, chunk_size: int) -> int:
        """Blocks of a chunk its file holds: all, or for a window the last ceil((window - 1) / block size):
        exactly the blocks vLLM keeps for a hit that ends at the chunk's end (tokens end - window + 1 .. end-1),
        so loading a long prefix reads only the window, never the history."""
        per_chunk = self.blocks_per_chunk(chunk_size)
        if self.kind == "state":
            return 1
        if self.kind != "window":
            return per_chunk
        return min(per_chunk, max(1, -(-(self.window - 1) // self.block_size)))

    def describe(self) -> dict:
        """What goes into the namespace and the chunk descriptor: a part's identity."""
        out: dict[str, Any] = {"kind": self.kind, "block_size": self.block_size, "layers": list(self.layer_names)}
        if self.window is not None:
            out["window"] = self.window
        if self.state is not None:
            out["state"] = self.state
        return out


@dataclasses.dataclass(frozen=True)
class ModelKV:
    parts: tuple[Part, ...]
    kv_cache_dtype: str  # vLLM's cache_dtype ("auto", "fp8_e4m3", ...)
    groups: int  # every group vLLM made (transferable or not)

    @property
    def hybrid(self) -> bool:
        """Several KV-cache groups: vLLM takes load failures only per request then (async loads)."""
        return self.groups > 1

    @property
    def has_window(self) -> bool:
        """Parts that restore only some positions (a window, or a state at a boundary)."""
        return any(p.kind in ("window", "state") for p in self.parts)

    @property
    def fp8(self) -> bool:
        return self.kv_cache_dtype in FP8_PER_TENSOR

    def chunk_multiple(self) -> int:
        """Chunks must hold whole blocks of every part."""
        return math.lcm(*(p.block_size for p in self.parts))

    def part_of_layer(self) -> dict[str, tuple[int, int]]:
        """layer name -> (part index, layer index within the part)."""
        return {name: (i, j) for i, p in enumerate(self.parts) for j, name in enumerate(p.layer_names)}


def _spec_kind(spec: Any) -> str:
    names = [c.__name__ for c in type(spec).__mro__]
    name = names[0]
    if name in MLA_SPECS:
        return "mla"
    if name in WINDOW_SPECS:
        return "window"
    if name in FULL_SPECS:
        return "window" if getattr(spec, "sliding_window", None) else "full"
    if name in RECURRENT_SPECS:
        return "state"
    return "unknown:" + name


def describe_model(kv_cache_config: Any, kv_cache_dtype: str, use_mla: bool = False,
                   context_parallel: int = 1) -> ModelKV:
    """Sort vLLM's KV-cache groups into parts, or raise UnsupportedModel naming what cannot be stored."""
    check_cache_dtype(kv_cache_dtype)
    if context_parallel > 1:
        raise UnsupportedModel(f"context parallelism ({context_parallel} ranks) splits each block's tokens across "
                               "ranks; the connector does not store such KV")
    groups = list(kv_cache_config.kv_cache_groups)
    if not groups:
        raise UnsupportedModel("the model has no KV cache groups")
    parts: dict[tuple, list[tuple[int, Any]]] = {}
    for gid, group in enumerate(groups):
        if getattr(group, "enable_kv_transfer", True) is False:
            continue  # vLLM rebuilds it from another group after a load (accelerator-side replica)
        spec = group.kv_cache_spec
        kind = _spec_kind(spec)
        if kind == "state" and getattr(spec, "mamba_cache_mode", "none") != "align":
            raise UnsupportedModel(
                f"KV-cache group {gid} holds recurrent state ({type(spec).__name__}: Mamba, GDN or linear "
                f"attention) with mamba_cache_mode {getattr(spec, 'mamba_cache_mode', None)!r}: vLLM keeps one "
                "state per request and no state at chunk boundaries, so nothing could be restored; enable "
                "prefix caching (mamba_cache_mode \"align\") (docs/connector.md, \"Models\")")
        if kind.startswith("unknown:"):
            raise UnsupportedModel(f"KV-cache group {gid} has spec {kind[8:]}, which the connector does not know "
                                   "(known: full attention, sliding window, MLA)")
        if getattr(spec, "attention_chunk_size", None):
            raise UnsupportedModel("chunked local attention (Llama 4) is not supported")
        head_v = getattr(spec, "head_size_v", None)
        if kind in ("full", "window") and head_v not in (None, spec.head_size):
            raise UnsupportedModel(f"K and V of different head sizes ({spec.head_size}, {head_v}) are not supported")
        if kind == "mla" and not use_mla:
            use_mla = True
        window = getattr(spec, "sliding_window", None) if kind == "window" else None
        if kind == "state":
            state = (f"{getattr(spec, 'mamba_type', '?')}:{list(map(list, spec.shapes))}:"
                     f"{[str(d).removeprefix('torch.') for d in spec.dtypes]}")
            key = (kind, spec.block_size, None, 0, getattr(spec, "real_page_size_bytes", spec.page_size_bytes), state)
        else:
            key = (kind, spec.block_size, window, spec.num_kv_heads, spec.head_size, str(spec.dtype))
        parts.setdefault(key, []).append((gid, group))
    out = []
    for (kind, block_size, window, heads, head_size, detail), members in parts.items():
        names: list[str] = []
        layer_groups: list[int] = []
        for slot, (_, group) in enumerate(members):
            names.extend(group.layer_names)
            layer_groups.extend([slot] * len(group.layer_names))
        order = sorted(range(len(names)), key=lambda i: layer_number(names[i]))
        out.append(Part(kind, tuple(g for g, _ in members), tuple(names[i] for i in order),
                        tuple(layer_groups[i] for i in order), block_size, heads, head_size, window,
                        detail if kind == "state" else None))
    if not out:
        raise UnsupportedModel("no KV-cache group is transferable")
    return ModelKV(tuple(sorted(out, key=_part_order)), kv_cache_dtype, len(groups))


def _part_order(p: Part) -> tuple:
    return ({"full": 0, "mla": 1, "window": 2, "state": 3}[p.kind], p.window or 0, p.groups)


def check_cache_dtype(kv_cache_dtype: str) -> None:
    """Per-tensor fp8 and unquantised caches are stored as they are; any mode that keeps scales beside the
    blocks (per token and head, block scales) or packs values is refused, naming the mode."""
    mode = str(kv_cache_dtype)
    if mode in ("auto", "bfloat16", "float16", "half", "float32", "float") or mode in FP8_PER_TENSOR:
        return
    if "per_token_head" in mode:
        raise UnsupportedModel(f"KV cache dtype {mode}: per-token-head quantisation keeps its scales in side "
                               "tensors the connector does not store; use --kv-cache-dtype fp8 (per-tensor scales) "
                               "or auto")
    raise UnsupportedModel(f"KV cache dtype {mode} is not supported (supported: auto, fp8, fp8_e4m3, fp8_e5m2)")


def layer_number(name: str) -> tuple:
    import re

    return tuple((0, int(x), "") if x.isdigit() else (1, 0, x) for x in re.split(r"(\d+)", name) if x)


def window_blocks_needed(part: Part, hit: int) -> tuple[int, int]:
    """The blocks [first, end) of a window or state part that a hit of `hit` tokens needs. A window: vLLM's
    own rule, a query at position `hit` attends to positions hit - window + 1 .. hit. A state: the block
    vLLM reads the state after `hit` tokens from, (hit - 1) // block size."""
    if part.kind == "state":
        return (hit - 1) // part.block_size, (hit - 1) // part.block_size + 1
    skipped = max(0, hit - part.window + 1)
    return skipped // part.block_size, -(-hit // part.block_size)


def restorable(parts: Sequence[Part], hit: int, stored_chunks: int, chunk_size: int) -> bool:
    """Whether every window and state part can restore a hit of `hit` tokens from the first `stored_chunks`
    chunks: the blocks it needs all lie in the stored tails of those chunks, and a state is the state after
    exactly `hit` tokens (a chunk's end)."""
    for part in parts:
        if part.kind == "state" and hit % chunk_size:
            return False
        if part.kind not in ("window", "state"):
            continue
        per_chunk = part.blocks_per_chunk(chunk_size)
        tail = part.stored_blocks(chunk_size)
        first, end = window_blocks_needed(part, hit)
        for block in range(first, end):
            chunk, offset = divmod(block, per_chunk)
            if chunk >= stored_chunks or offset < per_chunk - tail:
                return False
    return True
