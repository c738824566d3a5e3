"""The kvfs connector with a check for the model-family tests: every load, once its blocks are in the paged
cache, is compared byte for byte with the chunk file it came from (read again through the mount). The
counts go to $KVFS_VERIFY_DIR/<pid>.json: {"verified": blocks, "mismatched": blocks, "loads": n,
"parts": blocks per part kind}, rewritten after every check.

Loaded by module path in the engine (kv_connector_module_path "kvfs_verify_connector", tests/ on PYTHONPATH):
a test of what the engine holds, not a second implementation of the load.
"""

from __future__ import annotations

import json
import os

import torch
from kvfs_connector import chunkfile
from kvfs_connector.connector import KVFSConnector, KVFSMetadata


class VerifyingConnector(KVFSConnector):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.verify = {"verified": 0, "mismatched": 0, "loads": 0, "parts": {}}
        self._pending: dict[str, list] = {}  # asynchronous loads per request, checked once reported finished

    def start_load_kv(self, forward_context, **kwargs):
        super().start_load_kv(forward_context, **kwargs)
        meta = self._connector_metadata
        if isinstance(meta, KVFSMetadata):
            for spec in meta.loads:
                if spec.asynchronous:
                    self._pending.setdefault(spec.req_id, []).append(spec)

    def wait_for_save(self):
        meta = self._connector_metadata
        super().wait_for_save()  # the step's synchronous loads are in the paged cache now
        failed = self.get_block_ids_with_load_errors()
        if isinstance(meta, KVFSMetadata):
            for spec in meta.loads:
                if not spec.asynchronous and not set(spec.block_ids[spec.first_block:spec.end_block]) & failed:
                    self._check(spec)

    def get_transfer_results(self, finished_req_ids):
        results = super().get_transfer_results(finished_req_ids)
        for req_id in results.finished_recving - results.failed_recving:
            for spec in self._pending.pop(req_id, []):
                self._check(spec)
        return results

    def _check(self, spec) -> None:
        worker = self.workers[spec.part]
        lay = worker.layout
        raw = open(spec.paths[worker.rank], "rb").read()
        payload = torch.frombuffer(bytearray(raw[chunkfile.HEADER_SIZE:]), dtype=torch.uint8).view(lay.g.dtype)
        n = lay.g.blocks_per_chunk
        scratch = [torch.zeros((n,) + tuple(t.shape[1:]), dtype=t.dtype) for t in worker.kv_layers]
        groups = max(lay.layer_groups) + 1
        lay.scatter(scratch, payload, [list(range(n))] * groups, spec.first_block, spec.end_block)
        for layer, kv in enumerate(worker.kv_layers):
            ids = spec.groups[lay.layer_groups[layer]][spec.first_block:spec.end_block]
            same = [torch.equal(scratch[layer][spec.first_block + j].view(torch.uint8),
                                kv[i].cpu().contiguous().view(torch.uint8)) for j, i in enumerate(ids)]
            self.verify["verified"] += sum(same)
            self.verify["mismatched"] += len(same) - sum(same)
        self.verify["loads"] += 1
        kind = self.model.parts[spec.part].kind
        self.verify["parts"][kind] = self.verify["parts"].get(kind, 0) + spec.end_block - spec.first_block
        out = os.environ.get("KVFS_VERIFY_DIR")
        if out:  # after every check: the engine's exit need not call shutdown
            with open(os.path.join(out, f"{os.getpid()}.json"), "w") as f:
                json.dump(self.verify, f)
