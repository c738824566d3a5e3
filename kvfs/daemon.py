"""One daemon per mount: open the index, reconcile, mount, and run one trio nursery that owns everything.

Shutdown (SIGTERM/SIGINT, or `kvfs umount` which unmounts and lets the front end's main return): commit files
still open with unsaved data, flush batched access times, fsync and checkpoint the index, unmount.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import fcntl
import logging
import os
import re
import signal
import sys
from pathlib import Path

import trio

from . import crypto, metrics, native_stderr, owner, sdnotify
from .codecs import qat
from .codecs.qat import QatCodec
from .config import Config, ConfigError
from .frontend import api as fuse
from .frontend.ops import Operations
from .index import Index
from .locks import InodeLocks
from .mover import Mover
from .quotas import Quotas
from .events import EventSource, Publisher
from .reconcile import reconcile
from .sealing import Tenants
from .shared import SharedNamespace
from .stats import Counters
from .store import Store
from .tiers import DirectoryTier, S3Tier, S3Unavailable, SpreadTier, Tier

log = logging.getLogger("kvfs")
MAINTENANCE_TICK = 1.0  # seconds
ACCESS_FLUSH_TICKS = 5
CHECKPOINT_TICKS = 30
WAL_LIMIT_BYTES = 64 << 20  # past this the WAL is checkpointed and reset, whatever the interval
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters
READ_AHEAD_FRAMES = 4  # the kernel's read-ahead window on the mount, in frames (docs/datapath.md)


def setup_logging(config: Config) -> None:
    handler: logging.Handler
    if config.log_file:
        config.log_file.parent.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(config.log_file)
    else:
        handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if config.debug else logging.INFO)
    for chatty in ("botocore", "boto3", "urllib3", "s3transfer"):  # per-request notices: not kvfs events
        logging.getLogger(chatty).setLevel(logging.WARNING)


def _lock_state_dir(config: Config) -> int:
    config.state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(config.state_dir / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise SystemExit(f"kvfs: state directory {config.state_dir} is in use by another kvfs daemon") from None
    return fd


def keep_frame_buffers_in_heap() -> None:
    """Frames are 1 MiB buffers allocated and freed at a high rate. glibc serves such sizes with fresh
    mmap()s, so every frame paid page faults and kernel zeroing (measured: zstd reads 1.8 → 1.15 CPU-s/GB
    with this change). Keep them in the heap and do not trim it eagerly."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(M_MMAP_THRESHOLD, 32 << 20)
        libc.mallopt(M_TRIM_THRESHOLD, 256 << 20)
    except (OSError, AttributeError):  # not glibc: nothing to tune
        log.debug("mallopt not available")


def run(config: Config) -> int:
    """Mount and serve until unmounted or signalled. Returns the process exit status."""
    keep_frame_buffers_in_heap()
    lock_fd = _lock_state_dir(config)
    index = Index(config.index_path)
    tiers = open_tiers(config)
    claim = owner.claim_l4(tiers, config.state_dir, config.l4_lease_s, config.l4_takeover)
    try:
        return _mount_and_serve(config, index, tiers, claim)
    finally:
        if claim is not None:
            claim.release()  # after the last write: the next owner may start at once
        os.close(lock_fd)


def _mount_and_serve(config: Config, index: Index, tiers: list[Tier], claim: owner.Claim | None) -> int:
    """Reconcile (the L4 claimed: kvfs/owner.py), mount, serve until unmounted; returns the exit status."""
    report = reconcile(index, tiers)
    _warn_if_disk_smaller(tiers)
    counters = Counters(reconcile_orphans_removed=report.orphans_removed,
                        reconcile_rows_dropped=report.rows_dropped,
                        reconcile_objects_adopted=report.objects_adopted)
    qat_codec = _load_qat() if config.codec == "qat" else None
    store = Store(tiers)
    store.keyring = load_keyring(config)
    store.tenants = Tenants(d for d, _ in config.encryption.tenant_keys)
    for tier in tiers:
        tier.sealed = tier.name in config.encryption.tiers
    locks = InodeLocks()
    mover = Mover(store, index, config.tiers, config.promotion, counters, locks, config.idle_s)
    store.place = mover.place
    mover.max_backlog = config.max_backlog
    mover.quotas = Quotas(index, [t.name for t in tiers], dict(config.quotas))
    mover.write_through = any(t.s3 is not None and t.s3.write_policy == "through" for t in config.tiers)
    if mover.write_through:  # what a crash or a stop left unpublished (the settling schedule is in memory)
        for ino in index.unpublished_files():
            mover.publish_later(ino)
    ops = Operations(config, index, store, mover, locks, counters)
    ops.qat = qat_codec
    shared = [t for t in tiers if t.shared]
    if shared:
        ops.shared = mover.shared = SharedNamespace(index, store, shared[0])

    publisher = _start_events(config, ops)  # bound before mounting, as the metrics port

    options = set(fuse.default_options)
    options |= {"fsname=kvfs", "subtype=kvfs"}
    if config.allow_other:
        options.add("allow_other")
    exporter = None  # bound before mounting: a port in use fails the mount, not a live one
    if config.metrics_port is not None:
        exporter = metrics.start(ops.stats_doc, ops.latency, config.metrics_address, config.metrics_port)
    try:
        fuse.init(ops, str(config.mountpoint), options)
    except RuntimeError as e:  # libfuse said why on stderr (the log): no access to /dev/fuse, not permitted, …
        if exporter is not None:
            exporter.close()
        if publisher is not None:
            publisher.close()
        raise SystemExit(f"kvfs: mounting {config.mountpoint} failed ({e}): see the lines above") from None
    log.info("mounted %s (%s; codec %s, promotion %s, %d files)", config.mountpoint,
             ", ".join(f"{t.name} {t.describe()} {_capacity(t.capacity)}" for t in config.tiers), config.codec,
             config.promotion, sum(t.files for t in tiers))
    sdnotify.notify("READY=1", f"STATUS=mounted {config.mountpoint}")
    clean = False
    try:
        trio.run(_serve, ops, index, mover, exporter, claim)
        clean = True
    finally:
        if exporter is not None:
            exporter.close()
        if publisher is not None:
            publisher.close()
        fuse.close(unmount=True)
        ops.pages.helpers.close()  # after the unmount: a stat still waiting fails with it
        index.close()
        log.info("unmounted %s%s", config.mountpoint, "" if clean else " after an error")
    return 0


def _start_events(config: Config, ops: Operations) -> Publisher | None:
    ev = config.events
    if not ev.enabled:
        return None
    try:
        publisher = Publisher(ev.endpoint, ev.replay_endpoint, ev.topic, ev.buffer_steps)
    except Exception as e:  # zmq.ZMQError: the address is in use or not ours
        raise SystemExit(f"kvfs: cannot publish KV events on {ev.endpoint}"
                         f"{' / ' + ev.replay_endpoint if ev.replay_endpoint else ''}: {e}") from None
    ops.events = EventSource(ops.index, publisher, dict(ev.media))
    log.info("KV events on %s%s", publisher.endpoint, f", replay on {ev.replay_endpoint}" if ev.replay_endpoint else "")
    return publisher


def load_keyring(config: Config) -> crypto.KeyRing | None:
    """The keys of [encryption] (ConfigError naming the file when one cannot be used), None without any."""
    enc = config.encryption
    try:
        current = crypto.load_key_file(enc.key_file) if enc.key_file is not None else crypto.key_from_env()
        tenants = {d: [crypto.load_key_file(p) for p in files] for d, files in enc.tenant_keys}
        if current is None and not tenants:
            return None
        return crypto.KeyRing(current, [crypto.load_key_file(p) for p in enc.old_key_files], tenants)
    except crypto.KeyError_ as e:
        raise ConfigError(str(e)) from None


def open_tiers(config: Config) -> list[Tier]:
    """The configured tiers, fastest first; an object store must answer now (SystemExit with the reason). A
    private L4 comes fenced (read-only) until this process claims it (kvfs/owner.py)."""
    tiers: list[Tier] = []
    for t in config.tiers:
        if t.directories:
            tiers.append(SpreadTier(t.name, t.directories, t.persistent))
        elif t.s3 is None:
            tiers.append(DirectoryTier(t.name, t.path, t.capacity, t.persistent))
        else:
            tier = S3Tier(t.name, t.s3, t.capacity)
            try:
                tier.check()
            except S3Unavailable as e:
                raise SystemExit(f"kvfs: {e.strerror}") from None
            tiers.append(tier)
        if t is config.l4 and not tiers[-1].shared:
            tiers[-1].fenced = owner.NOT_CLAIMED
    return tiers


def _capacity(size: int) -> str:
    return "unlimited" if size >= 1 << 60 else f"{size >> 20} MiB"


def _load_qat() -> QatCodec:
    """Load libqatzip, probe for a QAT device and register the codec; say loudly when it runs in software."""
    native_stderr.capture()  # QATzip prints notices to stderr: attribute them in the log
    library = qat.load()
    hardware = qat.probe_hardware(library)
    codec = qat.install(library, hardware)
    if hardware:
        log.info("codec qat: QAT hardware via %s", library.path)
    else:
        log.warning("codec qat: no QAT device found, QATzip runs in its SOFTWARE FALLBACK (zlib speed, tens of "
                    "MB/s per core) via %s; codec deflate writes the same format several times faster",
                    library.path)
    return codec


def _warn_if_disk_smaller(tiers: list[Tier]) -> None:
    """A capacity larger than the filesystem under a tier can hold turns into ENOSPC from the disk (failed
    commits and moves) instead of orderly eviction: say so at start."""
    for tier in (member for t in tiers for member in getattr(t, "members", [t])):
        if not isinstance(tier, DirectoryTier) or tier.capacity >= 1 << 60:
            continue
        try:
            disk = os.statvfs(tier.root)
        except OSError:
            continue  # a directory of a spread tier that is down: said at start
        room = disk.f_bavail * disk.f_frsize + tier.used_bytes
        if room < tier.capacity:
            log.warning("%s capacity %d MiB exceeds what %s can hold (%d MiB): lower it to avoid ENOSPC from the "
                        "disk", tier.name, tier.capacity >> 20, tier.root, room >> 20)


async def _serve(ops: Operations, index: Index, mover: Mover, exporter: metrics.Exporter | None = None,
                 claim: owner.Claim | None = None) -> None:
    async with trio.open_nursery() as nursery:
        ops.nursery = nursery
        if exporter is not None:
            exporter.attach(trio.lowlevel.current_trio_token())
        nursery.start_soon(_watch_signals)
        nursery.start_soon(mover.run)
        nursery.start_soon(_flush_periodically, index, ops.counters)
        nursery.start_soon(_tune_read_ahead, ops)
        nursery.start_soon(ops.adopter.sweep_periodically)
        if claim is not None:
            nursery.start_soon(claim.keep)
        if ops.events is not None:
            nursery.start_soon(ops.events.run)
        if ops.shared is not None:
            nursery.start_soon(ops.shared.log_reads_periodically, ops.shared.tier.location.access_log_s)
        await fuse.main()
        # main() returned: the kernel unmounted us, or a signal asked us to stop
        sdnotify.notify("STOPPING=1", f"STATUS=unmounting {ops.config.mountpoint}")
        await ops.commit_all()
        if ops.events is not None:
            ops.events.drain()  # the last changes reach subscribers before the publisher closes
        if ops.shared is not None:
            with trio.move_on_after(10):
                await ops.shared.flush_reads()
        try:
            index.flush_access()
            await trio.to_thread.run_sync(index.sync)
        except Exception:
            log.exception("flushing the index at unmount failed; the WAL still holds every commit")
        nursery.cancel_scope.cancel()


async def _tune_read_ahead(ops: Operations) -> None:
    """Widen the kernel's read-ahead on this mount once INIT is answered (the kernel clamps it to libfuse's
    answer then, 128 KiB). With 128 KiB, a sequential reader's requests reach the daemon in 128 KiB pieces:
    eight requests, eight replies and eight slices of each 1 MiB frame. With a window of a few frames they
    arrive as max_pages-sized requests (1 MiB here), several at once, so frames decode in parallel."""
    await ops.initialized.wait()
    size = READ_AHEAD_FRAMES * ops.config.frame_size
    path = bdi_path(ops.config.mountpoint)
    if path is None:
        log.info("read-ahead left as the kernel set it: the mount's device is not in /proc/self/mountinfo")
        return
    try:
        with open(path / "read_ahead_kb", "w") as f:
            f.write(str(size >> 10))
    except OSError as e:  # not root, or no sysfs: reads work, in smaller requests
        log.info("read-ahead left as the kernel set it (%s: %s)", path, e.strerror)
        return
    log.debug("read-ahead of %s: %d KiB", ops.config.mountpoint, size >> 10)


def bdi_path(mountpoint) -> Path | None:
    """/sys/class/bdi/MAJOR:MINOR of a mount (its backing device info: read-ahead), found in mountinfo: a stat
    of the mount would be a FUSE request to this very daemon."""
    # not realpath(mountpoint): its lstat of the mountpoint would wait for this daemon's own answer
    parent, name = os.path.split(os.path.abspath(mountpoint))
    target = os.path.join(os.path.realpath(parent), name)
    device = None
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 4 and _unescape(fields[4]) == target:
                    device = fields[2]  # the last one: a mount stacked on an older one at the same place
    except OSError:
        return None
    return Path("/sys/class/bdi") / device if device else None


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


async def _watch_signals() -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        async for signum in signals:
            log.info("received %s, unmounting", signal.Signals(signum).name)
            fuse.terminate()
            return


async def _flush_periodically(index: Index, counters: Counters) -> None:
    """Batched access times every few seconds; WAL checkpoints off the trio thread, and a reset of the WAL
    whenever it outgrows WAL_LIMIT_BYTES (a steady stream of commits never lets a passive checkpoint
    finish, and the WAL would grow without bound). A failure is logged and retried at the next tick: the
    index stays correct (the WAL holds every commit)."""
    ticks = 0
    while True:
        await trio.sleep(MAINTENANCE_TICK)
        ticks += 1
        try:
            if ticks % ACCESS_FLUSH_TICKS == 0:
                index.flush_access()
            wal_large = index.wal_bytes() > WAL_LIMIT_BYTES
            if wal_large or ticks % CHECKPOINT_TICKS == 0:
                await trio.to_thread.run_sync(index.checkpoint)  # copies the bulk, concurrently with writers
                if wal_large:
                    index.truncate_wal()  # short: only frames written since; resets the WAL file
        except Exception:
            counters.errors += 1
            log.exception("index maintenance failed; retrying")
