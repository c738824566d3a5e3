"""The tier interface: a flat store of immutable encoded objects with a byte capacity.

Methods are blocking and are called from worker threads (behind the tier's I/O limiter), never from the
trio thread. Object ids are opaque ASCII strings chosen by the caller and never reused. Usage accounting
(used_bytes, files) is owned by the caller on the trio thread; `scan` seeds it at start.
"""

from __future__ import annotations

import abc
import dataclasses
import errno
from collections.abc import Iterable, Iterator

COPY_CHUNK = 4 << 20
HEAD_BYTES = 64 << 10  # what copy_from keeps of an object's start: its header and frame table


@dataclasses.dataclass(frozen=True)
class ObjectInfo:
    object_id: str
    size: int


@dataclasses.dataclass(frozen=True)
class Stray:
    """Something in a tier that is not an object in its place: `name` is where (tier-relative), `object_id`
    the object it was becoming when known (the temp file of an interrupted put)."""
    name: str
    size: int
    object_id: str | None = None


class Tier(abc.ABC):
    def __init__(self, name: str, capacity: int, persistent: bool) -> None:
        self.name = name
        self.capacity = capacity
        self.persistent = persistent  # survives a reboot: puts are fsynced
        self.used_bytes = 0
        self.files = 0

    deadline_s: float | None = None  # remote tiers: the longest one call may take, retries included
    sealed = False  # holds sealed objects only ([encryption] tiers; kvfs/sealing.py)
    shared = False  # one namespace with other mounts (an S3 prefix in shared mode): files published by path
    # Why this process must not write or delete here (a private L4 not claimed, or taken over by another
    # mount: kvfs/owner.py), or None. Reads go on: objects are verified by their checksums.
    fenced: str | None = None
    # Taken over by another mount: objects here may now be another index's under the same ids, whose
    # checksums hold. Not even read then: every object is a miss (FileNotFoundError).
    disowned = False

    def admit(self) -> None:
        """Raise (OSError EIO) at once when the tier is known to be down; local tiers never are."""

    def available(self) -> bool:
        """False while the tier is known to be down or is fenced (moves to it pause)."""
        return self.fenced is None

    def check_readable(self, object_id: str) -> None:
        """Raise FileNotFoundError when the tier is disowned: its objects are not this mount's any more."""
        if self.disowned:
            raise FileNotFoundError(errno.ENOENT, f"{self.name} {self.describe()}: {self.fenced}: {object_id} "
                                                  "is a miss")

    def check_writable(self) -> None:
        """Raise OSError EROFS when the tier is fenced: no write or deletion may reach it."""
        if self.fenced is not None:
            raise OSError(errno.EROFS, f"{self.name} {self.describe()}: {self.fenced}")

    def note_timeout(self, what: str) -> None:
        """A call was abandoned at its deadline (a hung store): counts as a failure."""

    def deadline_for(self, size: int) -> float | None:
        """The deadline of a call moving `size` bytes: the base, plus time at a floor rate of 8 MB/s."""
        return None if self.deadline_s is None else self.deadline_s + size / (8 << 20)

    def quarantine(self, object_id: str) -> str | None:
        """Keep a copy of a corrupt object aside, where no lookup or scan adopts it, for whoever investigates;
        returns where, or None (local tiers: the object is simply deleted with its file)."""
        return None

    def describe(self) -> str:
        """Where the tier keeps its objects, for logs and stats (never credentials)."""
        return self.name

    def stats(self) -> dict:
        """Tier-specific figures for .kvfs/stats (requests and bytes of a remote store)."""
        return {}

    def where(self, object_id: str) -> str:
        """The directory (or store) an object is in, for reports; no I/O."""
        return self.describe()

    def directories(self) -> list[dict]:
        """Per-directory state of a tier spread over several (kvfs/tiers/spread.py); empty for the others."""
        return []

    def free_bytes(self) -> int:
        return max(0, self.capacity - self.used_bytes)

    @abc.abstractmethod
    def put(self, object_id: str, parts: Iterable[bytes], durable: bool) -> int:
        """Atomically create the object from parts (temp name, rename); fsync when durable. Returns size."""

    def copy_from(self, source: "Tier", object_id: str, size: int, durable: bool, new_id: str | None = None,
                  head: bytearray | None = None) -> int:
        """Create the object (as `new_id`, else the same id) as a copy of `source`'s (the move protocol: temp,
        fsync, rename). Returns the bytes copied; fewer than `size` when the source is shorter. `head`, when
        given, receives the first HEAD_BYTES copied (the caller parses the frame table without a read)."""
        return self.put(new_id or object_id, _keeping_head(source.chunks(object_id, size), head), durable)

    def chunks(self, object_id: str, size: int) -> Iterator[bytes]:
        """The object's bytes in pieces, for a copy; ends early when the object is shorter than `size`."""
        return chunks_by_reads(self, object_id, size)

    @abc.abstractmethod
    def read(self, object_id: str, offset: int, length: int) -> bytes:
        """Read a byte range; a short result means the object is shorter (corrupt or truncated)."""

    def local_path(self, object_id: str) -> str | None:
        """A path on this host where the object can be opened read-only (kvfs.direct), or None (remote)."""
        return None

    @abc.abstractmethod
    def size_of(self, object_id: str) -> int | None:
        """Size of the object, None when absent."""

    @abc.abstractmethod
    def delete(self, object_id: str) -> None:
        """Remove the object; absent objects are not an error."""

    def delete_many(self, object_ids: list[str]) -> None:
        """Remove several objects (a remote store does it in one request)."""
        for object_id in object_ids:
            self.delete(object_id)

    @abc.abstractmethod
    def scan(self) -> Iterator[ObjectInfo]:
        """Every complete object held (temp files excluded)."""

    def strays(self) -> Iterator[Stray]:
        """What `remove_strays` would delete, without deleting it (kvfs fsck reports it first). Tiers that
        cannot list their strays cheaply yield nothing; `remove_strays` at start still cleans them."""
        return iter(())

    def stray_size(self, name: str) -> int | None:
        """Size of a stray named by `strays`, None when it is gone (a put renamed or removed it)."""
        return None

    def remove_stray(self, name: str) -> None:
        """Delete one stray named by `strays`; an absent one is not an error."""

    @abc.abstractmethod
    def remove_strays(self) -> int:
        """Delete what is not an object in its place (leftovers of interrupted puts, misplaced files);
        returns how many. After it, scan() yields only objects that delete() can remove."""


def _keeping_head(chunks: Iterable[bytes], head: bytearray | None) -> Iterator[bytes]:
    for chunk in chunks:
        if head is not None and len(head) < HEAD_BYTES:
            head += memoryview(chunk)[:HEAD_BYTES - len(head)]
        yield chunk


def chunks_by_reads(source: Tier, object_id: str, size: int, piece: int = COPY_CHUNK) -> Iterator[bytes]:
    """The object's bytes by reads of `piece` bytes; ends early when it is shorter than `size`."""
    offset = 0
    while offset < size:
        chunk = source.read(object_id, offset, min(piece, size - offset))
        if not chunk:
            return
        yield chunk
        offset += len(chunk)
