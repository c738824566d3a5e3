"""The connector's settings, from `kv_connector_extra_config`; bad values are a clear error at start."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from kvfs import lossy

from . import cpus

DEFAULT_CHUNK_TOKENS = 256
GPU_IO_THREADS, CPU_IO_THREADS = 8, 4


@dataclasses.dataclass(frozen=True)
class Settings:
    mount: str
    chunk_size: int | None = None  # tokens per file; None = 256 rounded up to a multiple of the block size
    on_load_error: str = "recompute"  # or "fail": vLLM's own default, which fails the request
    require_mount: bool = True  # only use `mount` while it is a mount point (never fill the disk under it)
    save_decode: bool = True  # also save chunks completed while decoding (the next turn reuses them)
    io_threads: int | None = None  # reader threads; None: 8 for a GPU cache, 4 for a CPU one (io_thread_count)
    io_cpus: str = "worker"  # CPUs of the reader/writer threads: "worker", "auto" or a list like "0-3,8" (cpus.py)
    direct_reads: bool = True  # read chunk objects past FUSE where kvfs offers it (kvfs.direct); else the mount
    direct_writes: bool = True  # encode chunks in the worker and have kvfs adopt them (kvfs.direct); else the mount
    save_threads: int = 2  # writer threads per worker (with direct writes they also encode)
    max_pending_save_mb: int = 512  # copied-out chunks waiting for the writer; beyond, saves are dropped
    pinned_memory_mb: int = 1024  # GPU workers: page-locked staging (readers' buffers, save slots); pageable beyond
    device_staging_mb: int = 128  # GPU workers: device memory a step's saves are gathered into (at least a chunk)
    lossy: str = "none"  # opt-in: kvfs lossy mode for the chunks (mantissa:K or fp8[:G]); its own namespace
    prefetch: bool = False  # when a request is first scheduled, ask kvfs to bring its stored chunks to L2
    demote_after_idle_s: int = 0  # a finished request's chunks go down a tier when not read for this long; 0 = off
    tenant_dirs: bool = False  # a request with a cache_salt keeps its chunks under <mount>/tenant-<hmac of salt>/
    tenant_dir_secret_file: str | None = None  # the HMAC key of those names (a file; recommended with tenant_dirs)
    record_blocks: bool = True  # a chunk's vLLM block hashes and tokens in user.kvfs.blocks: kvfs's KV events
    unsupported: str = "fail"  # a model or cache the connector cannot store: "fail" (refuse at start) or "disable"

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> Settings:
        extra = dict(extra or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"kvfs connector: unknown kv_connector_extra_config keys {unknown}; known: {sorted(known)}")
        if not extra.get("mount"):
            raise ValueError('kvfs connector: kv_connector_extra_config needs "mount" (the kvfs mount point)')
        s = cls(**extra)
        if s.unsupported not in ("fail", "disable"):
            raise ValueError(f'kvfs connector: unsupported must be "fail" or "disable", not {s.unsupported!r}')
        if s.on_load_error not in ("recompute", "fail"):
            raise ValueError(f'kvfs connector: on_load_error must be "recompute" or "fail", not {s.on_load_error!r}')
        if s.chunk_size is not None and (not isinstance(s.chunk_size, int) or s.chunk_size <= 0):
            raise ValueError(f"kvfs connector: chunk_size must be a positive number of tokens, not {s.chunk_size!r}")
        try:
            lossy.parse(s.lossy)
        except ValueError as e:
            raise ValueError(f"kvfs connector: {e}") from None
        if not isinstance(s.demote_after_idle_s, int) or s.demote_after_idle_s < 0:
            raise ValueError("kvfs connector: demote_after_idle_s must be a whole number of seconds >= 0")
        try:
            cpus.check(s.io_cpus)
        except ValueError as e:
            raise ValueError(f'kvfs connector: io_cpus must be "auto", "worker" or a CPU list: {e}') from None
        if (s.io_threads is not None and s.io_threads < 1) or s.max_pending_save_mb < 0 or s.save_threads < 1:
            raise ValueError("kvfs connector: io_threads and save_threads must be >= 1 and max_pending_save_mb >= 0")
        if s.tenant_dir_secret_file is not None and not s.tenant_dirs:
            raise ValueError("kvfs connector: tenant_dir_secret_file without tenant_dirs")
        for key in ("pinned_memory_mb", "device_staging_mb"):
            if not isinstance(getattr(s, key), int) or getattr(s, key) < 0:
                raise ValueError(f"kvfs connector: {key} must be a whole number of MB >= 0")
        return s

    def io_thread_count(self, device_side: bool, available_cpus: int) -> int:
        """Reader threads: as set, else 8 for a cache on a GPU (on an H200 host, 8 readers decoded and loaded
        6.5-7.3 GB/s of KV, 4 readers 3.8: docs/gpu.md) and 4 on a CPU engine, whose cores run the model; never
        more by default than the CPUs the threads may run on."""
        if self.io_threads is not None:
            return self.io_threads
        return max(1, min(GPU_IO_THREADS if device_side else CPU_IO_THREADS, available_cpus))

    @property
    def lossy_mode(self) -> str:
        """The normalised lossy mode ('none' when lossless)."""
        return lossy.parse(self.lossy).describe()

    def chunk_tokens(self, block_size: int) -> int:
        """Tokens per chunk: a multiple of vLLM's block size (the unit the paged cache moves in)."""
        if self.chunk_size is None:
            return -(-DEFAULT_CHUNK_TOKENS // block_size) * block_size
        if self.chunk_size % block_size:
            raise ValueError(f"kvfs connector: chunk_size {self.chunk_size} is not a multiple of the block "
                             f"size {block_size}")
        return self.chunk_size
