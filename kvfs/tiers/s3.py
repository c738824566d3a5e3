"""A tier on an S3-compatible object store (Ceph RGW, MinIO, AWS S3): kvfs's L4.

Layout: s3://<bucket>/<prefix>/objects/<2 hex digits>/<object_id>, the same encoded objects as the local tiers
(moves copy them as they are, no recompression). Each object's user metadata repeats what its header says —
logical size, dtype, codec, lossy mode — so a listing or a HEAD tells what an object holds without a GET.

- Endpoint and credentials come the standard way: AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID /
  AWS_SECRET_ACCESS_KEY, AWS_PROFILE and the AWS config files; or the [l4] section of the TOML config. Never
  from the command line, never into logs (S3Location hides the secret from its repr).
- Puts are atomic by the store's own semantics: a single PUT up to `multipart_threshold`, multipart above it
  (aborted on failure, so no partial object is ever visible). Reads are ranged GETs: only the frames a read
  touches travel. A whole-object copy (promotion) is one GET. GETs skip the client's per-call machinery
  (s3_get.DirectGet: botocore's signer on the client's own connections), the rest goes through the client.
- Every call has a connect and read timeout and a bounded number of retries (botocore's standard mode).
  A missing object raises FileNotFoundError, like a local tier; any other failure OSError(EIO).
"""

from __future__ import annotations

import base64
import dataclasses
import errno
import json
import logging
import threading
from collections.abc import Iterable, Iterator

from .. import format as fmt
from .base import ObjectInfo, Tier, chunks_by_reads
from .breaker import Breaker
from .directory import hash_shard
from .s3_get import DirectGet

log = logging.getLogger(__name__)

OBJECTS = "objects"
QUARANTINE = "quarantine"
FILES = "files"  # a shared prefix: published files by path, <prefix>/files/<path in the mount>
ACCESS = "access"  # a shared prefix: logs of reads, one object per flush per mount (kvfs gc reads them)
META_PREFIX = "kvfs-"
COPY_WHOLE_MAX = 64 << 20  # a copy fetches objects up to this size in one GET, bigger ones in ranged GETs of it


@dataclasses.dataclass(frozen=True)
class S3Location:
    """Where L4 lives and how to reach it. Credentials given here (TOML) override the environment's."""

    bucket: str
    prefix: str = ""
    endpoint_url: str | None = None  # None: AWS_ENDPOINT_URL or the AWS config files, else AWS itself
    region: str | None = None
    profile: str | None = None
    path_style: bool | None = None  # None: path-style when an endpoint is set (RGW, MinIO), else virtual-host
    access_key_id: str | None = dataclasses.field(default=None, repr=False)
    secret_access_key: str | None = dataclasses.field(default=None, repr=False)
    timeout_s: float = 10.0  # per attempt: connecting and each read of the answer
    attempts: int = 3
    deadline_s: float = 15.0  # per call, retries included (+ time for its bytes at 8 MB/s); EIO past it
    breaker_failures: int = 3  # failures in a row that mark the store down (calls fail fast) …
    probe_s: float = 5.0  # … until a probe, one call this often, succeeds
    shared: bool = False  # one namespace for every mount on this prefix (files by path, published once)
    write_policy: str = "demote"  # or "through": every committed file is published once it has settled
    access_log_s: float = 30.0  # a shared prefix: how often a mount writes the log of its reads
    multipart_threshold: int = 16 << 20
    part_size: int = 8 << 20

    @classmethod
    def parse_url(cls, url: str, **options) -> "S3Location":
        """'s3://BUCKET/PREFIX' → S3Location; ValueError for anything else."""
        if not url.startswith("s3://"):
            raise ValueError(f"not an s3:// URL: {url!r}")
        bucket, _, prefix = url[len("s3://"):].partition("/")
        if not bucket:
            raise ValueError(f"no bucket in {url!r}")
        return cls(bucket=bucket, prefix=prefix.strip("/"), **options)

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"


class S3Unavailable(OSError):
    """The store did not answer as it should (down, refusing, timed out): EIO for the caller."""

    def __init__(self, what: str, cause: Exception) -> None:
        super().__init__(errno.EIO, f"{what}: {_describe(cause)}")


class S3Tier(Tier):
    def __init__(self, name: str, location: S3Location, capacity: int) -> None:
        super().__init__(name, capacity, persistent=True)
        self.location = location
        self.client, credentials = _client(location)
        self._direct = _direct_get(self.client, credentials, location)
        self._base = f"{location.prefix}/{OBJECTS}/" if location.prefix else f"{OBJECTS}/"
        self._lock = threading.Lock()
        self.requests = {"get": 0, "put": 0, "head": 0, "delete": 0, "list": 0}
        self.bytes_in = 0  # downloaded
        self.bytes_out = 0  # uploaded
        self.failures = 0
        self.timeouts = 0
        self.quarantined = 0
        self.deadline_s = location.deadline_s
        self.shared = location.shared
        self.breaker = Breaker(f"L4 {location.url}", location.breaker_failures, location.probe_s)

    def describe(self) -> str:
        return self.location.url

    def admit(self) -> None:
        self.breaker.admit()

    def available(self) -> bool:
        return self.fenced is None and self.breaker.available()

    def note_timeout(self, what: str) -> None:
        with self._lock:
            self.timeouts += 1
            self.failures += 1
        self.breaker.failure(f"no answer within the deadline ({what})")

    # -- checks ------------------------------------------------------------------------------------------
    def check(self) -> None:
        """Fail at mount with a clear message when the bucket cannot be reached or used."""
        try:
            self.client.head_bucket(Bucket=self.location.bucket)
        except Exception as e:  # noqa: BLE001 - every failure becomes one clear message
            endpoint = self.client.meta.endpoint_url
            raise S3Unavailable(f"L4 {self.location.url} at {endpoint} is not usable", e) from None

    # -- the tier interface --------------------------------------------------------------------------------
    def _key(self, object_id: str) -> str:
        if object_id.startswith(f"{FILES}/"):  # a published file's id is its key under the prefix
            return f"{self.location.prefix}/{object_id}" if self.location.prefix else object_id
        return f"{self._base}{hash_shard(object_id):02x}/{object_id}"

    # -- the shared namespace (location.shared) ------------------------------------------------------------
    def publish(self, object_id: str, source: Tier, source_id: str, size: int, meta: dict[str, str],
                transcode=None) -> str:
        """Upload a file under its path id if no one has (If-None-Match: *), sealed on the way by `transcode`
        (kvfs/sealing.py) when given. Returns the ETag; FileExistsError when another node published that name
        first."""
        self.check_writable()
        body = b"".join(source.chunks(source_id, size))
        if len(body) != size:
            raise fmt.CorruptObject(f"object {source_id} in {source.name} is shorter than {size} bytes")
        if transcode is not None:
            body = transcode.body(body)
        try:
            answer = self.client.put_object(Bucket=self.location.bucket, Key=self._key(object_id), Body=body,
                                            Metadata={**_metadata(body), **meta}, IfNoneMatch="*")
        except Exception as e:  # noqa: BLE001
            if _code(e) in ("PreconditionFailed", "412", "ConditionalRequestConflict"):
                self._count("put")
                raise FileExistsError(errno.EEXIST, f"{object_id} is published already") from None
            raise self._failure("put", object_id, e) from None
        self._count("put", out=len(body))
        return answer["ETag"]

    def head(self, object_id: str) -> dict | None:
        """A published file's facts (size, stored bytes, ETag, mode, mtime), None when absent."""
        try:
            a = self._call("head", self.client.head_object, Bucket=self.location.bucket, Key=self._key(object_id))
        except FileNotFoundError:
            return None
        meta = a.get("Metadata", {})
        try:
            size = int(meta[f"{META_PREFIX}size"])
        except (KeyError, ValueError):
            return None  # not a kvfs object: not adopted
        return {"size": size, "stored_bytes": int(a["ContentLength"]), "etag": a["ETag"],
                "mode": int(meta.get(f"{META_PREFIX}mode", "0o100644"), 0),
                "mtime_ns": int(a["LastModified"].timestamp() * 1e9),
                "xattrs": decode_xattrs(meta.get(f"{META_PREFIX}xattrs", "")),
                "ttl_s": _positive_int(meta.get(f"{META_PREFIX}ttl"))}

    def list_dir(self, dir_id: str) -> tuple[list[str], list[str]]:
        """Names of the files and of the subdirectories under a published directory id ('files/a/b/')."""
        prefix = self._key(dir_id)
        files, dirs = [], []
        paginator = self.client.get_paginator("list_objects_v2")
        try:
            for page in paginator.paginate(Bucket=self.location.bucket, Prefix=prefix, Delimiter="/"):
                self._count("list")
                files += [o["Key"][len(prefix):] for o in page.get("Contents", [])]
                dirs += [p["Prefix"][len(prefix):].rstrip("/") for p in page.get("CommonPrefixes", [])]
        except Exception as e:  # noqa: BLE001
            raise self._failure("list", prefix, e) from None
        return [f for f in files if f and "/" not in f], [d for d in dirs if d]

    def has_children(self, dir_id: str) -> bool:
        """Whether anything is published under a directory id ('files/a/b/'): one key listed at most."""
        a = self._call("list", self.client.list_objects_v2, Bucket=self.location.bucket, Prefix=self._key(dir_id),
                       MaxKeys=1)
        return bool(a.get("KeyCount") or a.get("Contents"))

    def put_access_log(self, name: str, lines: str) -> None:
        """One batch of this mount's reads of published files: '<file id>\t<unix seconds>' per line."""
        root = f"{self.location.prefix}/{ACCESS}" if self.location.prefix else ACCESS
        self.check_writable()
        body = lines.encode()
        self._call("put", self.client.put_object, Bucket=self.location.bucket, Key=f"{root}/{name}", Body=body)
        self._count(out=len(body))

    def delete_if(self, object_id: str, etag: str) -> bool:
        """Delete a published file only if it is still the object this node read (same ETag)."""
        facts = self.head(object_id)
        if facts is None or facts["etag"] != etag:
            return False
        self.delete(object_id)
        return True

    def put(self, object_id: str, parts: Iterable[bytes], durable: bool) -> int:
        self.check_writable()
        key = self._key(object_id)
        buffered: list[bytes] = []
        size = 0
        upload = None
        try:
            for part in parts:
                buffered.append(bytes(part))
                size += len(part)
                if upload is None and size > self.location.multipart_threshold:
                    upload = _Multipart(self, key, _metadata(buffered[0]))
                if upload is not None:
                    buffered = upload.feed(buffered)
            if upload is None:
                body = b"".join(buffered)
                self._call("put", self.client.put_object, Bucket=self.location.bucket, Key=key, Body=body,
                           Metadata=_metadata(body))
                self._count(out=len(body))
            else:
                upload.finish(buffered)
        except BaseException:
            if upload is not None:
                upload.abort()
            raise
        return size

    def read(self, object_id: str, offset: int, length: int) -> bytes:
        self.check_readable(object_id)
        if length <= 0:
            return b""
        try:
            data = self._get(self._key(object_id), offset, offset + length - 1)
        except Exception as e:  # noqa: BLE001 - sorted below
            if _code(e) == "InvalidRange":
                self._count("get")
                return b""  # past the end: the object is shorter, as a short local read says
            raise self._failure("get", object_id, e) from None
        self._count("get", into=len(data))
        return data

    def chunks(self, object_id: str, size: int) -> Iterator[bytes]:
        """The whole object (a promotion's copy): one GET up to COPY_WHOLE_MAX, else ranged GETs of that size
        (the object is immutable: its pieces cannot come from different versions)."""
        self.check_readable(object_id)
        if size > COPY_WHOLE_MAX:
            yield from chunks_by_reads(self, object_id, size, COPY_WHOLE_MAX)
            return
        try:
            whole = self._get(self._key(object_id))
        except Exception as e:  # noqa: BLE001
            raise self._failure("get", object_id, e) from None
        self._count("get", into=len(whole))
        if whole:
            yield whole

    def size_of(self, object_id: str) -> int | None:
        if self.disowned:
            return None  # not this mount's any more: absent, as far as it is concerned
        try:
            answer = self._call("head", self.client.head_object, Bucket=self.location.bucket,
                                Key=self._key(object_id))
        except FileNotFoundError:
            return None
        return int(answer["ContentLength"])

    def delete(self, object_id: str) -> None:
        self.check_writable()
        self._call("delete", self.client.delete_object, Bucket=self.location.bucket, Key=self._key(object_id))

    def delete_many(self, object_ids: list[str]) -> None:
        self.check_writable()
        for i in range(0, len(object_ids), 1000):
            keys = [{"Key": self._key(oid)} for oid in object_ids[i:i + 1000]]
            answer = self._call("delete", self.client.delete_objects, Bucket=self.location.bucket,
                                Delete={"Objects": keys, "Quiet": True})
            errors = [e for e in answer.get("Errors", []) if e.get("Code") != "NoSuchKey"]
            if errors:
                raise S3Unavailable(f"L4 delete of {len(errors)} objects", RuntimeError(errors[0].get("Message", "")))

    def scan(self) -> Iterator[ObjectInfo]:
        if self.location.shared:
            return  # other nodes' files are not this mount's orphans: a shared prefix is managed by kvfs gc
        for key, size in self._list(self._base):
            shard, _, oid = key[len(self._base):].partition("/")
            if oid and "/" not in oid and shard == f"{hash_shard(oid):02x}":
                yield ObjectInfo(oid, size)

    def remove_strays(self) -> int:
        """Abandoned multipart uploads (a crash mid-upload) and keys out of place under the prefix."""
        self.check_writable()
        removed = 0
        uploads = self._call("list", self.client.list_multipart_uploads, Bucket=self.location.bucket,
                             Prefix=self._base)
        for u in uploads.get("Uploads", []):
            self._call("delete", self.client.abort_multipart_upload, Bucket=self.location.bucket, Key=u["Key"],
                       UploadId=u["UploadId"])
            removed += 1
        for key, _ in ([] if self.location.shared else self._list(self._base)):
            shard, _, oid = key[len(self._base):].partition("/")
            if not oid or "/" in oid or shard != f"{hash_shard(oid):02x}":
                self._call("delete", self.client.delete_object, Bucket=self.location.bucket, Key=key)
                removed += 1
        return removed

    def quarantine(self, object_id: str) -> str:
        """Move a corrupt object (server-side copy, then delete) under <prefix>/quarantine/, outside objects/
        and files/: never scanned, looked up or adopted again, by this node or another."""
        self.check_writable()
        root = f"{self.location.prefix}/{QUARANTINE}" if self.location.prefix else QUARANTINE
        key = f"{root}/{object_id.replace('/', '%2F')}"
        self._call("put", self.client.copy_object, Bucket=self.location.bucket, Key=key,
                   CopySource={"Bucket": self.location.bucket, "Key": self._key(object_id)})
        self.delete(object_id)  # moved, not copied: no other node's lookup finds it again
        with self._lock:
            self.quarantined += 1
        return f"s3://{self.location.bucket}/{key}"

    def stats(self) -> dict:
        with self._lock:
            doc = {"endpoint": self.client.meta.endpoint_url, "requests": dict(self.requests),
                   "bytes_downloaded": self.bytes_in, "bytes_uploaded": self.bytes_out, "failures": self.failures,
                   "timeouts": self.timeouts, "quarantined": self.quarantined,
                   "fenced": self.fenced}  # why no writes go there now (kvfs/owner.py), or None
        return {**doc, **self.breaker.stats()}

    # -- helpers -----------------------------------------------------------------------------------------
    def _get(self, key: str, first: int | None = None, last: int | None = None) -> bytes:
        direct = self._direct
        if direct is not None:
            try:
                return direct.get(key, first, last)
            except Exception as e:  # noqa: BLE001 - only a redirect is handled here
                if not _redirected(e):
                    raise
                self._direct = None  # the client follows a bucket's region; the direct path does not
                log.warning("L4 %s answers from another region (%s): GETs go through the S3 client from now on "
                            "(set the bucket's region to avoid the extra round trip)", self.location.url, _code(e))
        extra = {} if first is None else {"Range": f"bytes={first}-{last}"}
        return self.client.get_object(Bucket=self.location.bucket, Key=key, **extra)["Body"].read()

    def _list(self, prefix: str) -> Iterator[tuple[str, int]]:
        paginator = self.client.get_paginator("list_objects_v2")
        try:
            for page in paginator.paginate(Bucket=self.location.bucket, Prefix=prefix):
                self._count("list")
                for item in page.get("Contents", []):
                    yield item["Key"], int(item["Size"])
        except Exception as e:  # noqa: BLE001
            raise self._failure("list", prefix, e) from None

    def _call(self, kind: str, fn, **kwargs):
        try:
            answer = fn(**kwargs)
        except Exception as e:  # noqa: BLE001
            raise self._failure(kind, kwargs.get("Key", kwargs.get("Prefix", "")), e) from None
        self._count(kind)
        return answer

    def _count(self, kind: str | None = None, into: int = 0, out: int = 0) -> None:
        with self._lock:
            if kind:
                self.requests[kind] += 1
            self.bytes_in += into
            self.bytes_out += out
        if kind:
            self.breaker.success()

    def _failure(self, kind: str, what: str, e: Exception) -> OSError:
        if _code(e) in ("NoSuchKey", "404", "NotFound"):
            self._count(kind)  # the store answered
            return FileNotFoundError(errno.ENOENT, f"{self.location.url}: no object {what}")
        with self._lock:
            self.failures += 1
        error = S3Unavailable(f"L4 {kind} {what}", e)
        self.breaker.failure(_describe(e))
        return error


class _Multipart:
    """One multipart upload: parts of `part_size` as the data comes; completed or aborted, never left."""

    def __init__(self, tier: S3Tier, key: str, metadata: dict[str, str]) -> None:
        self.tier, self.key = tier, key
        self.bucket = tier.location.bucket
        answer = tier._call("put", tier.client.create_multipart_upload, Bucket=self.bucket, Key=key,
                            Metadata=metadata)
        self.upload_id = answer["UploadId"]
        self.done: list[dict] = []

    def feed(self, buffered: list[bytes]) -> list[bytes]:
        data = b"".join(buffered)
        size = self.tier.location.part_size
        while len(data) >= size:
            self._part(data[:size])
            data = data[size:]
        return [data] if data else []

    def finish(self, buffered: list[bytes]) -> None:
        rest = b"".join(buffered)
        if rest:
            self._part(rest)
        self.tier._call("put", self.tier.client.complete_multipart_upload, Bucket=self.bucket, Key=self.key,
                        UploadId=self.upload_id, MultipartUpload={"Parts": self.done})

    def abort(self) -> None:
        try:
            self.tier.client.abort_multipart_upload(Bucket=self.bucket, Key=self.key, UploadId=self.upload_id)
        except Exception:  # noqa: BLE001 - remove_strays aborts it at the next start
            pass

    def _part(self, data: bytes) -> None:
        n = len(self.done) + 1
        answer = self.tier._call("put", self.tier.client.upload_part, Bucket=self.bucket, Key=self.key,
                                 UploadId=self.upload_id, PartNumber=n, Body=data)
        self.tier._count(out=len(data))
        self.done.append({"PartNumber": n, "ETag": answer["ETag"]})


XATTRS_META_MAX = 1536  # of S3's 2 KiB of user metadata: the rest is kvfs's own fields


EXPIRES = "expires"  # access-log lines '<file id>\texpires\t<unix seconds>': a retention time's end (kvfs gc)


def _positive_int(text: str | None) -> int | None:
    try:
        n = int(text) if text else 0
    except ValueError:
        return None
    return n if n > 0 else None


def travels(name: bytes) -> bool:
    """Whether a file's attribute goes with it to other nodes: user.* but kvfs's own, except the blocks record
    (kvfs/events.py: the node that adopts the file announces its blocks too)."""
    return name.startswith(b"user.") and (not name.startswith(b"user.kvfs.") or name == b"user.kvfs.blocks")


def encode_xattrs(xattrs: list[tuple[bytes, bytes]]) -> dict[str, str]:
    """A file's user.* attributes as one S3 metadata value (JSON of base64), or nothing when they do not fit:
    then only the publishing node has them."""
    if not xattrs:
        return {}
    value = json.dumps({base64.b64encode(k).decode(): base64.b64encode(v).decode() for k, v in xattrs},
                       separators=(",", ":"))
    return {f"{META_PREFIX}xattrs": value} if len(value) <= XATTRS_META_MAX else {}


def decode_xattrs(value: str) -> list[tuple[bytes, bytes]]:
    try:
        return [(base64.b64decode(k), base64.b64decode(v)) for k, v in json.loads(value).items()] if value else []
    except (ValueError, AttributeError):
        return []  # not written by kvfs: ignored


def _metadata(head: bytes) -> dict[str, str]:
    """What the object's header says, as S3 user metadata (x-amz-meta-kvfs-*)."""
    try:
        h = fmt.parse_header(bytes(head))
    except fmt.CorruptObject:
        return {}
    return {f"{META_PREFIX}size": str(h.raw_size), f"{META_PREFIX}codec": str(h.codec),
            f"{META_PREFIX}dtype": fmt.DTYPE_NAMES.get(h.dtype, str(h.dtype)),
            f"{META_PREFIX}lossy": f"{h.lossy_mode}:{h.lossy_param}"}


def _direct_get(client, credentials, location: S3Location) -> DirectGet | None:
    """None when the client cannot presign (no credentials): GETs then go through the client, whose error
    says what is missing."""
    try:
        return DirectGet(client, credentials, location.bucket, location.attempts)
    except Exception:  # noqa: BLE001 - the client's own calls report the cause
        return None


def _client(location: S3Location):
    import boto3  # imported here: mounts without L4 do not pay boto3's import time
    from botocore.config import Config

    session = boto3.session.Session(profile_name=location.profile, region_name=location.region,
                                    aws_access_key_id=location.access_key_id,
                                    aws_secret_access_key=location.secret_access_key)
    endpoint = location.endpoint_url
    configured_endpoint = endpoint or _configured_endpoint(session)
    path_style = location.path_style if location.path_style is not None else configured_endpoint is not None
    config = Config(connect_timeout=min(location.timeout_s, 5.0), read_timeout=location.timeout_s,
                    retries={"mode": "standard", "total_max_attempts": location.attempts},
                    s3={"addressing_style": "path" if path_style else "auto"},
                    max_pool_connections=16, request_checksum_calculation="when_required",
                    response_checksum_validation="when_required")
    return session.client("s3", endpoint_url=endpoint, config=config), session.get_credentials()


def _configured_endpoint(session) -> str | None:
    import os

    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or \
        session._session.get_config_variable("endpoint_url")


def _redirected(e: Exception) -> bool:
    """The store sends this bucket's requests elsewhere (AWS: the bucket lives in another region)."""
    status = (getattr(e, "response", None) or {}).get("ResponseMetadata", {}).get("HTTPStatusCode")
    return status in (301, 307) or _code(e) in ("PermanentRedirect", "TemporaryRedirect",
                                                "AuthorizationHeaderMalformed")


def _code(e: Exception) -> str:
    response = getattr(e, "response", None)
    if isinstance(response, dict):
        return str(response.get("Error", {}).get("Code", ""))
    return ""


def _describe(e: Exception) -> str:
    code = _code(e)
    text = str(e) or type(e).__name__
    return f"{code}: {text}" if code and code not in text else text
