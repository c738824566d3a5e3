"""`kvfs gc`: the capacity of a shared L4 prefix, kept by deleting its least recently used published files.

A shared prefix has no per-mount capacity: every mount publishes into it and none may decide alone what goes.
One owner (a cron job, a systemd timer) runs gc. Last access of a file = the latest of its publication time
(LastModified) and every read any mount logged (`<prefix>/access/*.log`, '<file id>\\t<unix seconds>' lines,
written by each mount every `access_log_s`). gc first deletes files past their retention time (user.kvfs.ttl:
the publishing node logs '<file id>\texpires\t<unix seconds>'), then files oldest access first until the
prefix holds at most --max-size bytes, and every file not read for --max-age. It then replaces the logs it read by one
compacted log of the survivors' reads, so the logs stay small. A mount that still names a deleted file finds
it gone at its next read: a miss (ENOENT), never an error.
"""

from __future__ import annotations

import dataclasses
import time

from .tiers.s3 import ACCESS, EXPIRES, FILES, S3Location, S3Tier

@dataclasses.dataclass
class GcReport:
    files: int = 0
    bytes: int = 0
    deleted_files: int = 0
    deleted_bytes: int = 0
    logs_compacted: int = 0
    deleted: list[str] = dataclasses.field(default_factory=list)


def collect(location: S3Location, max_bytes: int | None = None, max_age_s: float | None = None,
            dry_run: bool = False, now: float | None = None) -> GcReport:
    tier = S3Tier("L4", location, 1 << 60)
    tier.check()
    root = f"{location.prefix}/" if location.prefix else ""
    now = time.time() if now is None else now
    files = {}  # file id → [size, last access]
    for key, size, modified in _listing(tier, root + FILES + "/"):
        files[key[len(root):]] = [size, modified]
    logs = [key for key, _, _ in _listing(tier, root + ACCESS + "/")]
    read_at: dict[str, float] = {}
    expires_at: dict[str, float] = {}  # retention times (I9) logged by the publishing nodes
    for key in logs:
        body = tier.client.get_object(Bucket=location.bucket, Key=key)["Body"].read().decode(errors="replace")
        for line in body.splitlines():
            fid, _, t = line.partition("\t")
            kind, _, at = t.partition("\t")
            try:
                if kind == EXPIRES:
                    expires_at[fid] = min(expires_at.get(fid, float("inf")), float(at))
                else:
                    read_at[fid] = max(read_at.get(fid, 0.0), float(t))
            except ValueError:
                continue  # a torn line: ignored
    for fid, t in read_at.items():
        if fid in files:
            files[fid][1] = max(files[fid][1], t)
    report = GcReport(files=len(files), bytes=sum(size for size, _ in files.values()))
    report.deleted = victims(files, expires_at, now, max_bytes, max_age_s)
    report.deleted_files = len(report.deleted)
    report.deleted_bytes = sum(files[fid][0] for fid in report.deleted)
    if not dry_run:
        tier.delete_many(report.deleted)  # DeleteObjects: up to 1,000 keys per request
    if not dry_run and logs:
        gone = set(report.deleted)
        kept = "".join(f"{fid}\t{int(t)}\n" for fid, t in read_at.items() if fid in files and fid not in gone)
        kept += "".join(f"{fid}\t{EXPIRES}\t{int(t)}\n" for fid, t in expires_at.items()
                        if fid in files and fid not in gone)
        if kept:
            tier.put_access_log(f"gc-{time.time_ns()}.log", kept)
        for key in logs:
            tier.client.delete_object(Bucket=location.bucket, Key=key)
        report.logs_compacted = len(logs)
    return report


def victims(files: dict[str, list], expires_at: dict[str, float], now: float, max_bytes: int | None,
            max_age_s: float | None) -> list[str]:
    """What goes: files past their retention time first, then the least recently used while the prefix is over
    max_bytes or they were not read for max_age_s. files: id → [size, last access]."""
    out = sorted(fid for fid, at in expires_at.items() if fid in files and at <= now)
    total = sum(size for size, _ in files.values()) - sum(files[fid][0] for fid in out)
    expired = set(out)
    for fid, (size, last) in sorted(files.items(), key=lambda kv: kv[1][1]):
        if fid in expired:
            continue
        too_old = max_age_s is not None and last < now - max_age_s
        too_big = max_bytes is not None and total > max_bytes
        if not (too_old or too_big):
            break  # oldest first: every later file is newer, and the total only shrank
        out.append(fid)
        total -= size
    return out


def _listing(tier: S3Tier, prefix: str):
    for page in tier.client.get_paginator("list_objects_v2").paginate(Bucket=tier.location.bucket, Prefix=prefix):
        for item in page.get("Contents", []):
            yield item["Key"], int(item["Size"]), item["LastModified"].timestamp()
