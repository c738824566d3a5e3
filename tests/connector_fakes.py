"""Stand-ins for the vLLM objects the connector's scheduler side reads (no torch, no vLLM needed)."""

from __future__ import annotations

import hashlib


class FakeRequest:
    """The parts of vllm.v1.request.Request the planner reads; hashes chained like vLLM's."""

    def __init__(self, rid: str, tokens: list[int], prompt_len: int, hash_block: int = 128) -> None:
        self.request_id = rid
        self.prompt_token_ids = tokens[:prompt_len]
        self.all_token_ids = list(tokens)
        self.block_hashes = []
        parent = b"seed"
        for i in range(len(tokens) // hash_block):
            parent = hashlib.sha256(parent + repr(tokens[i * hash_block:(i + 1) * hash_block]).encode()).digest()
            self.block_hashes.append(parent)
