"""Start-up reconcile: make the index and the tiers agree before the mount goes live.

- inodes left with nlink 0 (unlinked while open, then the daemon died) are deleted;
- interrupted puts (temp files), misplaced files and objects no row names are deleted (orphans);
- rows whose object is missing or has the wrong size (tmpfs lost at reboot, crash) are dropped: a miss —
  unless a complete copy of that very object sits in another tier (a move cut short), which is adopted;
- an object in two tiers (a move cut short before the source was unlinked) is kept where the row says;
- a shared L4 is not listed: its rows are kept (their objects are verified when read) and counted;
- a fenced tier (a private L4 this process has not claimed: kvfs/owner.py) is listed but nothing in it is
  deleted: another mount may own those objects;
- tier usage counters are seeded from what remains;
- a tier spread over several directories (L3 on several SSDs) says how each is: one that is down is not
  listed, so the rows whose object lies there are dropped (misses) while the others keep theirs.
"""

from __future__ import annotations

import dataclasses
import logging

from .index import Index, object_id
from .tiers import Tier

log = logging.getLogger(__name__)


@dataclasses.dataclass
class ReconcileReport:
    strays_removed: int = 0
    orphans_removed: int = 0
    rows_dropped: int = 0
    unlinked_deleted: int = 0
    objects_adopted: int = 0
    orphans_kept: int = 0  # in a fenced tier: not this process's to delete


def reconcile(index: Index, tiers: list[Tier]) -> ReconcileReport:
    report = ReconcileReport()
    gone = [r[0] for r in index.db.execute("SELECT id FROM inodes WHERE nlink = 0 AND id != 1")]
    index.purge(gone)
    report.unlinked_deleted = len(gone)

    found: dict[str, dict[str, int]] = {}  # object id → {tier: size}
    for tier in tiers:
        if tier.fenced is None:
            report.strays_removed += tier.remove_strays()
        for info in tier.scan():
            found.setdefault(info.object_id, {})[tier.name] = info.size

    keep: set[tuple[str, str]] = set()
    missing = []
    shared = {t.name: t for t in tiers if t.shared}
    for row in index.objects():
        if row["obj_tier"] in shared:  # published objects: not listed (other nodes' too); checked when read
            tier = shared[row["obj_tier"]]
            tier.used_bytes += row["stored_bytes"]
            tier.files += 1
            continue
        oid = object_id(row["id"], row["obj_gen"])
        places = found.get(oid, {})
        if places.get(row["obj_tier"]) == row["stored_bytes"]:
            keep.add((row["obj_tier"], oid))
            continue
        # a move interrupted after its copy was complete (e.g. a power loss lost the index switch and tmpfs):
        # the copy is the same object — same id, same size, checksummed when read — so it is kept
        adopted = next((t.name for t in tiers if places.get(t.name) == row["stored_bytes"]), None)
        if adopted is not None and index.move_object(row["id"], row["obj_gen"], row["obj_tier"], adopted):
            keep.add((adopted, oid))
            report.objects_adopted += 1
        else:
            missing.append(row["id"])
    index.purge(missing)
    report.rows_dropped = len(missing)

    for tier in tiers:
        if not tier.shared:
            tier.used_bytes = tier.files = 0
    by_name = {t.name: t for t in tiers}
    for oid, places in found.items():
        for tier_name, size in places.items():
            tier = by_name[tier_name]
            if (tier_name, oid) in keep:
                tier.used_bytes += size
                tier.files += 1
            elif tier.fenced is not None:
                report.orphans_kept += 1
            else:
                tier.delete(oid)
                report.orphans_removed += 1
    _fix_directory_links(index)
    if any(dataclasses.astuple(report)):
        log.info("reconcile: %s", report)
    _log_directories(tiers)
    return report


def _log_directories(tiers: list[Tier]) -> None:
    for tier in tiers:
        for d in tier.directories():
            if d["state"] == "down":
                log.warning("reconcile: %s directory %s is down (%s): its files are misses", tier.name, d["path"],
                            d["reason"])
            else:
                log.info("reconcile: %s directory %s: %d objects, %d MiB of %d MiB", tier.name, d["path"],
                         d["files"], d["used_bytes"] >> 20, d["capacity_bytes"] >> 20)


def _fix_directory_links(index: Index) -> None:
    """Dropped rows may have been subdirectories (never, today) — keep I2 exact regardless."""
    with index.transaction():
        index.db.execute(
            "UPDATE inodes SET nlink = 2 + (SELECT COUNT(*) FROM entries e JOIN inodes c ON c.id = e.inode "
            "WHERE e.parent = inodes.id AND (c.mode & 61440) = 16384) WHERE (mode & 61440) = 16384")
