"""The codec interface, shared by every codec module."""

from __future__ import annotations

from typing import Protocol


class Codec(Protocol):
    id: int
    name: str

    def compress(self, data: bytes | memoryview) -> bytes: ...

    def decompress(self, data: bytes | memoryview, raw_len: int) -> bytes: ...

    def encoder(self) -> "Codec":
        """The codec that writes new frames for this one (itself, except qat's fallback to ISA-L)."""
        ...


class CodecError(Exception):
    """Stored bytes that the codec rejects (caught as corruption by the caller)."""
