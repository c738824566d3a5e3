"""The direct-write protocol shared by writers (kvfs/direct_write.py) and the daemon (kvfs/adopt.py).

A writer encodes a file's object in its own process, writes it into the staging directory of the fastest
local tier, and asks the mount to adopt it under a name. The daemon verifies the object, places it (capacity,
demotion) and makes the name point at it in one index transaction. docs/direct.md describes the protocol.

Two extended attributes carry it, both on a directory of the mount:
- `user.kvfs.staging` (getxattr): the offer, ASCII `1 <frame size> <codec> <dtype> <lossy> <staging path>`
  (the path last: it may hold spaces). No answer (ENODATA) where the mount offers no direct writes.
- `user.kvfs.adopt` (setxattr): the request, lines of `key value` (see `AdoptRequest`), names in hex because
  file names and xattr values are arbitrary bytes. Several requests separated by an empty line are a batch,
  adopted all together or not at all (one index transaction; `encode_batch`).

Staged files are named `<writer pid>.<32 hex digits>.kvobj`; one whose writer has exited (or that is older
than STAGED_MAX_AGE_S) is abandoned: reconcile, the daemon's sweep and `kvfs fsck` remove it.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import time

XA_STAGING = "user.kvfs.staging"
XA_ADOPT = "user.kvfs.adopt"
PROTOCOL = 1
STAGING_DIR = "staging"  # inside the tier's root, next to the shard directories (same filesystem: rename)
STAGED_NAME = re.compile(r"(?P<pid>[0-9]{1,10})\.[0-9a-f]{32}\.kvobj")
STAGED_DEAD_GRACE_S = 60.0  # a staged file of an exited writer is kept this long (pids of other namespaces)
STAGED_MAX_AGE_S = 3600.0  # whatever its writer, a staged file older than this is abandoned
MAX_XATTRS = 16
MAX_BATCH = 256  # requests in one setxattr; the value's own bound is XATTR_SIZE_MAX
XATTR_SIZE_MAX = 64 << 10  # Linux's bound on one extended attribute value
_CRASH_AT = os.environ.get("KVFS_CRASH_AT")  # tests only: the step at which this process kills itself (-9)


def crash_point(step: str) -> None:
    """Where a kill -9 leaves a state worth testing (tests/test_direct_write.py sets KVFS_CRASH_AT)."""
    if _CRASH_AT == step:
        os.kill(os.getpid(), signal.SIGKILL)


@dataclasses.dataclass(frozen=True)
class Offer:
    """How a new file in a directory must be encoded, and where its object is staged."""

    frame_size: int
    codec: str  # "auto" or a codec name
    dtype: str  # the mount's default: "auto", "none" or a dtype name
    lossy: str  # the lossy mode new files there get ("none", "mantissa:K", "fp8[:G]")
    staging: str  # absolute path of the staging directory

    def encode(self) -> bytes:
        return f"{PROTOCOL} {self.frame_size} {self.codec} {self.dtype} {self.lossy} {self.staging}".encode()

    @classmethod
    def decode(cls, value: bytes) -> "Offer":
        version, frame_size, codec, dtype, lossy, path = value.decode().split(" ", 5)
        if int(version) != PROTOCOL:
            raise ValueError(f"staging protocol {version}, this kvfs speaks {PROTOCOL}")
        return cls(int(frame_size), codec, dtype, lossy, path)


@dataclasses.dataclass(frozen=True)
class AdoptRequest:
    """Adopt staged object `staged` as the file `name` of the directory the request is set on."""

    staged: str  # file name inside the staging directory
    name: bytes
    mode: int  # permission bits of the new file
    exclusive: bool = False  # EEXIST when the name exists; otherwise it is replaced, as rename(2) would
    xattrs: tuple[tuple[bytes, bytes], ...] = ()  # user.* attributes the file is created with
    shed: bool = False  # refuse it (EBUSY) rather than wait while the mover is congested (back-pressure)

    def encode(self) -> bytes:
        lines = [f"adopt {PROTOCOL}", f"staged {self.staged}", f"mode {self.mode:o}",
                 f"exclusive {int(self.exclusive)}", f"name {self.name.hex()}"]
        lines += [f"xattr {k.hex()} {v.hex()}" for k, v in self.xattrs]
        if self.shed:
            lines.append("shed 1")
        return "\n".join(lines).encode()

    @classmethod
    def decode(cls, value: bytes) -> "AdoptRequest":
        """Parse strictly; ValueError on anything unexpected."""
        fields: dict[str, str] = {}
        xattrs = []
        lines = bytes(value).decode("ascii").split("\n")
        if not lines or lines[0] != f"adopt {PROTOCOL}":
            raise ValueError("not an adopt request of this protocol version")
        for line in lines[1:]:
            key, _, rest = line.partition(" ")
            if key == "xattr":
                name, _, val = rest.partition(" ")
                xattrs.append((bytes.fromhex(name), bytes.fromhex(val)))
            elif key in ("staged", "mode", "exclusive", "name", "shed") and key not in fields:
                fields[key] = rest
            else:
                raise ValueError(f"unexpected line {line[:40]!r}")
        if set(fields) - {"shed"} != {"staged", "mode", "exclusive", "name"} or len(xattrs) > MAX_XATTRS:
            raise ValueError("incomplete request")
        if not STAGED_NAME.fullmatch(fields["staged"]):
            raise ValueError("staged name is not one a writer makes")
        mode = int(fields["mode"], 8)
        if mode & ~0o7777 or fields["exclusive"] not in ("0", "1"):
            raise ValueError("bad mode or exclusive flag")
        if fields.get("shed", "0") not in ("0", "1"):
            raise ValueError("bad shed flag")
        return cls(fields["staged"], bytes.fromhex(fields["name"]), mode, fields["exclusive"] == "1",
                   tuple(xattrs), fields.get("shed") == "1")


def encode_batch(requests: "list[AdoptRequest]") -> bytes:
    """One setxattr value adopting all of `requests` (files of one directory) together."""
    return b"\n\n".join(r.encode() for r in requests)


def decode_batch(value: bytes) -> "list[AdoptRequest]":
    """The requests of a batch (one, for a single request). ValueError when one is malformed, when there are
    too many, or when two name the same file or staged object."""
    requests = [AdoptRequest.decode(part) for part in bytes(value).split(b"\n\n")]
    if len(requests) > MAX_BATCH:
        raise ValueError(f"{len(requests)} requests in one batch, at most {MAX_BATCH}")
    if len({r.name for r in requests}) != len(requests) or len({r.staged for r in requests}) != len(requests):
        raise ValueError("two requests of the batch name the same file or staged object")
    return requests


def staged_name(pid: int | None = None) -> str:
    return f"{pid or os.getpid()}.{os.urandom(16).hex()}.kvobj"


def abandoned(name: str, mtime: float, now: float | None = None) -> bool:
    """A staged file nobody will ask to adopt: its writer has exited (after a grace period, since a pid of
    another pid namespace means nothing here), it is too old, or it is not named as writers name them."""
    age = (time.time() if now is None else now) - mtime
    if age > STAGED_MAX_AGE_S:
        return True
    if age <= STAGED_DEAD_GRACE_S:
        return False
    match = STAGED_NAME.fullmatch(name)
    return match is None or not _alive(int(match["pid"]))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: it exists
    return True
