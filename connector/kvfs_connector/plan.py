"""Scheduler side: which chunks exist (a hit), which to load into which blocks, which new chunks to save.

Runs in vLLM's scheduler process; it only stats files. Its decisions travel to the workers as KVFSMetadata.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Sequence

from kvfs.events import BlockRecord, encode_record

from . import compat, files
from .chunkfile import token_digest
from .mount import MountGuard
from .naming import chunk_relpath, tenant_dir

log = logging.getLogger("vllm.kvfs_connector")


@dataclasses.dataclass
class LoadSpec:
    req_id: str
    paths: list[str]  # one per worker (global rank order); each worker reads its own
    first_token: int  # the chunk's first token
    n_tokens: int  # tokens in the chunk file (the chunk size)
    token_digest: bytes  # of the request's tokens [0, first_token + n_tokens)
    block_ids: list[int]  # the chunk's blocks in the request's block table
    first_block: int  # blocks before this one are computed already (vLLM's own prefix cache)
    end_block: int  # blocks from here on are not loaded (the hit ends inside this chunk)


@dataclasses.dataclass
class SaveSpec:
    req_id: str
    paths: list[str]
    first_token: int
    n_tokens: int
    token_digest: bytes
    block_ids: list[int]
    blocks: bytes | None = None  # kvfs.events.BlockRecord of the chunk (user.kvfs.blocks on rank 0's file)


@dataclasses.dataclass
class RequestState:
    request: object  # vllm.v1.request.Request (kept by the scheduler until it finishes)
    block_ids: list[int] = dataclasses.field(default_factory=list)
    next_chunk: int = 0  # chunks before this one exist or were queued for saving


class Planner:
    def __init__(self, *, mount: str, namespaces: Callable[[], Sequence[str]], block_size: int, hash_block_size: int,
                 chunk_size: int, save_decode: bool, guard: MountGuard, prefetch: bool = False,
                 demote_after_idle_s: int = 0, tenant_dirs: bool = False, tenant_secret: bytes | None = None,
                 record_blocks: bool = True) -> None:
        self.mount = mount
        self.record_blocks = record_blocks
        self.tenant_dirs = tenant_dirs  # salted requests' chunks under a directory per tenant (naming.tenant_dir)
        self.tenant_secret = tenant_secret
        self._namespace_factory = namespaces  # called once, on first use: vLLM seeds its hashes after init
        self._namespaces: list[str] | None = None
        self.block_size = block_size
        self.hash_block_size = hash_block_size
        self.chunk_size = chunk_size
        self.save_decode = save_decode
        self.guard = guard
        self.prefetch = prefetch
        self.demote_after_idle_s = demote_after_idle_s
        self._prefetched: set[str] = set()  # requests whose chunks were prefetched (lookups repeat while waiting)
        self.requests: dict[str, RequestState] = {}
        self._hits: dict[str, tuple[int, int]] = {}  # req_id -> (chunks found, locally computed tokens)
        self._loads: list[LoadSpec] = []
        self.stats = {"lookups": 0, "hit_tokens": 0, "queried_tokens": 0, "prefetched_chunks": 0,
                      "idle_marked_chunks": 0}

    # -- names -----------------------------------------------------------------------------------------
    @property
    def namespaces(self) -> list[str]:
        """One per worker rank."""
        if self._namespaces is None:
            self._namespaces = list(self._namespace_factory())
            log.info("kvfs connector: namespace %s", " ".join(self._namespaces))
        return self._namespaces

    def chunk_paths(self, request, chunk: int) -> list[str] | None:
        """Paths of chunk `chunk` for every rank, or None if its last block has no hash yet."""
        last_token = (chunk + 1) * self.chunk_size
        hashes = request.block_hashes
        i = last_token // self.hash_block_size - 1
        if i >= len(hashes):
            return None
        salt = getattr(request, "cache_salt", None) if self.tenant_dirs else None
        tenant = tenant_dir(salt, self.tenant_secret) if salt else None
        return [os.path.join(self.mount, chunk_relpath(ns, bytes(hashes[i]), tenant)) for ns in self.namespaces]

    # -- lookups ---------------------------------------------------------------------------------------
    def lookup(self, request, num_computed_tokens: int) -> int:
        """Tokens beyond num_computed_tokens that chunk files can provide: whole chunks inside the prompt, but
        never the last prompt token (vLLM must compute at least one token to sample from). The hit may end
        inside a block: its slots beyond the hit are written by the load and again by vLLM's own compute."""
        prompt_len = len(request.prompt_token_ids or ())
        limit = prompt_len - 1
        found = 0
        if limit > 0 and self.guard.usable():
            found = self._count_existing(request, limit)
            if self.prefetch and found and request.request_id not in self._prefetched:
                self._prefetched.add(request.request_id)
                self._prefetch(request, found)
        self._hits[request.request_id] = (found, num_computed_tokens)
        hit = min(found * self.chunk_size, limit)
        self.stats["lookups"] += 1
        self.stats["queried_tokens"] += prompt_len
        return max(0, hit - num_computed_tokens)

    def _count_existing(self, request, limit: int) -> int:
        chunks = -(-limit // self.chunk_size)
        for k in range(chunks):
            paths = self.chunk_paths(request, k)
            try:
                if paths is None or not all(files.exists(p) for p in paths):
                    return k
            except OSError as e:
                self.guard.failed(e)
                return k
        return chunks

    def allocated(self, request, block_ids: list[int], num_external_tokens: int) -> None:
        """After vLLM allocated blocks: remember the request, and plan its loads."""
        req_id = request.request_id
        state = self.requests.setdefault(req_id, RequestState(request))
        state.block_ids = list(block_ids)
        found, local = self._hits.pop(req_id, (0, 0))  # local: vLLM's own prefix cache hit, block-aligned
        state.next_chunk = max(state.next_chunk, found)  # those exist: never saved again
        if num_external_tokens <= 0:
            return
        hit = local + num_external_tokens
        C, bs = self.chunk_size, self.block_size
        per_chunk = C // bs
        for k in range(local // C, -(-hit // C)):
            start = k * C
            paths = self.chunk_paths(request, k)
            assert paths is not None  # the lookup found it
            blocks = state.block_ids[k * per_chunk:(k + 1) * per_chunk]
            self._loads.append(LoadSpec(
                req_id, paths, start, C, token_digest(request.all_token_ids[:start + C]), blocks,
                first_block=max(0, (local - start) // bs), end_block=min(per_chunk, -(-(hit - start) // bs))))
        self.stats["hit_tokens"] += num_external_tokens

    # -- per step --------------------------------------------------------------------------------------
    def step(self, scheduler_output) -> tuple[list[LoadSpec], list[SaveSpec]]:
        """The loads planned since the last step, and the chunks this step completes."""
        so = scheduler_output
        computed: dict[str, int] = {}
        # preemptions first: a request preempted and resumed in one step comes back below with its new blocks
        for req_id in so.preempted_req_ids or ():
            if req_id in self.requests:
                self.requests[req_id].block_ids = []
        for new in so.scheduled_new_reqs:
            state = self.requests.get(new.req_id)
            if state is not None:
                state.block_ids = list(new.block_ids[0])
                computed[new.req_id] = new.num_computed_tokens
        cached = so.scheduled_cached_reqs
        resumed = compat.resumed_req_ids(cached)
        for i, req_id in enumerate(cached.req_ids):
            state = self.requests.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in resumed:
                state.block_ids = list(new_ids[0]) if new_ids is not None else []
            elif new_ids is not None:
                state.block_ids.extend(new_ids[0])
            computed[req_id] = cached.num_computed_tokens[i]
        saves = []
        for req_id, done in computed.items():
            saves.extend(self._saves_for(self.requests[req_id], done + so.num_scheduled_tokens.get(req_id, 0)))
        loads, self._loads = self._loads, []
        return loads, saves

    def _saves_for(self, state: RequestState, kv_tokens: int) -> list[SaveSpec]:
        """Chunks whose every token has KV in the cache once this step has run."""
        request = state.request
        C = self.chunk_size
        per_chunk = C // self.block_size
        prompt_len = len(request.prompt_token_ids or ())
        out = []
        while (state.next_chunk + 1) * C <= kv_tokens:
            k = state.next_chunk
            end = (k + 1) * C
            if end > prompt_len and not self.save_decode:
                break
            paths = self.chunk_paths(request, k)
            blocks = state.block_ids[k * per_chunk:(k + 1) * per_chunk]
            if paths is None or len(blocks) < per_chunk or len(request.all_token_ids) < end:
                break  # hash or blocks not there yet (asynchronous scheduling): try next step
            out.append(SaveSpec(request.request_id, paths, k * C, C, token_digest(request.all_token_ids[:end]),
                                blocks, self.block_record(request, k) if self.record_blocks else None))
            state.next_chunk += 1
        return out

    def block_record(self, request, chunk: int) -> bytes:
        """The vLLM blocks chunk `chunk` holds, as vLLM's own BlockStored describes them (kvfs/events.py):
        kvfs announces them to routers in the tier the file is in."""
        per_hash = self.hash_block_size
        first, end = chunk * self.chunk_size // per_hash, (chunk + 1) * self.chunk_size // per_hash
        hashes = request.block_hashes
        lora = getattr(request, "lora_request", None)
        start = chunk * self.chunk_size
        return encode_record(BlockRecord(
            block_hashes=[compat.external_block_hash(h) for h in hashes[first:end]],
            parent_block_hash=compat.external_block_hash(hashes[first - 1]) if first else None,
            token_ids=list(request.all_token_ids[start:start + self.chunk_size]),
            block_size=per_hash, lora_name=lora.name if lora is not None else None,
            extra_keys=compat.event_extra_keys(request, start, start + self.chunk_size, per_hash)))

    def _prefetch(self, request, chunks: int) -> None:
        """Chunks a request will load go to kvfs's fastest tier in the background: a request waiting for
        blocks finds them in L2, not on disk or in the object store."""
        for k in range(chunks):
            for path in self.chunk_paths(request, k) or ():
                self.stats["prefetched_chunks"] += files.request(path, files.XA_PREFETCH, b"1")

    def finished(self, req_id: str) -> None:
        state = self.requests.pop(req_id, None)
        self._hits.pop(req_id, None)
        self._prefetched.discard(req_id)
        if state is not None and self.demote_after_idle_s and self.guard.usable():
            self._mark_idle(state)

    def _mark_idle(self, state: RequestState) -> None:
        """A finished conversation's chunks go down a tier once nobody read them for demote_after_idle_s
        (kvfs's idle policy): idle → offloaded; a returning session reads them back (promotion)."""
        value = str(self.demote_after_idle_s).encode()
        for k in range(state.next_chunk):
            for path in self.chunk_paths(state.request, k) or ():
                self.stats["idle_marked_chunks"] += files.request(path, files.XA_IDLE, value)
