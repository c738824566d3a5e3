"""Moving a chunk between vLLM's paged KV cache and the chunk file's payload order.

The payload puts like bytes together: per layer, K then V, each as [heads][channels][tokens] (channel-major:
one channel of one head over all tokens of the chunk is contiguous). Neighbouring values then share exponents,
which is what kvfs's byte planes and entropy stages feed on.

Layouts the connector knows:
- `cpu-vec`: vLLM's CPU attention backend with the portable kernels (ISA vec/vec16/neon/...): one tensor per
  layer `[num_blocks, kv_heads, block_size, 2*head_size]`; inside each (block, head) K transposed as
  `[head_size][block_size]`, then V as `[block_size][head_size]` (verified bit-exact against the model's KV).
  Reorganised to channel-major K and V.
- `blocks`: any other per-layer tensor whose first dimension is the block (GPU backends, AMX packing): the
  block's bytes are stored as they are, in layer and block order. Bit-exact, just not reorganised.
The layout name and geometry go into the namespace and every file's descriptor, so chunks of different
layouts never mix. gather runs on the worker's forward thread, scatter in its reader threads; both only copy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np
import torch

DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


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
    v = a.view()
    try:
        v.shape = shape
    except AttributeError as e:
        raise ValueError(f"cannot view {a.shape} (strides {a.strides}) as {shape} without a copy") from e
    return v


class ChunkLayout:
    """Gathers a chunk's blocks out of the paged cache into payload order, and scatters them back."""

    name = "abstract"

    def __init__(self, geometry: Geometry, block_shape: tuple[int, ...]) -> None:
        self.g = geometry
        self.block_shape = tuple(block_shape)  # per-layer tensor shape without the block dimension

    @property
    def block_elements(self) -> int:
        n = 1
        for d in self.block_shape:
            n *= d
        return n

    @property
    def payload_elements(self) -> int:
        return self.g.num_layers * self.g.blocks_per_chunk * self.block_elements

    def descriptor(self) -> dict:
        g = self.g
        return {"layout": self.name, "dtype": str(g.dtype).removeprefix("torch."), "layers": g.num_layers,
                "kv_heads": g.num_kv_heads, "head_size": g.head_size, "block_size": g.block_size,
                "chunk_size": g.chunk_size, "block_shape": list(self.block_shape), "order": self.order}

    order = ""

    def shape_hint(self, payload_offset: int) -> str:
        raise NotImplementedError

    def gather(self, kv_layers: list[torch.Tensor], block_ids: list[int]) -> torch.Tensor:
        """A new contiguous tensor with the chunk's payload (a copy: vLLM may reuse the blocks at once)."""
        out = torch.empty(self.payload_elements, dtype=self.g.dtype)
        for part, block in self._pairs(kv_layers, out, block_ids, 0, len(block_ids)):
            np.copyto(part, block)
        return out

    def scatter(self, kv_layers: list[torch.Tensor], payload: torch.Tensor, block_ids: list[int], first: int,
                end: int) -> None:
        """Write blocks `first..end` of a chunk (payload order), every layer, into `block_ids[first:end]` of the
        paged cache."""
        for part, block in self._pairs(kv_layers, payload, block_ids, first, end):
            np.copyto(block, part)

    def _pairs(self, kv_layers: list[torch.Tensor], payload: torch.Tensor, block_ids: list[int], first: int,
               end: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(payload part, paged-cache part) views of equal shape covering chunk blocks first..end of every
        layer. Copies between them are numpy's: several times faster here than torch's index_copy_ and
        permuted copies, and bit-exact through integer views."""
        raise NotImplementedError

    def payload_view(self, buf) -> torch.Tensor:
        t = torch.frombuffer(buf, dtype=self.g.dtype, count=self.payload_elements)
        return t


class CpuVecLayout(ChunkLayout):
    name = "cpu-vec"
    order = "layer,kv,head,channel,token"

    def __init__(self, geometry: Geometry, block_shape: tuple[int, ...]) -> None:
        super().__init__(geometry, block_shape)
        g = geometry
        if self.block_shape != (g.num_kv_heads, g.block_size, 2 * g.head_size):
            raise ValueError(f"unexpected CPU KV block shape {self.block_shape}")

    def shape_hint(self, payload_offset: int) -> str:
        g = self.g
        return (f"offset={payload_offset} layer={g.num_layers} kv=2 head={g.num_kv_heads} "
                f"channel={g.head_size} token={g.chunk_size}")

    def _pairs(self, kv_layers, payload, block_ids, first, end):
        g = self.g
        H, D, bs = g.num_kv_heads, g.head_size, g.block_size
        p = as_numpy(payload, g.num_layers, 2, H, D, g.blocks_per_chunk, bs)
        for layer, kv in enumerate(kv_layers):
            blocks = as_numpy(kv, kv.shape[0], H, 2 * bs * D)
            for j in range(first, end):
                block = blocks[block_ids[j]]
                yield p[layer, 0, :, :, j], view_as(block[:, :bs * D], H, D, bs)  # K^T [D][bs]: runs of bs
                yield p[layer, 1, :, :, j], view_as(block[:, bs * D:], H, bs, D).transpose(0, 2, 1)  # V [bs][D]


class BlockBytesLayout(ChunkLayout):
    name = "blocks"
    order = "layer,block,<engine block layout>"

    def shape_hint(self, payload_offset: int) -> str:
        return f"offset={payload_offset} layer={self.g.num_layers} block={self.g.blocks_per_chunk} " \
               f"element={self.block_elements}"

    def _pairs(self, kv_layers, payload, block_ids, first, end):
        p = as_numpy(payload, self.g.num_layers, self.g.blocks_per_chunk, *self.block_shape)
        for layer, kv in enumerate(kv_layers):
            blocks = as_numpy(kv)
            for j in range(first, end):
                yield p[layer, j], blocks[block_ids[j]]


def choose(geometry: Geometry, block_shape: tuple[int, ...], backend: str) -> ChunkLayout:
    """The layout for this engine: reorganised where the byte order is known, block bytes otherwise."""
    if backend == "cpu-vec":
        return CpuVecLayout(geometry, block_shape)
    return BlockBytesLayout(geometry, block_shape)
