"""Moving a chunk between vLLM's paged KV cache and the chunk file's payload order.

The payload is layer-major, and within a layer puts like bytes together: K then V, each as
[heads][channels][tokens] (channel-major: one channel of one head over all tokens of the chunk is contiguous).
Neighbouring values then share exponents, which is what kvfs's byte planes and entropy stages feed on.

vLLM (0.32 and later, RFC #42082) hands the connector one tensor per layer whose *logical* shape is
`[num_blocks, kv_heads, block_size, content]`; the physical order (NHD, HND, ...) is a stride permutation of it,
and `content` is the backend's business. Layouts the connector knows (`choose`), by backend:
- `cpu-vec`: CPU_ATTN with the portable kernels (ISA vec): content = 2*head_size, but inside
  each (block, head) K is transposed as `[head_size][block_size]`, then V as `[block_size][head_size]`
  (verified bit-exact against the model's KV). numpy copies, CPU tensors only.
- `token-kv`: FLASH_ATTN, FLASHINFER, TRITON_ATTN, FLEX_ATTENTION (unquantised): content = K then V of one
  token, `[K(head_size) | V(head_size)]`. torch gathers and scatters on the tensors' own device (a GPU's, or the
  CPU's in tests), so one code path serves both.
- `blocks:cpu-<isa>@vllm-<minor>`: CPU_ATTN with another ISA (AMX, vec16, neon, ... pack block interiors their own
  way): the logical block's bytes as they are. Bit-exact, only loadable into the same backend and ISA, and the
  same vLLM minor version (a release may change how its kernels pack a block; the descriptor says which).
Anything else — another backend, or a tensor whose shape is not what its backend's layout says — is refused
(UnknownLayout) at engine start: guessing where the block dimension is would store other bytes than the KV.
The layout name and geometry go into the namespace and every file's descriptor, so chunks of different
layouts never mix.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Iterator

import numpy as np
import torch

DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.uint8: "u8"}


@dataclasses.dataclass(frozen=True)
class Geometry:
    num_layers: int
    num_kv_heads: int
    head_size: int
    block_size: int
    chunk_size: int  # tokens per chunk file, a multiple of block_size
    dtype: torch.dtype

    @property
    def blocks_per_chunk(self) -> int:
        return self.chunk_size // self.block_size


_SAME_SIZE_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def as_numpy(t: torch.Tensor, *shape: int) -> np.ndarray:
    """A numpy view of a tensor's elements as integers of the same size (bf16 has no numpy dtype): copies
    through it move bits exactly, NaN payloads and -0.0 included. Reshaped to `shape` where given."""
    a = t.view(_SAME_SIZE_INT[t.element_size()]).numpy()
    return view_as(a, *shape) if shape else a


def view_as(a: np.ndarray, *shape: int) -> np.ndarray:
    """`a` reshaped without copying, or ValueError: a copy of the paged cache would silently swallow the
    writes made into it (numpy's reshape copies when it must)."""
    try:
        if _RESHAPE_HAS_COPY:
            return np.reshape(a, shape, copy=False)
        v = a.view()
        v.shape = shape  # numpy < 2.1 (deprecated from 2.5): refuses a copy the same way
        return v
    except (ValueError, AttributeError) as e:
        raise ValueError(f"cannot view {a.shape} (strides {a.strides}) as {shape} without a copy") from e


_RESHAPE_HAS_COPY = "copy" in inspect.signature(np.reshape).parameters


class UnknownLayout(RuntimeError):
    """The engine's KV cache is laid out in a way the connector does not know: it refuses to start."""


class ChunkLayout:
    """Gathers a chunk's blocks out of the paged cache into payload order, and scatters them back, a layer at
    a time. Payloads are layer-major: layer l is elements [l * layer_elements, (l+1) * layer_elements)."""

    name = "abstract"
    order = ""

    def __init__(self, geometry: Geometry, block_shape: tuple[int, ...]) -> None:
        self.g = geometry
        self.block_shape = tuple(block_shape)  # per-layer tensor shape without the block dimension
        # per layer: which of the part's KV-cache groups (block tables) it belongs to (model.Part.layer_groups)
        self.layer_groups: tuple[int, ...] = (0,) * geometry.num_layers
        self.extra: dict = {}  # what else the descriptor says (the part, a window, fp8 scales...)

    @property
    def block_elements(self) -> int:
        n = 1
        for d in self.block_shape:
            n *= d
        return n

    @property
    def layer_elements(self) -> int:
        return self.g.blocks_per_chunk * self.block_elements

    @property
    def payload_elements(self) -> int:
        return self.g.num_layers * self.layer_elements

    @property
    def payload_bytes(self) -> int:
        return self.payload_elements * self.g.dtype.itemsize

    def descriptor(self) -> dict:
        g = self.g
        return {"layout": self.name, "dtype": str(g.dtype).removeprefix("torch."), "layers": g.num_layers,
                "kv_heads": g.num_kv_heads, "head_size": g.head_size, "block_size": g.block_size,
                "chunk_size": g.chunk_size, "block_shape": list(self.block_shape), "order": self.order,
                **self.extra}

    def shape_hint(self, payload_offset: int) -> str:
        g = self.g
        return (f"offset={payload_offset} layer={g.num_layers} kv=2 head={g.num_kv_heads} "
                f"channel={g.head_size} token={g.chunk_size}")

    def layer_slice(self, payload: torch.Tensor, layer: int) -> torch.Tensor:
        return payload[layer * self.layer_elements:(layer + 1) * self.layer_elements]

    def gather(self, kv_layers: list[torch.Tensor], block_ids: list[int]) -> torch.Tensor:
        """A new contiguous tensor (on the cache's device) with the chunk's payload."""
        out = torch.empty(self.payload_elements, dtype=self.g.dtype, device=kv_layers[0].device)
        self.gather_into(kv_layers, block_ids, out)
        return out

    def gather_into(self, kv_layers: list[torch.Tensor], block_ids, out: torch.Tensor) -> None:
        """Copy the chunk's blocks, every layer, into `out` (payload order, on the cache's device). block_ids:
        one list for every layer, or one list per KV-cache group of the part (layer_groups picks)."""
        ids = self.group_index(block_ids, kv_layers[0].device)
        for layer, kv in enumerate(kv_layers):
            self.gather_layer(kv, ids[self.layer_groups[layer]], self.layer_slice(out, layer))

    def scatter(self, kv_layers: list[torch.Tensor], payload: torch.Tensor, block_ids, first: int,
                end: int) -> None:
        """Write blocks `first..end` of a chunk (payload order), every layer, into `block_ids[first:end]`."""
        ids = self.group_index(block_ids, kv_layers[0].device)
        for _ in self.scatter_layers(kv_layers, payload, ids, first, end):
            pass

    def scatter_layers(self, kv_layers: list[torch.Tensor], payload: torch.Tensor, ids: list, first: int,
                       end: int) -> Iterator[int]:
        """scatter, a layer at a time (ids: group_index's): yields each layer once its copies are done (or
        queued, on a GPU)."""
        for layer, kv in enumerate(kv_layers):
            self.scatter_layer(kv, self.layer_slice(payload, layer), ids[self.layer_groups[layer]], first, end)
            yield layer

    def group_index(self, block_ids, device: torch.device) -> list:
        """index() of each group's block ids: [ids] for a flat list. Block 0 is vLLM's null block (positions
        outside a sliding window): it is never read into a file nor written from one."""
        groups = block_ids if len(block_ids) and isinstance(block_ids[0], (list, tuple)) else [block_ids]
        if len(groups) != max(self.layer_groups) + 1:
            raise ValueError(f"{len(groups)} block tables for a part of {max(self.layer_groups) + 1} groups")
        return [self.index(list(ids), device) for ids in groups]

    def batch_sources(self, flat: torch.Tensor, n: int):
        """n whole chunks' payloads, back to back in `flat`, as scatter_batch_layer reads them."""
        raise NotImplementedError(f"layout {self.name} has no batched scatter")

    def scatter_batch_layer(self, kv: torch.Tensor, sources, layer: int, ids) -> None:
        """One layer of n whole chunks (batch_sources) into blocks `ids` (the chunks' block ids, in order)."""
        raise NotImplementedError(f"layout {self.name} has no batched scatter")

    def index(self, block_ids: list[int], device: torch.device):
        """The block ids in the form gather_layer and scatter_layer take (made once per chunk). For a GPU
        through pinned memory from torch's caching host allocator: a copy from pageable memory would wait
        for the whole stream."""
        ids = torch.tensor(block_ids, dtype=torch.long)
        if device.type == "cuda":
            ids = ids.pin_memory()
        return ids.to(device, non_blocking=True)

    def gather_layer(self, kv: torch.Tensor, ids, out: torch.Tensor) -> None:
        raise NotImplementedError

    def scatter_layer(self, kv: torch.Tensor, src: torch.Tensor, ids, first: int, end: int) -> None:
        """Blocks first..end of one layer's payload `src` (same device as `kv`) into blocks ids[first:end]."""
        raise NotImplementedError


class CpuVecLayout(ChunkLayout):
    """numpy copies through integer views: several times faster here than torch's index_copy_ and permuted
    copies, and bit-exact (NaN payloads, -0.0). The cache must be viewable as [blocks][heads][2*bs*D]."""

    name = "cpu-vec"
    order = "layer,kv,head,channel,token"

    def __init__(self, geometry: Geometry, block_shape: tuple[int, ...]) -> None:
        super().__init__(geometry, block_shape)
        g = geometry
        if self.block_shape != (g.num_kv_heads, g.block_size, 2 * g.head_size):
            raise UnknownLayout(f"unexpected CPU KV block shape {self.block_shape}")

    def index(self, block_ids, device):
        return list(block_ids)

    def _pairs(self, kv: torch.Tensor, payload: torch.Tensor, ids: list[int], first: int,
               end: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        g = self.g
        H, D, bs = g.num_kv_heads, g.head_size, g.block_size
        p = as_numpy(payload, 2, H, D, g.blocks_per_chunk, bs)
        blocks = as_numpy(kv, kv.shape[0], H, 2 * bs * D)
        for j in range(first, end):
            block = blocks[ids[j]]
            yield p[0, :, :, j], view_as(block[:, :bs * D], H, D, bs)  # K^T [D][bs]: runs of bs
            yield p[1, :, :, j], view_as(block[:, bs * D:], H, bs, D).transpose(0, 2, 1)  # V [bs][D]

    def gather_layer(self, kv, ids, out):
        for part, block in self._pairs(kv, out, ids, 0, len(ids)):
            np.copyto(part, block)

    def scatter_layer(self, kv, src, ids, first, end):
        for part, block in self._pairs(kv, src, ids, first, end):
            np.copyto(block, part)


class TokenKVLayout(ChunkLayout):
    """GPU backends whose content is [K | V] per token. One index_select (or index_copy_) and one permuted
    copy per layer, on the cache's device: the same code on a GPU (on whatever stream is current) and on
    the CPU."""

    name = "token-kv"
    order = "layer,kv,head,channel,token"

    def __init__(self, geometry: Geometry, block_shape: tuple[int, ...]) -> None:
        super().__init__(geometry, block_shape)
        g = geometry
        if self.block_shape != (g.num_kv_heads, g.block_size, 2 * g.head_size):
            raise UnknownLayout(f"unexpected KV block shape {self.block_shape}")

    def _split(self, kv: torch.Tensor) -> torch.Tensor:
        return kv.unflatten(-1, (2, self.g.head_size))  # [blocks, H, bs, kv, D]: a view (content is innermost)

    def _payload(self, flat: torch.Tensor) -> torch.Tensor:
        g = self.g
        return flat.view(2, g.num_kv_heads, g.head_size, g.blocks_per_chunk, g.block_size)  # kv, H, D, block, token

    def gather_layer(self, kv, ids, out):
        blocks = self._split(kv).index_select(0, ids)  # [n, H, bs, kv, D]
        self._payload(out).copy_(blocks.permute(3, 1, 4, 0, 2))

    def scatter_layer(self, kv, src, ids, first, end):
        part = self._payload(src)[:, :, :, first:end].permute(3, 1, 4, 0, 2)  # [n, H, bs, kv, D]
        self._split(kv).index_copy_(0, ids[first:end], part)

    def scatter_layers(self, kv_layers, payload, ids, first, end):
        # the views made once per chunk, not per layer: on a GPU each torch call costs host time under the GIL
        g = self.g
        parts = payload.view(g.num_layers, 2, g.num_kv_heads, g.head_size, g.blocks_per_chunk, g.block_size)
        parts = parts[:, :, :, :, first:end].permute(0, 4, 2, 5, 1, 3)  # [layer, n, H, bs, kv, D]
        ids = [i[first:end] for i in ids]
        for layer, kv in enumerate(kv_layers):
            self._split(kv).index_copy_(0, ids[self.layer_groups[layer]], parts[layer])
            yield layer

    def batch_sources(self, flat, n):
        g = self.g
        return flat.view(n, g.num_layers, 2, g.num_kv_heads, g.head_size, g.blocks_per_chunk, g.block_size)

    def scatter_batch_layer(self, kv, sources, layer, ids):
        g = self.g
        part = sources[:, layer].permute(0, 4, 2, 5, 1, 3).reshape(-1, g.num_kv_heads, g.block_size, 2, g.head_size)
        self._split(kv).index_copy_(0, ids, part)


class MlaLayout(ChunkLayout):
    """MLA: one latent per token and layer (kv_lora_rank + rope dims, e.g. 512 + 64 = 576), no K/V split and
    no heads. vLLM's MLA backends (CPU_MLA, AMX_MLA, FLASHMLA, CUTLASS_MLA, TRITON_MLA, FLASHINFER_MLA, FLASH_ATTN_MLA)
    all hold `[num_blocks, block_size, latent]`. The payload is channel-major per layer, [latent][tokens]: one
    channel over all the chunk's tokens is contiguous. torch copies on the cache's device."""

    name = "mla-latent"
    order = "layer,channel,token"

    def __init__(self, geometry: Geometry, block_shape: tuple[int, ...]) -> None:
        super().__init__(geometry, block_shape)
        g = geometry
        if self.block_shape not in ((g.block_size, g.head_size), (1, g.block_size, g.head_size)):
            raise UnknownLayout(f"unexpected MLA KV block shape {self.block_shape}")

    def shape_hint(self, payload_offset: int) -> str:
        g = self.g
        return f"offset={payload_offset} layer={g.num_layers} channel={g.head_size} token={g.chunk_size}"

    def _blocks(self, kv: torch.Tensor) -> torch.Tensor:
        return kv if kv.dim() == 3 else kv.select(1, 0)  # [blocks, bs, latent]: a view

    def _payload(self, flat: torch.Tensor) -> torch.Tensor:
        g = self.g
        return flat.view(g.head_size, g.blocks_per_chunk, g.block_size)  # latent, block, token

    def gather_layer(self, kv, ids, out):
        self._payload(out).copy_(self._blocks(kv).index_select(0, ids).permute(2, 0, 1))

    def scatter_layer(self, kv, src, ids, first, end):
        self._blocks(kv).index_copy_(0, ids[first:end], self._payload(src)[:, first:end].permute(1, 2, 0))

    def batch_sources(self, flat, n):
        g = self.g
        return flat.view(n, g.num_layers, g.head_size, g.blocks_per_chunk, g.block_size)

    def scatter_batch_layer(self, kv, sources, layer, ids):
        g = self.g
        part = sources[:, layer].permute(0, 2, 3, 1).reshape(-1, g.block_size, g.head_size)
        self._blocks(kv).index_copy_(0, ids, part)


class BlockBytesLayout(ChunkLayout):
    """A logical block's elements as the backend holds them (only into the same backend and ISA)."""

    name = "blocks"
    order = "layer,block,<engine block layout>"

    def __init__(self, geometry: Geometry, block_shape: tuple[int, ...], name: str) -> None:
        super().__init__(geometry, block_shape)
        self.name = name

    def shape_hint(self, payload_offset: int) -> str:
        return f"offset={payload_offset} layer={self.g.num_layers} block={self.g.blocks_per_chunk} " \
               f"element={self.block_elements}"

    def _blocks(self, flat: torch.Tensor) -> torch.Tensor:
        return flat.view(self.g.blocks_per_chunk, *self.block_shape)

    def gather_layer(self, kv, ids, out):
        torch.index_select(kv, 0, ids, out=self._blocks(out))

    def scatter_layer(self, kv, src, ids, first, end):
        kv.index_copy_(0, ids[first:end], self._blocks(src)[first:end])

    def batch_sources(self, flat, n):
        return flat.view(n, self.g.num_layers, self.g.blocks_per_chunk, *self.block_shape)

    def scatter_batch_layer(self, kv, sources, layer, ids):
        kv.index_copy_(0, ids, sources[:, layer].reshape(-1, *self.block_shape))


TOKEN_KV_BACKENDS = ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION")
MLA_BACKENDS = ("CPU_MLA", "AMX_MLA", "FLASHMLA", "CUTLASS_MLA", "TRITON_MLA", "FLASHINFER_MLA", "FLASH_ATTN_MLA")
VEC_ISAS = ("vec",)  # the portable kernels' packing, verified bit-exact; other ISAs: opaque block bytes


@dataclasses.dataclass(frozen=True)
class EngineLayout:
    """What the engine says about its KV cache: the attention backend's name and, on CPU, its kernel ISA."""

    backend: str
    isa: str | None = None
    vllm_version: str = "?"

    @property
    def vllm_minor(self) -> str:
        """'0.32' of '0.32.0+cpu'."""
        return ".".join(self.vllm_version.split("+")[0].split(".")[:2])

    def layout_name(self) -> str:
        """The layout the connector would use, or UnknownLayout. The same answer on the scheduler and the
        worker, so it names the namespace."""
        if self.backend in MLA_BACKENDS:
            return MlaLayout.name
        if self.backend == "CPU_ATTN":
            if self.isa in VEC_ISAS:
                return CpuVecLayout.name
            if self.isa:  # bytes as vLLM's C++ kernels pack them: a release may repack, so its minor version too
                return f"blocks:cpu-{self.isa}@vllm-{self.vllm_minor}"
        elif self.backend in TOKEN_KV_BACKENDS:
            return TokenKVLayout.name
        raise UnknownLayout(
            f"vLLM {self.vllm_version}: attention backend {self.backend}"
            + (f" (ISA {self.isa})" if self.isa else "")
            + f" has a KV cache layout kvfs_connector does not know (known: CPU_ATTN, "
            f"{', '.join(TOKEN_KV_BACKENDS + MLA_BACKENDS)});"
            " refusing to start rather than guess where its blocks are")


def choose(geometry: Geometry, tensor_shape: tuple[int, ...], engine: EngineLayout) -> ChunkLayout:
    """The layout for this engine's cache tensors (shape of one layer's tensor), or UnknownLayout."""
    name = engine.layout_name()
    g = geometry
    if name == MlaLayout.name:
        if len(tensor_shape) not in (3, 4) or tuple(tensor_shape[-2:]) != (g.block_size, g.head_size):
            raise UnknownLayout(
                f"vLLM {engine.vllm_version}: MLA backend {engine.backend} gave a KV cache tensor of shape "
                f"{tuple(tensor_shape)}; kvfs_connector knows [num_blocks, block size {g.block_size}, latent "
                f"{g.head_size}] and refuses to start rather than guess")
        return MlaLayout(geometry, tuple(tensor_shape[1:]))
    expected = (g.num_kv_heads, g.block_size, 2 * g.head_size)  # [blocks, H, bs, content] (RFC #42082)
    if len(tensor_shape) != 4 or tuple(tensor_shape[1:]) != expected:
        raise UnknownLayout(
            f"vLLM {engine.vllm_version}: attention backend {engine.backend} gave a KV cache tensor of shape "
            f"{tuple(tensor_shape)}; kvfs_connector knows [num_blocks, {g.num_kv_heads} kv heads, block size "
            f"{g.block_size}, 2 x head size {g.head_size}] and refuses to start rather than guess")
    block_shape = tuple(tensor_shape[1:])
    if name == CpuVecLayout.name:
        return CpuVecLayout(geometry, block_shape)
    if name == TokenKVLayout.name:
        return TokenKVLayout(geometry, block_shape)
    return BlockBytesLayout(geometry, block_shape, name)
