#!/usr/bin/env python3
"""Demotion and promotion throughput with L3 in one directory vs spread over two (`--l3` given twice), on real
KV files, side by side in one run.

Each layout gets its own filesystems, mounted by the tool (root): `--backing tmpfs` (default) one tmpfs per
directory; `--backing ext4` one ext4 image per directory on its own loop device (images in --image-dir), so
fsyncs reach a block device. "1 dir" has one filesystem of --l3-size, "2 dirs" two of half that each. L2 is
a tmpfs directory under /dev/shm, roomy enough for every file; `--promote never` so that verification reads
do not move files.

--files real KV files (tests/data/kv or --data, each made unique) are written once per layout. Each round,
for each layout in a rotating order: every file is demoted to L3 by --threads clients at once
(setxattr user.kvfs.tier=L3, the hot/cold API: the mover's move protocol, copy + fsync + rename, at most four
moves at a time), then promoted back the same way (=L2). Each phase is timed from the first request to the
last answer; after it every file is read back through the mount (page cache dropped) and compared with its
source: wrong bytes, a file not on the tier asked for, or an error counter of the daemon abort the run (exit
status 3). Reported per layout and phase: MB/s of stored (moved) bytes, median over rounds, the ratio of two
directories to one, and how the two directories shared the objects. Prints a table, saves JSON (--out).

On a machine with few cores and memory-backed directories, moves are bound by CPU and the daemon's thread
hops, not by the directories: expect ratios near 1 there; the layout pays off where each directory is its
own SSD with its own queue.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))
from bench_l4 import Mount, drop_page_cache, kv_files  # noqa: E402

LAYOUTS = {"1 dir": 1, "2 dirs": 2}
PHASES = ("demote", "promote")
TIER_XATTR = "user.kvfs.tier"
FAULTS = ("errors", "checksum_failures", "commit_failures", "move_failures")


@contextlib.contextmanager
def filesystems(base: Path, count: int, size_mb: int, backing: str, image_dir: Path) -> Iterator[list[Path]]:
    """`count` directories, each the root of its own filesystem of `size_mb` MiB; unmounted afterwards."""
    dirs: list[Path] = []
    images: list[Path] = []
    try:
        for i in range(count):
            d = base / f"l3-{i}"
            d.mkdir(parents=True)
            if backing == "tmpfs":
                cmd = ["mount", "-t", "tmpfs", "-o", f"size={size_mb}M,mode=0700", "tmpfs", str(d)]
            else:
                image = image_dir / f"{base.name}-l3-{i}.img"
                images.append(image)
                subprocess.run(["truncate", "-s", f"{size_mb}M", str(image)], check=True)
                subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True, capture_output=True)
                cmd = ["mount", "-o", "loop", str(image), str(d)]
            subprocess.run(cmd, check=True, capture_output=True)
            dirs.append(d)
        yield dirs
    finally:
        for d in dirs:
            subprocess.run(["umount", str(d)], capture_output=True)
        for image in images:
            image.unlink(missing_ok=True)


def move_all(paths: list[Path], tier: str, threads: int) -> float:
    """Every file to `tier` by `threads` clients at once; seconds from the first request to the last answer."""
    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda p: os.setxattr(p, TIER_XATTR, tier.encode()), paths))
    return time.perf_counter() - started


def verify(paths: list[Path], expected: list[bytes], tier: str) -> None:
    for path, want in zip(paths, expected):
        if os.getxattr(path, TIER_XATTR).decode() != tier:
            raise SystemExit(f"{path} is not on {tier}")
        drop_page_cache(path)
        if path.read_bytes() != want:
            print(f"wrong bytes read from {path}", file=sys.stderr)
            raise SystemExit(3)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, default=REPO / "tests" / "data" / "kv")
    ap.add_argument("--files", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=4, help="clients asking for moves at once")
    ap.add_argument("--backing", choices=("tmpfs", "ext4"), default="tmpfs")
    ap.add_argument("--image-dir", type=Path, default=Path("/var/tmp"), help="ext4 images (--backing ext4)")
    ap.add_argument("--l3-size", type=int, default=1024, help="MiB of L3 per layout (split over its directories)")
    ap.add_argument("--out", type=Path, default=REPO / "bench-results" / "bench_l3_dirs.json")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        raise SystemExit("mounting the directories' filesystems needs root")

    blobs = kv_files(args.data, args.files)
    records: list[dict] = []
    spread: dict[str, dict[str, int]] = {}
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-l3-dirs-")))
        mounts = {}
        for layout, count in LAYOUTS.items():
            base = tmp / layout.replace(" ", "-")
            dirs = stack.enter_context(filesystems(base, count, args.l3_size // count, args.backing,
                                                  args.image_dir))
            l2 = stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-l3-dirs-l2-", dir="/dev/shm"))
            mb = args.l3_size // count
            l3 = [a for d in dirs for a in ("--l3", f"{d}:{mb * 15 // 16}M")]  # room for ext4's own metadata
            mount = Mount(base, "mnt", {}, "--l2", f"{l2}:2G", *l3, "--promote", "never", "--codec", "auto")
            mount.start()
            stack.callback(_stop, mount)
            paths = [mount.mountpoint / f"{i:03d}.kv" for i in range(len(blobs))]
            for path, blob in zip(paths, blobs):
                path.write_bytes(blob)
            mounts[layout] = (mount, paths)
        for rnd in range(args.rounds):
            order = list(LAYOUTS)[rnd % 2:] + list(LAYOUTS)[:rnd % 2]
            for layout in order:
                mount, paths = mounts[layout]
                stored = sum(t["used_bytes"] for t in mount.stats()["tiers"].values())
                for phase, tier in zip(PHASES, ("L3", "L2")):
                    seconds = move_all(paths, tier, args.threads)
                    verify(paths, blobs, tier)
                    records.append({"round": rnd, "layout": layout, "phase": phase, "seconds": seconds,
                                    "stored_bytes": stored, "logical_bytes": sum(map(len, blobs))})
        for layout, (mount, _) in mounts.items():
            stats = mount.stats()
            for key in FAULTS:
                if stats[key]:
                    print(f"{layout}: the daemon counted {stats[key]} {key}", file=sys.stderr)
                    return 3
            if "directories" in stats["tiers"]["L3"]:
                spread[layout] = {d["path"]: d["written_bytes"] for d in stats["tiers"]["L3"]["directories"]}
    report = summarize(records)
    doc = {"args": {k: str(v) for k, v in vars(args).items()}, "cpus": os.cpu_count(), "summary": report,
           "written_per_directory": spread, "records": records}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2))
    print_table(report, spread, args, sum(map(len, blobs)))
    print(f"saved {args.out}")
    return 0


def _stop(mount: Mount) -> None:
    if mount.proc is not None and mount.proc.poll() is None:
        mount.stop()


def summarize(records: list[dict]) -> dict:
    out: dict[str, dict] = {}
    for phase in PHASES:
        for layout in LAYOUTS:
            rows = [r for r in records if (r["phase"], r["layout"]) == (phase, layout)]
            mbps = [r["stored_bytes"] / r["seconds"] / 1e6 for r in rows]
            out.setdefault(phase, {})[layout] = {"MBps_p50": round(statistics.median(mbps), 1),
                                                 "MBps_min": round(min(mbps), 1), "MBps_max": round(max(mbps), 1),
                                                 "seconds_p50": round(statistics.median(r["seconds"] for r in rows), 3)}
        by_round = {}
        for r in records:
            if r["phase"] == phase:
                by_round.setdefault(r["round"], {})[r["layout"]] = r["seconds"]
        out[phase]["ratio_2_to_1_p50"] = round(statistics.median(
            s["1 dir"] / s["2 dirs"] for s in by_round.values()), 3)
    return out


def print_table(report: dict, spread: dict, args, logical: int) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"L3 in 1 vs 2 directories ({args.backing}; {args.files} KV files, {logical / 1e6:.0f} MB "
                        f"logical; {args.threads} clients, {args.rounds} rounds; {os.cpu_count()} CPUs)")
    for col in ("phase", "1 dir MB/s", "2 dirs MB/s", "2 dirs / 1 dir", "1 dir range", "2 dirs range"):
        table.add_column(col, justify="right")
    for phase in PHASES:
        one, two = report[phase]["1 dir"], report[phase]["2 dirs"]
        table.add_row(phase, f"{one['MBps_p50']:.0f}", f"{two['MBps_p50']:.0f}",
                      f"{report[phase]['ratio_2_to_1_p50']:.2f}×", f"{one['MBps_min']:.0f}–{one['MBps_max']:.0f}",
                      f"{two['MBps_min']:.0f}–{two['MBps_max']:.0f}")
    Console().print(table)
    shares = ", ".join(f"{Path(p).name} {b / 1e6:.0f} MB" for p, b in spread["2 dirs"].items())
    Console().print(f"2 dirs: written per directory over all rounds: {shares}")


if __name__ == "__main__":
    sys.exit(main())
