"""Encryption at rest: keys, and sealing of frame payloads (AES-256-GCM through `cryptography`, i.e. OpenSSL).

Keys are 32 random bytes, read from a key file (mode 0600 or stricter, checked) or from the environment
variable KVFS_KEY (64 hex digits); never from argv, never logged. A key is named by its key id, 8 bytes
derived from it (HKDF), which objects carry in their header: a reader finds the key by id, and a key that is
not listed is a miss (EIO), not a guess.

Each object gets its own working key, HKDF-SHA256(key, salt = 16 random bytes kept in the object's header,
info = "kvfs object key v1"): nonces (the payload's offset in the object) are then unique per working key
without any counter to keep. The byte-level layout is in docs/format.md ("Sealed frames").
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import os
import stat
import struct
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

KEY_BYTES = 32
KEY_ID_BYTES = 8
NONCE_BYTES = 16  # per object: the HKDF salt of its working key
TAG_BYTES = 16
RAW_SUM = struct.Struct("<Q")  # the raw checksum, sealed with the payload
SEAL_OVERHEAD = RAW_SUM.size + TAG_BYTES  # a sealed payload is this much longer than the plain one
ALG_AES256_GCM = 1
ENV_KEY = "KVFS_KEY"


class KeyError_(Exception):
    """A key file or value that cannot be used (the message says why; it never contains key material)."""


class KeyUnavailable(OSError):
    """An object sealed with a key this process does not hold: EIO, not corruption (the file is kept: the key
    may be listed again)."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.EIO, message)


@dataclasses.dataclass(frozen=True)
class Key:
    secret: bytes = dataclasses.field(repr=False)
    source: str  # where it came from, for messages: a path or the variable's name

    @functools.cached_property
    def key_id(self) -> bytes:
        return _hkdf(self.secret, b"", b"kvfs key id v1", KEY_ID_BYTES)

    def object_cipher(self, nonce: bytes) -> AESGCM:
        return AESGCM(_hkdf(self.secret, nonce, b"kvfs object key v1", KEY_BYTES))


def _hkdf(secret: bytes, salt: bytes, info: bytes, length: int) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=salt or None, info=info).derive(secret)


def load_key_file(path: str | os.PathLike) -> Key:
    """A key from a file of exactly 32 bytes that only its owner may read or write (mode 0600 or 0400)."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise KeyError_(f"key file {path}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise KeyError_(f"key file {path}: not a regular file")
        if st.st_mode & 0o077:
            raise KeyError_(f"key file {path}: mode {stat.S_IMODE(st.st_mode):04o} lets other users read it; "
                            f"chmod 600 {path}")
        secret = os.read(fd, KEY_BYTES + 1)
    finally:
        os.close(fd)
    if len(secret) != KEY_BYTES:
        raise KeyError_(f"key file {path}: must hold exactly {KEY_BYTES} bytes (head -c 32 /dev/urandom)")
    return Key(secret, str(path))


def key_from_env(environ: Mapping[str, str] = os.environ) -> Key | None:
    value = environ.get(ENV_KEY)
    if value is None:
        return None
    try:
        secret = bytes.fromhex(value.strip())
    except ValueError:
        secret = b""
    if len(secret) != KEY_BYTES:
        raise KeyError_(f"{ENV_KEY} must be {2 * KEY_BYTES} hex digits")
    return Key(secret, ENV_KEY)


def write_key_file(path: str | os.PathLike) -> Key:
    """Create a new random key file (mode 0600); refuses to overwrite one."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    secret = os.urandom(KEY_BYTES)
    try:
        os.write(fd, secret)
        os.fsync(fd)
    finally:
        os.close(fd)
    return Key(secret, str(path))


class KeyRing:
    """The keys a mount seals with and opens with: a default key (`current`, the one for sealed tiers) and
    each tenant directory's own key, with the older, rotated-out keys of either, by key id."""

    def __init__(self, current: Key | None, older: Iterable[Key] = (),
                 tenants: Mapping[str, Sequence[Key]] | None = None) -> None:
        self.current = current
        self.tenants = {name: keys[0] for name, keys in (tenants or {}).items()}  # tenant → its current key
        self.by_id: dict[bytes, Key] = {}
        for key in (*([current] if current else []), *older,
                    *(k for keys in (tenants or {}).values() for k in keys)):
            self.by_id.setdefault(key.key_id, key)
        self._ciphers: dict[tuple[bytes, bytes], AESGCM] = {}

    def tenant_key(self, tenant: str | None) -> Key | None:
        """The key of a tenant directory (kvfs/sealing.py Tenants), None for no tenant or one without its own."""
        return self.tenants.get(tenant) if tenant is not None else None

    def sealed_header(self, header, key: Key):
        """A header sealed with `key` under a fresh object nonce, and the working cipher of that object."""
        nonce = os.urandom(NONCE_BYTES)
        return header.sealed_with(key.key_id, nonce), self.cipher(key.key_id, nonce)

    def cipher(self, key_id: bytes, nonce: bytes) -> AESGCM:
        """The working cipher of one object; KeyUnavailable when its key is not listed here."""
        found = self._ciphers.get((key_id, nonce))
        if found is not None:
            return found
        key = self.by_id.get(key_id)
        if key is None:
            raise KeyUnavailable(f"sealed with key {key_id.hex()}, which this mount does not hold")
        cipher = key.object_cipher(nonce)
        if len(self._ciphers) > 4096:
            self._ciphers.clear()
        self._ciphers[(key_id, nonce)] = cipher
        return cipher


def seal(cipher: AESGCM, offset: int, aad: bytes, raw_xxh3: int, payload) -> bytes:
    """A sealed payload: AES-256-GCM of (raw checksum | payload), nonce = its offset in the object."""
    return cipher.encrypt(_nonce(offset), RAW_SUM.pack(raw_xxh3) + bytes(payload), aad)


def unseal(cipher: AESGCM, offset: int, aad: bytes, sealed) -> tuple[int, bytes]:
    """(raw checksum, payload) of a sealed payload; ValueError when it fails authentication."""
    try:
        plain = cipher.decrypt(_nonce(offset), bytes(sealed), aad)
    except InvalidTag:
        raise ValueError("sealed payload fails authentication (tampered, or another object's)") from None
    return RAW_SUM.unpack_from(plain)[0], plain[RAW_SUM.size:]


def _nonce(offset: int) -> bytes:
    return struct.pack("<QI", offset, 0)
