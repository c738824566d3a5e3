"""A tier spread over several directories, one per SSD (`--l3 DIR:SIZE` given more than once): one logical
tier for the rest of kvfs (rows say "L3"; the mover, quotas and the hot/cold API see one tier whose capacity
is the members' sum), each object in one member directory (kvfs/tiers/member.py).

Placement: weighted rendezvous hashing (HRW) of the object id over the members, weighted by capacity. Each
object has a fixed order of preference over the members, computed from its id alone; it goes to the first
member that is up and has room, and reads look there first. So no lookup table and no index column: a
failed member's objects are simply unavailable, the others' first choices do not change, and new objects
whose first choice it was go to their second. Free space decides only when the first choice is full (the
disk said ENOSPC, or its capacity is used): the object goes to the next member in its order. Objects not in
their first choice are remembered in a small map, filled by the listing at start and by puts; a read that
does not find an object where expected looks in the other members too, so a stale map is never a miss.

Why not place by free space: the emptiest member would take every new object until the others caught up (a
burst of demotions on one SSD instead of all of them), and finding an object again would need a table or a
probe of every member. Hashing spreads every burst over all members in proportion to their size.

Failure isolation: a member that fails (EIO, its filesystem unmounted under it) is taken out: its objects
read as EIO (never other bytes), deletions there wait until it is back, new objects go to the others, and
it is probed again every few seconds. A full or read-only member only takes no new objects. The tier stays
available while one member is.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import math
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TypeVar

from .base import ObjectInfo, Stray, Tier, _keeping_head
from .member import FULL_ERRNOS, Member, MemberDown

log = logging.getLogger(__name__)

T = TypeVar("T")


class SpreadTier(Tier):
    def __init__(self, name: str, directories: Sequence[tuple[Path, int]], persistent: bool) -> None:
        self.members = [Member(name, Path(root), capacity, persistent) for root, capacity in directories]
        super().__init__(name, 0, persistent)
        self._keys = [hashlib.blake2b((m.identity or str(m.root)).encode(), digest_size=16).digest()
                      for m in self.members]
        self._elsewhere: dict[str, Member] = {}  # object id → its member, where that is not its first choice
        self._lock = threading.Lock()
        self._seeded = False  # the first listing seeds the members' accounting and the map

    @property
    def capacity(self) -> int:
        """The members' room: a full or down one counts only what it holds (kvfs/tiers/member.py room)."""
        return sum(m.room() for m in self.members)

    @capacity.setter
    def capacity(self, value: int) -> None:
        """Tier.__init__ sets it: the members' capacities are what counts."""

    def describe(self) -> str:
        return ", ".join(str(m.root) for m in self.members)

    def where(self, object_id: str) -> str:
        return str(self._holder(object_id).root)

    def directories(self) -> list[dict]:
        return [m.status() for m in self.members]

    def stats(self) -> dict:
        return {"directories": self.directories()}

    def available(self) -> bool:
        return self.fenced is None and any(m.usable() for m in self.members)

    # -- placement -----------------------------------------------------------------------------------
    def _ranking(self, object_id: str) -> list[Member]:
        """The members in the object's order of preference (weighted rendezvous hashing)."""
        scores = [_score(object_id, key, m.capacity) for key, m in zip(self._keys, self.members)]
        return [m for _, m in sorted(zip(scores, self.members), key=lambda p: p[0], reverse=True)]

    def _first(self, object_id: str) -> Member:
        return max(zip(self._keys, self.members), key=lambda km: _score(object_id, km[0], km[1].capacity))[1]

    def _holder(self, object_id: str) -> Member:
        """Where the object is, as far as this process knows: its first choice unless placed elsewhere."""
        return self._elsewhere.get(object_id) or self._first(object_id)

    def _placed(self, object_id: str, member: Member | None) -> None:
        """Remember where an object is (None: nowhere any more)."""
        with self._lock:
            if member is None or member is self._first(object_id):
                self._elsewhere.pop(object_id, None)
            else:
                self._elsewhere[object_id] = member

    def _place(self, object_id: str, size: int, write: Callable[[Member], int], retryable: Callable[[], bool]) -> int:
        """Write a new object into the first member of its order that is up and has room; on a member's
        failure, into the next (while the bytes can be read again)."""
        errors: list[OSError] = []
        for member in self._ranking(object_id):
            if not member.usable():
                errors.append(MemberDown(member))
                continue
            if member.state == "full" or not member.reserve(size):
                errors.append(OSError(errno.ENOSPC, f"{member.root} has no room"))
                continue
            written = None
            try:
                member.admit()
                member.check()
                written = write(member)
            except _SourceFailed as e:
                raise e.error from None
            except OSError as e:
                member.failed(e)
                errors.append(e)
                if not retryable():
                    raise
                continue
            finally:
                member.settle(size, written)
            member.succeeded(wrote=True)
            self._placed(object_id, member)
            return written
        raise _no_room(self.name, object_id, size, errors)

    def put(self, object_id: str, parts: Iterable[bytes], durable: bool) -> int:
        once = _Parts(parts)
        size = sum(len(p) for p in parts) if once.replayable else 0
        return self._place(object_id, size, lambda m: m.put(object_id, once, durable), once.retryable)

    def copy_from(self, source: Tier, object_id: str, size: int, durable: bool, new_id: str | None = None,
                  head: bytearray | None = None) -> int:
        oid = new_id or object_id

        def write(member: Member) -> int:
            if head is not None:
                del head[:]  # a retry in another member starts the copy again
            return member.put(oid, _keeping_head(_from_source(source.chunks(object_id, size)), head), durable)

        return self._place(oid, size, write, lambda: True)

    # -- reads -----------------------------------------------------------------------------------------
    def _call(self, member: Member, op: Callable[[Member], T]) -> T:
        member.admit()
        try:
            result = op(member)
        except FileNotFoundError:
            raise
        except OSError as e:
            member.failed(e)
            raise
        member.succeeded()
        return result

    def _find(self, object_id: str, skip: Member) -> Member | None:
        """The member holding an object that is not where it was expected (looked for in its order)."""
        for member in self._ranking(object_id):
            if member is skip or not member.usable():
                continue
            try:
                if member.size_of(object_id) is not None:
                    self._placed(object_id, member)
                    return member
            except OSError as e:
                member.failed(e)
        return None

    def _at(self, object_id: str, op: Callable[[Member], T]) -> T:
        """Run `op` on the member holding the object. A member that vanished answers MemberDown (EIO), not
        FileNotFoundError: its objects are unavailable, not gone."""
        member = self._holder(object_id)
        try:
            return self._call(member, op)
        except FileNotFoundError:
            member.check()
            other = self._find(object_id, member)
            if other is None:
                raise
            return self._call(other, op)

    def read(self, object_id: str, offset: int, length: int) -> bytes:
        def read(member: Member) -> bytes:
            data = member.read(object_id, offset, length)
            member.read_bytes += len(data)
            return data

        return self._at(object_id, read)

    def size_of(self, object_id: str) -> int | None:
        def size_of(member: Member) -> int:
            size = member.size_of(object_id)
            if size is None:
                raise FileNotFoundError(errno.ENOENT, object_id)
            return size

        try:
            return self._at(object_id, size_of)
        except FileNotFoundError:
            return None

    def local_path(self, object_id: str) -> str | None:
        member = self._holder(object_id)
        return member.local_path(object_id) if member.opened and member.state != "down" else None

    # -- deletion ----------------------------------------------------------------------------------------
    def delete(self, object_id: str) -> None:
        """Remove the object. A member that is down (or fails now) deletes it when it is back: the object is
        not this tier's any more either way, and a failing directory must not fail the caller."""
        member = self._holder(object_id)
        self._placed(object_id, None)
        try:
            member.admit()
            if member.remove(object_id) is None:
                member.check()  # vanished: the object may be there again when it is back
                other = self._find(object_id, member)
                if other is not None:
                    other.remove(object_id)
                    self._placed(object_id, None)
        except MemberDown:
            member.forget_later(object_id)
        except OSError as e:
            member.failed(e)
            member.forget_later(object_id)
            log.debug("deleting %s from %s failed: %s (retried when it answers)", object_id, member.root, e)
        else:
            member.succeeded(wrote=True)

    # -- listing -----------------------------------------------------------------------------------------
    def _listable(self, member: Member) -> bool:
        if not member.opened or member.state == "down":
            return False
        try:
            member.check()
        except MemberDown:
            return False
        return True

    def scan(self) -> Iterator[ObjectInfo]:
        """Every object of every member that is up. The first listing (reconcile at start, an offline fsck)
        seeds the members' accounting and the map of objects outside their first choice; a member that cannot
        be listed then is taken down (its objects are not counted: their rows are dropped as misses)."""
        seeding = not self._seeded
        for member in self.members:
            if not self._listable(member):
                continue
            used = files = 0
            try:
                for info in member.scan():
                    if seeding:
                        self._placed(info.object_id, member)
                        used, files = used + info.size, files + 1
                    yield info
            except OSError as e:
                member.failures += 1
                member.breaker.trip(f"listing failed: {e.strerror or e}")
                continue
            if seeding:
                member.seed(used, files)
        self._seeded = True

    def strays(self) -> Iterator[Stray]:
        """The members' strays, named by their full path (which says the directory)."""
        for member in self.members:
            if not self._listable(member):
                continue
            try:
                for stray in member.strays():
                    yield Stray(str(member.root / stray.name), stray.size, stray.object_id)
            except OSError as e:
                member.failed(e)

    def _stray_member(self, name: str) -> tuple[Member | None, str]:
        for member in self.members:
            if Path(name).is_relative_to(member.root):
                usable = member.opened and member.state != "down"
                return (member if usable else None), str(Path(name).relative_to(member.root))
        return None, name

    def stray_size(self, name: str) -> int | None:
        member, rest = self._stray_member(name)
        return member.stray_size(rest) if member is not None else None

    def remove_stray(self, name: str) -> None:
        member, rest = self._stray_member(name)
        if member is not None:
            try:
                member.remove_stray(rest)
            except OSError as e:
                member.failed(e)

    def remove_strays(self) -> int:
        removed = 0
        for member in self.members:
            if self._listable(member):
                try:
                    removed += member.remove_strays()
                except OSError as e:
                    member.failed(e)
        return removed


def _score(object_id: str, key: bytes, weight: int) -> float:
    """Weighted rendezvous score: the highest wins; a member twice as large wins twice as often."""
    h = int.from_bytes(hashlib.blake2b(object_id.encode(), key=key, digest_size=8).digest(), "big")
    return weight / -math.log((h + 0.5) / 2 ** 64)


def _no_room(tier: str, object_id: str, size: int, errors: list[OSError]) -> OSError:
    """ENOSPC when a directory lacked room (the mover can make some), else EIO (every one failed or is down)."""
    if any(e.errno in FULL_ERRNOS for e in errors):
        return OSError(errno.ENOSPC, f"{tier}: no directory has room for {object_id} ({size} bytes)")
    return OSError(errno.EIO, f"{tier}: no directory could take {object_id}: {errors[-1] if errors else 'none'}")


class _SourceFailed(Exception):
    """Reading a put's parts failed (the source of a copy): not the member's fault, and not retried."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


def _from_source(parts: Iterable[bytes]) -> Iterator[bytes]:
    it = iter(parts)
    while True:
        try:
            part = next(it)
        except StopIteration:
            return
        except Exception as e:
            raise _SourceFailed(e) from e
        yield part


class _Parts:
    """A put's parts. A list can be written again into another member after a failure; an iterator only
    while the failed put had not started reading it (its temp file could not even be created)."""

    def __init__(self, parts: Iterable[bytes]) -> None:
        self.parts = parts
        self.replayable = isinstance(parts, (list, tuple))
        self.started = False

    def __iter__(self) -> Iterator[bytes]:
        self.started = True
        return _from_source(self.parts)

    def retryable(self) -> bool:
        return self.replayable or not self.started
