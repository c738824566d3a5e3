"""kvfs.client: the hot/cold API for engines and scripts — pin, unpin, demote, prefetch, drop, idle, status.

Every call is an extended-attribute request on a path in the mount (kvfs/hotcold.py lists them), so the
filesystem's permissions apply and any language can do the same with setxattr(2). Errors are KvfsError
(an OSError with the errno the daemon answered) whose message says what to do.

    from kvfs import client
    client.pin("/mnt/kvfs/conv-42", recursive=True)       # keep a live conversation where it is
    client.demote("/mnt/kvfs/conv-17", to="L3", recursive=True)   # push an idle one down now
    client.prefetch(paths)                                # bring a returning session back, in the background
    client.set_idle("/mnt/kvfs/chat", "10m", recursive=True)     # not read for 10 min: down a tier

On a directory, `recursive=True` is required. pin, unpin and set_idle send one request for the whole tree
(a pin is then granted or refused whole); demote, prefetch and drop go file by file, reporting progress.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

XA_PIN = "user.kvfs.pin"
XA_TIER = "user.kvfs.tier"
XA_PREFETCH = "user.kvfs.prefetch"
XA_DROP = "user.kvfs.drop"
XA_IDLE = "user.kvfs.idle"
XA_TTL = "user.kvfs.ttl"

PathArg = str | os.PathLike | Iterable[str | os.PathLike]
Progress = Callable[[int, int], None]  # (files done, files in all)


class KvfsError(OSError):
    """A request the mount refused or could not do; str() says why and what to do."""


@dataclasses.dataclass(frozen=True)
class FileStatus:
    path: str
    tier: str  # 'none': no object yet (empty or never committed)
    pinned: bool
    idle_s: int  # the idle period in effect, 0 = never
    codec: str
    size: int
    stored_bytes: int
    transform: str = "none"
    ttl_s: int | None = None  # retention (user.kvfs.ttl); None: none set


def pin(paths: PathArg, *, recursive: bool = False) -> int:
    """Never demote or evict these files. Refused whole (KvfsError, ENOSPC) if a tier's pins would pass its
    pin limit. Returns the number of paths requested."""
    return _per_tree(paths, XA_PIN, b"1", recursive)


def unpin(paths: PathArg, *, recursive: bool = False) -> int:
    return _per_tree(paths, XA_PIN, b"0", recursive)


def set_idle(paths: PathArg, after: str | int | None, *, recursive: bool = False) -> int:
    """Idle policy: not read for `after` (seconds or '10m', '2h'; 0/'off' = never; None = the mount's
    default), a file goes down a tier, one more per further period. A directory passes it to new entries."""
    value = b"default" if after is None else str(after).encode()
    return _per_tree(paths, XA_IDLE, value, recursive)


def demote(paths: PathArg, to: str, *, recursive: bool = False, progress: Progress | None = None) -> int:
    """Move files to tier `to` now (any tier: 'L2' promotes). Returns when they are there; pinned files in
    a tree are skipped (a single pinned file is an error)."""
    return _per_file(paths, XA_TIER, to.encode(), recursive, progress)


def prefetch(paths: PathArg, *, recursive: bool = False, progress: Progress | None = None) -> int:
    """Promote files to the fastest tier in the background (returns at once)."""
    return _per_file(paths, XA_PREFETCH, b"1", recursive, progress)


def drop(paths: PathArg, *, recursive: bool = False, progress: Progress | None = None) -> int:
    """Remove files from every tier now: their next lookup is a miss. Directories stay."""
    return _per_file(paths, XA_DROP, b"1", recursive, progress)


def status(path: str | os.PathLike) -> FileStatus:
    """Where a file lies and how it is stored: kvfs's attributes of it, readable by name (not listed)."""
    def attr(name: str) -> str:
        return _call(os.getxattr, path, name).decode()

    def ttl() -> int | None:
        try:
            return int(os.getxattr(path, XA_TTL))
        except OSError as e:
            if e.errno != errno.ENODATA:
                raise KvfsError(e.errno, _explain(str(path), XA_TTL, (), e), str(path)) from None
            return None

    st = os.stat(path)
    return FileStatus(str(path), attr(XA_TIER), attr(XA_PIN) == "1", int(attr(XA_IDLE)),
                      attr("user.kvfs.codec"), st.st_size, int(attr("user.kvfs.stored_bytes")),
                      attr("user.kvfs.transform"), ttl())


def files(paths: PathArg, recursive: bool) -> Iterator[str]:
    """The regular files named, directories expanded (recursive) — in the order given, then walk order."""
    for p in _paths(paths):
        if not os.path.isdir(p):
            yield p
            continue
        _need_recursive(p, recursive)
        top = mount_root(p)
        for root, dirs, names in os.walk(p):
            dirs.sort()
            if os.path.abspath(root) == top:  # the mount's virtual statistics directory holds no files of yours
                dirs[:] = [d for d in dirs if d != ".kvfs"]
            for name in sorted(names):
                full = os.path.join(root, name)
                if os.path.isfile(full) and not os.path.islink(full):
                    yield full


def mount_root(path: str | os.PathLike) -> str | None:
    """The kvfs mount a path lies in, or None."""
    p = Path(os.path.abspath(path))
    for candidate in (p, *p.parents):
        if os.path.ismount(candidate):
            return str(candidate) if (candidate / ".kvfs" / "stats").exists() else None
    return None


# -- plumbing ------------------------------------------------------------------------------------------------
def _paths(paths: PathArg) -> list[str]:
    """The paths given, each checked to lie in a kvfs mount (elsewhere a user.* xattr would just be stored)."""
    out = [os.fspath(paths)] if isinstance(paths, (str, os.PathLike)) else [os.fspath(p) for p in paths]
    roots: dict[str, str | None] = {}
    for p in out:
        parent = os.path.dirname(os.path.abspath(p))
        if parent not in roots:
            roots[parent] = mount_root(p)
        if roots[parent] is None:
            raise KvfsError(errno.ENOTSUP, f"{p} is not in a kvfs mount", p)
    return out


def _need_recursive(path: str, recursive: bool) -> None:
    if not recursive:
        raise KvfsError(errno.EISDIR, f"{path} is a directory: ask for its whole tree (recursive, -r)", path)


def _per_tree(paths: PathArg, name: str, value: bytes, recursive: bool) -> int:
    done = 0
    for p in _paths(paths):
        if os.path.isdir(p):
            _need_recursive(p, recursive)
        _call(os.setxattr, p, name, value)
        done += 1
    return done


def _per_file(paths: PathArg, name: str, value: bytes, recursive: bool, progress: Progress | None) -> int:
    todo = list(files(paths, recursive))
    for i, p in enumerate(todo, 1):
        _call(os.setxattr, p, name, value)
        if progress is not None:
            progress(i, len(todo))
    return len(todo)


def _call(fn, path, name: str, *args):
    try:
        return fn(path, name, *args)
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.EACCES, errno.EPERM, errno.EISDIR):
            raise KvfsError(e.errno, f"{path}: {e.strerror}", str(path)) from None
        raise KvfsError(e.errno, _explain(str(path), name, args, e), str(path)) from None


def _explain(path: str, name: str, args: tuple, e: OSError) -> str:
    value = args[0].decode(errors="replace") if args else ""
    if e.errno in (errno.ENOTSUP, errno.EOPNOTSUPP) or (e.errno == errno.ENODATA and mount_root(path) is None):
        return f"{path} is not in a kvfs mount"
    if name == XA_PIN and e.errno == errno.ENOSPC:
        return f"{path}: pin refused: {_pin_budget(path)}"
    if name == XA_TIER and e.errno == errno.EBUSY:
        return f"{path} is pinned: unpin it before demoting it"
    if name == XA_TIER and e.errno == errno.EINVAL:
        return f"{path}: no tier {value!r} in this mount (it has {', '.join(_tiers(path)) or '?'})"
    if name == XA_TIER and e.errno == errno.ENOSPC:
        return f"{path}: {value} has no room for it (or its pin limit would be passed)"
    if name == XA_TIER and e.errno == errno.EEXIST:
        return f"{path}: another node published this name in the shared L4 first"
    if e.errno in (errno.EHOSTDOWN, errno.EAGAIN):
        return f"{path}: the tier is not answering now; try again later"
    if name == XA_IDLE and e.errno == errno.EINVAL:
        return f"{path}: not an idle period: {value!r} (use seconds, 30m, 2h, off or default)"
    return f"{path}: {name}={value}: {e.strerror}"


def _stats(path: str) -> dict:
    root = mount_root(path)
    if root is None:
        return {}
    try:
        return json.loads(Path(root, ".kvfs", "stats").read_bytes())
    except (OSError, ValueError):
        return {}


def _tiers(path: str) -> list[str]:
    return list(_stats(path).get("tiers", {}))


def _pin_budget(path: str) -> str:
    doc = _stats(path)
    limit = doc.get("mover", {}).get("pin_limit_bytes")
    if limit is None:
        return "all pins together would pass the pin limit"
    pinned = sum(t.get("pinned_bytes", 0) for t in doc.get("tiers", {}).values())
    fastest = next(iter(doc.get("tiers", {})), "L2")
    return (f"pins may fill {fastest} up to its high watermark ({limit / (1 << 20):.1f} MiB), "
            f"{pinned / (1 << 20):.1f} MiB are pinned already")
