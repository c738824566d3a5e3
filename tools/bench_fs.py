#!/usr/bin/env python3
"""Benchmark kvfs against its own backing store with real KV-cache block files (a benchmark, not a test).

Two sections, both by default (--only codecs / --only tiers runs one). The codecs section measures three
variants side by side in one run:

    tmpfs   files written and read directly on /dev/shm (the baseline: what the L2 tier itself can do)
    none    through a kvfs mount with --codec none (FUSE + daemon + object format, no compression)
    zstd    through a kvfs mount with --codec zstd (byte planes + tuned zstd for 2-byte floats)

The machine this runs on is shared and noisy, so the variants are interleaved: every round runs each
variant once, in a rotating order, each on its own fresh mount (fresh L2 directory under /dev/shm, fresh
--state-dir); figures are the medians over rounds, and the zstd/none ratios are taken per round (paired,
same noise conditions) and then the median of those.

Per variant, round and dtype (bf16 and fp16 are separate data sets):
  * write MB/s    logical bytes / wall time of create + write + close() of every file, one after another
                  (a kvfs file is committed on close, so the commit is inside the timing)
  * read MB/s     logical bytes / wall time of open + read + close of every file, after
                  `sync; echo 3 > /proc/sys/vm/drop_caches` (FUSE page-cache pages are dropped too; tmpfs
                  pages are the storage itself and stay)
  * CPU s/GB      daemon: utime+stime delta of the kvfs process (all its threads) from /proc/<pid>/stat;
                  total: daemon + this benchmark process (user+sys, which includes the kernel's FUSE work
                  on the caller side); per 1e9 logical bytes
  * stored/raw    kvfs: delta of stored_bytes / logical_bytes in .kvfs/stats across the dtype's writes,
                  cross-checked with the sum of the user.kvfs.stored_bytes xattrs; tmpfs: st_blocks*512 / size
Every file read back is compared with the source by SHA-256; any difference (or a daemon error, a failed
commit, a checksum failure, a traceback in the daemon log) aborts the benchmark with exit status 3.

MB = 1e6 bytes, GB = 1e9 bytes.

Input: directories of real KV block files written by tools/dump_kv.py (default /work/kvdata/bf16 and
/work/kvdata/fp16). Where a directory has a manifest.json, only files listed there whose SHA-256 matches
are used (so a dump still in progress cannot feed a half-written file). If the defaults are missing, the
committed samples in tests/data/kv/*.kv are used instead, replicated to N files where there are fewer;
the output says so.

Targets (PASS/FAIL printed, exit status 1 if any fails):
  zstd stored/raw <= 0.69 on bf16 and <= 0.87 on fp16
  zstd write MB/s >= 0.6 x codec none, zstd read MB/s >= 0.7 x codec none (both through the mount)

The tiers section (tools/bench_tiers.py, details there) measures, with the same files, reads of files on
L2 (tmpfs) vs on L3 (local disk, --l3-dir) with the L3 objects in the page cache ("L3 warm") or dropped from
it ("L3 cold"): MB/s and per-file latency p50/p99; and the mover's demotion throughput L2 -> L3, at mount
(a remount with a small L2) and while a writer fills a small L2. It has no targets.

Usage (as root, FUSE available):
    .venv/bin/python tools/bench_fs.py                       # 64 files per dtype, 5 rounds, both sections
    .venv/bin/python tools/bench_fs.py --files 16 --rounds 1 # quick
    .venv/bin/python tools/bench_fs.py --only tiers --rounds 3   # -> bench-results/bench_fs-tiers.json
    .venv/bin/python tools/bench_fs.py --data bf16=/path/a --data fp16=/path/b --out bench-results/x.json
"""

from __future__ import annotations

import argparse
import collections
import datetime
import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import bench_tiers
from bench_harness import (DEFAULT_DATA, GB, MB, REPO, BenchFailure, DataSet, Mount, SetupError, drop_caches,
                           fs_type, load_datasets, proc_cpu_s, read_file, self_cpu_s, write_file)

VARIANTS = ("tmpfs", "none", "zstd")
SECTIONS = ("codecs", "tiers")  # tiers: tools/bench_tiers.py
TARGET_RATIO = {"bf16": 0.69, "fp16": 0.87}
TARGET_WRITE = 0.6
TARGET_READ = 0.7


def frames_of(size: int, frame_size: int) -> int:
    return -(-size // frame_size)


def run_variant(variant: str, rnd: int, datasets: dict[str, DataSet], args, base: Path, shm_base: Path,
                live: list) -> dict:
    tag = f"{variant}-r{rnd}"
    mount: Mount | None = None
    if variant == "tmpfs":
        root = shm_base / f"direct-{tag}"
        root.mkdir(parents=True)
        pid = None
    else:
        total = sum(ds.total_bytes for ds in datasets.values())
        capacity = int(total * 1.25) + (256 << 20)
        mount = Mount(args.kvfs, variant, base, shm_base, capacity, tag, args.dtype)
        live.append(mount)
        mount.start()
        root = mount.mountpoint
        pid = mount.pid
    rec: dict = {"variant": variant, "round": rnd, "dtypes": {}}
    try:
        # warm-up outside the figures: thread pools, codec contexts, first index writes
        warm = root / "warmup"
        warm.mkdir()
        for ds in datasets.values():
            f = ds.files[0]
            write_file(warm / f"{ds.dtype}.kv", f.data, args.io_size)
            if hashlib.sha256(read_file(warm / f"{ds.dtype}.kv", len(f.data), args.io_size)).hexdigest() != f.sha256:
                raise BenchFailure(f"{variant}: warm-up file {ds.dtype}.kv read back wrong data")

        # writes, one dtype after the other so per-dtype stored bytes are stats deltas
        for ds in datasets.values():
            d = root / ds.dtype
            d.mkdir()
            before = mount.stats() if mount else None
            c_d0, c_s0 = proc_cpu_s(pid), self_cpu_s()
            t0 = time.perf_counter()
            for f in ds.files:
                write_file(d / f.name, f.data, args.io_size)
            wall = time.perf_counter() - t0
            c_d1, c_s1 = proc_cpu_s(pid), self_cpu_s()
            r = rec["dtypes"][ds.dtype] = {
                "bytes": ds.total_bytes, "files": len(ds.files),
                "write_s": wall, "write_cpu_daemon_s": c_d1 - c_d0, "write_cpu_bench_s": c_s1 - c_s0,
            }
            if mount:
                after = mount.stats()
                logical = after["logical_bytes"] - before["logical_bytes"]
                stored = after["stored_bytes"] - before["stored_bytes"]
                if logical != ds.total_bytes:
                    raise BenchFailure(f"{variant}/{ds.dtype}: stats logical_bytes grew by {logical}, "
                                       f"expected {ds.total_bytes}")
                xattr_stored = sum(int(os.getxattr(d / f.name, "user.kvfs.stored_bytes")) for f in ds.files)
                transforms = collections.Counter(os.getxattr(d / f.name, "user.kvfs.transform").decode()
                                                 for f in ds.files)
                frame_size = after["frame_size"]
                r.update(stored_bytes=stored, stored_bytes_xattr=xattr_stored, stored_ratio=stored / logical,
                         frames_encoded=after["frames_encoded"] - before["frames_encoded"],
                         frames_expected=sum(frames_of(len(f.data), frame_size) for f in ds.files),
                         commits=after["commits"] - before["commits"], transforms=dict(transforms))
            else:
                st = [os.stat(d / f.name) for f in ds.files]
                stored = sum(s.st_blocks * 512 for s in st)
                r.update(stored_bytes=stored, stored_ratio=stored / ds.total_bytes)

        rec["caches_dropped"] = drop_caches()

        for ds in datasets.values():
            d = root / ds.dtype
            before = mount.stats() if mount else None
            c_d0, c_s0 = proc_cpu_s(pid), self_cpu_s()
            t0 = time.perf_counter()
            bufs = [read_file(d / f.name, len(f.data), args.io_size) for f in ds.files]
            wall = time.perf_counter() - t0
            c_d1, c_s1 = proc_cpu_s(pid), self_cpu_s()
            bad = [f.name for f, b in zip(ds.files, bufs) if hashlib.sha256(b).hexdigest() != f.sha256]
            if bad:
                raise BenchFailure(f"{variant} round {rnd}: {len(bad)} {ds.dtype} file(s) read back DIFFERENT "
                                   f"bytes than written, e.g. {bad[:3]}")
            del bufs
            r = rec["dtypes"][ds.dtype]
            r.update(read_s=wall, read_cpu_daemon_s=c_d1 - c_d0, read_cpu_bench_s=c_s1 - c_s0, verified=True)
            if mount:
                after = mount.stats()
                r.update(frames_decoded=after["frames_decoded"] - before["frames_decoded"],
                         bytes_read_daemon=after["bytes_read"] - before["bytes_read"])

        if mount:
            final = mount.stats()
            rec["daemon_counters"] = {k: final[k] for k in ("commits", "commit_failures", "checksum_failures",
                                                             "errors", "frames_encoded", "frames_decoded")}
            faults = {k: final[k] for k in ("commit_failures", "checksum_failures", "errors") if final[k]}
            if faults:
                raise BenchFailure(f"{variant} round {rnd}: daemon reported {faults}:\n{mount.log_tail()}")
    except BaseException:
        if mount:  # the original error is what matters: detach without further checks, then re-raise
            mount.kill()
            live.remove(mount)
        else:
            shutil.rmtree(root, ignore_errors=True)
        raise
    if mount:
        notes: list[str] = []
        code = mount.stop(notes)
        live.remove(mount)
        if notes:
            rec["notes"] = notes
        bad_lines = mount.bad_log_lines()
        if code != 0 or bad_lines:
            raise BenchFailure(f"{variant} round {rnd}: daemon exit {code}, log errors:\n" +
                               "\n".join(bad_lines[:20]) + "\n" + mount.log_tail())
        mount.remove_dirs()
    else:
        shutil.rmtree(root, ignore_errors=True)
    return rec


# ---------------------------------------------------------------------------------------------------
# aggregation
# ---------------------------------------------------------------------------------------------------
def derive(r: dict) -> dict:
    """Rates from one round's raw record of one dtype (or the 'all' sum)."""
    gb = r["bytes"] / GB
    out = {
        "write_MBps": r["bytes"] / MB / r["write_s"],
        "read_MBps": r["bytes"] / MB / r["read_s"],
        "write_cpu_daemon_s_per_GB": r["write_cpu_daemon_s"] / gb,
        "write_cpu_total_s_per_GB": (r["write_cpu_daemon_s"] + r["write_cpu_bench_s"]) / gb,
        "read_cpu_daemon_s_per_GB": r["read_cpu_daemon_s"] / gb,
        "read_cpu_total_s_per_GB": (r["read_cpu_daemon_s"] + r["read_cpu_bench_s"]) / gb,
        "stored_ratio": r["stored_bytes"] / r["bytes"],
    }
    if r.get("frames_expected"):
        out["encode_amplification"] = r["frames_encoded"] / r["frames_expected"]
    return out


SUMMED = ("bytes", "files", "write_s", "read_s", "write_cpu_daemon_s", "write_cpu_bench_s", "read_cpu_daemon_s",
          "read_cpu_bench_s", "stored_bytes", "frames_encoded", "frames_expected")


def with_all(rec: dict) -> dict:
    dts = rec["dtypes"]
    total = {k: sum(d.get(k, 0) for d in dts.values()) for k in SUMMED}
    return {**dts, "all": total}


def aggregate(records: list[dict], dtypes: list[str]) -> dict:
    groups = [*dtypes, "all"] if len(dtypes) > 1 else list(dtypes)
    per: dict = {v: {g: collections.defaultdict(list) for g in groups} for v in VARIANTS}
    for rec in records:
        for g, raw in with_all(rec).items():
            if g not in groups:
                continue
            for k, val in derive(raw).items():
                per[rec["variant"]][g][k].append(val)
    medians = {v: {g: {k: statistics.median(vals) for k, vals in per[v][g].items()} for g in groups}
               for v in VARIANTS}
    spreads = {v: {g: {k: [min(vals), max(vals)] for k, vals in per[v][g].items()} for g in groups}
               for v in VARIANTS}

    # paired ratios: round by round (same noise conditions), then the median
    by_round = collections.defaultdict(dict)
    for rec in records:
        by_round[rec["round"]][rec["variant"]] = {g: derive(raw) for g, raw in with_all(rec).items()}
    ratios = {}
    for g in groups:
        ratios[g] = {}
        for num, den in (("zstd", "none"), ("none", "tmpfs"), ("zstd", "tmpfs")):
            for k in ("write_MBps", "read_MBps"):
                paired = [rr[num][g][k] / rr[den][g][k] for rr in by_round.values() if num in rr and den in rr]
                ratios[g][f"{num}/{den} {k}"] = {
                    "paired_median": statistics.median(paired) if paired else None,
                    "paired_per_round": paired,
                    "ratio_of_medians": medians[num][g][k] / medians[den][g][k],
                }
        # what the throughput ratio would be if both were purely CPU-bound on one core (noise-robust hint)
        for k in ("write", "read"):
            cpu = [rr["none"][g][f"{k}_cpu_total_s_per_GB"] / rr["zstd"][g][f"{k}_cpu_total_s_per_GB"]
                   for rr in by_round.values() if "none" in rr and "zstd" in rr]
            ratios[g][f"cpu none/zstd {k}"] = {"paired_median": statistics.median(cpu) if cpu else None,
                                                "paired_per_round": cpu}
    return {"groups": groups, "per_round": {v: {g: dict(per[v][g]) for g in groups} for v in VARIANTS},
            "medians": medians, "min_max": spreads, "ratios": ratios}


def check_targets(agg: dict) -> list[dict]:
    targets = []
    med, ratios = agg["medians"], agg["ratios"]
    for dtype, limit in TARGET_RATIO.items():
        if dtype in med["zstd"]:
            val = med["zstd"][dtype]["stored_ratio"]
            targets.append({"target": f"zstd stored/raw {dtype} <= {limit}", "value": val, "limit": limit,
                            "pass": val <= limit})
    for key, limit, label in (("zstd/none write_MBps", TARGET_WRITE, "write"),
                              ("zstd/none read_MBps", TARGET_READ, "read")):
        for g in agg["groups"]:
            val = ratios[g][key]["paired_median"]
            targets.append({"target": f"zstd {label} MB/s >= {limit} x none ({g})", "value": val, "limit": limit,
                            "ratio_of_medians": ratios[g][key]["ratio_of_medians"], "pass": val >= limit})
    return targets


# ---------------------------------------------------------------------------------------------------
# output
# ---------------------------------------------------------------------------------------------------
def print_report(doc: dict, console) -> None:
    from rich.markup import escape
    from rich.table import Table

    agg = doc["results"]
    med, mm = agg["medians"], agg["min_max"]
    t = Table(title=escape(f"kvfs vs tmpfs: medians of {doc['config']['rounds']} round(s), "
                           f"{doc['config']['files_per_dtype']} files/dtype (MB = 1e6 B; [min-max] over rounds)"))
    for col in ("variant", "data", "MB", "write MB/s", "read MB/s", "write CPU s/GB\ndaemon / total",
                "read CPU s/GB\ndaemon / total", "stored/raw", "encodes\n/frame"):
        t.add_column(col, justify="left" if col in ("variant", "data") else "right")
    for g in agg["groups"]:
        for v in VARIANTS:
            m, s = med[v][g], mm[v][g]
            nbytes = doc["data"][g]["bytes"] if g in doc["data"] else sum(d["bytes"] for d in doc["data"].values())
            dcol = (lambda k: "-" if v == "tmpfs" else f"{m[k]:.2f}")
            t.add_row(v, g, f"{nbytes / MB:.0f}",
                      escape(f"{m['write_MBps']:.0f} [{s['write_MBps'][0]:.0f}-{s['write_MBps'][1]:.0f}]"),
                      escape(f"{m['read_MBps']:.0f} [{s['read_MBps'][0]:.0f}-{s['read_MBps'][1]:.0f}]"),
                      f"{dcol('write_cpu_daemon_s_per_GB')} / {m['write_cpu_total_s_per_GB']:.2f}",
                      f"{dcol('read_cpu_daemon_s_per_GB')} / {m['read_cpu_total_s_per_GB']:.2f}",
                      f"{m['stored_ratio']:.4f}",
                      f"{m['encode_amplification']:.2f}" if "encode_amplification" in m else "-",
                      end_section=(v == VARIANTS[-1]))
    console.print(t)

    rt = Table(title="throughput ratios (median of per-round paired ratios; ratio of medians in brackets)")
    rt.add_column("data")
    keys = ["zstd/none write_MBps", "zstd/none read_MBps", "none/tmpfs write_MBps", "none/tmpfs read_MBps",
            "zstd/tmpfs write_MBps", "zstd/tmpfs read_MBps"]
    for k in keys:
        rt.add_column(k.replace("_MBps", ""), justify="right")
    rt.add_column("CPU-bound est.\nwrite / read", justify="right")
    for g in agg["groups"]:
        ra = agg["ratios"][g]
        cpu_w, cpu_r = ra["cpu none/zstd write"]["paired_median"], ra["cpu none/zstd read"]["paired_median"]
        rt.add_row(g, *(f"{ra[k]['paired_median']:.3f} ({ra[k]['ratio_of_medians']:.3f})" for k in keys),
                   f"{cpu_w:.3f} / {cpu_r:.3f}")
    console.print(rt)

    tt = Table(title="targets")
    tt.add_column("target")
    tt.add_column("value", justify="right")
    tt.add_column("result")
    for tg in doc["targets"]:
        verdict = "[green]PASS[/green]" if tg["pass"] else "[bold red]FAIL[/bold red]"
        tt.add_row(tg["target"], f"{tg['value']:.3f}", verdict)
    console.print(tt)


def make_plot(doc: dict, path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    agg = doc["results"]
    groups = agg["groups"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    width = 0.8 / len(VARIANTS)
    for ax, key, title in ((axes[0], "write_MBps", "write MB/s"), (axes[1], "read_MBps", "read MB/s"),
                           (axes[2], "stored_ratio", "stored / raw")):
        for j, v in enumerate(VARIANTS):
            vals = [agg["medians"][v][g][key] for g in groups]
            lo = [agg["medians"][v][g][key] - agg["min_max"][v][g][key][0] for g in groups]
            hi = [agg["min_max"][v][g][key][1] - agg["medians"][v][g][key] for g in groups]
            xs = [i + (j - (len(VARIANTS) - 1) / 2) * width for i in range(len(groups))]
            ax.bar(xs, vals, width, yerr=[lo, hi], capsize=3, label=v)
        ax.set_xticks(range(len(groups)), groups)
        ax.set_title(title)
    for dtype, limit in TARGET_RATIO.items():
        if dtype in groups:
            i = groups.index(dtype)
            axes[2].hlines(limit, i - 0.45, i + 0.45, colors="red", linestyles="dashed")
    axes[0].legend()
    fig.suptitle(f"kvfs benchmark, {doc['config']['files_per_dtype']} files/dtype, "
                 f"{doc['config']['rounds']} rounds, medians with min-max")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _git_head() -> str | None:
    try:
        res = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--", "kvfs"],
                               capture_output=True, text=True).stdout.strip()
        return res.stdout.strip() + ("+dirty(kvfs/)" if dirty else "") if res.returncode == 0 else None
    except OSError:
        return None


def _default_kvfs() -> str:
    venv = REPO / ".venv" / "bin" / "kvfs"
    if venv.exists():
        return str(venv)
    return shutil.which("kvfs") or str(Path(sys.executable).with_name("kvfs"))


# ---------------------------------------------------------------------------------------------------
def run_codec_rounds(datasets: dict[str, DataSet], args, base: Path, shm_base: Path, live: list,
                     console) -> list[dict]:
    records = []
    for rnd in range(args.rounds):
        k = rnd % len(VARIANTS)
        order = VARIANTS[k:] + VARIANTS[:k]
        for v in order:
            t0 = time.monotonic()
            rec = run_variant(v, rnd, datasets, args, base, shm_base, live)
            records.append(rec)
            brief = "  ".join(f"{dt} w {derive(r)['write_MBps']:.0f} r {derive(r)['read_MBps']:.0f}"
                              for dt, r in rec["dtypes"].items())
            console.print(f"round {rnd + 1}/{args.rounds} {v:5s}: {brief} MB/s  ({time.monotonic() - t0:.1f}s)")
    return records


def codec_doc(records: list[dict], datasets: dict[str, DataSet]) -> dict:
    """The codec section's part of the JSON (top-level keys, as before the tier section existed)."""
    agg = aggregate(records, list(datasets))
    targets = check_targets(agg)
    return {
        "caches_dropped": all(r.get("caches_dropped") for r in records),
        "rounds": records,
        "fields": {"cpu none/zstd": "total CPU s/GB of none / of zstd, per round then median: the zstd/none "
                                    "throughput ratio if both were CPU-bound (insensitive to other load)",
                   "encode_amplification": "frames encoded by the daemon / frames in the files written "
                                           "(1.0 = every frame compressed once)",
                   "transforms": "user.kvfs.transform xattr of the files written (per file)",
                   "paired_median": "median over rounds of (numerator / denominator) of the same round"},
        "results": agg,
        "targets": targets,
        "all_targets_pass": all(t["pass"] for t in targets),
    }


def check_l3_dir(path: Path, need: int, notes: list[str]) -> None:
    """The tier section's L3 must be a real disk with room for the files (twice over, for safety)."""
    if not path.is_dir():
        raise SetupError(f"--l3-dir {path} is not a directory")
    free = shutil.disk_usage(path).free
    if free < 2 * need:
        raise SetupError(f"--l3-dir {path}: {free / GB:.1f} GB free, the tier section needs {2 * need / GB:.1f} GB")
    kind = fs_type(path)
    if kind in ("tmpfs", "ramfs"):
        notes.append(f"--l3-dir {path} is on {kind}: 'L3 cold' reads are NOT disk reads")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", action="append", metavar="[DTYPE=]DIR",
                   help="directory of .kv block files (repeatable); DTYPE= labels all its files, otherwise the "
                        "dtype comes from manifest.json or the file name prefix (default: "
                        + ", ".join(map(str, DEFAULT_DATA)) + ")")
    p.add_argument("--files", type=int, default=64, metavar="N", help="files per dtype (default 64, ~190 MB)")
    p.add_argument("--rounds", type=int, default=5, metavar="R", help="rounds of each section (default 5)")
    p.add_argument("--only", choices=SECTIONS, help="run one section (default: all of " + ", ".join(SECTIONS) + ")")
    p.add_argument("--out", type=Path, help="JSON results (default bench-results/bench_fs.json, or "
                                            "bench_fs-SECTION.json with --only)")
    p.add_argument("--plot", type=Path, metavar="PNG", help="bar chart of the codecs section (only if matplotlib "
                                                            "is importable)")
    p.add_argument("--io-size", type=int, default=0, metavar="BYTES",
                   help="bytes per write()/read() call; 0 = the whole file in one call (default)")
    p.add_argument("--kvfs", default=_default_kvfs(), help="kvfs executable (default: the repo's .venv); it must "
                                                           "exec the daemon itself (its pid is the daemon's)")
    p.add_argument("--dtype", choices=["auto", "bf16", "fp16", "none"],
                   help="pass --dtype to the kvfs mounts (default: not passed, i.e. kvfs decides: auto)")
    p.add_argument("--shm", type=Path, default=Path("/dev/shm"), help="tmpfs for L2 and the baseline")
    p.add_argument("--l3-dir", type=Path, default=Path("/var/tmp"),
                   help="local disk for the tier section's L3 directories (default /var/tmp)")
    p.add_argument("--tier-codec", choices=["zstd", "none"], default="zstd", help="codec of the tier section")
    p.add_argument("--tier-small-l2", type=int, default=64, metavar="MIB",
                   help="L2 capacity in MiB that makes the mover demote, in the tier section (default 64)")
    p.add_argument("--workdir", type=Path, default=None, help="where mountpoints, state dirs and logs go "
                                                              "(default: a fresh directory in /tmp)")
    p.add_argument("--keep-logs", action="store_true", help="keep the work directory with the daemon logs")
    args = p.parse_args(argv)
    if args.files < 1 or args.rounds < 1 or args.tier_small_l2 < 1:
        p.error("--files, --rounds and --tier-small-l2 must be >= 1")
    sections = [args.only] if args.only else list(SECTIONS)
    if args.out is None:
        args.out = REPO / "bench-results" / (f"bench_fs-{args.only}.json" if args.only else "bench_fs.json")

    from rich.console import Console
    console = Console(width=None if sys.stdout.isatty() else 160)

    try:
        datasets, notes = load_datasets(args.data, args.files)
        if "tiers" in sections:
            check_l3_dir(args.l3_dir, sum(ds.total_bytes for ds in datasets.values()), notes)
    except SetupError as e:
        console.print(f"[bold red]setup error:[/bold red] {e}")
        return 2
    for dtype, ds in datasets.items():
        console.print(f"[bold]{dtype}[/bold]: {len(ds.files)} files, {ds.total_bytes / MB:.1f} MB, "
                      f"{ds.distinct_files} distinct, from {', '.join(ds.sources)}")
    for n in notes:
        console.print(f"[yellow]note:[/yellow] {n}")
    if os.geteuid() != 0:
        console.print("[yellow]note:[/yellow] not root: page cache cannot be dropped before reads")

    base = Path(tempfile.mkdtemp(prefix="kvfs-bench-", dir=args.workdir))
    shm_base = Path(tempfile.mkdtemp(prefix="kvfs-bench-", dir=args.shm))
    l3_base = Path(tempfile.mkdtemp(prefix="kvfs-bench-", dir=args.l3_dir)) if "tiers" in sections else None
    live: list[Mount] = []
    records: list[dict] = []
    tier_run = None
    load_before = os.getloadavg()
    git_head = _git_head()
    t_start = time.monotonic()
    try:
        if "codecs" in sections:
            records = run_codec_rounds(datasets, args, base, shm_base, live, console)
        if "tiers" in sections:
            tier_run = bench_tiers.run_rounds(datasets, args, (base, shm_base, l3_base), live, console)
    except BenchFailure as e:
        console.print(f"[bold red]BENCHMARK FAILED:[/bold red] {e}")
        console.print(f"[red]daemon logs kept in {base}[/red]")
        args.keep_logs = True
        return 3
    except Exception as e:  # an I/O error through the mount is a failure too, not a crash of the tool
        console.print_exception()
        console.print(f"[bold red]BENCHMARK FAILED:[/bold red] {type(e).__name__}: {e}")
        console.print(f"[red]daemon logs kept in {base}[/red]")
        args.keep_logs = True
        return 3
    except KeyboardInterrupt:
        console.print("[red]interrupted[/red]")
        args.keep_logs = True
        return 130
    finally:
        for m in list(live):
            m.kill()
        shutil.rmtree(shm_base, ignore_errors=True)
        if l3_base is not None:
            shutil.rmtree(l3_base, ignore_errors=True)
        if not args.keep_logs:
            shutil.rmtree(base, ignore_errors=True)

    doc = {
        "tool": "tools/bench_fs.py",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": {"kernel": platform.release(), "cpus": os.cpu_count(), "python": platform.python_version(),
                 "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "git": git_head,
        "config": {"sections": sections, "files_per_dtype": args.files, "rounds": args.rounds,
                   "variants": list(VARIANTS), "io_size": args.io_size or "whole file", "kvfs": args.kvfs,
                   "kvfs_dtype": args.dtype or "(default)", "shm": str(args.shm),
                   "units": {"MB": MB, "GB": GB}, "duration_s": round(time.monotonic() - t_start, 1)},
        "data": {dt: {"bytes": ds.total_bytes, "files": len(ds.files), "distinct_files": ds.distinct_files,
                      "replicated": ds.replicated, "sources": ds.sources,
                      "file_names": sorted({f.source.name for f in ds.files})} for dt, ds in datasets.items()},
        "notes": notes + [n for r in records for n in r.get("notes", [])],
    }
    if records:
        doc.update(codec_doc(records, datasets))
        print_report(doc, console)
    if tier_run is not None:
        doc["tiers"] = bench_tiers.result_doc(*tier_run, args, (base, shm_base, l3_base))
        doc["notes"] += doc["tiers"]["notes"]
        bench_tiers.print_report(doc["tiers"], console)
    for n in doc["notes"][len(notes):]:
        console.print(f"[yellow]note:[/yellow] {n}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    console.print(f"results: {args.out}")
    if args.plot:
        if not records:
            console.print("[yellow]note:[/yellow] --plot draws the codecs section, which did not run; no plot")
        elif make_plot(doc, args.plot):
            console.print(f"plot: {args.plot}")
        else:
            console.print("[yellow]note:[/yellow] matplotlib is not importable; no plot")
    return 0 if doc.get("all_targets_pass", True) else 1


if __name__ == "__main__":
    # bench_tiers imports this file as `bench_fs`: let it find this very module, not load a second copy
    # (with its own BenchFailure class, which the handlers here would not catch)
    sys.modules.setdefault("bench_fs", sys.modules[__name__])
    sys.exit(main())
