"""Where a chunk lives: `<mount>/<namespace>/<ab>/<hash>.kv`.

namespace = a readable model name + `-` + 12 hex digits of sha256 over everything that changes the bytes of a
chunk or their meaning (model, dtype, geometry, block and chunk size, layout, parallel ranks and sizes, hash
algorithm and the identity of vLLM's hash seed, lossy mode). Engines that agree on all of it share files; any
difference gives a separate directory, never a mix. hash = vLLM's chained block hash of the chunk's last
block, so a file name names the whole prefix up to the end of its chunk.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import os
import re

NAME_SAFE = re.compile(r"[^A-Za-z0-9._-]+")


@dataclasses.dataclass(frozen=True)
class NamespaceKey:
    model: str  # the name or path the engine was started with
    dtype: str  # KV cache element type, e.g. "bfloat16"
    num_layers: int
    num_kv_heads: int
    head_size: int
    block_size: int
    chunk_size: int
    layout: str  # byte order the chunk payload was produced from (layout.py)
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    hash_algo: str
    hash_seed_id: str  # digest of vLLM's NONE_HASH: chained hashes are only comparable under the same seed
    lossy: str = "lossless"
    # set only where they apply, so that a plain model's namespace is what it always was:
    part: str | None = None  # which part of a hybrid or MLA model's KV (model.Part.describe), as JSON
    kv_cache_dtype: str | None = None  # quantised caches: vLLM's cache dtype (fp8_e4m3, ...)
    backend: str | None = None  # quantised caches: the attention backend (its bit convention, vLLM PR #54341)

    def digest(self) -> str:
        fields = {k: v for k, v in dataclasses.asdict(self).items()
                  if v is not None or k not in ("part", "kv_cache_dtype", "backend")}
        blob = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()[:12]

    def readable_model(self) -> str:
        name = os.path.basename(self.model.rstrip("/")) or self.model
        return NAME_SAFE.sub("_", name).strip("._-")[:64] or "model"

    def namespace(self) -> str:
        return f"{self.readable_model()}-{self.digest()}"


def chunk_relpath(namespace: str, block_hash: bytes, tenant: str | None = None) -> str:
    h = block_hash.hex()
    return f"{tenant}/{namespace}/{h[:2]}/{h}.kv" if tenant else f"{namespace}/{h[:2]}/{h}.kv"


def tenant_dir(cache_salt: str, secret: bytes | None = None) -> str:
    """The directory of one tenant's chunks (the `tenant_dirs` setting): `tenant-` and 20 hex digits of an
    HMAC-SHA256 of the request's cache_salt under the deployment's secret (SHA-256 without one), so the name
    does not reveal the salt; with a secret, not even to someone who can guess it."""
    mac = hmac.new(secret, cache_salt.encode(), hashlib.sha256) if secret else hashlib.sha256(
        b"kvfs tenant dir v1\0" + cache_salt.encode())
    return "tenant-" + mac.hexdigest()[:20]


def seed_identity(none_hash: bytes) -> str:
    return hashlib.sha256(bytes(none_hash)).hexdigest()[:16]


if __name__ == "__main__":  # python -m kvfs_connector.naming SALT [SECRET_FILE]: a tenant's directory name
    import sys

    if len(sys.argv) not in (2, 3):
        raise SystemExit("usage: python -m kvfs_connector.naming CACHE_SALT [TENANT_DIR_SECRET_FILE]")
    print(tenant_dir(sys.argv[1], open(sys.argv[2], "rb").read() if len(sys.argv) == 3 else None))
