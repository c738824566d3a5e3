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
from .model import Part, restorable, window_blocks_needed
from .mount import MountGuard
from .naming import chunk_relpath, tenant_dir

NULL_BLOCK = 0  # vLLM's null block: skipped positions (outside a sliding window); never stored or loaded
# Parts needed only where a hit ends (a window's last blocks, a recurrent state): a chunk without its tail
# files still serves longer hits, whose ends have theirs. The other parts are needed for every chunk of a hit.
TAIL_KINDS = ("window", "state")

log = logging.getLogger("vllm.kvfs_connector")


@dataclasses.dataclass
class LoadSpec:
    req_id: str
    paths: list[str]  # one per worker (global rank order); each worker reads its own
    first_token: int  # the chunk's first token
    n_tokens: int  # tokens in the chunk (the chunk size)
    token_digest: bytes  # of the request's tokens [0, first_token + n_tokens)
    block_ids: list[int]  # the blocks the file holds, in the request's block table (the part's first group)
    first_block: int  # blocks before this one are computed already (vLLM's own prefix cache), or skipped
    end_block: int  # blocks from here on are not loaded (the hit ends inside this chunk)
    part: int = 0  # which part of the model's KV (model.Part) the file holds
    group_block_ids: list[list[int]] | None = None  # per group of the part, when it has several
    asynchronous: bool = False  # a hybrid model's load: finished through get_finished, not layer by layer

    @property
    def groups(self) -> list[list[int]]:
        return self.group_block_ids if self.group_block_ids is not None else [self.block_ids]


@dataclasses.dataclass
class SaveSpec:
    req_id: str
    paths: list[str]
    first_token: int
    n_tokens: int
    token_digest: bytes
    block_ids: list[int]
    blocks: bytes | None = None  # kvfs.events.BlockRecord of the chunk (user.kvfs.blocks on rank 0's file)
    part: int = 0
    group_block_ids: list[list[int]] | None = None

    @property
    def groups(self) -> list[list[int]]:
        return self.group_block_ids if self.group_block_ids is not None else [self.block_ids]


@dataclasses.dataclass
class RequestState:
    request: object  # vllm.v1.request.Request (kept by the scheduler until it finishes)
    group_ids: list[list[int]] = dataclasses.field(default_factory=lambda: [[]])  # per vLLM KV-cache group
    next_chunk: int = 0  # chunks before this one exist or were queued for saving

    @property
    def block_ids(self) -> list[int]:
        return self.group_ids[0]


def per_group(block_ids, groups: int) -> list[list[int]]:
    """vLLM's block ids of a request as one list per KV-cache group (it hands a tuple of lists; a plain list
    is one group's)."""
    if not block_ids:
        return [[] for _ in range(groups)]
    if not isinstance(block_ids[0], (list, tuple)):
        return [list(block_ids)]
    return [list(ids) for ids in block_ids]


class Planner:
    def __init__(self, *, mount: str, namespaces: Callable[[], Sequence], block_size: int, hash_block_size: int,
                 chunk_size: int, save_decode: bool, guard: MountGuard, prefetch: bool = False,
                 demote_after_idle_s: int = 0, tenant_dirs: bool = False, tenant_secret: bytes | None = None,
                 record_blocks: bool = True, parts: Sequence[Part] | None = None, groups: int = 1,
                 asynchronous: bool = False) -> None:
        self.mount = mount
        self.record_blocks = record_blocks
        self.tenant_dirs = tenant_dirs  # salted requests' chunks under a directory per tenant (naming.tenant_dir)
        self.tenant_secret = tenant_secret
        self._namespace_factory = namespaces  # called once, on first use: vLLM seeds its hashes after init
        self._namespaces: list[list[str]] | None = None
        self.block_size = block_size
        self.parts = list(parts) if parts else [Part("full", (0,), (), (), block_size, 0, 0)]
        self.groups = groups  # vLLM's KV-cache groups (block tables per request)
        self.asynchronous = asynchronous  # hybrid models: loads finish through get_finished (vLLM's rule)
        self.has_window = any(p.kind in ("window", "state") for p in self.parts)
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
                      "idle_marked_chunks": 0, "unsaveable_chunks": 0, "tails_not_saved": 0}

    # -- names -----------------------------------------------------------------------------------------
    @property
    def namespaces(self) -> list[list[str]]:
        """Per part, one per worker rank."""
        if self._namespaces is None:
            made = list(self._namespace_factory())
            self._namespaces = [list(made)] if made and isinstance(made[0], str) else [list(m) for m in made]
            log.info("kvfs connector: namespace %s", " ".join(ns for part in self._namespaces for ns in part))
        return self._namespaces

    def chunk_paths(self, request, chunk: int, part: int = 0) -> list[str] | None:
        """Paths of chunk `chunk` of a part for every rank, or None if its last block has no hash yet."""
        last_token = (chunk + 1) * self.chunk_size
        hashes = request.block_hashes
        i = last_token // self.hash_block_size - 1
        if i >= len(hashes):
            return None
        salt = getattr(request, "cache_salt", None) if self.tenant_dirs else None
        tenant = tenant_dir(salt, self.tenant_secret) if salt else None
        return [os.path.join(self.mount, chunk_relpath(ns, bytes(hashes[i]), tenant))
                for ns in self.namespaces[part]]

    def all_chunk_paths(self, request, chunk: int) -> list[str] | None:
        """Every part's paths of a chunk (all ranks): a chunk is stored when all of them exist."""
        out: list[str] = []
        for part in range(len(self.parts)):
            paths = self.chunk_paths(request, chunk, part)
            if paths is None:
                return None
            out.extend(dict.fromkeys(paths))  # a replicated part names one file for every rank
        return out

    # -- lookups ---------------------------------------------------------------------------------------
    def lookup(self, request, num_computed_tokens: int) -> int:
        """Tokens beyond num_computed_tokens that chunk files can provide: whole chunks inside the prompt, but
        never the last prompt token (vLLM must compute at least one token to sample from). The hit may end
        inside a block: its slots beyond the hit are written by the load and again by vLLM's own compute.
        With window or state parts, the hit must also be restorable there (their files at its end)."""
        prompt_len = len(request.prompt_token_ids or ())
        limit = prompt_len - 1
        hit = 0
        if limit > 0 and self.guard.usable():
            try:
                hit = self._longest_hit(request, limit)
            except OSError as e:
                self.guard.failed(e)
            found = -(-hit // self.chunk_size)
            if self.prefetch and found and request.request_id not in self._prefetched:
                self._prefetched.add(request.request_id)
                self._prefetch(request, found)
        self._hits[request.request_id] = (-(-hit // self.chunk_size), num_computed_tokens)
        self.stats["lookups"] += 1
        self.stats["queried_tokens"] += prompt_len
        return max(0, hit - num_computed_tokens)

    def _longest_hit(self, request, limit: int) -> int:
        """The longest restorable hit: every chunk's body files (full attention, MLA) up to it, and the tail
        files (window, state) its end needs."""
        C = self.chunk_size
        body = [p for p, part in enumerate(self.parts) if part.kind not in TAIL_KINDS]
        found = 0
        for k in range(-(-limit // C)):
            paths = [self.chunk_paths(request, k, p) for p in body] if body else [self.chunk_paths(request, k)]
            if any(ps is None for ps in paths) or (body and not all(files.exists(x) for ps in paths for x in ps)):
                break
            found = k + 1
        if not self.has_window:
            return min(found * C, limit)
        for chunks in range(found, 0, -1):
            for hit in dict.fromkeys((min(chunks * C, limit), chunks * C)):  # inside the chunk, else its end
                if hit <= limit and self._tail_ready(request, hit, chunks):
                    return hit
        return 0

    def _tail_ready(self, request, hit: int, chunks: int) -> bool:
        """Whether the window and state parts can restore a hit of `hit` tokens from their files."""
        if not restorable(self.parts, hit, chunks, self.chunk_size):
            return False
        for p, part in enumerate(self.parts):
            if part.kind not in TAIL_KINDS:
                continue
            per_chunk = part.blocks_per_chunk(self.chunk_size)
            first, end = window_blocks_needed(part, hit)
            for k in sorted({b // per_chunk for b in range(first, end)}):
                paths = self.chunk_paths(request, k, p)
                if paths is None or not all(files.exists(x) for x in paths):
                    return False
        return True

    def allocated(self, request, block_ids, num_external_tokens: int) -> None:
        """After vLLM allocated blocks (one list per KV-cache group): remember the request, plan its loads."""
        req_id = request.request_id
        state = self.requests.setdefault(req_id, RequestState(request))
        state.group_ids = per_group(block_ids, self.groups)
        found, local = self._hits.pop(req_id, (0, 0))  # local: vLLM's own prefix cache hit, block-aligned
        state.next_chunk = max(state.next_chunk, found)  # those exist: never saved again
        if num_external_tokens <= 0:
            return
        hit = local + num_external_tokens
        C = self.chunk_size
        for k in range(local // C if not self.has_window else 0, -(-hit // C)):
            for p, part in enumerate(self.parts):
                spec = self._load_spec(request, state, k, p, part, local, hit)
                if spec is not None:
                    self._loads.append(spec)
        self.stats["hit_tokens"] += num_external_tokens

    def _load_spec(self, request, state: RequestState, k: int, p: int, part: Part, local: int,
                   hit: int) -> LoadSpec | None:
        """The load of part `p` of chunk `k`, or None when the hit needs none of its blocks."""
        C, bs = self.chunk_size, part.block_size
        per_chunk, tail = part.blocks_per_chunk(C), part.stored_blocks(C)
        base = k * per_chunk + per_chunk - tail  # the first block the file holds
        first = max(0, (local - k * C) // bs)  # blocks vLLM's own prefix cache computed
        first = max(first, per_chunk - tail)
        end = min(per_chunk, -(-(hit - k * C) // bs))
        if part.kind in ("window", "state"):
            need_first, need_end = window_blocks_needed(part, hit)
            first = max(first, need_first - k * per_chunk)
            end = min(end, need_end - k * per_chunk)
        if end <= first:
            return None
        groups = [state.group_ids[g][base:base + tail] for g in part.groups]
        first, end = first - (per_chunk - tail), end - (per_chunk - tail)  # within the file's blocks
        paths = self.chunk_paths(request, k, p)
        assert paths is not None  # the lookup found it
        bad = any(len(ids) < end or NULL_BLOCK in ids[first:end] for ids in groups)
        if bad:  # vLLM's block table disagrees with the window rule: fail the load, never write block 0
            log.warning("kvfs connector: request %s: part %s of chunk %d maps to the null block; recomputed",
                        request.request_id, part.kind, k)
        return LoadSpec(request.request_id, [] if bad else paths, k * C, C,
                        token_digest(request.all_token_ids[:k * C + C]), groups[0], first, end, p,
                        groups if len(groups) > 1 else None, self.asynchronous)

    # -- per step --------------------------------------------------------------------------------------
    def step(self, scheduler_output) -> tuple[list[LoadSpec], list[SaveSpec]]:
        """The loads planned since the last step, and the chunks this step completes."""
        so = scheduler_output
        computed: dict[str, int] = {}
        # preemptions first: a request preempted and resumed in one step comes back below with its new blocks
        for req_id in so.preempted_req_ids or ():
            if req_id in self.requests:
                self.requests[req_id].group_ids = per_group(None, self.groups)
        for new in so.scheduled_new_reqs:
            state = self.requests.get(new.req_id)
            if state is not None:
                state.group_ids = per_group(new.block_ids, self.groups)
                computed[new.req_id] = new.num_computed_tokens
        cached = so.scheduled_cached_reqs
        resumed = compat.resumed_req_ids(cached)
        for i, req_id in enumerate(cached.req_ids):
            state = self.requests.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in resumed:
                state.group_ids = per_group(new_ids, self.groups)
            elif new_ids is not None:
                for ids, more in zip(state.group_ids, per_group(new_ids, self.groups)):
                    ids.extend(more)
            computed[req_id] = cached.num_computed_tokens[i]
        saves = []
        for req_id, done in computed.items():
            saves.extend(self._saves_for(self.requests[req_id], done + so.num_scheduled_tokens.get(req_id, 0),
                                         done))
        loads, self._loads = self._loads, []
        return loads, saves

    def _saves_for(self, state: RequestState, kv_tokens: int, done: int = 0) -> list[SaveSpec]:
        """Chunks whose every token has KV in the cache once this step has run (every part of them)."""
        request = state.request
        C = self.chunk_size
        prompt_len = len(request.prompt_token_ids or ())
        out = []
        while (state.next_chunk + 1) * C <= kv_tokens:
            k = state.next_chunk
            end = (k + 1) * C
            if end > prompt_len and not self.save_decode:
                break
            paths = [self.chunk_paths(request, k, p) for p in range(len(self.parts))]
            if paths[0] is None or len(request.all_token_ids) < end:
                break  # hash not there yet (asynchronous scheduling): try next step
            specs = [self._save_spec(request, state, k, p, part, paths[p], done, kv_tokens)
                     for p, part in enumerate(self.parts)]
            if "later" in specs:
                break  # blocks not there yet
            state.next_chunk += 1
            if not all(isinstance(s, SaveSpec) for s, part in zip(specs, self.parts) if part.kind not in TAIL_KINDS):
                self.stats["unsaveable_chunks"] += 1
                continue
            # a window freed already, or a state the step ran past (vLLM computed several chunks in one step):
            # the chunk serves longer hits, not hits that end here
            self.stats["tails_not_saved"] += sum(s is None for s in specs)
            for spec, part in zip(specs, self.parts):
                if isinstance(spec, SaveSpec):
                    if self.record_blocks:  # each part's file announces its blocks under each of its groups
                        spec.blocks = self.block_record(request, k, part.groups[0], part.groups)
                    out.append(spec)
        return out

    def _save_spec(self, request, state: RequestState, k: int, p: int, part: Part, paths: list[str],
                   done: int, kv_tokens: int):
        C, bs = self.chunk_size, part.block_size
        per_chunk, tail = part.blocks_per_chunk(C), part.stored_blocks(C)
        base = k * per_chunk + per_chunk - tail
        groups = [state.group_ids[g][base:base + tail] for g in part.groups]
        if any(len(ids) < tail for ids in groups):
            return "later" if all(len(state.group_ids[g]) < (k + 1) * per_chunk for g in part.groups) else None
        # vLLM frees window blocks wholly below done - window + 1 at the start of a step: older ids are stale
        if part.kind == "window" and (base + 1) * bs <= done - part.window + 1:
            return None
        # a recurrent state block holds the state after the chunk's end only at the end of the step that
        # reached it (vLLM's align mode ends a step at every block boundary); later it runs on or is freed
        if part.kind == "state" and kv_tokens != (k + 1) * C:
            return None
        if any(NULL_BLOCK in ids for ids in groups):
            return None
        return SaveSpec(request.request_id, paths, k * C, C, token_digest(request.all_token_ids[:(k + 1) * C]),
                        groups[0], None, p, groups if len(groups) > 1 else None)

    def block_record(self, request, chunk: int, group: int | None = None,
                     groups: Sequence[int] | None = None) -> bytes:
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
            extra_keys=compat.event_extra_keys(request, start, start + self.chunk_size, per_hash),
            group_idx=group if self.groups > 1 else None,
            group_ids=list(groups) if groups and len(groups) > 1 else None))

    def _prefetch(self, request, chunks: int) -> None:
        """Chunks a request will load go to kvfs's fastest tier in the background: a request waiting for
        blocks finds them in L2, not on disk or in the object store."""
        for k in range(chunks):
            for path in self.all_chunk_paths(request, k) or ():
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
            for path in self.all_chunk_paths(state.request, k) or ():
                self.stats["idle_marked_chunks"] += files.request(path, files.XA_IDLE, value)
