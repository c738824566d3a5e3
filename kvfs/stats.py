"""Counters kept by the daemon and the JSON document served as .kvfs/stats."""

from __future__ import annotations

import dataclasses
import json
import os
import time


@dataclasses.dataclass
class TierCounters:
    hits: int = 0  # file reads served from this tier (counted once per open handle, at its first read)
    demoted_files: int = 0  # moved from this tier to the next (slower) one
    demoted_bytes: int = 0
    promoted_files: int = 0  # moved into this tier from a slower one
    promoted_bytes: int = 0
    evicted_files: int = 0  # dropped from this tier, the last one: they became misses
    evicted_bytes: int = 0
    evicted_next_down_files: int = 0  # of those, evicted because the next tier was down (no demotion possible)
    idle_demoted_files: int = 0  # of the demoted ones, moved by the idle policy (not read for long enough)
    dropped_files: int = 0  # removed from this tier by a drop request (user.kvfs.drop, kvfs drop)
    dropped_bytes: int = 0


@dataclasses.dataclass
class Counters:
    bytes_written: int = 0  # logical bytes accepted by write()
    bytes_read: int = 0  # logical bytes returned by read()
    write_requests: int = 0
    read_requests: int = 0
    native_reads: int = 0  # read requests answered in the native front end's C threads (kvfs/frontend/_loop.c)
    native_read_bytes: int = 0  # their logical bytes (both also counted in read_requests and bytes_read)
    native_writes: int = 0  # write requests taken in the native front end's C threads (kvfs/frontend/native_write.py)
    native_write_bytes: int = 0  # their logical bytes (both also counted in write_requests and bytes_written)
    native_write_fallbacks: int = 0  # native writers sent back to Python before their close (a write out of order, …)
    direct_reads: int = 0  # files whose object a reader opened past FUSE (user.kvfs.object, kvfs.direct)
    direct_bytes: int = 0  # their logical bytes
    direct_writes: int = 0  # files whose object a writer encoded and staged, adopted by the daemon (kvfs.direct)
    direct_write_bytes: int = 0  # their logical bytes
    adopt_requests: int = 0  # user.kvfs.adopt requests (a batch of files is one: kvfs.direct.write_files)
    adopt_refusals: int = 0  # adopt requests refused (bad object or request, no room: the log says why)
    staged_abandoned: int = 0  # staged objects removed because their writers were gone
    commits: int = 0  # objects committed (flush/fsync with changes)
    commit_failures: int = 0  # commits answered with an error (ENOSPC, EIO, …)
    frames_encoded: int = 0
    frames_decoded: int = 0
    checksum_failures: int = 0  # corrupt objects detected (each dropped from the index)
    key_unavailable: int = 0  # reads refused: the object is sealed with a key this mount does not hold (EIO)
    errors: int = 0  # unexpected exceptions answered with EIO
    lookup_misses: int = 0  # lookups of a name that does not exist (a cache miss: the caller computes or creates it)
    reconcile_orphans_removed: int = 0
    reconcile_rows_dropped: int = 0
    reconcile_objects_adopted: int = 0  # rows pointed at a complete copy in another tier (a move cut short)
    published_through: int = 0  # files uploaded to a shared L4 after settling (write policy through)
    publish_conflicts: int = 0  # demotions to a shared L4 refused: another node published the name first
    requested_moves: int = 0  # moves asked for by name (user.kvfs.tier, kvfs demote) that were done
    prefetches: int = 0  # promotions queued by a prefetch request (user.kvfs.prefetch, kvfs prefetch)
    pin_refusals: int = 0  # pin requests refused: all pins together would pass the pin limit
    move_failures: int = 0  # moves given up (copy failed, no room); the file stays where it was
    moves_skipped: int = 0  # moves not done because their file was deleted meanwhile (not a failure)
    expired_files: int = 0  # files dropped from every tier at the end of their retention time (user.kvfs.ttl)
    expired_bytes: int = 0  # their stored bytes
    saves_shed: int = 0  # saves skipped while the mover was congested: refused adoptions + writers' reports
    writer_waits: int = 0  # commits that waited for the mover to make room
    writer_wait_s: float = 0.0
    tiers: dict[str, TierCounters] = dataclasses.field(default_factory=dict)

    def tier(self, name: str) -> TierCounters:
        return self.tiers.setdefault(name, TierCounters())


def document(*, counters: Counters, tiers, totals: dict[str, tuple[int, int, int, int, int]], config, started: float,
             open_files: int, dirty_bytes: int, read_bytes: dict[str, int], mover: dict, qat: dict,
             quotas: list[dict] | None = None, events: dict | None = None) -> dict:
    """The statistics document: what .kvfs/stats serves as JSON and the metrics exporter turns into metrics."""
    tier_docs = {}
    logical_all = stored_all = 0
    for t in tiers:
        files, logical, stored, pinned_files, pinned_bytes = totals.get(t.name, (0, 0, 0, 0, 0))
        logical_all += logical
        stored_all += stored
        tier_docs[t.name] = {
            "path": t.describe(),
            "persistent": t.persistent,
            "sealed": t.sealed,
            "capacity_bytes": t.capacity,
            "used_bytes": t.used_bytes,
            "files": t.files,
            "logical_bytes": logical,
            "compression_ratio": round(stored / logical, 4) if logical else None,
            "read_bytes": read_bytes.get(t.name, 0),
            "pinned_files": pinned_files,  # pinned files whose object is here now (promotion may be pending)
            "pinned_bytes": pinned_bytes,
            **_fields(counters.tier(t.name)),
            **t.stats(),
        }
    doc = {
        "version": 1,
        "pid": os.getpid(),
        "mountpoint": str(config.mountpoint),
        "uptime_s": round(time.monotonic() - started, 1),
        "codec": config.codec,
        "dtype": config.dtype,
        "frame_size": config.frame_size,
        "tiers": tier_docs,
        "logical_bytes": logical_all,
        "stored_bytes": stored_all,
        "compression_ratio": round(stored_all / logical_all, 4) if logical_all else None,
        "open_files": open_files,
        "dirty_bytes": dirty_bytes,
        "mover": mover,
        "qat": qat,
        "quotas": quotas or [],  # [{path, limits: {tier: bytes}, used: {tier: bytes}}] (kvfs/quotas.py)
        "events": events,  # None when the mount publishes no KV events (kvfs/events.py)
        **_fields(counters, skip="tiers"),
    }
    return doc


def _fields(obj, skip: str = "") -> dict:
    """A dataclass's fields, shallow: dataclasses.asdict deep-copies every value (0.18 ms of each stats read,
    on the trio thread)."""
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if f.name != skip}


def to_json(doc: dict) -> bytes:
    return (json.dumps(doc, indent=2) + "\n").encode()


def human_bytes(n: float | None) -> str:
    """1536 → '1.5 KiB' (binary units), for tables."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
