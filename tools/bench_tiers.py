"""The tier section of tools/bench_fs.py (run with it, or alone with `bench_fs.py --only tiers`).

Every file of the data sets (all dtypes, interleaved) is measured, each round on fresh mounts with an L2 in
tmpfs and an L3 directory on local disk (--l3-dir, default /var/tmp), codec --tier-codec, `--promote never`
so that reads from L3 stay on L3:

  reads     MB/s (logical bytes / summed per-file open+read+close time) and per-file latency p50 / p99
            (nearest rank) of all files when they are
              L2       on L2 (tmpfs)
              L3 warm  on L3, their object files in the page cache (read once just before)
              L3 cold  on L3, their object files dropped from the page cache (sync, then
                       posix_fadvise(DONTNEED) on every object under the L3 directory)
            Before every pass the kernel's FUSE page cache of the files is dropped the same way, so that
            every byte comes from the daemon: the pass fails unless .kvfs/stats shows exactly one hit per
            file on the claimed tier and bytes_read grown by the files' size. "disk MB" is what the daemon
            read from the block layer (/proc/PID/io read_bytes): ~0 warm, ~the stored size cold.
  demotion  the mover's throughput: the files, written to a roomy L2 (the L2 pass above) and unmounted, are
            remounted with an L2 of --tier-small-l2 MiB: at start the mover demotes LRU files to L3 down to
            the low watermark. Stats are polled every POLL_S until mover.backlog_bytes is 0 and nothing is
            draining. Rates are over the active window (last poll before the first demotion → settled);
            "wall" is from the mount going live (it includes the mover's first tick). Stored MB are the
            compressed objects moved, logical MB the size of the files that moved.
            The files still on L2 after that are then fsync'ed (which moves an object to the persistent
            tier), and the two L3 passes run, in a rotating order; the L2 pass always comes first (it needs
            the files on L2), so the ratios are paired per round rather than interleaved.
  writes    the same files written into a fresh mount whose L2 has only --tier-small-l2 MiB: writers wait
            while the mover demotes (writer_waits); write MB/s next to the same writes into the roomy L2,
            and the demotion rate from the first write until the mover settled.
The demotion window is exact to ±POLL_S at each end (0.02 s; ~0.4 s windows with the default 128 files).
Every file read is compared with its source by SHA-256; wrong bytes, a file not on the tier claimed, an
error counter of the daemon or an ERROR/Traceback in its log abort the benchmark (exit status 3).
"""

from __future__ import annotations

import collections
import hashlib
import math
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import bench_harness as bf
from bench_harness import fs_type

READ_VARIANTS = ("L2", "L3 warm", "L3 cold")
TIER_XATTR = "user.kvfs.tier"
POLL_S = 0.02  # stats polling while the mover works: the window is exact to ±POLL_S at each end; a poll
# costs the daemon one stats render (a small index query)
SETTLE_TIMEOUT_S = 300.0
FAULTS = ("commit_failures", "checksum_failures", "errors")
MOVE_COUNTERS = ("demoted_files", "promoted_files", "evicted_files")


@dataclass
class TierFile:
    rel: str  # path inside the mount: <dtype>/<name>
    kv: bf.KvFile

    @property
    def size(self) -> int:
        return len(self.kv.data)


def tier_files(datasets: dict[str, bf.DataSet]) -> list[TierFile]:
    """All files of all dtypes, interleaved, so that each dtype is spread evenly over the LRU order."""
    columns = [[TierFile(f"{ds.dtype}/{f.name}", f) for f in ds.files] for ds in datasets.values()]
    return [col[i] for i in range(max(map(len, columns))) for col in columns if i < len(col)]


# ---------------------------------------------------------------------------------------------------
# page cache and process helpers
# ---------------------------------------------------------------------------------------------------


def proc_io_read_bytes(pid: int) -> int:
    """Bytes a process (all its threads) caused to be fetched from the block layer."""
    with open(f"/proc/{pid}/io") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    raise bf.BenchFailure(f"/proc/{pid}/io has no read_bytes")


def l3_objects(l3_dir: Path) -> list[Path]:
    """Object files of a directory tier: <dir>/<2 hex>/<id>, temp files excluded."""
    return [p for p in l3_dir.glob("*/*") if p.is_file() and not p.name.endswith(".tmp")]


def fadvise_dontneed(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def load_into_page_cache(path: Path) -> None:
    with open(path, "rb", buffering=0) as f:
        while f.read(1 << 20):
            pass


def drop_fuse_cache(mount: bf.Mount, files: list[TierFile]) -> None:
    """The kernel keeps file pages of the mount across opens (keep_cache): drop them, so the daemon serves
    every byte of the next read."""
    for tf in files:
        fadvise_dontneed(mount.mountpoint / tf.rel)


def prepare_pass(variant: str, mount: bf.Mount, files: list[TierFile]) -> None:
    os.sync()  # dirty pages cannot be dropped
    drop_fuse_cache(mount, files)  # first: opening a file may read its object's header
    if variant == "L3 warm":
        for p in l3_objects(mount.l3):
            load_into_page_cache(p)
    elif variant == "L3 cold":
        for p in l3_objects(mount.l3):
            fadvise_dontneed(p)


# ---------------------------------------------------------------------------------------------------
# mounts and checks
# ---------------------------------------------------------------------------------------------------
def new_mount(args, base: Path, shm_base: Path, l3_base: Path, tag: str, l2_capacity: int, l3_capacity: int,
              live: list) -> bf.Mount:
    m = bf.Mount(args.kvfs, args.tier_codec, base, shm_base, l2_capacity, tag, args.dtype,
                 l3=(l3_base, l3_capacity), promote="never")
    live.append(m)
    m.start()
    return m


def check_daemon(mount: bf.Mount, doc: dict, what: str) -> None:
    faults = {k: doc[k] for k in FAULTS if doc[k]}
    if faults:
        raise bf.BenchFailure(f"{what}: daemon reported {faults}:\n{mount.log_tail()}")


def stop_mount(mount: bf.Mount, live: list, notes: list[str], what: str) -> None:
    """Unmount, wait for the daemon to exit; a bad exit or an ERROR in its log fails the benchmark."""
    check_daemon(mount, mount.stats(), what)
    code = mount.stop(notes)
    live.remove(mount)
    bad = mount.bad_log_lines()
    if code != 0 or bad:
        raise bf.BenchFailure(f"{what}: daemon exit {code}, log errors:\n" + "\n".join(bad[:20]) + "\n" +
                              mount.log_tail())


def placement(mount: bf.Mount, files: list[TierFile]) -> collections.Counter:
    return collections.Counter(os.getxattr(mount.mountpoint / tf.rel, TIER_XATTR).decode() for tf in files)


def expect_tier(mount: bf.Mount, files: list[TierFile], tier: str, notes: list[str], what: str) -> None:
    """Timing files somewhere else than claimed would be a wrong figure: fail on any misplaced file."""
    where = placement(mount, files)
    if where != {tier: len(files)}:
        raise bf.BenchFailure(f"{what}: expected all {len(files)} files on {tier}, user.kvfs.tier says "
                              f"{dict(where)}")
    counted = mount.stats()["tiers"][tier]["files"]
    if counted != len(files):
        notes.append(f"{what}: stats tiers.{tier}.files = {counted}, but {len(files)} files are on {tier}")


def tier_delta(before: dict | None, after: dict, tier: str, key: str) -> int:
    """Growth of a per-tier counter; before=None: since the daemon started (its counters start at 0)."""
    return after["tiers"][tier][key] - (before["tiers"][tier][key] if before else 0)


# ---------------------------------------------------------------------------------------------------
# the phases of a round
# ---------------------------------------------------------------------------------------------------
def write_all(mount: bf.Mount, files: list[TierFile], io_size: int, what: str) -> tuple[dict, float, dict]:
    """Create, write and close every file (timed). Returns the figures, the start time and the stats before."""
    for d in {tf.rel.split("/")[0] for tf in files}:
        (mount.mountpoint / d).mkdir(exist_ok=True)
    before = mount.stats()
    t0 = time.perf_counter()
    for tf in files:
        bf.write_file(mount.mountpoint / tf.rel, tf.kv.data, io_size)
    wall = time.perf_counter() - t0
    after = mount.stats()
    total = sum(tf.size for tf in files)
    if after["logical_bytes"] - before["logical_bytes"] != total:
        raise bf.BenchFailure(f"{what}: stats logical_bytes grew by {after['logical_bytes'] - before['logical_bytes']},"
                              f" expected {total}")
    return {"bytes": total, "files": len(files), "write_s": wall, "write_MBps": total / bf.MB / wall,
            "stored_bytes": after["stored_bytes"] - before["stored_bytes"],
            "writer_waits": after["writer_waits"] - before["writer_waits"],
            "writer_wait_s": after["writer_wait_s"] - before["writer_wait_s"],
            "demoted_bytes_during_writes": tier_delta(before, after, "L2", "demoted_bytes")}, t0, before


def read_one(mount: bf.Mount, tf: TierFile, io_size: int, what: str) -> None:
    data = bf.read_file(mount.mountpoint / tf.rel, tf.size, io_size)
    if hashlib.sha256(data).hexdigest() != tf.kv.sha256:
        raise bf.BenchFailure(f"{what}: {tf.rel} read back DIFFERENT bytes than written")


def verify_all(mount: bf.Mount, files: list[TierFile], io_size: int, what: str) -> None:
    for tf in files:
        read_one(mount, tf, io_size, what)


def timed_reads(mount: bf.Mount, files: list[TierFile], variant: str, io_size: int, what: str) -> dict:
    """One pass over all files, one after another; per-file open+read+close times (hashing excluded)."""
    tier = variant.split()[0]
    read_one(mount, files[0], io_size, what)  # warm-up outside the figures: daemon threads, codec contexts
    prepare_pass(variant, mount, files)
    before, io0, cpu0 = mount.stats(), proc_io_read_bytes(mount.pid), bf.proc_cpu_s(mount.pid)
    latencies = []
    for tf in files:
        t0 = time.perf_counter()
        data = bf.read_file(mount.mountpoint / tf.rel, tf.size, io_size)
        latencies.append(time.perf_counter() - t0)
        if hashlib.sha256(data).hexdigest() != tf.kv.sha256:
            raise bf.BenchFailure(f"{what}: {tf.rel} read back DIFFERENT bytes than written")
    after, io1, cpu1 = mount.stats(), proc_io_read_bytes(mount.pid), bf.proc_cpu_s(mount.pid)
    total = sum(tf.size for tf in files)
    check_served_by(before, after, tier, len(files), total, what)
    return {"bytes": total, "files": len(files), "read_s": sum(latencies), "latency_s": latencies,
            "disk_read_bytes": io1 - io0, "cpu_daemon_s": cpu1 - cpu0,
            "tier_read_bytes": tier_delta(before, after, tier, "read_bytes"),
            "stored_bytes": after["tiers"][tier]["used_bytes"]}  # only these files are on that tier


def check_cache_state(variant: str, r: dict, notes: list[str], what: str) -> None:
    """The daemon's block-layer reads tell whether L3 was as warm or cold as claimed."""
    disk, stored = r["disk_read_bytes"], r["stored_bytes"]
    if variant == "L3 cold" and disk < 0.9 * stored:
        notes.append(f"{what}: read only {disk} bytes from disk of {stored} stored: not fully cold")
    elif variant != "L3 cold" and disk > 0.1 * stored:
        notes.append(f"{what}: read {disk} bytes from disk ({stored} stored): not warm")


def check_served_by(before: dict, after: dict, tier: str, n: int, total: int, what: str) -> None:
    """The daemon served every byte (no kernel page cache) and every file from `tier`, with no move."""
    hits = {t: tier_delta(before, after, t, "hits") for t in after["tiers"]}
    served = after["bytes_read"] - before["bytes_read"]
    moves = {f"{t}.{k}": tier_delta(before, after, t, k) for t in after["tiers"] for k in MOVE_COUNTERS
             if tier_delta(before, after, t, k)}
    if hits != {t: (n if t == tier else 0) for t in after["tiers"]} or served != total or moves:
        raise bf.BenchFailure(f"{what}: expected {n} hits on {tier} and {total} bytes served, no moves; stats "
                              f"say hits {hits}, bytes_read +{served}, moves {moves or 'none'}")


def poll_until_settled(mount: bf.Mount, what: str) -> list[dict]:
    """Stats samples until the mover has no backlog and drains nothing (the first sample is taken at once)."""
    samples = []
    deadline = time.perf_counter() + SETTLE_TIMEOUT_S
    while True:
        doc = mount.stats()
        t = time.perf_counter()
        samples.append({"t": t, "doc": doc})
        if doc["mover"]["backlog_bytes"] == 0 and not doc["mover"]["draining"]:
            return samples
        if t > deadline:
            raise bf.BenchFailure(f"{what}: mover still busy after {SETTLE_TIMEOUT_S}s: {doc['mover']}")
        time.sleep(POLL_S)


def demotion_figures(samples: list[dict], t_from: float, baseline: dict | None, logical: int) -> dict:
    """Demoted bytes/files from L2 since `baseline`, over the window from the last sample with nothing demoted
    yet (or t_from when the first sample already shows demotion) to the settled sample."""
    moved = [tier_delta(baseline, s["doc"], "L2", "demoted_bytes") for s in samples]
    idle = [s["t"] for s, m in zip(samples, moved) if m == 0]
    start = idle[-1] if idle and moved[0] == 0 else t_from
    last = samples[-1]["doc"]
    window = samples[-1]["t"] - start
    stored, nfiles = moved[-1], tier_delta(baseline, last, "L2", "demoted_files")
    return {"demoted_files": nfiles, "demoted_stored_bytes": stored, "demoted_logical_bytes": logical,
            "window_s": window, "wall_s": samples[-1]["t"] - t_from,
            "stored_MBps": stored / bf.MB / window if window > 0 else None,
            "logical_MBps": logical / bf.MB / window if window > 0 else None,
            "files_per_s": nfiles / window if window > 0 else None,
            "l2_used_after": last["tiers"]["L2"]["used_bytes"], "l2_capacity": last["tiers"]["L2"]["capacity_bytes"],
            "move_failures": last["move_failures"] - (baseline["move_failures"] if baseline else 0),
            "evicted_files": tier_delta(baseline, last, "L3", "evicted_files"), "polls": len(samples)}


def logical_on(mount: bf.Mount, files: list[TierFile], tier: str) -> int:
    return sum(tf.size for tf in files if os.getxattr(mount.mountpoint / tf.rel, TIER_XATTR).decode() == tier)


def demote_at_mount(args, dirs: tuple, tag: str, files: list[TierFile], live: list, rec: dict) -> bf.Mount:
    """Remount the roomy round's state with a small L2: the mover demotes at start. Returns the live mount."""
    m = new_mount(args, *dirs, tag, args.tier_small_l2 << 20, l3_capacity(files), live)
    t_live = time.perf_counter()
    samples = poll_until_settled(m, f"{tag} demotion at mount")
    fig = demotion_figures(samples, t_live, None, logical_on(m, files, "L3"))
    if not fig["demoted_files"]:
        rec["notes"].append(f"{tag}: nothing demoted at mount: the files fit under L2's high watermark "
                            f"({args.tier_small_l2} MiB); lower --tier-small-l2 or add --files")
    l3_logical = samples[-1]["doc"]["tiers"]["L3"]["logical_bytes"]
    if l3_logical != fig["demoted_logical_bytes"]:
        rec["notes"].append(f"{tag}: stats L3 logical_bytes {l3_logical} != size of files on L3 "
                            f"{fig['demoted_logical_bytes']}")
    check_lru(m, files, rec["notes"], tag)
    if fig["l2_used_after"] > 0.8 * fig["l2_capacity"]:
        rec["notes"].append(f"{tag}: mover settled with L2 at {fig['l2_used_after']} of {fig['l2_capacity']} bytes "
                            "(above the low watermark)")
    rec["demotion_at_mount"] = fig
    return m


def check_lru(mount: bf.Mount, files: list[TierFile], notes: list[str], what: str) -> None:
    """The last pass before the remount read the files in list order, so LRU demotion leaves a tail on L2."""
    on_l2 = [i for i, tf in enumerate(files) if os.getxattr(mount.mountpoint / tf.rel, TIER_XATTR) == b"L2"]
    if on_l2 != list(range(len(files) - len(on_l2), len(files))):
        notes.append(f"{what}: files left on L2 are not the most recently read ones: positions {on_l2}")


def fsync_rest_to_l3(mount: bf.Mount, files: list[TierFile]) -> int:
    """fsync moves a file's object to the persistent tier (L3): the files the mover left on L2."""
    moved = 0
    for tf in files:
        path = mount.mountpoint / tf.rel
        if os.getxattr(path, TIER_XATTR).decode() == "L2":
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            moved += 1
    return moved


def writes_under_demotion(args, dirs: tuple, rnd: int, files: list[TierFile], live: list, rec: dict) -> None:
    """Fresh mount with a small L2: write everything while the mover demotes, then wait until it settles."""
    tag = f"tiers-w-r{rnd}"
    m = new_mount(args, *dirs, tag, args.tier_small_l2 << 20, l3_capacity(files), live)
    w, t0, before = write_all(m, files, args.io_size, tag)
    samples = poll_until_settled(m, f"{tag} after writes")
    logical = logical_on(m, files, "L3")
    fig = demotion_figures(samples, t0, before, logical)
    where = placement(m, files)
    if set(where) - {"L2", "L3"} or sum(where.values()) != len(files):
        raise bf.BenchFailure(f"{tag}: files placed {dict(where)}")
    if fig["demoted_files"] != where["L3"]:  # then some were placed on L3 directly: logical MB is too high
        rec["notes"].append(f"{tag}: {where['L3']} files on L3 but {fig['demoted_files']} demoted")
    verify_all(m, files, args.io_size, tag)  # untimed: only that the bytes are right
    rec["writes_small_l2"] = {**w, **{k: v for k, v in fig.items() if k != "wall_s"}, "placement": dict(where)}
    stop_mount(m, live, rec["notes"], tag)
    m.remove_dirs()


def roomy_l2(files: list[TierFile]) -> int:
    return int(sum(tf.size for tf in files) * 1.25) + (256 << 20)


def l3_capacity(files: list[TierFile]) -> int:
    """Far above what the files need: L3 must never evict (nor drain) during the benchmark."""
    return 2 * sum(tf.size for tf in files) + (1 << 30)


def run_round(rnd: int, files: list[TierFile], args, dirs: tuple, live: list) -> dict:
    rec: dict = {"round": rnd, "notes": [], "reads": {}}
    tag = f"tiers-r{rnd}"
    m = new_mount(args, *dirs, tag, roomy_l2(files), l3_capacity(files), live)
    rec["writes_roomy_l2"] = write_all(m, files, args.io_size, tag)[0]
    expect_tier(m, files, "L2", rec["notes"], tag)
    rec["reads"]["L2"] = timed_reads(m, files, "L2", args.io_size, f"{tag} L2")
    stop_mount(m, live, rec["notes"], f"{tag} (roomy L2)")

    m = demote_at_mount(args, dirs, tag, files, live, rec)
    rec["fsynced_to_l3"] = fsync_rest_to_l3(m, files)
    expect_tier(m, files, "L3", rec["notes"], tag)
    l3_order = ("L3 warm", "L3 cold") if rnd % 2 == 0 else ("L3 cold", "L3 warm")
    rec["l3_order"] = list(l3_order)
    for variant in l3_order:
        rec["reads"][variant] = timed_reads(m, files, variant, args.io_size, f"{tag} {variant}")
    for variant, r in rec["reads"].items():
        check_cache_state(variant, r, rec["notes"], f"{tag} {variant}")
    expect_tier(m, files, "L3", rec["notes"], f"{tag} after the reads")  # --promote never kept them there
    stop_mount(m, live, rec["notes"], f"{tag} (small L2)")
    m.remove_dirs()

    writes_under_demotion(args, dirs, rnd, files, live, rec)
    return rec


def _num(x: float | None, fmt: str = ".0f") -> str:
    return "-" if x is None else f"{x:{fmt}}"


def brief(rec: dict) -> str:
    r, d = rec["reads"], rec["demotion_at_mount"]
    return ("  ".join(f"{v} {r[v]['bytes'] / bf.MB / r[v]['read_s']:.0f}" for v in READ_VARIANTS) +
            f" MB/s; demote {_num(d['stored_MBps'])} MB/s stored; writes small L2 "
            f"{rec['writes_small_l2']['write_MBps']:.0f} MB/s")


def run_rounds(datasets: dict, args, dirs: tuple, live: list, console) -> tuple[list[TierFile], list[dict]]:
    files = tier_files(datasets)
    records = []
    for rnd in range(args.rounds):
        t0 = time.monotonic()
        rec = run_round(rnd, files, args, dirs, live)
        records.append(rec)
        console.print(f"tiers round {rnd + 1}/{args.rounds}: {brief(rec)}  ({time.monotonic() - t0:.1f}s)")
    return files, records


# ---------------------------------------------------------------------------------------------------
# aggregation and output
# ---------------------------------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float:
    """Nearest rank: the smallest value with at least q% of the values at or below it."""
    s = sorted(values)
    return s[max(0, math.ceil(q / 100 * len(s)) - 1)]


def read_figures(r: dict) -> dict:
    lat = r["latency_s"]
    return {"read_MBps": r["bytes"] / bf.MB / r["read_s"], "p50_ms": 1e3 * percentile(lat, 50),
            "p99_ms": 1e3 * percentile(lat, 99), "max_ms": 1e3 * max(lat),
            "disk_read_MB": r["disk_read_bytes"] / bf.MB,
            "cpu_daemon_s_per_GB": r["cpu_daemon_s"] / (r["bytes"] / bf.GB)}


def summarize(rows: list[dict]) -> dict:
    """Median and [min, max] over rounds of every numeric field."""
    keys = [k for k, v in rows[0].items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    vals = {k: [r[k] for r in rows if r.get(k) is not None] for k in keys}
    return {"median": {k: statistics.median(v) for k, v in vals.items() if v},
            "min_max": {k: [min(v), max(v)] for k, v in vals.items() if v}}


PAIRED = (("L3 warm", "L2", "read_MBps"), ("L3 cold", "L2", "read_MBps"), ("L3 cold", "L3 warm", "read_MBps"),
          ("L3 warm", "L2", "p99_ms"), ("L3 cold", "L2", "p99_ms"))


def aggregate(records: list[dict]) -> dict:
    reads = {v: [read_figures(rec["reads"][v]) for rec in records] for v in READ_VARIANTS}
    ratios = {}
    for num, den, key in PAIRED:
        per = [n[key] / d[key] for n, d in zip(reads[num], reads[den])]
        ratios[f"{num}/{den} {key}"] = {"paired_median": statistics.median(per), "paired_per_round": per}
    roomy = [rec["writes_roomy_l2"] for rec in records]
    small = [rec["writes_small_l2"] for rec in records]
    per = [s["write_MBps"] / r["write_MBps"] for s, r in zip(small, roomy)]
    ratios["small L2/roomy L2 write_MBps"] = {"paired_median": statistics.median(per), "paired_per_round": per}
    return {"reads": {v: summarize(rows) for v, rows in reads.items()},
            "demotion_at_mount": summarize([rec["demotion_at_mount"] for rec in records]),
            "writes_roomy_l2": summarize(roomy), "writes_small_l2": summarize(small), "ratios": ratios}


def result_doc(files: list[TierFile], records: list[dict], args, dirs: tuple) -> dict:
    for rec in records:  # latencies in µs keep the JSON readable
        for r in rec["reads"].values():
            r["latency_s"] = [round(x, 6) for x in r["latency_s"]]
    return {
        "config": {"files": len(files), "bytes": sum(tf.size for tf in files), "rounds": len(records),
                   "codec": args.tier_codec, "promote": "never", "small_l2_MiB": args.tier_small_l2,
                   "l3_dir": str(dirs[2]), "l3_fs": fs_type(dirs[2]), "l2_dir": str(dirs[1]),
                   "l2_fs": fs_type(dirs[1]), "poll_s": POLL_S},
        "notes": [n for rec in records for n in rec["notes"]],
        "rounds": records,
        "results": aggregate(records),
    }


def _mm(summary: dict, key: str, fmt: str = ".0f") -> str:
    """median [min-max], or - where no round had the figure (e.g. nothing demoted)."""
    if key not in summary["median"]:
        return "-"
    m, (lo, hi) = summary["median"][key], summary["min_max"][key]
    return f"{m:{fmt}} [{lo:{fmt}}-{hi:{fmt}}]"


def print_report(tdoc: dict, console) -> None:
    from rich.markup import escape
    from rich.table import Table

    cfg, res = tdoc["config"], tdoc["results"]
    t = Table(title=escape(f"tier reads: {cfg['files']} files, {cfg['bytes'] / bf.MB:.0f} MB, codec {cfg['codec']}, "
                           f"medians of {cfg['rounds']} round(s) [min-max]; L3 on {cfg['l3_fs']}"))
    for col in ("files on", "read MB/s", "p50 ms", "p99 ms", "disk MB\nread", "daemon CPU\ns/GB", "MB/s vs L2\n(paired)"):
        t.add_column(col, justify="left" if col == "files on" else "right")
    for v in READ_VARIANTS:
        s = res["reads"][v]
        ratio = res["ratios"].get(f"{v}/L2 read_MBps")
        t.add_row(v, escape(_mm(s, "read_MBps")), escape(_mm(s, "p50_ms", ".1f")), escape(_mm(s, "p99_ms", ".1f")),
                  f"{s['median']['disk_read_MB']:.0f}", f"{s['median']['cpu_daemon_s_per_GB']:.2f}",
                  "-" if ratio is None else f"{ratio['paired_median']:.3f}")
    console.print(t)

    d = Table(title=escape(f"mover demotion L2 -> L3 (L2 {cfg['small_l2_MiB']} MiB; MB/s over the active window; "
                           "stored = compressed, logical = file sizes)"))
    for col in ("scenario", "files", "stored MB", "logical MB", "window s", "stored MB/s", "logical MB/s",
                "files/s", "writer MB/s", "writer waits"):
        d.add_column(col, justify="left" if col == "scenario" else "right")
    roomy, small, at_mount = res["writes_roomy_l2"], res["writes_small_l2"], res["demotion_at_mount"]
    d.add_row("writes, roomy L2", "-", "-", "-", "-", "-", "-", "-", escape(_mm(roomy, "write_MBps")),
              f"{roomy['median']['writer_waits']:.0f}")
    for name, s in (("at mount (remount)", at_mount), ("while writing", small)):
        med = s["median"]
        d.add_row(name, f"{med['demoted_files']:.0f}", f"{med['demoted_stored_bytes'] / bf.MB:.0f}",
                  f"{med['demoted_logical_bytes'] / bf.MB:.0f}", escape(_mm(s, "window_s", ".2f")),
                  escape(_mm(s, "stored_MBps")), escape(_mm(s, "logical_MBps")), _num(med.get("files_per_s")),
                  escape(_mm(s, "write_MBps")) if "write_MBps" in med else "-",
                  f"{med['writer_waits']:.0f} ({med['writer_wait_s']:.1f}s)" if "writer_waits" in med else "-")
    console.print(d)
    r = res["ratios"]
    console.print("paired ratios (median over rounds): " + ", ".join(
        f"{k} {v['paired_median']:.3f}" for k, v in r.items()))
    wall = at_mount["median"]["wall_s"]
    console.print(f"demotion at mount: {wall:.2f}s from the mount going live to settled (includes the mover's "
                  f"first tick)")
