#!/usr/bin/env python3
"""Encryption at rest: loads from L3 and from L4 (a real Ceph RGW started for the run), sealed vs plain, in one
run (a benchmark, not a test).

Two mounts side by side, the same real KV files (tests/data/kv, each copy slightly perturbed, as in
bench_datapath), the default codec, promotion off (every read is served from the tier measured):
    plain    no key
    sealed   --key-file K --encrypt L3,L4 (L3 opts in; L4 is sealed by default once a key is given)
Per round and mount: the files are written, moved to L3 (user.kvfs.tier), the page cache dropped, and every file
read whole through the mount (the "L3 load"), then again with kvfs.direct.read_file as the connector loads
(a sealed tier falls back to the mount: that is the cost of opting L3 in). Then the files move to L4, the page
cache is dropped, and they are read whole through the mount ("L4 load"). The mounts alternate which goes first.
Every byte read is compared with what was written. Throughput is logical MB read per second; the issue's
target: sealed ≥ 0.85 × plain for the L3 and L4 loads. Prints a table, saves JSON (--out).

Usage (root, FUSE, Ceph installed by tools/install_ceph.sh):
    .venv/bin/python tools/bench_encryption.py --files 48 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))
sys.path.insert(1, str(REPO))
from bench_datapath import make_file, sources  # noqa: E402
from bench_harness import MB, BenchFailure, Mount, drop_caches  # noqa: E402
from ceph_cluster import CephCluster  # noqa: E402

from kvfs import crypto, direct  # noqa: E402

ARMS = ("L3 load", "L3 load, kvfs.direct", "L4 load")


def move_all(root: Path, names: list[str], tier: str) -> None:
    for name in names:
        os.setxattr(root / name, "user.kvfs.tier", tier.encode())
        if os.getxattr(root / name, "user.kvfs.tier") != tier.encode():
            raise BenchFailure(f"{name} did not move to {tier}")


def timed_reads(root: Path, files: dict[str, bytes], via_direct: bool = False) -> float:
    drop_caches()
    total, t0 = 0, time.perf_counter()
    for name, body in files.items():
        data = direct.read_file(root / name)[0] if via_direct else (root / name).read_bytes()
        if data != body:
            raise BenchFailure(f"{name}: wrong bytes read")
        total += len(data)
    return total / (time.perf_counter() - t0) / MB


def one_mount(tag: str, args, base: Path, shm: Path, cluster: CephCluster, files: dict[str, bytes],
              key: Path | None) -> dict[str, float]:
    m = Mount(sys.executable, "auto", base, shm, 4 << 30, tag, l3=(base, 4 << 30), promote="never")
    m.cmd[0:1] = [sys.executable, "-P", "-m", "kvfs"]
    m.cmd += ["--l4", f"s3://kvfs-test/{tag}"]
    if key is not None:
        m.cmd += ["--key-file", str(key), "--encrypt", "L3,L4"]
    env = dict(os.environ)
    os.environ.update(cluster.env, PYTHONPATH=str(REPO))
    try:
        m.start()
    finally:
        os.environ.clear()
        os.environ.update(env)
    try:
        for name, body in files.items():
            (m.mountpoint / name).write_bytes(body)
        names = list(files)
        move_all(m.mountpoint, names, "L3")
        out = {"L3 load": timed_reads(m.mountpoint, files),
               "L3 load, kvfs.direct": timed_reads(m.mountpoint, files, via_direct=True)}
        move_all(m.mountpoint, names, "L4")
        out["L4 load"] = timed_reads(m.mountpoint, files)
        st = m.stats()
        out["stored_bytes_l4"] = st["tiers"]["L4"]["used_bytes"]
        out["direct_reads"] = st["direct_reads"]
        if st["checksum_failures"] or st["key_unavailable"]:
            raise BenchFailure(f"{tag}: {st['checksum_failures']} checksum failures, {st['key_unavailable']} "
                               "unreadable")
        return out
    finally:
        bad = m.bad_log_lines()
        if m.stop([]) != 0 or bad:
            raise BenchFailure(f"{tag} daemon failed:\n" + "\n".join(bad[-20:]))
        m.remove_dirs()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--files", type=int, default=48)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--data", type=Path, default=REPO / "tests" / "data" / "kv")
    p.add_argument("--out", type=Path, default=REPO / "bench-results" / "encryption.json")
    args = p.parse_args(argv)
    srcs = [s.read_bytes() for s in sources(args.data)]
    files = {f"f{k}.kv": make_file(srcs, k) for k in range(args.files)}
    rounds = []
    with tempfile.TemporaryDirectory(prefix="kvfs-bench-enc-") as tmp, \
            tempfile.TemporaryDirectory(prefix="kvfs-bench-enc-l2-", dir="/dev/shm") as shm:
        base = Path(tmp)
        key = base / "bench.key"
        crypto.write_key_file(key)
        cluster = CephCluster(base / "ceph", port=7491, mon_ports=(3311, 6800),
                              capacity=max(2 << 30, 4 * args.rounds * sum(map(len, files.values()))))
        cluster.start()
        try:
            for r in range(args.rounds):
                order = [("plain", None), ("sealed", key)]
                if r % 2:
                    order.reverse()
                got = {tag: one_mount(f"{tag}-r{r}", args, base, Path(shm), cluster, files, k) for tag, k in order}
                rounds.append(got)
                print(f"round {r}: " + ", ".join(f"{arm} {got['sealed'][arm] / got['plain'][arm]:.2f}x"
                                                  for arm in ARMS), flush=True)
        finally:
            cluster.stop()
    doc = report(rounds, args, sum(map(len, files.values())))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"saved {args.out}")
    return 0


def report(rounds: list[dict], args, total: int) -> dict:
    rows = {}
    print(f"\n{args.files} files, {total / MB:.0f} MB per arm, medians of {len(rounds)} rounds")
    print(f"{'arm':<24}{'plain MB/s':>12}{'sealed MB/s':>13}{'sealed/plain':>14}")
    for arm in ARMS:
        plain = statistics.median(r["plain"][arm] for r in rounds)
        sealed = statistics.median(r["sealed"][arm] for r in rounds)
        ratio = statistics.median(r["sealed"][arm] / r["plain"][arm] for r in rounds)
        rows[arm] = {"plain_mb_s": round(plain, 1), "sealed_mb_s": round(sealed, 1), "ratio": round(ratio, 3),
                     "target_met": ratio >= 0.85 if arm != "L3 load, kvfs.direct" else None}
        print(f"{arm:<24}{plain:>12.0f}{sealed:>13.0f}{ratio:>13.2f}x")
    overhead = statistics.median(r["sealed"]["stored_bytes_l4"] / r["plain"]["stored_bytes_l4"] for r in rounds)
    print(f"L4 stored bytes, sealed / plain: {overhead:.5f}")
    return {"files": args.files, "bytes_per_arm": total, "rounds": rounds, "summary": rows,
            "l4_stored_sealed_over_plain": overhead, "target": "sealed >= 0.85x plain (L3 and L4 loads)"}


if __name__ == "__main__":
    sys.exit(main())
