"""Start-up reconcile: make the index and the tiers agree before the mount goes live.

- inodes left with nlink 0 (unlinked while open, then the daemon died) are deleted;
- interrupted puts (temp files), misplaced files and objects no row names are deleted (orphans);
- rows whose object is missing or has the wrong size (tmpfs lost at reboot, crash) are dropped: a miss;
- tier usage counters are seeded from what remains.
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


def reconcile(index: Index, tiers: list[Tier]) -> ReconcileReport:
    report = ReconcileReport()
    db = index.db
    gone = [r[0] for r in db.execute("SELECT id FROM inodes WHERE nlink = 0 AND id != 1")]
    index.purge(gone)
    report.unlinked_deleted = len(gone)

    wanted = {(r["obj_tier"], object_id(r["id"], r["obj_gen"])): (r["id"], r["stored_bytes"])
              for r in index.objects()}
    present: set[tuple[str, str]] = set()
    for tier in tiers:
        report.strays_removed += tier.remove_strays()
        tier.used_bytes = tier.files = 0
        for info in list(tier.scan()):
            key = (tier.name, info.object_id)
            expected = wanted.get(key)
            if expected is None or expected[1] != info.size:
                tier.delete(info.object_id)
                report.orphans_removed += 1
                continue
            present.add(key)
            tier.used_bytes += info.size
            tier.files += 1

    missing = [ino for key, (ino, _) in wanted.items() if key not in present]
    index.purge(missing)
    report.rows_dropped = len(missing)
    _fix_directory_links(index)
    if report.orphans_removed or report.rows_dropped or report.strays_removed or report.unlinked_deleted:
        log.info("reconcile: %s", report)
    return report


def _fix_directory_links(index: Index) -> None:
    """Dropped rows may have been subdirectories (never, today) — keep I2 exact regardless."""
    with index.transaction():
        index.db.execute(
            "UPDATE inodes SET nlink = 2 + (SELECT COUNT(*) FROM entries e JOIN inodes c ON c.id = e.inode "
            "WHERE e.parent = inodes.id AND (c.mode & 61440) = 16384) WHERE (mode & 61440) = 16384")
