"""Command line + TOML → one immutable Config; size parsing; embedded defaults."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import tomllib
from pathlib import Path

from . import lossy, quotas, units
from .tiers.s3 import S3Location

DEFAULT_L2_CAPACITY = 1 << 30  # a modest 1 GiB of tmpfs
DEFAULT_L3_CAPACITY = 16 << 30  # local disk: an upper bound, nothing is preallocated
DEFAULT_L4_CAPACITY = 1 << 60  # remote stores: unlimited unless the mount is given a share of a private prefix
DEFAULT_HIGH_WATERMARK = 0.90  # the mover starts draining a tier above this fraction of its capacity …
DEFAULT_LOW_WATERMARK = 0.80  # … and stops below this one
DEFAULT_FRAME_SIZE = 1 << 20
DEFAULT_L4_LEASE_S = 60.0  # a private L4's claim (kvfs/owner.py): renewed every quarter of it
TAKEOVERS = ("expired", "force")  # --l4-takeover, --force
CODECS = ("auto", "entropy", "entropy8", "zstd", "deflate", "qat", "none")
DTYPES = ("auto", "bf16", "fp16", "fp32", "fp8_e4m3", "fp8_e5m2", "none")
# what adopting a direct write's staged object checks: its header and frame table ("table": no payload is read,
# every read checks a frame's payload and raw checksums, as for any object; docs/direct.md), also every
# payload's checksum ("checksums": a pass over the stored bytes), or also decodes every frame and checks its raw
# checksum ("decode": a decode per byte written)
ADOPT_VERIFY = ("table", "checksums", "decode")



class ConfigError(ValueError):
    """A configuration value the user must fix; the message says which and why."""


def parse_size(text: str | int) -> int:
    """'512M', '8G', '1.5GiB', '4096' → bytes (binary units); ConfigError otherwise."""
    try:
        return units.parse_size(text)
    except ValueError as e:
        raise ConfigError(str(e)) from None


_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")
_DURATION_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str | int | float) -> float:
    """'90s', '30m', '12h', '7d' or plain seconds → seconds."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"not a duration: {text!r}")
        return float(text)
    m = _DURATION_RE.match(str(text))
    if not m:
        raise ValueError(f"not a duration: {text!r} (use e.g. 90s, 30m, 12h, 7d)")
    return float(m.group(1)) * _DURATION_UNITS[m.group(2)]


def parse_idle(text: str | int | float) -> int:
    """An idle period (I8): a duration in whole seconds, at least 1; 'off', 'never' or 0 = never."""
    if str(text).strip().lower() in ("off", "never", "none", "0"):
        return 0
    try:
        seconds = parse_duration(text)
    except ValueError as e:
        raise ConfigError(f"idle period: {e}, or off") from None
    if seconds < 1:
        raise ConfigError(f"idle period {text!r} is under a second: the mover looks once a second")
    return int(seconds)


def parse_tier_spec(spec: str) -> tuple[Path, int]:
    """'DIR:SIZE' → (Path, bytes). The size follows the last colon."""
    path, sep, size = spec.rpartition(":")
    if not sep or not path:
        raise ConfigError(f"tier spec must be DIR:SIZE, got {spec!r}")
    return Path(path).expanduser(), parse_size(size)


@dataclasses.dataclass(frozen=True)
class TierConfig:
    name: str
    path: Path | None  # a directory tier's; None for an object store (s3)
    capacity: int
    persistent: bool
    high_watermark: float = DEFAULT_HIGH_WATERMARK
    low_watermark: float = DEFAULT_LOW_WATERMARK
    s3: S3Location | None = None
    # several directories, each with its capacity (L3 on several SSDs: kvfs/tiers/spread.py); then `path` is
    # the first and `capacity` their sum. Empty: the tier is `path` alone.
    directories: tuple[tuple[Path, int], ...] = ()

    def describe(self) -> str:
        if self.directories:
            return ", ".join(str(p) for p, _ in self.directories)
        return self.s3.url if self.s3 is not None else str(self.path)


@dataclasses.dataclass(frozen=True)
class PromotionPolicy:
    """When a file read from a slower tier moves back to the fastest: after `after_reads` reads of it
    (1 = always), or never (0)."""
    after_reads: int = 1

    @classmethod
    def parse(cls, text: str | int) -> "PromotionPolicy":
        value = str(text).strip().lower()
        if value == "always":
            return cls(1)
        if value == "never":
            return cls(0)
        try:
            n = int(value.removeprefix("after:"))
        except ValueError:
            raise ConfigError(f"promotion policy must be always, never or a number of reads, got {text!r}") from None
        if n < 1:
            raise ConfigError(f"promotion after {n} reads makes no sense: use a number >= 1, or never")
        return cls(n)

    def __str__(self) -> str:
        return {0: "never", 1: "always"}.get(self.after_reads, f"after {self.after_reads} reads")


@dataclasses.dataclass(frozen=True)
class EncryptionConfig:
    """[encryption]: the key files (never the keys: kvfs/crypto.py loads them at mount) and the tiers that hold
    sealed objects only. The key may also come from the environment (KVFS_KEY), never from arguments."""
    key_file: Path | None = None  # the current key: new objects are sealed with it
    old_key_files: tuple[Path, ...] = ()  # rotated-out keys: objects sealed with them stay readable
    tiers: tuple[str, ...] = ()  # names of the tiers that seal, a suffix of the tier order
    # tenant directories (relative to the mount's root) with keys of their own: (dir, (current, older…))
    tenant_keys: tuple[tuple[str, tuple[Path, ...]], ...] = ()

    @property
    def enabled(self) -> bool:
        return self.key_file is not None or bool(self.tiers) or bool(self.tenant_keys)


@dataclasses.dataclass(frozen=True)
class EventsConfig:
    """[events]: KV events in vLLM's wire format (kvfs/events.py); off without an endpoint."""
    endpoint: str | None = None  # ZMQ PUB: '*' and ipc:// bind, other tcp:// addresses connect (as vLLM)
    replay_endpoint: str | None = None  # ZMQ ROUTER for replays (always bound)
    topic: str = ""
    buffer_steps: int = 10_000  # batches kept for replay
    media: tuple[tuple[str, str], ...] = ()  # tier name → medium in events (default: the tier's name)

    @property
    def enabled(self) -> bool:
        return self.endpoint is not None


@dataclasses.dataclass(frozen=True)
class Config:
    mountpoint: Path | None  # None only for offline tools (kvfs fsck --config) given no mountpoint
    state_dir: Path
    l2: TierConfig
    l3: TierConfig | None = None
    l4: TierConfig | None = None
    promotion: PromotionPolicy = PromotionPolicy()
    idle_s: int = 0  # the default idle policy (I8): files not read for k*idle_s seconds sit k tiers down; 0 = off
    codec: str = "auto"
    dtype: str = "auto"
    lossy: str = "none"  # opt-in lossy mode for every file whose dtype is known (kvfs/lossy.py)
    frame_size: int = DEFAULT_FRAME_SIZE
    max_dirty: int = 256 << 20  # bytes of unsaved frames across open files (build_config: default_max_dirty())
    max_backlog: int | None = None  # [mount] max_backlog: L2 bytes behind that mean congested (None: 15% of L2)
    allow_other: bool = False
    frontend: str = "native"  # the FUSE front end: native (kvfs/frontend, libfuse in C threads), the only one
    foreground: bool = False
    debug: bool = False
    log_file: Path | None = None
    metrics_port: int | None = None  # Prometheus metrics on metrics_address:metrics_port (kvfs/metrics.py)
    metrics_address: str = "127.0.0.1"
    l4_lease_s: float = DEFAULT_L4_LEASE_S  # [l4] lease: how long a private L4's claim outlives its last renewal
    l4_takeover: str | None = None  # take over another mount's private L4: "expired" (its lease) or "force"
    direct_writes: bool = True  # offer writers a staging directory (kvfs/staging.py, docs/direct.md)
    adopt_verify: str = "table"  # what adopting a staged object checks: ADOPT_VERIFY
    encryption: EncryptionConfig = EncryptionConfig()
    quotas: tuple[tuple[str, str], ...] = ()  # [quotas]: directory (relative to the root) → spec (kvfs/quotas.py)
    events: EventsConfig = EventsConfig()

    @property
    def lossy_mode(self) -> lossy.Lossy:
        return lossy.parse(self.lossy)

    @property
    def index_path(self) -> Path:
        return self.state_dir / "index.sqlite"

    @property
    def tiers(self) -> tuple[TierConfig, ...]:
        """Fastest first."""
        return tuple(t for t in (self.l2, self.l3, self.l4) if t is not None)


FRONTENDS = ("native",)


def _frontend(value) -> str:
    if value == "pyfuse3":
        raise ConfigError("[mount] frontend = 'pyfuse3': that front end was removed; the native one replaces it "
                          "(docs/frontend.md)")
    if value not in FRONTENDS:
        raise ConfigError(f"[mount] frontend = {value!r}: choose one of {', '.join(FRONTENDS)}")
    return value


CGROUP_MEMORY_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")  # v2, v1


def memory_limit() -> int | None:
    """The memory limit of the cgroup this process sees at /sys/fs/cgroup (a container's or a pod's), or None:
    no limit, or not in a container (the root cgroup has none)."""
    for path in CGROUP_MEMORY_LIMITS:
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:  # "max" (v2) or a page-rounded 2^63 (v1): unlimited
            return int(text)
    return None


def default_max_dirty() -> int:
    """A quarter of physical memory, or of the container's memory limit where that is lower, at least 256 MiB:
    unsaved writes live in memory until close."""
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        ram = 4 << 30
    limit = memory_limit()
    return max(256 << 20, min(ram, limit if limit is not None else ram) // 4)


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


def default_l3_dir(state_dir: Path) -> Path:
    return state_dir / "l3"


def _tier_config(name: str, section: dict, spec: str | None, default_path: Path | None, default_capacity: int,
                 persistent: bool) -> TierConfig | None:
    """One tier from its TOML section and its DIR:SIZE command-line spec ('none' disables a tier)."""
    unknown = set(section) - {"path", "capacity", "persistent", "high_watermark", "low_watermark"}
    if unknown:
        raise ConfigError(f"unknown keys in [{name.lower()}]: {sorted(unknown)}")
    path = Path(section["path"]).expanduser() if "path" in section else default_path
    capacity = parse_size(section.get("capacity", default_capacity))
    if spec is not None:
        if spec.strip().lower() == "none":
            return None
        path, capacity = parse_tier_spec(spec)
    if path is None:
        return None
    high, low = _watermarks(name.lower(), section)
    return TierConfig(name, path, capacity, bool(section.get("persistent", persistent)), high, low)


def _l3_config(section: dict, specs: str | tuple[str, ...] | None, default_path: Path) -> TierConfig | None:
    """L3 from [l3] and --l3: one directory (path, capacity / DIR:SIZE) as any tier, or several, each with its
    own capacity ([l3] directories = [{path, capacity}, …] / --l3 DIR:SIZE repeated)."""
    specs = (specs,) if isinstance(specs, str) else tuple(specs or ())
    section = dict(section)
    listed = section.pop("directories", None)
    if len(specs) == 1 or (not specs and listed is None):
        return _tier_config("L3", section, specs[0] if specs else None, default_path, DEFAULT_L3_CAPACITY, True)
    if specs:
        if any(s.strip().lower() == "none" for s in specs):
            raise ConfigError("--l3 none cannot be combined with L3 directories")
        dirs = [parse_tier_spec(s) for s in specs]
    else:
        if {"path", "capacity"} & set(section):
            raise ConfigError("[l3] has directories: give each its path and capacity there, not path/capacity")
        dirs = [_l3_directory(d) for d in listed] if isinstance(listed, list) else []
    if len(dirs) < 2:
        raise ConfigError("[l3] directories needs at least two entries {path = …, capacity = …} (one: use path)")
    tier = _tier_config("L3", section, None, dirs[0][0], sum(c for _, c in dirs), True)
    return dataclasses.replace(tier, directories=tuple(dirs))


def _l3_directory(entry) -> tuple[Path, int]:
    if not isinstance(entry, dict) or set(entry) != {"path", "capacity"}:
        raise ConfigError(f"[l3] directories: each entry is {{path = DIR, capacity = SIZE}}, got {entry!r}")
    return Path(entry["path"]).expanduser(), parse_size(entry["capacity"])


def _overlapping(paths: list[Path]) -> tuple[Path, Path] | None:
    """Two tier directories that are the same or one inside the other (a listing of one would see the other's
    objects as strays), or None."""
    real = [p.resolve() for p in paths]
    for i, a in enumerate(real):
        for b in real[i + 1:]:
            if a == b or a.is_relative_to(b) or b.is_relative_to(a):
                return a, b
    return None


S3_KEYS = {"endpoint_url": str, "region": str, "profile": str, "path_style": bool, "access_key_id": str,
           "secret_access_key": str, "timeout_s": float, "attempts": int, "deadline_s": float,
           "breaker_failures": int, "probe_s": float, "shared": bool, "write_policy": str,
           "access_log_s": float}
S3_SIZE_KEYS = ("multipart_threshold", "part_size")


def _l4_config(section: dict, target: str | None, capacity: str | None, path_style: bool | None,
               shared: bool | None = None, write_policy: str | None = None) -> TierConfig | None:
    """L4 from its TOML section and the command line: an s3:// URL (any S3-compatible store) or a directory
    on a mounted distributed filesystem. Credentials only from TOML or the environment, never arguments."""
    tier_keys = {"url", "capacity", "high_watermark", "low_watermark", "lease"}  # lease: build_config's
    unknown = set(section) - tier_keys - set(S3_KEYS) - set(S3_SIZE_KEYS)
    if unknown:
        raise ConfigError(f"unknown keys in [l4]: {sorted(unknown)}")
    target = target or section.get("url")
    if not target or target.strip().lower() == "none":
        return None
    capacity_bytes = parse_size(capacity or section.get("capacity", DEFAULT_L4_CAPACITY))
    high, low = _watermarks("l4", section)
    if not target.startswith("s3://"):
        if set(section) & (set(S3_KEYS) | set(S3_SIZE_KEYS)):
            raise ConfigError(f"[l4] S3 options given, but L4 is the directory {target!r}")
        return TierConfig("L4", Path(target).expanduser(), capacity_bytes, True, high, low)
    options = {}
    for key, kind in S3_KEYS.items():
        if key in section:
            if not isinstance(section[key], kind) and not (kind is float and isinstance(section[key], int)):
                raise ConfigError(f"[l4] {key} must be a {kind.__name__}")
            options[key] = section[key]
    for key in S3_SIZE_KEYS:
        if key in section:
            options[key] = parse_size(section[key])
    if path_style is not None:
        options["path_style"] = path_style
    if shared is not None:
        options["shared"] = shared
    if write_policy is not None:
        options["write_policy"] = write_policy
    if options.get("write_policy", "demote") not in ("demote", "through"):
        raise ConfigError("[l4] write_policy must be demote or through")
    if options.get("write_policy") == "through" and not options.get("shared"):
        raise ConfigError("write_policy through needs a shared L4 prefix (shared = true, --l4-shared)")
    if options.get("shared") and capacity:
        raise ConfigError("a shared L4 prefix has no per-mount capacity: kvfs gc manages it")
    if options.get("part_size", 8 << 20) < (5 << 20):
        raise ConfigError("[l4] part_size must be at least 5M (the S3 minimum part size)")
    try:
        location = S3Location.parse_url(target, **options)
    except ValueError as e:
        raise ConfigError(f"L4: {e}") from None
    return TierConfig("L4", None, capacity_bytes, True, high, low, s3=location)


def _watermarks(name: str, section: dict) -> tuple[float, float]:
    high = float(section.get("high_watermark", DEFAULT_HIGH_WATERMARK))
    low = float(section.get("low_watermark", DEFAULT_LOW_WATERMARK))
    if not 0 < low < high <= 1:
        raise ConfigError(f"[{name}] watermarks must satisfy 0 < low_watermark < high_watermark <= 1, "
                          f"got low {low}, high {high}")
    return high, low


def load_toml(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"cannot read config {path}: {e.strerror}") from e
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"bad TOML in {path}: {e}") from e


def build_config(
    mountpoint: str | Path | None,
    *,
    config_file: str | Path | None = None,
    l2: str | None = None,
    l3: str | tuple[str, ...] | None = None,
    l4: str | None = None,
    l4_capacity: str | None = None,
    l4_path_style: bool | None = None,
    l4_shared: bool | None = None,
    l4_write: str | None = None,
    promote: str | None = None,
    idle: str | None = None,
    codec: str | None = None,
    dtype: str | None = None,
    lossy_mode: str | None = None,
    state_dir: str | Path | None = None,
    allow_other: bool | None = None,
    frontend: str | None = None,
    foreground: bool = False,
    debug: bool = False,
    log_file: str | Path | None = None,
    metrics_port: int | None = None,
    metrics_address: str | None = None,
    l4_takeover: str | None = None,
    direct_writes: bool | None = None,
    key_file: str | Path | None = None,
    old_key_files: tuple[str | Path, ...] = (),
    encrypt: str | None = None,
    tenant_keys: tuple[str, ...] = (),
    events: str | None = None,
    events_replay: str | None = None,
) -> Config:
    """Merge embedded defaults < TOML file < command line into one Config."""
    toml = load_toml(Path(config_file)) if config_file else {}
    unknown = set(toml) - {"mount", "l2", "l3", "l4", "encryption", "quotas", "events"}
    if unknown:
        raise ConfigError(f"unknown config sections: {sorted(unknown)}")
    mount_t = toml.get("mount", {})
    mountpoint = mountpoint if mountpoint is not None else mount_t.get("mountpoint")
    mnt = Path(mountpoint).expanduser() if mountpoint else None
    sdir = state_dir or mount_t.get("state_dir")
    if mnt is None and not (sdir and (l2 or "path" in toml.get("l2", {}))):
        raise ConfigError("no mountpoint: set mountpoint in [mount] (or state_dir there and path in [l2])")
    sdir = Path(sdir).expanduser() if sdir else default_state_dir(mnt)
    l2_tier = _tier_config("L2", toml.get("l2", {}), l2, default_l2_dir(mnt) if mnt else None,
                           DEFAULT_L2_CAPACITY, False)
    if l2_tier is None:
        raise ConfigError("L2 cannot be disabled")
    l3_tier = _l3_config(toml.get("l3", {}), l3, default_l3_dir(sdir))
    if l3_tier is not None and l3_tier.path.resolve() == l2_tier.path.resolve():
        raise ConfigError("L2 and L3 must be different directories")
    l4_tier = _l4_config(toml.get("l4", {}), l4, l4_capacity, l4_path_style, l4_shared, l4_write)
    if l4_tier is not None and l4_tier.path is not None and any(
            t is not None and t.path.resolve() == l4_tier.path.resolve() for t in (l2_tier, l3_tier)):
        raise ConfigError("L4 must be a directory of its own")
    if l3_tier is not None and l3_tier.directories:
        dirs = [l2_tier.path, *(p for p, _ in l3_tier.directories), *([l4_tier.path] if l4_tier and l4_tier.path else [])]
        if both := _overlapping(dirs):
            raise ConfigError(f"tier directories must not overlap: {both[0]} and {both[1]}")
    lease_s = _l4_lease(toml.get("l4", {}))
    if l4_takeover is not None:
        if l4_takeover not in TAKEOVERS:
            raise ConfigError(f"unknown takeover {l4_takeover!r}")
        if l4_tier is None or (l4_tier.s3 is not None and l4_tier.s3.shared):
            raise ConfigError("--l4-takeover and --force take over a private L4 (--l4): a shared one has no owner")
    promotion = PromotionPolicy.parse(promote or mount_t.get("promote", "always"))
    idle_s = parse_idle(idle if idle is not None else mount_t.get("idle", 0))

    codec = codec or mount_t.get("codec", "auto")
    if codec not in CODECS:
        raise ConfigError(f"unknown codec {codec!r}; choose one of {', '.join(CODECS)}")
    dtype = dtype or mount_t.get("dtype", "auto")
    if dtype not in DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    lossy_spec = lossy_mode or mount_t.get("lossy", "none")
    try:
        lossy_spec = lossy.parse(lossy_spec).describe()
    except ValueError as e:
        raise ConfigError(str(e)) from None
    frame_size = parse_size(mount_t.get("frame_size", DEFAULT_FRAME_SIZE))
    if frame_size % 4096 or not (64 << 10) <= frame_size <= (16 << 20):
        raise ConfigError("frame_size must be a multiple of 4 KiB between 64K and 16M")
    max_dirty = parse_size(mount_t["max_dirty"]) if "max_dirty" in mount_t else default_max_dirty()
    max_backlog = _max_backlog(mount_t.get("max_backlog"), l2_tier.capacity)
    adopt_verify = mount_t.get("adopt_verify", "table")
    if adopt_verify not in ADOPT_VERIFY:
        raise ConfigError(f"adopt_verify must be one of {', '.join(ADOPT_VERIFY)}, got {adopt_verify!r}")
    encryption = _encryption_config(toml.get("encryption", {}), key_file, old_key_files, encrypt,
                                    [t for t in (l2_tier, l3_tier, l4_tier) if t is not None], tenant_keys)
    quota_specs = _quota_config(toml.get("quotas", {}), [t.name for t in (l2_tier, l3_tier, l4_tier) if t is not None])
    lfile = log_file or mount_t.get("log_file")
    port = _metrics_port(metrics_port if metrics_port is not None else mount_t.get("metrics_port"))
    return Config(
        mountpoint=mnt,
        state_dir=sdir,
        l2=l2_tier,
        l3=l3_tier,
        l4=l4_tier,
        promotion=promotion,
        idle_s=idle_s,
        codec=codec,
        dtype=dtype,
        lossy=lossy_spec,
        frame_size=frame_size,
        max_dirty=max_dirty,
        max_backlog=max_backlog,
        allow_other=bool(mount_t.get("allow_other", False) if allow_other is None else allow_other),
        frontend=_frontend(frontend or mount_t.get("frontend") or os.environ.get("KVFS_FRONTEND") or "native"),
        foreground=foreground,
        debug=debug or bool(mount_t.get("debug", False)),
        log_file=Path(lfile).expanduser() if lfile else None,
        metrics_port=port,
        metrics_address=str(metrics_address or mount_t.get("metrics_address", "127.0.0.1")),
        l4_lease_s=lease_s,
        l4_takeover=l4_takeover,
        direct_writes=bool(mount_t.get("direct_writes", True) if direct_writes is None else direct_writes),
        adopt_verify=adopt_verify,
        encryption=encryption,
        quotas=quota_specs,
        events=_events_config(toml.get("events", {}), events, events_replay,
                              [t.name for t in (l2_tier, l3_tier, l4_tier) if t is not None]),
    )


def _events_config(section: dict, endpoint: str | None, replay: str | None, tiers: list[str]) -> EventsConfig:
    unknown = set(section) - {"endpoint", "replay_endpoint", "topic", "buffer_steps", "media"}
    if unknown:
        raise ConfigError(f"unknown keys in [events]: {sorted(unknown)}")
    endpoint = endpoint or section.get("endpoint")
    replay = replay or section.get("replay_endpoint")
    for what, value in (("events endpoint", endpoint), ("events replay endpoint", replay)):
        if value is not None and not re.match(r"^(tcp|ipc|inproc)://\S+$", str(value)):
            raise ConfigError(f"{what} must be a ZMQ endpoint such as tcp://*:5557 or ipc:///run/kvfs.events, "
                              f"got {value!r}")
    if replay and not endpoint:
        raise ConfigError("an events replay endpoint needs an events endpoint (--events)")
    media = section.get("media", {})
    if not isinstance(media, dict) or set(media) - set(tiers):
        raise ConfigError(f"[events] media maps tier names ({', '.join(tiers)}) to medium names, got {media!r}")
    steps = section.get("buffer_steps", 10_000)
    if not isinstance(steps, int) or steps < 1:
        raise ConfigError(f"[events] buffer_steps must be a positive integer, got {steps!r}")
    return EventsConfig(endpoint=endpoint, replay_endpoint=replay, topic=str(section.get("topic", "")),
                        buffer_steps=steps, media=tuple((k, str(v)) for k, v in media.items()))


def _max_backlog(value, l2_capacity: int) -> int | None:
    """A size, or a percentage of L2's capacity."""
    if value is None:
        return None
    text = str(value).strip()
    if text.endswith("%"):
        try:
            share = float(text[:-1]) / 100
        except ValueError:
            share = -1
        if not 0 < share <= 1:
            raise ConfigError(f"max_backlog {value!r}: a percentage must be in (0, 100]")
        return int(share * l2_capacity)
    return parse_size(text)


def _quota_config(section: dict, tiers: list[str]) -> tuple[tuple[str, str], ...]:
    out = []
    for directory, spec in section.items():
        path = _inside_mount(directory, "[quotas] directory")
        try:
            quotas.parse(str(spec), tiers)
        except ValueError as e:
            raise ConfigError(f"[quotas] {directory!r}: {e}") from None
        out.append((path, str(spec)))
    return tuple(out)


def _encryption_config(section: dict, key_file, old_key_files, encrypt: str | None,
                       tiers: list[TierConfig], tenant_specs: tuple[str, ...] = ()) -> EncryptionConfig:
    """Keys from --key-file (or [encryption] key_file, or KVFS_KEY at mount); sealed tiers from --encrypt (or
    [encryption] tiers): by default L4 alone, what leaves the host, once a key is given. Tenant directories
    with keys of their own from --tenant-key DIR=FILE[,OLD…] (or [encryption.tenants] DIR = FILE | [FILE, OLD…])."""
    unknown = set(section) - {"key_file", "old_key_files", "tiers", "tenants"}
    if unknown:
        raise ConfigError(f"unknown keys in [encryption]: {sorted(unknown)}")
    key = key_file or section.get("key_file")
    old = tuple(Path(p).expanduser() for p in (old_key_files or section.get("old_key_files", ())))
    names = [t.name for t in tiers]
    keyed = key is not None or "KVFS_KEY" in os.environ
    spec = encrypt if encrypt is not None else section.get("tiers")
    if spec is None:
        sealed = ("L4",) if keyed and "L4" in names else ()
    else:
        listed = spec if isinstance(spec, list) else [p for p in str(spec).split(",") if p.strip()]
        sealed = tuple(str(p).strip().upper() for p in listed)
        if sealed == ("NONE",):
            sealed = ()
        for name in sealed:
            if name not in names:
                raise ConfigError(f"--encrypt {name}: no such tier here (tiers: {', '.join(names)})")
        if sealed and not keyed:
            raise ConfigError("sealed tiers need a key: --key-file FILE, [encryption] key_file, or KVFS_KEY")
    first = min((names.index(n) for n in sealed), default=len(names))
    if set(sealed) != set(names[first:]):
        raise ConfigError(f"sealed tiers must include every tier below the fastest sealed one ({', '.join(names[first:])}):"
                          " objects only move down into sealed tiers, never out of them unsealed")
    if old and not keyed:
        raise ConfigError("old key files without a current key")
    return EncryptionConfig(Path(key).expanduser() if key is not None else None, old,
                            tuple(n for n in names if n in sealed), _tenant_keys(section.get("tenants", {}), tenant_specs))


def _tenant_keys(table: dict, specs: tuple[str, ...]) -> tuple[tuple[str, tuple[Path, ...]], ...]:
    entries: dict[str, list] = {}
    for directory, files in table.items():
        entries[directory] = files if isinstance(files, list) else [files]
    for spec in specs:
        directory, sep, files = spec.partition("=")
        if not sep or not files:
            raise ConfigError(f"--tenant-key must be DIR=KEYFILE[,OLDKEYFILE…], got {spec!r}")
        entries[directory] = files.split(",")
    out = []
    for directory, files in entries.items():
        if not files or not all(isinstance(f, str) and f for f in files):
            raise ConfigError(f"tenant directory {directory!r}: key files must be paths")
        out.append((_inside_mount(directory, "tenant directory"), tuple(Path(f).expanduser() for f in files)))
    return tuple(sorted(out))


def _inside_mount(directory, what: str) -> str:
    """A directory named relative to the mount's root, normalised ('a//b/' → 'a/b'); ConfigError outside it."""
    parts = [p for p in str(directory).split("/") if p not in ("", ".")]
    if not parts or ".." in parts:
        raise ConfigError(f"{what} {directory!r} must be a path inside the mount, e.g. tenants/acme")
    return "/".join(parts)


def _l4_lease(section: dict) -> float:
    try:
        lease = parse_duration(section.get("lease", DEFAULT_L4_LEASE_S))
    except ValueError as e:
        raise ConfigError(f"[l4] lease: {e}") from None
    if lease < 2:
        raise ConfigError(f"[l4] lease {section.get('lease')!r} is under 2 s: renewals come every quarter of it")
    return lease


def _metrics_port(value) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 65535:
        raise ConfigError(f"metrics_port must be a port number 1..65535, got {value!r}")
    return value
