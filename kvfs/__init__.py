"""kvfs: a compressed, checksummed, tiered FUSE filesystem for LLM KV caches."""

__version__ = "0.1.0"
