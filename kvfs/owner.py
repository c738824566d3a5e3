"""A private L4 belongs to one mount: the claim on it, taken at start, renewed while mounted, released at exit.

A private L4 prefix is one index's store: its start-up reconcile deletes what that index does not name. Two
mounts on one prefix would destroy each other's files, so a mount claims the prefix first and refuses to start
when another mount holds it.

- S3: the owner object `<prefix>/.kvfs-owner` (JSON: mount id, index id, host, pid, start time, lease). It is
  created with If-None-Match: * and replaced (renewal, takeover) with If-Match on the ETag read, so two racing
  mounts never both win. The lease is the store's clock: the object's Last-Modified plus the owner's lease,
  against the Date of the answer. The owner renews it every lease/4 seconds; a renewal that finds the object
  no longer its own fences the tier (no more writes or deletions there) for good.
- Directory: the lock file `DIR/.kvfs-owner`, same JSON, held with flock for the mount's life (kill -9 frees
  the lock; the file keeps the owner's facts for the message). --force replaces the file (a new inode, locked
  by the new owner); the old owner sees the swap at its next check and fences the tier.
- A restart of the same state directory on the same host takes its own claim back at once: the state
  directory's lock proves the previous daemon is gone.
- A takeover (--l4-takeover once the lease has expired, --force at once) makes this index the prefix's: its
  reconcile deletes the objects the previous owner's index named. That is what a takeover means.
- Shared prefixes (--l4-shared) have no owner: a shared mount refuses a prefix that has an owner object, and a
  private mount refuses one that holds published files or access logs (files/, access/).
"""

from __future__ import annotations

import abc
import dataclasses
import datetime
import email.utils
import errno
import fcntl
import json
import logging
import os
import socket
import threading
import time
import uuid
from pathlib import Path

import trio

from .tiers import DirectoryTier, S3Tier, Tier
from .tiers.s3 import ACCESS, FILES

log = logging.getLogger(__name__)

OWNER_NAME = ".kvfs-owner"
DEFAULT_LEASE_S = 60.0
NOT_CLAIMED = "not claimed by this process (read-only)"
PRECONDITION_CODES = ("PreconditionFailed", "412", "ConditionalRequestConflict")


class ClaimRefused(Exception):
    """Another mount owns the L4; the message is one line naming it and the ways out."""


@dataclasses.dataclass(frozen=True)
class OwnerInfo:
    mount_id: str  # one daemon's life
    index_id: str  # the state directory's index, across restarts
    host: str
    pid: int
    started: float  # unix seconds
    lease_s: float

    @classmethod
    def for_this_mount(cls, index_id: str, lease_s: float) -> "OwnerInfo":
        return cls(uuid.uuid4().hex[:12], index_id, socket.gethostname(), os.getpid(), time.time(), lease_s)

    def to_json(self) -> bytes:
        return json.dumps({"kvfs_owner": 1, **dataclasses.asdict(self), "renewed": time.time()}).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "OwnerInfo | None":
        """None when the bytes are not an owner record kvfs wrote."""
        try:
            doc = json.loads(raw)
            return cls(str(doc["mount_id"]), str(doc["index_id"]), str(doc["host"]), int(doc["pid"]),
                       float(doc["started"]), float(doc["lease_s"]))
        except (ValueError, KeyError, TypeError):
            return None

    def same_index(self, other: "OwnerInfo") -> bool:
        return self.index_id == other.index_id and self.host == other.host

    def describe(self) -> str:
        return f"kvfs mount {self.mount_id} (host {self.host}, pid {self.pid}, started {_utc(self.started)})"


def decide(where: str, holder: OwnerInfo | None, me: OwnerInfo, takeover: str | None,
           expires: float | None, now: float) -> str:
    """Whether this mount may take a claim that exists (`holder`; None: unreadable) whose lease runs until
    `expires` (None: no lease, the holder is alive). Returns why it may ('own', 'expired', 'force'); raises
    ClaimRefused with the one-line reason otherwise."""
    if holder is not None and holder.same_index(me):
        return "own"
    if takeover == "force":
        return "force"
    owner = holder.describe() if holder is not None else f"an owner record kvfs cannot read ({OWNER_NAME})"
    if expires is None:
        lease = "its lock is held: it is alive"
    elif now >= expires:
        lease = f"lease expired {_utc(expires)}"
    else:
        lease = f"lease until {_utc(expires)}, in {expires - now:.0f} s"
    if takeover == "expired":
        if expires is not None and now >= expires:
            return "expired"
        if expires is None:
            raise ClaimRefused(f"kvfs: L4 {where} is owned by {owner}; {lease}: --force takes over now")
        raise ClaimRefused(f"kvfs: L4 {where} is owned by {owner}; {lease}: --l4-takeover works once the lease "
                           f"has expired (--force takes over now)")
    ways = ("--l4-takeover once its lease has expired, --force now" if expires is not None else "--force")
    raise ClaimRefused(f"kvfs: L4 {where} is owned by {owner}; {lease}. Another mount's private L4 is not "
                       f"shared: to take it over use {ways} (its files then count as orphans of this mount and "
                       f"are deleted), or mount with --l4-shared if sharing was meant")


def index_id(state_dir: Path) -> str:
    """The state directory's own id (created once): a restart of the same index is the same owner."""
    path = state_dir / "owner-id"
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        value = uuid.uuid4().hex
        tmp = path.with_name("owner-id.tmp")
        tmp.write_text(value + "\n")
        os.replace(tmp, path)
        return value


class Claim(abc.ABC):
    """A claim held on a tier: renewed (or checked) in the background; fences the tier when lost."""

    def __init__(self, tier: Tier, me: OwnerInfo, interval_s: float) -> None:
        self.tier = tier
        self.me = me
        self.interval_s = interval_s
        self.lost = False
        self.lock = threading.Lock()  # a renewal in flight (a worker thread) and the release at exit

    @abc.abstractmethod
    def acquire(self, takeover: str | None) -> None:
        """Take the claim (`takeover`: None, 'expired' or 'force'); ClaimRefused with the reason."""

    @abc.abstractmethod
    def renew(self) -> None:
        """Blocking: confirm the claim (a worker thread calls it); fence the tier when it was taken."""

    @abc.abstractmethod
    def release(self) -> None:
        """Give the claim up if it is still ours (a clean exit)."""

    def check_lapse(self) -> None:
        """Fence the tier when the claim may have lapsed (a lease not renewed in time)."""

    async def keep(self) -> None:
        """The daemon's background task: renew every interval until the claim is lost. A renewal that hangs
        (a store that does not answer) is left behind after an interval; the lapse is checked regardless."""
        while not self.lost:
            await trio.sleep(self.interval_s)
            try:
                with trio.move_on_after(self.interval_s):
                    await trio.to_thread.run_sync(self.renew, abandon_on_cancel=True)
            except Exception:  # a background task must not end the daemon; the next interval tries again
                log.exception("renewing the claim on L4 %s failed", self.tier.describe())
            self.check_lapse()

    def _lose(self, holder: str) -> None:
        self.lost = True
        self.tier.fenced = f"taken over by {holder}"
        self.tier.disowned = True  # its ids may name the new owner's objects now: never read them as ours
        log.error("L4 %s was taken over by %s: this mount no longer reads, writes or deletes there (its files in "
                  "L4 are misses now); remount with another prefix", self.tier.describe(), holder)


class S3Claim(Claim):
    def __init__(self, tier: S3Tier, me: OwnerInfo, interval_s: float) -> None:
        super().__init__(tier, me, interval_s)
        self.s3 = tier
        prefix = tier.location.prefix
        self.key = f"{prefix}/{OWNER_NAME}" if prefix else OWNER_NAME
        self.etag: str | None = None
        self.confirmed_at = 0.0  # monotonic time of the last renewal sent that succeeded
        self.failure = ""  # why the last renewal failed

    def acquire(self, takeover: str | None) -> None:
        self._refuse_shared_prefix()
        for _ in range(5):  # the holder changed while we looked: look again
            sent = time.monotonic()
            try:
                self.etag = self._put(IfNoneMatch="*")
                break
            except FileExistsError:
                pass
            current = self._get()
            if current is None:
                continue  # released meanwhile
            raw, etag, expires, now = current
            holder = OwnerInfo.from_json(raw)
            why = decide(self.s3.location.url, holder, self.me, takeover, expires, now)
            try:
                self.etag = self._put(IfMatch=etag)
            except FileExistsError:
                continue
            if why != "own":
                log.warning("L4 %s: took over the claim of %s (%s); the objects its index named are deleted by "
                            "this mount's reconcile", self.s3.location.url,
                            holder.describe() if holder else "an unreadable owner record", why)
            if why == "force" and now < expires:
                _let_the_holder_notice(holder)
                sent = time.monotonic()
                self.etag = self._put(IfMatch=self.etag)  # the lease from now, not from before the wait
            break
        else:
            raise ClaimRefused(f"kvfs: L4 {self.s3.location.url}: the owner record kept changing; try again")
        self.confirmed_at = sent
        self.s3.fenced = None

    def renew(self) -> None:
        with self.lock:
            if not self.lost and self.etag is not None:
                self._renew()

    def _renew(self) -> None:
        sent = time.monotonic()
        try:
            try:
                self.etag = self._put(IfMatch=self.etag)
            except FileExistsError:
                if not self._still_ours_after_conflict():
                    return
        except OSError as e:
            self.failure = str(e)
            return
        self.confirmed_at, self.failure = sent, ""
        if self.s3.fenced is not None:
            log.info("L4 %s: claim renewed, writing there again", self.s3.location.url)
            self.s3.fenced = None

    def check_lapse(self) -> None:
        """Before the next interval would end past the lease's end, stop writing: another mount may take
        over once it has expired (its clock is the store's; ours counts from the last renewal sent)."""
        if self.lost or self.s3.fenced is not None:
            return
        if time.monotonic() - self.confirmed_at >= self.me.lease_s - self.interval_s:
            self.s3.fenced = "lease not renewed in time (the store did not answer)"
            log.warning("L4 %s: the claim was not renewed for %.0f s (%s): no writes or deletions there until "
                        "a renewal succeeds", self.s3.location.url, time.monotonic() - self.confirmed_at,
                        self.failure or "no answer")

    def _still_ours_after_conflict(self) -> bool:
        """A renewal's condition failed: someone replaced the record (lost), or it was deleted (by hand):
        nobody holds it then, so take it back."""
        current = self._get()
        if current is not None:
            holder = OwnerInfo.from_json(current[0])
            self._lose(holder.describe() if holder else "an unreadable owner record")
            return False
        try:
            self.etag = self._put(IfNoneMatch="*")
        except FileExistsError:
            self._lose("another mount")
            return False
        return True

    def release(self) -> None:
        """Delete the owner object if it is still ours. RGW 16 ignores If-Match on DELETE: read, compare, delete."""
        with self.lock:
            if not self.lost and self.etag is not None:
                self._release()

    def _release(self) -> None:
        try:
            current = self._get()
            ours = current is not None and current[1].strip('"') == self.etag.strip('"')
            if ours:
                self._delete_record()
        except Exception as e:  # noqa: BLE001 - the lease expires by itself
            log.warning("L4 %s: the claim was not released (%s); it expires %g s after its last renewal",
                        self.s3.location.url, e, self.me.lease_s)
            return
        self.etag = None
        log.info("L4 %s: %s", self.s3.location.url, "claim released" if ours else "the owner record is not ours "
                 "any more: left as it is")

    def _delete_record(self) -> None:
        """DELETE with If-Match where the store honours it (AWS), plain where it refuses the header."""
        bucket = self.s3.location.bucket
        try:
            self.s3.client.delete_object(Bucket=bucket, Key=self.key, IfMatch=self.etag)
        except Exception as e:  # noqa: BLE001
            if _code(e) not in ("NotImplemented", "501"):
                raise
            self.s3.client.delete_object(Bucket=bucket, Key=self.key)

    # -- the owner object ------------------------------------------------------------------------------
    def _put(self, **condition: str) -> str:
        """Write our record under the condition; FileExistsError when it does not hold. RGW 16 matches If-Match
        only on the bare ETag (a quoted one always fails); a store that wants it quoted is asked again."""
        body = self.me.to_json()
        if "IfMatch" not in condition:
            return self._put_once(body, condition)
        bare = condition["IfMatch"].strip('"')
        try:
            return self._put_once(body, {"IfMatch": bare})
        except FileExistsError:
            current = self._get()
            if current is None or current[1].strip('"') != bare:
                raise
            return self._put_once(body, {"IfMatch": f'"{bare}"'})

    def _put_once(self, body: bytes, condition: dict[str, str]) -> str:
        try:
            answer = self.s3.client.put_object(Bucket=self.s3.location.bucket, Key=self.key, Body=body,
                                               ContentType="application/json", **condition)
        except Exception as e:  # noqa: BLE001
            if _code(e) in PRECONDITION_CODES or (_code(e) == "NoSuchKey" and "IfMatch" in condition):
                raise FileExistsError(errno.EEXIST, f"{self.key}: precondition failed") from None
            raise OSError(errno.EIO, f"L4 {self.s3.location.url}: owner record not written: {e}") from None
        return answer["ETag"]

    def _get(self) -> tuple[bytes, str, float, float] | None:
        """The owner record, its ETag, its lease's expiry and the store's time now; None when absent."""
        try:
            a = self.s3.client.get_object(Bucket=self.s3.location.bucket, Key=self.key)
        except Exception as e:  # noqa: BLE001
            if _code(e) in ("NoSuchKey", "404", "NotFound"):
                return None
            raise OSError(errno.EIO, f"L4 {self.s3.location.url}: owner record not read: {e}") from None
        raw = a["Body"].read()
        holder = OwnerInfo.from_json(raw)
        now = _server_time(a)
        lease = holder.lease_s if holder is not None else DEFAULT_LEASE_S
        return raw, a["ETag"], a["LastModified"].timestamp() + lease, now

    def _refuse_shared_prefix(self) -> None:
        loc = self.s3.location
        for part in (FILES, ACCESS):
            prefix = f"{loc.prefix}/{part}/" if loc.prefix else f"{part}/"
            try:
                a = self.s3.client.list_objects_v2(Bucket=loc.bucket, Prefix=prefix, MaxKeys=1)
            except Exception as e:  # noqa: BLE001
                raise OSError(errno.EIO, f"L4 {loc.url} not listed: {e}") from None
            if a.get("KeyCount") or a.get("Contents"):
                raise ClaimRefused(f"kvfs: L4 {loc.url} is a shared prefix (it holds {part}/): mount it with "
                                   f"--l4-shared, or give this mount a private prefix of its own")


def refuse_private_owner(tier: S3Tier) -> None:
    """A shared mount must not start on a prefix a private mount owns (its reconcile deletes what others put)."""
    loc = tier.location
    key = f"{loc.prefix}/{OWNER_NAME}" if loc.prefix else OWNER_NAME
    try:
        raw = tier.client.get_object(Bucket=loc.bucket, Key=key)["Body"].read()
    except Exception as e:  # noqa: BLE001
        if _code(e) in ("NoSuchKey", "404", "NotFound"):
            return
        raise OSError(errno.EIO, f"L4 {loc.url}: owner record not read: {e}") from None
    holder = OwnerInfo.from_json(raw)
    owner = holder.describe() if holder else "an unreadable owner record"
    raise ClaimRefused(f"kvfs: L4 {loc.url} is the private prefix of {owner}: a shared mount cannot use it; "
                       f"choose another prefix, or mount without --l4-shared")


class DirectoryClaim(Claim):
    def __init__(self, tier: DirectoryTier, me: OwnerInfo, interval_s: float) -> None:
        super().__init__(tier, me, interval_s)
        self.path = tier.root / OWNER_NAME
        self.fd: int | None = None

    def acquire(self, takeover: str | None) -> None:
        for _ in range(5):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = OwnerInfo.from_json(_read_fd(fd))
                os.close(fd)
                decide(str(self.tier.describe()), holder, self.me, takeover, None, time.time())
                self._replace()
                _let_the_holder_notice(holder)
                log.warning("L4 %s: took over the lock of %s (--force); the objects its index named are deleted "
                            "by this mount's reconcile", self.tier.describe(),
                            holder.describe() if holder else "an unreadable owner record")
                break
            if not self._is_current(fd):
                os.close(fd)  # released (unlinked) between our open and our lock: try the new file
                continue
            previous = OwnerInfo.from_json(_read_fd(fd))
            _write_fd(fd, self.me.to_json())
            self.fd = fd
            if previous is not None and not previous.same_index(self.me):
                log.warning("L4 %s: the lock of %s was free (that mount is gone): claimed; the objects its index "
                            "named are deleted by this mount's reconcile", self.tier.describe(), previous.describe())
            break
        else:
            raise ClaimRefused(f"kvfs: L4 {self.tier.describe()}: the lock file kept changing; try again")
        self.tier.fenced = None

    def _replace(self) -> None:
        """--force on a held lock: a new lock file, locked by us, renamed over the old one."""
        tmp = self.path.with_name(f"{OWNER_NAME}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        _write_fd(fd, self.me.to_json())
        os.replace(tmp, self.path)
        self.fd = fd

    def _is_current(self, fd: int) -> bool:
        try:
            return os.stat(self.path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            return False

    def renew(self) -> None:
        if self.lost or self.fd is None or self._is_current(self.fd):
            return
        try:
            holder = OwnerInfo.from_json(self.path.read_bytes())
        except OSError:
            holder = None
        self._lose(holder.describe() if holder else "another mount")

    def release(self) -> None:
        if self.fd is None:
            return
        if not self.lost and self._is_current(self.fd):
            os.unlink(self.path)  # before the lock goes: a waiter that locks the old file sees it unlinked
            log.info("L4 %s: lock released", self.tier.describe())
        os.close(self.fd)
        self.fd = None


def claim_l4(tiers: list[Tier], state_dir: Path, lease_s: float, takeover: str | None) -> Claim | None:
    """Claim the private L4 among `tiers` (SystemExit with one line when refused); None without one. A shared
    L4 is checked for a private owner instead."""
    l4 = [t for t in tiers if t.shared or t.fenced == NOT_CLAIMED]
    if not l4:
        return None
    tier = l4[0]
    try:
        if tier.shared:
            if isinstance(tier, S3Tier):
                refuse_private_owner(tier)
            return None
        me = OwnerInfo.for_this_mount(index_id(state_dir), lease_s)
        interval = max(0.5, lease_s / 4)
        claim: Claim = S3Claim(tier, me, interval) if isinstance(tier, S3Tier) else DirectoryClaim(tier, me, interval)
        claim.acquire(takeover)
    except ClaimRefused as e:
        raise SystemExit(str(e)) from None
    except OSError as e:
        raise SystemExit(f"kvfs: L4 {tier.describe()}: cannot claim it: {e.strerror or e}") from None
    log.info("L4 %s claimed by mount %s (lease %g s, renewed every %g s)", tier.describe(), me.mount_id, lease_s,
             interval)
    return claim


def _let_the_holder_notice(holder: OwnerInfo | None) -> None:
    """A live owner was forced out: wait for its next check (a quarter of its lease, and a second), so it has
    stopped using the tier before this mount writes there under ids that its index names too."""
    wait = (holder.lease_s if holder is not None else DEFAULT_LEASE_S) / 4 + 1
    log.info("waiting %.0f s for the previous owner's next check of its claim", wait)
    time.sleep(wait)


def _read_fd(fd: int) -> bytes:
    return os.pread(fd, 1 << 16, 0)


def _write_fd(fd: int, data: bytes) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)
    os.fsync(fd)


def _server_time(answer: dict) -> float:
    date = answer.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
    try:
        return email.utils.parsedate_to_datetime(date).timestamp() if date else time.time()
    except (TypeError, ValueError):
        return time.time()


def _utc(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _code(e: Exception) -> str:
    response = getattr(e, "response", None)
    return str(response.get("Error", {}).get("Code", "")) if isinstance(response, dict) else ""
