"""Quotas per directory: a bound on the stored bytes of the files below a directory, per tier.

Semantics (docs/hotcold.md, "Quotas"): a quota is set on a directory (`user.kvfs.quota`, `kvfs quota DIR SIZE`,
or `[quotas]` in the TOML) and counts the stored (compressed) bytes of every file below it, in each tier it
names. A bare size bounds the fastest tier (L2), where tenants compete: `4G`; several tiers: `L2=4G,L3=100G`.
A directory over its quota in a tier has its own least recently used files moved out of that tier (down one
tier; from the last tier, evicted) by the mover. While a tier needs room (a writer, or the high watermark), a
directory at its quota there (within its largest file's size of it) or over it gives up its own least recently
used files first; other files go only when that is not enough: for the high watermark, when the others' data
alone is over it; for a writer, once those directories gave what they can (kvfs/mover.py, Mover._drain). A
tenant that floods pushes out its own files, not another's. A file counts once per name: hard links under two
quota directories count in both. Pinned files count but are never moved for a quota.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping

from .units import parse_size

XA_QUOTA = b"user.kvfs.quota"
_TIER = re.compile(r"^(L[234])$")


def parse(spec: str | bytes, tiers: Iterable[str]) -> dict[str, int]:
    """'4G' → {fastest tier: 4 GiB}; 'L2=4G,L3=100G' → per tier; 'none' or '' → {} (no quota). ValueError."""
    text = (spec.decode() if isinstance(spec, bytes) else spec).strip()
    tiers = list(tiers)
    if text.lower() in ("", "none", "off"):
        return {}
    out = {}
    for part in (p.strip() for p in text.split(",")):
        name, sep, size = part.rpartition("=")
        name = name.strip().upper() if sep else tiers[0]
        if not _TIER.match(name) or name not in tiers:
            raise ValueError(f"quota {part!r}: no tier {name} here (tiers: {', '.join(tiers)})")
        try:
            out[name] = parse_size(size.strip())
        except ValueError as e:
            raise ValueError(f"quota {part!r}: {e}") from None
    return out


def describe(limits: Mapping[str, int]) -> str:
    return ",".join(f"{t}={n}" for t, n in limits.items()) or "none"


@dataclasses.dataclass
class Quota:
    ino: int
    path: str  # for stats and logs
    limits: dict[str, int]  # tier → bytes
    used: dict[str, int] = dataclasses.field(default_factory=dict)  # tier → stored bytes below it now
    largest: dict[str, int] = dataclasses.field(default_factory=dict)  # tier → its largest file's stored bytes

    def excess(self, tier: str) -> int:
        limit = self.limits.get(tier)
        return 0 if limit is None else max(0, self.used.get(tier, 0) - limit)

    def at_limit(self, tier: str) -> bool:
        """At its quota in `tier` or over it: its next file of its largest size would not fit under the limit.
        A directory that keeps a flood within its quota sits there (each new file takes it over, the mover
        brings it back), and a tier that needs room then takes it from this directory first."""
        limit, used = self.limits.get(tier), self.used.get(tier, 0)
        return limit is not None and used > 0 and used + self.largest.get(tier, 0) >= limit

    def doc(self) -> dict:
        return {"path": self.path, "limits": dict(self.limits), "used": {t: self.used.get(t, 0) for t in self.limits}}


class Quotas:
    """The quotas in force: directories with user.kvfs.quota, and the TOML's by path (resolved each refresh,
    so a directory made later gets its quota). Usage is recomputed from the index at each refresh."""

    def __init__(self, index, tiers: list[str], configured: Mapping[str, str] | None = None) -> None:
        self.index = index
        self.tiers = tiers
        self.configured = dict(configured or {})
        self.current: list[Quota] = []

    def refresh(self) -> list[Quota]:
        found: dict[int, Quota] = {}
        for path, spec in self.configured.items():
            ino = self.index.resolve_path([p.encode() for p in path.split("/") if p])
            if ino is not None:
                found[ino] = Quota(ino, path, parse(spec, self.tiers))
        for ino, value in self.index.quota_dirs():
            try:
                limits = parse(value, self.tiers)
            except ValueError:
                continue  # set when other tiers were configured: ignored until they are again
            parts = self.index.path_of(ino)
            found[ino] = Quota(ino, "/".join(p.decode(errors="replace") for p in parts) if parts is not None
                               else f"inode {ino}", limits)  # the xattr wins over the TOML
        for q in found.values():
            usage = self.index.tree_tiers(q.ino)
            q.used = {t: used for t, (used, _) in usage.items()}
            q.largest = {t: largest for t, (_, largest) in usage.items()}
        self.current = [q for q in found.values() if q.limits]
        return self.current

    def over(self, tier: str) -> list[Quota]:
        """Quotas over their limit in `tier` now (fresh usage), most over first."""
        return sorted((q for q in self.refresh() if q.excess(tier)), key=lambda q: -q.excess(tier))

    def at_or_over(self, tier: str) -> list[Quota]:
        """Quotas at their limit in `tier` or over it now (fresh usage), the farthest over first. A directory
        inside another one listed is left out: the outer one's files include its files."""
        found = sorted((q for q in self.refresh() if q.at_limit(tier)),
                       key=lambda q: q.limits[tier] - q.used.get(tier, 0))
        if len(found) > 1:
            inner = {d for q in found for d in self.index.tree_dirs(q.ino) if d != q.ino}
            found = [q for q in found if q.ino not in inner]
        return found
