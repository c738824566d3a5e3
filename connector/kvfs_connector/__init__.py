"""kvfs_connector: a vLLM v1 KV connector that stores and loads KV chunks as files in a kvfs mount.

Load it with no vLLM source change:

    --kv-transfer-config '{"kv_connector": "KVFSConnector", "kv_connector_module_path": "kvfs_connector",
                           "kv_role": "kv_both", "kv_connector_extra_config": {"mount": "/mnt/kvfs"}}'

The pure parts (chunk file format, names, settings) import without vLLM or torch; `KVFSConnector` is imported
lazily so that `import kvfs_connector.chunkfile` works on a machine without vLLM. See docs/connector.md.
"""

from __future__ import annotations

__all__ = ["KVFSConnector"]


def __getattr__(name: str):
    if name == "KVFSConnector":
        from .connector import KVFSConnector

        return KVFSConnector
    raise AttributeError(name)
