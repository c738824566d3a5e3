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
Arms: plain (a /dev/shm directory), kvfs (this checkout's daemon) and, with --baseline DIR, base (that
checkout's daemon, with --base-env settings). Columns: seconds (median over --rounds), µs per file, kvfs / base,
and the daemon's CPU-s per 10k files. Output: a table, bench-results/metadata.json.

Usage (as root, FUSE available):
    .venv/bin/python tools/bench_metadata.py [--files 10000] [--rounds 3]
    # before and after the native front end, in one run (b993f46: the last commit with pyfuse3, which this
    # .venv must still have installed; copy the built kvfs/**/*.so into the worktree):
    git worktree add /tmp/kvfs-base b993f46
    .venv/bin/python tools/bench_metadata.py --baseline /tmp/kvfs-base --base-env KVFS_FRONTEND=pyfuse3
"""

from __future__ import annotations

import argparse
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


def kvfs_arm(arm: str, checkout: Path, env: dict[str, str], rnd: int, work: Path, shm: Path,
             files) -> dict[str, tuple[float, float]]:
    m = Mount(sys.executable, "auto", work, shm, 1 << 30, f"{arm}-r{rnd}", env={**env, "PYTHONPATH": str(checkout)},
              cwd=checkout)
    m.cmd[1:1] = ["-m", "kvfs"]  # `python -m kvfs mount ...` of that checkout
    notes: list[str] = []
    m.start()
    try:
        res = run_ops(m.mountpoint, files, m.pid)
        bad = m.bad_log_lines()
    finally:
        code = m.stop(notes)
    if code != 0 or bad:
        raise BenchFailure(f"{arm}: daemon exit {code}; {bad[:3]}")
    m.remove_dirs()
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=10_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--baseline", type=Path, help="another kvfs checkout: its daemon serves the 'base' arm")
    ap.add_argument("--base-env", action="append", default=[], metavar="NAME=VALUE",
                    help="the base daemon's environment (repeatable)")
    ap.add_argument("--out", default=str(REPO / "bench-results" / "metadata.json"))
    args = ap.parse_args()
    files = names(args.files)
    checkouts = {"kvfs": (REPO, {})}
    if args.baseline:
        checkouts["base"] = (args.baseline.resolve(), dict(e.split("=", 1) for e in args.base_env))
    arms = ["plain", *checkouts]
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
                    runs[arm].append(kvfs_arm(arm, *checkouts[arm], rnd, work, shm, files))
                print(f"round {rnd + 1}/{args.rounds}: {arm} done", file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    med = {a: {op: (statistics.median(r[op][0] for r in runs[a]), statistics.median(r[op][1] for r in runs[a]))
               for op in OPS} for a in arms}
    ref = "base" if args.baseline else None
    print(f"\n{args.files} files in {DIRS} directories, medians of {args.rounds} rounds"
          + (f"; ratio = time / {ref}'s" if ref else ""))
    print(f"{'op':<10} {'arm':<8} {'s':>8} {'µs/file':>9} {'ratio':>7} {'daemon CPU-s/10k':>17}")
    for op in OPS:
        for a in arms:
            s, cpu = med[a][op]
            ratio = f"{s / med[ref][op][0]:.2f}" if ref and a == "kvfs" else ""
            cpu_txt = f"{cpu * 10_000 / args.files:.2f}" if a != "plain" else ""
            print(f"{op:<10} {a:<8} {s:8.3f} {s / args.files * 1e6:9.1f} {ratio:>7} {cpu_txt:>17}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "files": args.files, "dirs": DIRS, "baseline": str(args.baseline) if args.baseline else None,
        "base_env": args.base_env, "rounds": args.rounds, "host": platform.node(), "cpus": os.cpu_count(),
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
