"""The hot/cold API: where a file lives, steered by name — pin, unpin, move to a tier, prefetch, drop, idle.

Requests arrive as extended attributes on files and directories of the mount, so filesystem permissions
apply (setting a user.* xattr needs write access to the file); `kvfs.client` and the `kvfs` CLI set them.
A request on a directory applies to every regular file of its tree at that moment.

  user.kvfs.pin       1 | 0: keep hot — promoted to the fastest tier (in the background) and never demoted or
                      evicted (I8); readable by name, not listed (cp -a, rsync -X do not copy pins). All pins
                      together may fill the fastest tier up to its high watermark (the pin limit): a pin
                      that would pass it is refused as a whole (ENOSPC). removexattr = 0.
  user.kvfs.tier      L2 | L3 | L4: move there now; the call returns when the object is there. Its current
                      value (or `none`, a file with no object yet) changes nothing. A pinned file is not
                      demoted (EBUSY; a tree skips its pinned files). Reads answer where the file is; not
                      listed, so copies do not carry it into another mount as a request (docs/hotcold.md).
  user.kvfs.prefetch  any value: promote to the fastest tier in the background; the call returns at once.
  user.kvfs.drop      any value: remove the file from every tier now (its names too: the next lookup misses).
  user.kvfs.idle      DURATION | off | default: the idle policy of a file or a directory (new entries inherit
                      a directory's): not read for k periods, it sits at least k tiers down. Reads answer the
                      period in effect, in seconds (0 = never).
  user.kvfs.ttl       DURATION | off: the retention time of a file or a directory (new entries inherit a
                      directory's): the file is dropped from every tier DURATION after its last write, pinned
                      or not (I9, docs/hotcold.md "Retention"). Reads answer it in seconds; none set: ENODATA.

Moves are the mover's (the move protocol); a prefetch joins its promotion queue.
"""

from __future__ import annotations

import errno
import logging
import stat
from collections.abc import Awaitable, Callable

from .config import ConfigError, parse_duration, parse_idle
from .index import Index
from .mover import Mover
from .stats import Counters
from .store import Store

log = logging.getLogger(__name__)

XA_PIN = b"user.kvfs.pin"
XA_TIER = b"user.kvfs.tier"
XA_PREFETCH = b"user.kvfs.prefetch"
XA_DROP = b"user.kvfs.drop"
XA_IDLE = b"user.kvfs.idle"
XA_TTL = b"user.kvfs.ttl"
REQUEST_XATTRS = (XA_PIN, XA_TIER, XA_PREFETCH, XA_DROP, XA_IDLE, XA_TTL)  # readable by name at most, never listed

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class RequestError(OSError):
    """A request refused: errno for the caller, the reason for the log."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(code, reason)


def text_of(value: bytes) -> str:
    return bytes(value).rstrip(b"\0").decode(errors="replace").strip()


def parse_flag(value: bytes) -> bool:
    text = text_of(value).lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise RequestError(errno.EINVAL, f"pin takes 1 or 0, not {text[:20]!r}")


def parse_idle_value(value: bytes) -> int | None:
    """None = back to the mount's default."""
    text = text_of(value)
    if text.lower() == "default":
        return None
    try:
        return parse_idle(text)
    except ConfigError as e:
        raise RequestError(errno.EINVAL, str(e)) from None


def parse_ttl_value(value: bytes) -> int | None:
    """A retention time in whole seconds (at least 1), or None for off."""
    text = text_of(value)
    if text.lower() in ("off", "none", "never", "0"):
        return None
    try:
        seconds = parse_duration(text)
    except ValueError as e:
        raise RequestError(errno.EINVAL, f"ttl: {e}, or off") from None
    if seconds < 1:
        raise RequestError(errno.EINVAL, f"ttl {text!r} is under a second: expiry is swept once a second")
    return int(seconds)


class HotCold:
    def __init__(self, index: Index, store: Store, mover: Mover, counters: Counters,
                 drop_file: Callable[[int], Awaitable[bool]]) -> None:
        self.index = index
        self.store = store
        self.mover = mover
        self.counters = counters
        self.drop_file = drop_file  # the filesystem's: names, kernel caches, open handles

    # -- requests (ino: a file or a directory) ------------------------------------------------------------
    async def request(self, ino: int, name: bytes, value: bytes) -> None:
        if name == XA_PIN:
            self.pin(ino, parse_flag(value))
        elif name == XA_TIER:
            await self.move_to(ino, text_of(value))
        elif name == XA_PREFETCH:
            self.prefetch(ino)
        elif name == XA_DROP:
            await self.drop(ino)
        elif name == XA_IDLE:
            self.set_idle(ino, parse_idle_value(value))
        elif name == XA_TTL:
            self.set_ttl(ino, parse_ttl_value(value))
        else:
            raise RequestError(errno.EOPNOTSUPP, f"{name!r} is no kvfs request")

    def pin(self, ino: int, pinned: bool) -> int:
        """Pin or unpin every file of the tree; a pin that would pass a tier's pin limit is refused whole."""
        files = self.index.tree_files(ino)
        rows = [r for r in map(self.index.get, files) if r is not None and bool(r["pinned"]) != pinned]
        if pinned:
            self._check_pin_budget(rows)
        self.index.set_pinned([r["id"] for r in rows], pinned)
        if pinned:
            for r in rows:  # pinned files belong in the fastest tier (I8)
                self.mover.prefetch(r["id"])
        return len(rows)

    def _check_pin_budget(self, rows) -> None:
        more = sum(r["stored_bytes"] for r in rows if r["obj_gen"])
        have, limit = self.index.pinned_bytes(), self.mover.pin_limit()
        if have + more > limit:
            self.counters.pin_refusals += 1
            fastest = self.store.order[0].name
            raise RequestError(errno.ENOSPC, f"pinning {_mib(more)} more would pass {fastest}'s pin limit: "
                               f"{_mib(have)} of {_mib(limit)} pinned")

    async def move_to(self, ino: int, tier_name: str) -> int:
        """Move every file of the tree to the named tier now. Returns how many moved; raises the first error
        (a tree still tries all its files)."""
        if tier_name.lower() == "none":
            return 0  # what a file with no object reads: copying xattrs must not fail
        dest = self.store.tiers.get(tier_name.upper())
        if dest is None:
            raise RequestError(errno.EINVAL, f"no tier {tier_name[:20]!r} here (tiers: "
                               f"{', '.join(self.store.tiers)})")
        files = self.index.tree_files(ino)
        single = files == [ino]
        moved, first_error = 0, None
        for f in files:
            try:
                moved += await self._move_one(f, dest.name, strict=single)
            except OSError as e:
                first_error = first_error or e
        if first_error is not None:
            raise first_error
        return moved

    async def _move_one(self, ino: int, dest_name: str, strict: bool) -> bool:
        row = self.index.get(ino)
        if row is None or not row["obj_gen"] or row["obj_tier"] == dest_name:
            return False
        order = [t.name for t in self.store.order]
        dest = self.store.tiers[dest_name]
        down = order.index(dest_name) > order.index(row["obj_tier"])
        if down and row["pinned"]:
            if strict:
                raise RequestError(errno.EBUSY, "the file is pinned: unpin it first")
            return False
        if not dest.available():
            # not EAGAIN: the kernel turns a setxattr's EAGAIN into EOPNOTSUPP ("no xattrs here")
            raise RequestError(errno.EHOSTDOWN, f"{dest_name} is not answering now")
        if row["stored_bytes"] > dest.capacity:
            raise RequestError(errno.ENOSPC, f"the object ({row['stored_bytes'] >> 20} MiB) is larger than "
                               f"{dest_name} ({dest.capacity >> 20} MiB)")
        if not down:
            self.index.note_use(ino)  # brought up to be used: not the first file a drain picks
        if await self.mover.move(ino, dest, wait=True):
            self.counters.requested_moves += 1
            await self.mover.pages_forgotten(ino)  # demoted: its next read reaches kvfs, as asked
            return True
        row = self.index.get(ino)
        if row is None or not row["obj_gen"] or row["obj_tier"] == dest_name:
            return False  # rewritten, dropped or moved meanwhile: nothing left to do
        if dest.shared and self.mover.conflicted(ino):
            raise RequestError(errno.EEXIST, "another node published this name in the shared L4 first")
        full = not self.store.fits(dest, row["stored_bytes"])
        raise RequestError(errno.ENOSPC if full else errno.EIO, f"the move to {dest_name} failed"
                           + (": no room could be made" if full else " (see the log)"))

    def prefetch(self, ino: int) -> int:
        queued = sum(self.mover.prefetch(f) for f in self.index.tree_files(ino))
        self.counters.prefetches += queued
        return queued

    async def drop(self, ino: int) -> int:
        dropped = 0
        for f in self.index.tree_files(ino):
            dropped += await self.drop_file(f)
        return dropped

    def set_idle(self, ino: int, seconds: int | None) -> None:
        self.index.set_idle_policy(self._inherited_by(ino), seconds)
        self.mover.wake()

    def set_ttl(self, ino: int, seconds: int | None) -> None:
        self.index.set_ttl(self._inherited_by(ino), seconds)
        self.mover.wake()

    def _inherited_by(self, ino: int) -> list[int]:
        """The files of a tree, and for a directory its directories too: they pass a policy on to the entries
        created in them later."""
        row = self.index.get(ino)
        targets = self.index.tree_files(ino)
        if row is not None and stat.S_ISDIR(row["mode"]):
            targets += self.index.tree_dirs(ino)
        return targets

    # -- reads -------------------------------------------------------------------------------------------
    def read(self, ino: int, name: bytes) -> bytes | None:
        """The value of a readable request attribute (pin, idle); None: no such attribute here."""
        row = self.index.get(ino)
        if row is None:
            return None
        if name == XA_PIN:
            if stat.S_ISREG(row["mode"]):
                return b"1" if row["pinned"] else b"0"
            if stat.S_ISDIR(row["mode"]):  # 1 when the tree has files and all of them are pinned
                rows = [self.index.get(f) for f in self.index.tree_files(ino)]
                return b"1" if rows and all(r["pinned"] for r in rows) else b"0"
            return None
        if name == XA_IDLE:
            own = row["idle_policy_s"]
            return str(self.mover.idle_s if own is None else own).encode()
        if name == XA_TTL and row["ttl_s"]:
            return str(row["ttl_s"]).encode()
        return None


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"
