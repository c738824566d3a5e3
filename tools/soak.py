#!/usr/bin/env python3
"""A soak run of kvfs: hours of mixed load on one mount, watching the daemon for leaks.

    tools/soak.py [--duration 1h] [--out DIR] [--ceph DIR] [--interval 10]

One mount with a small L2 (tmpfs), L3 and L4 on a real Ceph RGW, so files keep moving L2 → L3 → L4 and back.
Standalone it starts its own one-host cluster (tools/ceph_cluster.py) on ports beside the test suite's (RGW
7580, mon 3380/6780); --ceph DIR uses one already running in DIR. Meanwhile:

  writers   new files of real KV bytes (tests/data/kv, rotated and cut per file: no two alike), a SHA-256 kept
            per file; past --max-files the oldest are unlinked (the data set stays bounded, L4 objects go too)
  readers   read random files with their page cache dropped and compare with the writer's checksum: wrong
            bytes are a failure; a miss (ENOENT) is fine for a dropped or unlinked file only
  hot/cold  pin, unpin, demote to L3/L4, prefetch and drop through kvfs.client
  RGW       stopped for --rgw-down seconds every --rgw-every: reads of L4 files must fail with EIO meanwhile;
            after the restart every file that was in L4 must read back right

Every --interval seconds: the daemon's RSS, open fds and threads (/proc/PID), the size of the index's WAL and
the mover's backlog (.kvfs/stats). Passes (exit 0) when no read was wrong, no committed file was lost, RSS and
fds are flat after the warm-up (least-squares slopes within the bounds below), the WAL stayed below its bound
and the daemon lived to a clean unmount. Prints a table, writes OUT/soak.json and OUT/soak.png.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import errno
import hashlib
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Protocol

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))
from ceph_cluster import BUCKET, CephCluster  # noqa: E402

from kvfs import client  # noqa: E402
from kvfs.config import parse_duration  # noqa: E402
from kvfs.daemon import WAL_LIMIT_BYTES  # noqa: E402

# Bounds of the verdict. RSS: after the warm-up the heap should have reached the high-water mark of frames in
# flight (the daemon keeps freed frame buffers, mallopt trim threshold 256 MiB), so a healthy daemon is flat;
# 2 MiB/min (120 MiB/h) lies above the sampling noise and far below a leak of anything per file (hundreds of
# files a minute: 2 MiB/min is < 10 KiB per file written). Measured (docs/soak.md): the daemon's native (non-
# Python) memory still grows 4-9 MiB/min in the first 15 minutes while its Python heap is flat, an open
# finding; short runs (CI) pass a looser bound with --rss-slope, which still catches a leak of file-sized
# buffers. fds: the steady set (FUSE, index,
# WAL, lock, pooled S3 connections, open objects) does not grow with files; 1 fd/min is 60 leaked fds an
# hour, a leak per file (hundreds a minute) or per outage shows far above it. WAL: the daemon checkpoints it
# every 30 s and resets it once past WAL_LIMIT_BYTES (64 MiB), so it can pass that only by one tick's commits.
RSS_SLOPE_MIB_PER_MIN = 2.0
FDS_SLOPE_PER_MIN = 1.0
S3_POOL_FDS = 16  # kvfs's S3 client pools up to 16 connections, opened as concurrency rises: a short run's
# slope may carry them (bound: at least this many fds over the fitted span), a leak keeps climbing past them
WAL_MAX_BYTES = WAL_LIMIT_BYTES + (16 << 20)
WARMUP_FRACTION, WARMUP_MAX_S = 0.2, 120.0
RECOVERY_S = 120.0  # RGW restarted: how long until a read of an L4 file must succeed again
DOWN_ERRNOS = {errno.EIO, errno.EHOSTDOWN, errno.ETIMEDOUT}  # a clean failure while the store is down
MISS_ERRNOS = {errno.ENOENT, errno.ESTALE}
_LOG_PROBLEM = re.compile(r"^\d{4}-\d\d-\d\d [\d:,]+ (ERROR|CRITICAL) |Traceback")
L4_TOML = "[l4]\nbreaker_failures = 2\nprobe_s = 1\ndeadline_s = 5\n"  # fail fast and recover fast


class Store(Protocol):
    """What the soak needs of a Ceph cluster (tools/ceph_cluster.CephCluster, the tests' `ceph` fixture)."""

    env: dict[str, str]

    def stop_rgw(self) -> None: ...

    def start_rgw(self, timeout: float = 60.0) -> None: ...


@dataclasses.dataclass
class Options:
    duration_s: float = 3600.0
    out: Path = REPO / "bench-results" / "soak"
    interval_s: float = 10.0
    writers: int = 2
    readers: int = 2
    write_rate: float = 3.0  # new files per second, all writers together
    max_files: int = 240
    min_file: int = 128 << 10
    max_file: int = 3 << 19  # 1.5 MiB
    l2: str = "16M"
    l3: str = "128M"
    rgw_every_s: float = 60.0
    rgw_down_s: float = 10.0
    hotcold_every_s: float = 0.5
    seed: int = 1
    data: Path = REPO / "tests" / "data" / "kv"
    rss_slope_mib_per_min: float = RSS_SLOPE_MIB_PER_MIN


@dataclasses.dataclass
class Entry:
    name: str
    digest: bytes
    size: int
    state: str = "live"  # live | dropped (a drop was asked) | deleted (unlinked) | missing (a miss while live)


class Catalog:
    """Every file written and what it must read as; shared by the workers."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, Entry] = {}
        self._live: collections.OrderedDict[str, None] = collections.OrderedDict()  # oldest first

    def add(self, entry: Entry) -> None:
        with self._lock:
            self._entries[entry.name] = entry
            self._live[entry.name] = None

    def mark(self, name: str, state: str) -> bool:
        """Set a live file's state; False if it was no longer live."""
        with self._lock:
            if self._live.pop(name, 0) == 0:
                return False
            self._entries[name].state = state
            return True

    def state(self, name: str) -> str:
        with self._lock:
            return self._entries[name].state

    def pick(self, rng: random.Random) -> Entry | None:
        with self._lock:
            return self._entries[rng.choice(list(self._live))] if self._live else None

    def oldest(self) -> str | None:
        with self._lock:
            return next(iter(self._live), None)

    def live(self) -> list[Entry]:
        with self._lock:
            return [self._entries[name] for name in self._live]

    def __len__(self) -> int:
        with self._lock:
            return len(self._live)


class Outages:
    """When the store was down: from RGW's stop until kvfs's L4 circuit breaker closed again (Soak.recover)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.windows: list[list[float | None]] = []

    def begin(self) -> None:
        with self._lock:
            self.windows.append([time.monotonic(), None])

    def end(self) -> None:
        with self._lock:
            self.windows[-1][1] = time.monotonic()

    def covers(self, t0: float, t1: float) -> bool:
        with self._lock:
            return any(start <= t1 and (end is None or end >= t0) for start, end in self.windows)


class Tally:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts: collections.Counter[str] = collections.Counter()
        self.failures: list[str] = []  # the first few, for the report

    def add(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.counts[key] += n

    def fail(self, key: str, detail: str) -> None:
        with self._lock:
            self.counts[key] += 1
            if len(self.failures) < 50:
                self.failures.append(f"{key}: {detail}")


def kv_samples(data: Path) -> list[bytes]:
    paths = sorted(data.glob("*.kv"))
    if not paths:
        raise SystemExit(f"no real KV samples (*.kv) in {data}")
    return [p.read_bytes() for p in paths]


def file_bytes(samples: list[bytes], n: int, rng: random.Random, lo: int, hi: int) -> bytes:
    """Real KV bytes for file n: a sample rotated by a per-file offset (frames differ), cut to a random even
    size and stamped with n, so no two files (and no two objects) are alike."""
    sample = samples[n % len(samples)]
    size = rng.randrange(lo, min(hi, len(sample)) + 1) & ~1
    offset = (n * 7919 * 2) % len(sample)
    rotated = sample[offset:] + sample[:offset]
    return n.to_bytes(8, "little") + rotated[:size - 8]


class Soak:
    def __init__(self, opts: Options, store: Store, mountpoint: Path, state_dir: Path, pid: int) -> None:
        self.opts = opts
        self.store = store
        self.root = mountpoint
        self.wal = state_dir / "index.sqlite-wal"
        self.pid = pid
        self.catalog = Catalog()
        self.outages = Outages()
        self.tally = Tally()
        self.samples: list[dict] = []
        self.last_stats: dict = {}
        self.stop = threading.Event()
        self.started = time.monotonic()
        self._next_file = 0
        self._id_lock = threading.Lock()
        self._kv = kv_samples(opts.data)

    # -- workers --------------------------------------------------------------------------------------------
    def writer(self, wid: int) -> None:
        rng = random.Random(self.opts.seed * 1000 + wid)
        period = self.opts.writers / self.opts.write_rate
        while not self.stop.wait(rng.uniform(0.5, 1.5) * period):
            with self._id_lock:
                n, self._next_file = self._next_file, self._next_file + 1
            data = file_bytes(self._kv, n, rng, self.opts.min_file, self.opts.max_file)
            name = f"d{n % 8}/f{n:07d}.kv"
            try:
                (self.root / name).parent.mkdir(exist_ok=True)
                with open(self.root / name, "wb") as f:
                    for i in range(0, len(data), 256 << 10):
                        f.write(data[i:i + (256 << 10)])
            except OSError as e:  # a refused commit must say so at close(): the file does not count as written
                self.tally.fail("write_errors", f"{name}: {e}")
                continue
            self.catalog.add(Entry(name, hashlib.sha256(data).digest(), len(data)))
            self.tally.add("files_written")
            self.tally.add("bytes_written", len(data))
            while len(self.catalog) > self.opts.max_files:
                self.unlink_oldest()

    def unlink_oldest(self) -> None:
        name = self.catalog.oldest()
        if name is None or not self.catalog.mark(name, "deleted"):
            return
        try:
            os.unlink(self.root / name)
            self.tally.add("files_unlinked")
        except OSError as e:
            self.judge_error("unlink", name, e, time.monotonic())

    def reader(self, rid: int) -> None:
        rng = random.Random(self.opts.seed * 1000 + 100 + rid)
        while not self.stop.wait(0.05):
            entry = self.catalog.pick(rng)
            if entry is not None:
                self.read_and_verify(entry)

    def read_and_verify(self, entry: Entry, kind: str = "read") -> str | None:
        """Read a whole file past the page cache; when it read right, the tier it lay in (truthy), else None."""
        path = self.root / entry.name
        t0 = time.monotonic()
        try:
            tier = os.getxattr(path, client.XA_TIER).decode()
            with open(path, "rb") as f:
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)  # every byte from kvfs
                data = f.read()
        except OSError as e:
            self.judge_error(kind, entry.name, e, t0)
            return None
        if len(data) != entry.size or hashlib.sha256(data).digest() != entry.digest:
            self.tally.fail("wrong_reads", f"{entry.name} (from {tier}): {len(data)} bytes, expected {entry.size}")
            return None
        self.tally.add(f"{kind}s_ok")
        self.tally.add(f"{kind}s_from_{tier}")
        return tier

    def judge_error(self, kind: str, name: str, e: OSError, t0: float) -> None:
        state = self.catalog.state(name)
        if e.errno in MISS_ERRNOS and state != "live":
            self.tally.add(f"{kind}_misses_after_drop_or_unlink")
        elif e.errno in MISS_ERRNOS:  # weighed against the daemon's evictions at the end; counted once
            if self.catalog.mark(name, "missing"):
                self.tally.fail("live_files_missing", f"{kind} {name}: {e}")
        elif e.errno in DOWN_ERRNOS and self.outages.covers(t0, time.monotonic()):
            self.tally.add(f"{kind}_failures_while_store_down")
        else:
            self.tally.fail("unexpected_errors", f"{kind} {name} ({state}) at {t0 - self.started:.1f} s: {e}"
                            + self._why_not_a_mount(e))

    def _why_not_a_mount(self, e: OSError) -> str:
        """kvfs.client says 'not in a kvfs mount' when it cannot see the mount's stats file: why not?"""
        if e.errno not in (errno.ENOTSUP, errno.EOPNOTSUPP):
            return ""
        try:
            os.stat(self.root / ".kvfs" / "stats")
            return f" (ismount: {os.path.ismount(self.root)}, stats file there)"
        except OSError as err:
            return f" (ismount: {os.path.ismount(self.root)}, stat of the stats file: {err})"

    def hotcold(self) -> None:
        """Pin, unpin, demote, prefetch and drop random files through the hot/cold API, in turn."""
        rng = random.Random(self.opts.seed * 1000 + 200)
        pinned: collections.deque[str] = collections.deque()
        actions = ["pin", "demote_L3", "demote_L4", "prefetch", "demote_L4", "unpin", "drop", "prefetch"]
        step = 0
        while not self.stop.wait(self.opts.hotcold_every_s):
            action = actions[step % len(actions)]
            step += 1
            entry = self.catalog.pick(rng)
            if entry is None or (entry.name in pinned and action != "pin"):
                continue
            if action == "unpin":
                if not pinned:
                    continue
                entry = Entry(pinned.popleft(), b"", 0)
            if action == "drop" and not self.catalog.mark(entry.name, "dropped"):
                continue
            path = self.root / entry.name
            t0 = time.monotonic()
            try:
                if action == "pin":
                    client.pin(path)
                    pinned.append(entry.name)
                elif action == "unpin":
                    client.unpin(path)
                elif action.startswith("demote"):
                    client.demote(path, to=action[-2:])
                elif action == "prefetch":
                    client.prefetch(path)
                else:
                    client.drop(path)
            except client.KvfsError as e:
                if e.errno == errno.ENOSPC or (e.errno == errno.EBUSY and action.startswith("demote")):
                    self.tally.add(f"{action}_refused")  # pin limit reached, a pinned file, a full tier
                else:
                    self.judge_error(action, entry.name, e, t0)
                continue
            self.tally.add(f"{action}s")

    def rgw_cycle(self) -> None:
        """Stop RGW every rgw_every_s for rgw_down_s; once back, every file that was in L4 must read right."""
        o = self.opts
        k = 1
        while not self.stop.wait(max(0.0, self.started + k * o.rgw_every_s - time.monotonic())):
            k += 1
            if time.monotonic() + o.rgw_down_s + 30 > self.started + o.duration_s:
                continue  # not enough time left to see it recover
            in_l4 = [e for e in self.catalog.live() if self._tier(e.name) == "L4"]
            self.outages.begin()
            self.store.stop_rgw()
            self.tally.add("rgw_stops")
            try:
                probe = self._still_in_l4(in_l4)
                if probe is not None:  # a read of an L4 file must fail, and cleanly
                    self.read_and_verify(probe, "outage_probe")
                self.stop.wait(o.rgw_down_s)
            finally:
                self.store.start_rgw()
            self.tally.add("rgw_starts")
            self.recover(in_l4)

    def recover(self, in_l4: list[Entry]) -> None:
        """RGW answers again; the outage ends once kvfs says so: its L4 circuit breaker is closed. Until its next
        probe (probe_s after the last failed one) the breaker stays open and reads of L4 files fail at once, RGW
        up or not. A read of a file that lies in L4 (writers unlink old files, and files of the outage move)
        is the probe that closes it; a read served by L2 or L3 proves nothing of L4 (issue 40: such a probe
        ended an outage 0.1 s before the breaker closed, and 20 reads of L4 files that followed got EIO)."""
        deadline = time.monotonic() + RECOVERY_S
        while True:
            probe = self._still_in_l4(in_l4)
            if probe is not None:
                self.read_and_verify(probe, "recovery_probe")
            if self._l4_breaker() == "closed":
                if probe is None:
                    self.tally.add("recoveries_without_an_L4_file")  # the mover's or the readers' calls closed it
                break
            if time.monotonic() > deadline:
                self.tally.fail("store_not_back", f"L4's circuit still open {RECOVERY_S:.0f} s after RGW restarted")
                break
            time.sleep(0.5)
        self.outages.end()
        for entry in in_l4:  # nothing committed is lost: every file that lay in L4 reads back right
            if self.catalog.state(entry.name) == "live":
                self.read_and_verify(entry, "after_restart")

    def _still_in_l4(self, entries: list[Entry]) -> Entry | None:
        return next((e for e in entries if self.catalog.state(e.name) == "live" and self._tier(e.name) == "L4"), None)

    def _l4_breaker(self) -> str:
        """L4's circuit breaker as the daemon reports it: closed, open, or ? (no answer)."""
        try:
            return json.loads((self.root / ".kvfs" / "stats").read_bytes())["tiers"]["L4"]["breaker"]
        except (OSError, ValueError, KeyError):
            return "?"

    def _tier(self, name: str) -> str:
        try:
            return os.getxattr(self.root / name, client.XA_TIER).decode()
        except OSError:
            return "?"

    def sampler(self) -> None:
        while self.sample() and not self.stop.wait(self.opts.interval_s):
            pass

    def sample(self) -> bool:
        """Record one sample; False (and the run stops) when the daemon is gone."""
        try:
            status = Path(f"/proc/{self.pid}/status").read_text()
            stats = json.loads((self.root / ".kvfs" / "stats").read_bytes())
        except OSError as e:
            self.tally.fail("daemon_gone", f"sampling failed: {e}")
            self.stop.set()
            return False
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        self.last_stats = stats
        mover = stats["mover"]
        self.samples.append({
            "t_s": round(time.monotonic() - self.started, 2),
            "rss_bytes": int(fields["VmRSS"].split()[0]) * 1024,
            **{f"{key.lower()}_bytes": int(fields[key].split()[0]) * 1024  # heap, mapped files, shared memory
               for key in ("RssAnon", "RssFile", "RssShmem") if key in fields},
            "fds": len(os.listdir(f"/proc/{self.pid}/fd")),
            "threads": int(fields["Threads"]),
            "wal_bytes": self.wal.stat().st_size if self.wal.exists() else 0,
            "backlog_bytes": mover["backlog_bytes"],
            "moves_in_flight": mover["moves_in_flight"],
            "promotions_queued": mover["promotions_queued"],
            "dirty_bytes": stats["dirty_bytes"],
            "open_files": stats["open_files"],
            "files": {name: t["files"] for name, t in stats["tiers"].items()},
            "store_down": self.outages.covers(time.monotonic(), time.monotonic()),
        })
        return True

    # -- the run --------------------------------------------------------------------------------------------
    def run(self) -> None:
        targets = [(self.writer, (i,)) for i in range(self.opts.writers)]
        targets += [(self.reader, (i,)) for i in range(self.opts.readers)]
        targets += [(fn, ()) for fn in (self.hotcold, self.rgw_cycle, self.sampler)]
        workers = [threading.Thread(target=fn, args=args, daemon=True) for fn, args in targets]
        for w in workers:
            w.start()
        self.stop.wait(self.opts.duration_s)
        self.stop.set()
        for w in workers:
            w.join(RECOVERY_S + 60)
        self.sample()

    def final_check(self) -> None:
        """With the store up and the load stopped: every live file reads right."""
        for entry in self.catalog.live():
            self.read_and_verify(entry, "final")


# -- verdict ------------------------------------------------------------------------------------------------
def slope_per_min(samples: list[dict], key: str, since_s: float) -> float:
    import numpy as np

    pts = [(s["t_s"] / 60, s[key]) for s in samples if s["t_s"] >= since_s]
    if len(pts) < 3:
        return float("nan")
    t, v = np.array(pts).T
    return float(np.polyfit(t, v, 1)[0])


def verdict(soak: Soak, stats: dict, exit_code: int | None, alive: bool, log_problems: list[str]) -> dict:
    warmup = min(WARMUP_FRACTION * soak.opts.duration_s, WARMUP_MAX_S)
    counts = soak.tally.counts
    evicted = sum(t["evicted_files"] for t in stats["tiers"].values())
    rss_slope = slope_per_min(soak.samples, "rss_bytes", warmup) / (1 << 20)
    fds_slope = slope_per_min(soak.samples, "fds", warmup)
    fitted_min = (soak.samples[-1]["t_s"] - warmup) / 60
    fds_bound = round(max(FDS_SLOPE_PER_MIN, S3_POOL_FDS / fitted_min), 2)
    rss_bound = soak.opts.rss_slope_mib_per_min
    wal_max = max(s["wal_bytes"] for s in soak.samples)
    checks = [
        ("wrong reads", counts["wrong_reads"], "= 0", counts["wrong_reads"] == 0),
        # a miss of a live file is a loss unless the daemon evicted that many files (L3 full with L4 down)
        ("live files missing", counts["live_files_missing"], f"<= {evicted} evicted",
         counts["live_files_missing"] <= evicted),
        ("unexpected errors", counts["unexpected_errors"], "= 0", counts["unexpected_errors"] == 0),
        ("write errors", counts["write_errors"], "= 0", counts["write_errors"] == 0),
        ("store back after restart", counts["store_not_back"], "= 0", counts["store_not_back"] == 0),
        ("daemon errors + checksum failures", stats["errors"] + stats["checksum_failures"], "= 0",
         stats["errors"] + stats["checksum_failures"] == 0),
        ("RSS slope after warm-up (MiB/min)", round(rss_slope, 3), f"< {rss_bound}", rss_slope < rss_bound),
        ("fds slope after warm-up (/min)", round(fds_slope, 3), f"< {fds_bound}", fds_slope < fds_bound),
        ("WAL max (MiB)", round(wal_max / (1 << 20), 2), f"< {WAL_MAX_BYTES >> 20}", wal_max < WAL_MAX_BYTES),
        ("daemon alive at the end", alive, "= True", alive),
        ("clean unmount (exit status)", exit_code, "= 0", exit_code == 0),
        ("log errors / tracebacks", len(log_problems), "= 0", not log_problems),
    ]
    return {"passed": all(ok for *_, ok in checks), "warmup_s": warmup,
            "checks": [{"check": c, "value": v, "bound": b, "ok": ok} for c, v, b, ok in checks]}


def moves(stats: dict) -> dict:
    keys = ("demoted_files", "promoted_files", "evicted_files", "dropped_files", "hits")
    return {name: {k: t[k] for k in keys} for name, t in stats["tiers"].items()}


# -- the mount ------------------------------------------------------------------------------------------------
class Mount:
    def __init__(self, base: Path, shm: Path, opts: Options, store: Store) -> None:
        self.base = base
        self.mountpoint = base / "mnt"
        self.state = base / "state"
        self.log = base / "kvfs.log"
        self.prefix = f"soak-{uuid.uuid4().hex[:8]}"  # fresh each run: no leftover claim or object in the way
        self.mountpoint.mkdir(parents=True)
        (base / "kvfs.toml").write_text(L4_TOML)
        self.args = ["--l2", f"{shm}:{opts.l2}", "--l3", f"{base / 'l3'}:{opts.l3}", "--l4",
                     f"s3://{BUCKET}/{self.prefix}", "--config", str(base / "kvfs.toml"), "--state-dir",
                     str(self.state)]
        self.env = {**os.environ, **store.env}
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 60.0) -> None:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "kvfs", "mount", "--foreground",
                                          str(self.mountpoint), *self.args], stdout=log, stderr=log, env=self.env)
        deadline = time.monotonic() + timeout
        while not os.path.ismount(self.mountpoint):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"kvfs did not mount; see {self.log}:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.05)

    def stats(self) -> dict:
        return json.loads((self.mountpoint / ".kvfs" / "stats").read_bytes())

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None and os.path.ismount(self.mountpoint)

    def unmount(self) -> int | None:
        if self.proc is not None and self.proc.poll() is not None:  # died: the kernel still holds the mount
            subprocess.run(["fusermount3", "-u", "-z", str(self.mountpoint)], capture_output=True)
            return self.proc.returncode
        if os.path.ismount(self.mountpoint):
            subprocess.run(["fusermount3", "-u", str(self.mountpoint)], capture_output=True)
        try:
            return self.proc.wait(120) if self.proc else None
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)
            subprocess.run(["fusermount3", "-u", "-z", str(self.mountpoint)], capture_output=True)
            return None

    def log_problems(self) -> list[str]:
        return [line for line in self.log.read_text(errors="replace").splitlines() if _LOG_PROBLEM.search(line)]


def run_soak(opts: Options, store: Store, workdir: Path) -> dict:
    """One soak run on `store`; returns the report (also written to opts.out/soak.json, with the PNG)."""
    with tempfile.TemporaryDirectory(prefix="kvfs-soak-l2-", dir="/dev/shm") as shm:
        mount = Mount(workdir, Path(shm), opts, store)
        mount.start()
        try:
            soak = Soak(opts, store, mount.mountpoint, mount.state, mount.stats()["pid"])
            soak.run()
            alive = mount.alive()
            if alive:
                soak.final_check()
                soak.sample()
            stats = soak.last_stats
            # leave the bucket as found: unlinking deletes the L4 objects
            for entry in soak.catalog.live() if alive else []:
                soak.catalog.mark(entry.name, "deleted")
                try:
                    os.unlink(mount.mountpoint / entry.name)
                except OSError as e:
                    soak.judge_error("unlink", entry.name, e, time.monotonic())
        finally:
            exit_code = mount.unmount()
            opts.out.mkdir(parents=True, exist_ok=True)
            shutil.copy(mount.log, opts.out / "kvfs.log")
    report = {
        "options": {k: str(v) for k, v in dataclasses.asdict(opts).items()},
        "l4": f"s3://{BUCKET}/{mount.prefix}",
        "duration_s": round(time.monotonic() - soak.started, 1),
        **verdict(soak, stats, exit_code, alive, mount.log_problems()),
        "counts": dict(sorted(soak.tally.counts.items())),
        "tiers": moves(stats),
        "daemon": {k: stats[k] for k in ("commits", "commit_failures", "errors", "checksum_failures",
                                         "move_failures", "requested_moves", "prefetches", "pin_refusals")},
        "outages": [[round(a - soak.started, 1), round(b - soak.started, 1)] for a, b in soak.outages.windows
                    if b is not None],
        "failures": soak.tally.failures,
        "log_problems": mount.log_problems()[:50],
        "samples": soak.samples,
    }
    opts.out.mkdir(parents=True, exist_ok=True)
    (opts.out / "soak.json").write_text(json.dumps(report, indent=1))
    plot(report, opts.out / "soak.png")
    return report


# -- output ---------------------------------------------------------------------------------------------------
def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = report["samples"]
    t = [s["t_s"] / 60 for s in samples]
    series = [("RSS (MiB)", "rss_bytes", 1 << 20), ("open fds", "fds", 1), ("threads", "threads", 1),
              ("WAL (MiB)", "wal_bytes", 1 << 20), ("backlog (MiB)", "backlog_bytes", 1 << 20)]
    fig, axes = plt.subplots(len(series), 1, figsize=(7, 8), sharex=True)
    for ax, (label, key, unit) in zip(axes, series):
        ax.plot(t, [s[key] / unit for s in samples], lw=1.2)
        ax.set_ylabel(label, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.axvline(report["warmup_s"] / 60, color="grey", ls="--", lw=0.8)
        for start, end in report["outages"]:
            ax.axvspan(start / 60, end / 60, color="tab:red", alpha=0.15, lw=0)
        ax.set_ylim(bottom=0)
    axes[-1].set_xlabel("minutes (dashed: end of warm-up; red: RGW down until L4 reads again)", fontsize=8)
    verdict_text = "PASS" if report["passed"] else "FAIL"
    fig.suptitle(f"kvfs soak, {report['duration_s'] / 60:.0f} min: {verdict_text}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def print_report(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"kvfs soak, {report['duration_s']:.0f} s, {report['l4']}: "
                        f"{'PASS' if report['passed'] else 'FAIL'}")
    for col in ("check", "value", "bound", "ok"):
        table.add_column(col, justify="left" if col == "check" else "right")
    for c in report["checks"]:
        table.add_row(c["check"], str(c["value"]), c["bound"], "yes" if c["ok"] else "NO")
    counts = Table(title="what the run did", show_header=False)
    for key, n in report["counts"].items():
        counts.add_row(key, str(n))
    for tier, t in report["tiers"].items():
        counts.add_row(f"{tier} moves", ", ".join(f"{k} {v}" for k, v in t.items()))
    console = Console()
    console.print(table)
    console.print(counts)
    for line in report["failures"][:20] + report["log_problems"][:20]:
        console.print(f"  {line}", markup=False)


def existing_cluster(root: Path) -> CephCluster:
    """A cluster tools/ceph_cluster.py started in root: its endpoint and keys from root/env."""
    env = dict(line.removeprefix("export ").split("=", 1) for line in (root / "env").read_text().splitlines())
    cluster = CephCluster(root, port=int(env["AWS_ENDPOINT_URL"].rsplit(":", 1)[1]))
    cluster.access_key, cluster.secret_key = env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"]
    return cluster


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", default="1h", help="how long the load runs (e.g. 3m, 1h; default 1h)")
    ap.add_argument("--out", type=Path, default=Options.out, help="where soak.json and soak.png go")
    ap.add_argument("--interval", type=float, default=Options.interval_s, help="seconds between samples")
    ap.add_argument("--ceph", type=Path, metavar="DIR",
                    help="a cluster tools/ceph_cluster.py started in DIR (default: start one on ports 7580, 3380/6780)")
    ap.add_argument("--rgw-every", type=float, default=Options.rgw_every_s, help="seconds between RGW stops")
    ap.add_argument("--rgw-down", type=float, default=Options.rgw_down_s, help="seconds RGW stays down")
    ap.add_argument("--write-rate", type=float, default=Options.write_rate, help="new files per second")
    ap.add_argument("--max-files", type=int, default=Options.max_files, help="live files kept (oldest unlinked)")
    ap.add_argument("--seed", type=int, default=Options.seed)
    ap.add_argument("--rss-slope", type=float, default=RSS_SLOPE_MIB_PER_MIN,
                    help=f"bound of RSS growth after the warm-up, MiB/min (default {RSS_SLOPE_MIB_PER_MIN})")
    args = ap.parse_args(argv)
    opts = Options(duration_s=parse_duration(args.duration), out=args.out, interval_s=args.interval,
                   rgw_every_s=args.rgw_every, rgw_down_s=args.rgw_down, write_rate=args.write_rate,
                   max_files=args.max_files, seed=args.seed, rss_slope_mib_per_min=args.rss_slope)
    with tempfile.TemporaryDirectory(prefix="kvfs-soak-") as tmp:
        work = Path(tmp)
        cluster = existing_cluster(args.ceph) if args.ceph else None
        try:
            if cluster is None:
                cluster = CephCluster(work / "ceph", port=7580, mon_ports=(3380, 6780)).start()
            (work / "run").mkdir()
            report = run_soak(opts, cluster, work / "run")
        finally:
            if cluster is not None and not args.ceph:
                cluster.stop()
            shutil.rmtree(work / "run" / "l3", ignore_errors=True)
    print_report(report)
    print(f"saved {opts.out / 'soak.json'} and {opts.out / 'soak.png'}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
