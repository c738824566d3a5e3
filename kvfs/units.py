"""Sizes as people write them ('512M', '8G', '1.5GiB', '4096'): shared by the configuration and the quotas,
which the configuration checks (a module of its own, so that neither imports the other)."""

from __future__ import annotations

import re

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGTP]?)(I?B?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "P": 1 << 50}


def parse_size(text: str | int) -> int:
    """'512M', '8G', '1.5GiB', '4096' → bytes (binary units); ValueError otherwise."""
    if isinstance(text, int):
        return text
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ValueError(f"not a size: {text!r} (use e.g. 512M, 8G)")
    value = float(m.group(1)) * _UNITS[m.group(2).upper()]
    if value < 1:
        raise ValueError(f"size must be positive: {text!r}")
    return int(value)
