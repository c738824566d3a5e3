#!/usr/bin/env python3
"""Metadata through the mount: create+close of empty files, `stat` and `ls -l` of every file, each front end
against a plain tmpfs directory, all arms in one run (a benchmark, not a test; issue 38's metadata target).

Layout: --files N files (default 10,000) under 100 directories `ns/ab/<hash>.kv`, as kvfs's KV files are laid
out. Per arm and round, in this order:
    create   open(O_CREAT|O_WRONLY)+close of every file (empty: no object, names only)
    stat     os.stat of every file, after dropping the kernel's dentries and inodes (every name is looked up
             by the daemon again: LOOKUP + GETATTR)
    stat warm  the same again without dropping: what the kernel's attribute cache answers
    ls -l    `ls -l` of every directory (READDIRPLUS, then lstat/getxattr of each entry), after dropping
    unlink   every file
Arms: plain (a /dev/shm directory), and one kvfs mount per front end named with --frontends (default: native
and, where pyfuse3 is installed, pyfuse3). Columns: seconds (median over --rounds), µs per file, the ratio to
the first kvfs arm, and the daemon's CPU-s per 10k files. Output: a table, bench-results/metadata.json.

Usage (as root, FUSE available):
    .venv/bin/python tools/bench_metadata.py [--files 10000] [--rounds 3] [--frontends native,pyfuse3]
"""

from __future__ import annotations

import argparse
import importlib.util
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_harness import REPO, BenchFailure, Mount, drop_caches, proc_cpu_s  # noqa: E402

OPS = ("create", "stat", "stat warm", "ls -l", "unlink")
DIRS = 100


def names(n: int) -> list[tuple[str, str]]:
    """(directory, file) pairs: n files spread over DIRS directories under ns/."""
    return [(f"ns/{i % DIRS:02x}", f"{i:016x}.kv") for i in range(n)]


def run_ops(root: Path, files: list[tuple[str, str]], pid: int | None) -> dict[str, tuple[float, float]]:
    """Each operation's (seconds, daemon CPU-s) on the tree under root."""
    out: dict[str, tuple[float, float]] = {}
    dirs = sorted({d for d, _ in files})
    for d in dirs:
        (root / d).mkdir(parents=True, exist_ok=True)
    paths = [str(root / d / f) for d, f in files]

    def timed(op: str, fn, drop: bool = False) -> None:
        if drop and not drop_caches():
            raise BenchFailure("cannot drop caches (needs root)")
        cpu0, t0 = proc_cpu_s(pid), time.perf_counter()
        fn()
        out[op] = (time.perf_counter() - t0, proc_cpu_s(pid) - cpu0)

    def create() -> None:
        for p in paths:
            os.close(os.open(p, os.O_CREAT | os.O_WRONLY | os.O_CLOEXEC, 0o644))

    def stat_all() -> None:
        for p in paths:
            if os.stat(p).st_size != 0:
                raise BenchFailure(f"{p}: not empty")

    def ls_l() -> None:
        for d in dirs:
            res = subprocess.run(["ls", "-l", str(root / d)], capture_output=True, text=True)
            if res.returncode != 0 or res.stdout.count(".kv\n") != sum(1 for dd, _ in files if dd == d):
                raise BenchFailure(f"ls -l {root / d}: {res.returncode} {res.stderr.strip()}")

    def unlink() -> None:
        for p in paths:
            os.unlink(p)

    timed("create", create)
    timed("stat", stat_all, drop=True)
    timed("stat warm", stat_all)
    timed("ls -l", ls_l, drop=True)
    timed("unlink", unlink)
    for d in dirs:
        (root / d).rmdir()
    return out


def kvfs_arm(frontend: str, rnd: int, work: Path, shm: Path, files) -> dict[str, tuple[float, float]]:
    m = Mount(sys.executable, "auto", work, shm, 1 << 30, f"{frontend}-r{rnd}", env={"KVFS_FRONTEND": frontend})
    m.cmd[1:1] = ["-m", "kvfs"]  # `python -m kvfs mount ...`
    notes: list[str] = []
    m.start()
    try:
        res = run_ops(m.mountpoint, files, m.pid)
        bad = m.bad_log_lines()
    finally:
        code = m.stop(notes)
    if code != 0 or bad:
        raise BenchFailure(f"{frontend}: daemon exit {code}; {bad[:3]}")
    m.remove_dirs()
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=10_000)
    ap.add_argument("--rounds", type=int, default=3)
    have_pyfuse3 = importlib.util.find_spec("pyfuse3") is not None
    ap.add_argument("--frontends", default="native,pyfuse3" if have_pyfuse3 else "native")
    ap.add_argument("--out", default=str(REPO / "bench-results" / "metadata.json"))
    args = ap.parse_args()
    frontends = [f for f in args.frontends.split(",") if f]
    files = names(args.files)
    arms = ["plain", *frontends]
    runs: dict[str, list[dict[str, tuple[float, float]]]] = {a: [] for a in arms}
    work = Path(tempfile.mkdtemp(prefix="kvfs-bench-meta-"))
    shm = Path(tempfile.mkdtemp(prefix="kvfs-bench-meta-", dir="/dev/shm"))
    try:
        for rnd in range(args.rounds):
            for arm in arms:  # interleaved: a noisy moment hits every arm
                if arm == "plain":
                    root = shm / f"plain-r{rnd}"
                    runs[arm].append(run_ops(root, files, None))
                    shutil.rmtree(root)
                else:
                    runs[arm].append(kvfs_arm(arm, rnd, work, shm, files))
                print(f"round {rnd + 1}/{args.rounds}: {arm} done", file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    med = {a: {op: (statistics.median(r[op][0] for r in runs[a]), statistics.median(r[op][1] for r in runs[a]))
               for op in OPS} for a in arms}
    ref = frontends[-1] if len(frontends) > 1 else None  # the one being replaced
    print(f"\n{args.files} files in {DIRS} directories, medians of {args.rounds} rounds"
          + (f"; ratio = time / {ref}'s" if ref else ""))
    print(f"{'op':<10} {'arm':<8} {'s':>8} {'µs/file':>9} {'ratio':>7} {'daemon CPU-s/10k':>17}")
    for op in OPS:
        for a in arms:
            s, cpu = med[a][op]
            ratio = f"{s / med[ref][op][0]:.2f}" if ref and a != "plain" else ""
            cpu_txt = f"{cpu * 10_000 / args.files:.2f}" if a != "plain" else ""
            print(f"{op:<10} {a:<8} {s:8.3f} {s / args.files * 1e6:9.1f} {ratio:>7} {cpu_txt:>17}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "files": args.files, "dirs": DIRS, "rounds": args.rounds, "host": platform.node(), "cpus": os.cpu_count(),
        "medians": {a: {op: {"seconds": s, "daemon_cpu_s": c} for op, (s, c) in v.items()} for a, v in med.items()},
        "runs": runs}, indent=1))
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BenchFailure as e:
        print(f"FAILED: {e}", file=sys.stderr)
        sys.exit(3)
