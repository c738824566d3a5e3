"""Command line + TOML → one immutable Config; size parsing; embedded defaults."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import tomllib
from pathlib import Path

DEFAULT_L2_CAPACITY = 1 << 30  # a modest 1 GiB of tmpfs
DEFAULT_FRAME_SIZE = 1 << 20
CODECS = ("zstd", "none")
DTYPES = ("auto", "bf16", "fp16", "none")

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGTP]?)(I?B?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "P": 1 << 50}


class ConfigError(ValueError):
    """A configuration value the user must fix; the message says which and why."""


def parse_size(text: str | int) -> int:
    """'512M', '8G', '1.5GiB', '4096' → bytes (binary units)."""
    if isinstance(text, int):
        return text
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ConfigError(f"not a size: {text!r} (use e.g. 512M, 8G)")
    value = float(m.group(1)) * _UNITS[m.group(2).upper()]
    if value < 1:
        raise ConfigError(f"size must be positive: {text!r}")
    return int(value)


def parse_tier_spec(spec: str) -> tuple[Path, int]:
    """'DIR:SIZE' → (Path, bytes). The size follows the last colon."""
    path, sep, size = spec.rpartition(":")
    if not sep or not path:
        raise ConfigError(f"tier spec must be DIR:SIZE, got {spec!r}")
    return Path(path).expanduser(), parse_size(size)


@dataclasses.dataclass(frozen=True)
class TierConfig:
    name: str
    path: Path
    capacity: int
    persistent: bool


@dataclasses.dataclass(frozen=True)
class Config:
    mountpoint: Path
    state_dir: Path
    l2: TierConfig
    codec: str = "zstd"
    dtype: str = "auto"
    frame_size: int = DEFAULT_FRAME_SIZE
    max_dirty: int = 256 << 20  # bytes of unsaved frames across open files (build_config: default_max_dirty())
    allow_other: bool = False
    foreground: bool = False
    debug: bool = False
    log_file: Path | None = None

    @property
    def index_path(self) -> Path:
        return self.state_dir / "index.sqlite"

    @property
    def tiers(self) -> tuple[TierConfig, ...]:
        return (self.l2,)


def default_max_dirty() -> int:
    """A quarter of physical memory, at least 256 MiB: unsaved writes live in memory until close."""
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        ram = 4 << 30
    return max(256 << 20, ram // 4)


def _mount_slug(mountpoint: Path) -> str:
    """A short stable name per mountpoint, so two default mounts never share state."""
    real = str(mountpoint.resolve())
    digest = hashlib.sha256(real.encode()).hexdigest()[:10]
    base = re.sub(r"[^A-Za-z0-9_.-]", "_", mountpoint.resolve().name or "root")[:40]
    return f"{base}-{digest}"


def default_state_dir(mountpoint: Path) -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "kvfs" / _mount_slug(mountpoint)


def default_l2_dir(mountpoint: Path) -> Path:
    return Path("/dev/shm") / f"kvfs-{os.getuid()}" / _mount_slug(mountpoint)


def load_toml(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"cannot read config {path}: {e.strerror}") from e
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"bad TOML in {path}: {e}") from e


def build_config(
    mountpoint: str | Path,
    *,
    config_file: str | Path | None = None,
    l2: str | None = None,
    codec: str | None = None,
    dtype: str | None = None,
    state_dir: str | Path | None = None,
    allow_other: bool | None = None,
    foreground: bool = False,
    debug: bool = False,
    log_file: str | Path | None = None,
) -> Config:
    """Merge embedded defaults < TOML file < command line into one Config."""
    mnt = Path(mountpoint).expanduser()
    toml = load_toml(Path(config_file)) if config_file else {}
    unknown = set(toml) - {"mount", "l2"}
    if unknown:
        raise ConfigError(f"unknown config sections: {sorted(unknown)}")
    mount_t = toml.get("mount", {})
    l2_t = toml.get("l2", {})

    l2_path = Path(l2_t["path"]).expanduser() if "path" in l2_t else default_l2_dir(mnt)
    l2_cap = parse_size(l2_t.get("capacity", DEFAULT_L2_CAPACITY))
    if l2:
        l2_path, l2_cap = parse_tier_spec(l2)

    codec = codec or mount_t.get("codec", "zstd")
    if codec not in CODECS:
        raise ConfigError(f"unknown codec {codec!r}; choose one of {', '.join(CODECS)}")
    dtype = dtype or mount_t.get("dtype", "auto")
    if dtype not in DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    frame_size = parse_size(mount_t.get("frame_size", DEFAULT_FRAME_SIZE))
    if frame_size % 4096 or not (64 << 10) <= frame_size <= (16 << 20):
        raise ConfigError("frame_size must be a multiple of 4 KiB between 64K and 16M")
    max_dirty = parse_size(mount_t["max_dirty"]) if "max_dirty" in mount_t else default_max_dirty()
    sdir = state_dir or mount_t.get("state_dir")
    lfile = log_file or mount_t.get("log_file")
    return Config(
        mountpoint=mnt,
        state_dir=Path(sdir).expanduser() if sdir else default_state_dir(mnt),
        l2=TierConfig("L2", l2_path, l2_cap, persistent=bool(l2_t.get("persistent", False))),
        codec=codec,
        dtype=dtype,
        frame_size=frame_size,
        max_dirty=max_dirty,
        allow_other=bool(mount_t.get("allow_other", False) if allow_other is None else allow_other),
        foreground=foreground,
        debug=debug or bool(mount_t.get("debug", False)),
        log_file=Path(lfile).expanduser() if lfile else None,
    )
