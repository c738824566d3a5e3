#!/usr/bin/env python3
"""What the hot/cold API buys a returning session: loading a conversation's KV from L2, from L3 cold, and from
L3 after a prefetch — on real KV files, side by side in one run.

A "conversation" is --files real KV files (tests/data/kv or --data DIR). Each round, every conversation is
measured in every variant, in a rotating order, on one mount (L2 on tmpfs, L3 on --l3-dir, the default
promotion policy: a load from L3 reads there and promotes in the background; one from L4 promotes first — one
whole-object GET — and reads the L2 copy, as kvfs.direct does):

  L2             the conversation is in L2 (`kvfs demote --to L2`): the hot case, what a pin keeps
  L3 cold        demoted to L3 (`kvfs demote --to L3`), its objects dropped from the page cache: a session
                 returning with no warning
  L3+prefetch    the same, then `kvfs.client.prefetch` and a wait until every file is in L2 (the prefetch
                 time is reported: how early an engine must ask), then the load
  L4 cold, L4+prefetch   the same with the conversation demoted to L4, with --ceph: a real one-host Ceph
                 cluster started for the run (tools/ceph_cluster.py, RGW on 127.0.0.1:7492)

A load reads every file as the vLLM connector does (kvfs.direct.read_file, --threads readers) and compares it
with its source (wrong bytes abort, exit status 3). Reported per variant: load time p50 over conversations and
rounds, MB/s (logical), and the ratio to L2 of the same round. Prints a table, saves JSON (--out).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))
from bench_l4 import Mount, drop_page_cache, kv_files  # noqa: E402
from ceph_cluster import BUCKET, CephCluster  # noqa: E402

from kvfs import client, direct  # noqa: E402

VARIANTS = ("L2", "L3 cold", "L3+prefetch", "L4 cold", "L4+prefetch")
POLL_S = 0.005


def load(paths: list[Path], expected: list[bytes], threads: int) -> float:
    for p in paths:  # the kernel keeps a FUSE file's pages across opens: every byte must come from kvfs
        drop_page_cache(p)
    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        got = list(pool.map(lambda p: direct.read_file(p)[0], paths))
    elapsed = time.perf_counter() - started
    for path, data, want in zip(paths, got, expected):
        if bytes(data) != want:
            print(f"wrong bytes read from {path}", file=sys.stderr)
            raise SystemExit(3)
    return elapsed


def all_in(paths: list[Path], tier: str) -> bool:
    return all(client.status(p).tier == tier for p in paths)


def measure(variant: str, paths: list[Path], expected: list[bytes], l3_dir: Path, threads: int) -> dict:
    if variant == "L2":
        client.demote(paths, to="L2")
        return {"load_s": load(paths, expected, threads)}
    tier = variant[:2]
    client.demote(paths, to=tier)
    for obj in l3_dir.rglob("*"):  # the objects come from the disk, not the page cache
        if obj.is_file():
            drop_page_cache(obj)
    if variant.endswith("cold"):
        return {"load_s": load(paths, expected, threads)}
    started = time.perf_counter()
    client.prefetch(paths)
    while not all_in(paths, "L2"):
        time.sleep(POLL_S)
    prefetch_s = time.perf_counter() - started
    return {"load_s": load(paths, expected, threads), "prefetch_s": prefetch_s}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, default=REPO / "tests" / "data" / "kv")
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--files", type=int, default=6, help="KV files per conversation")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=4, help="readers per load (the connector's io_threads)")
    ap.add_argument("--l3-dir", type=Path, default=Path("/var/tmp"))
    ap.add_argument("--ceph", action="store_true", help="also L4 on a real Ceph RGW started for the run")
    ap.add_argument("--out", type=Path, default=REPO / "bench-results" / "bench_hotcold.json")
    args = ap.parse_args(argv)
    variants = VARIANTS if args.ceph else VARIANTS[:3]

    blobs = kv_files(args.data, args.conversations * args.files)
    with tempfile.TemporaryDirectory(prefix="bench-hotcold-") as tmp, \
            tempfile.TemporaryDirectory(prefix="bench-hotcold-l2-", dir="/dev/shm") as l2, \
            tempfile.TemporaryDirectory(prefix="bench-hotcold-l3-", dir=args.l3_dir) as l3:
        base = Path(tmp)
        cluster, l4 = None, []
        if args.ceph:
            cluster = CephCluster(base / "ceph", port=7492, mon_ports=(3312, 6801))  # beside test clusters
            cluster.start()
            l4 = ["--l4", f"s3://{BUCKET}/bench-hotcold-{int(time.time())}"]
        mount = Mount(base, "mnt", cluster.env if cluster else {}, "--l2", f"{l2}:1G", "--l3", f"{l3}:4G", *l4,
                      "--codec", "auto")
        try:
            mount.start()
            convs = []
            for c in range(args.conversations):
                paths = []
                for f in range(args.files):
                    p = mount.mountpoint / f"conv-{c}" / f"{f:02d}.kv"
                    p.parent.mkdir(exist_ok=True)
                    p.write_bytes(blobs[c * args.files + f])
                    paths.append(p)
                convs.append((paths, blobs[c * args.files:(c + 1) * args.files]))
            records = []
            for rnd in range(args.rounds):
                for c, (paths, expected) in enumerate(convs):
                    shift = (rnd + c) % len(variants)
                    for variant in variants[shift:] + variants[:shift]:
                        rec = measure(variant, paths, expected, Path(l3), args.threads)
                        records.append({"round": rnd, "conversation": c, "variant": variant,
                                        "bytes": sum(map(len, expected)), **rec})
            stats = mount.stats()
            mount.stop()
        finally:
            if mount.proc is not None and mount.proc.poll() is None:
                mount.stop()
            if cluster is not None:
                cluster.stop()
    report = summarize(records, variants)
    for key in ("errors", "checksum_failures", "commit_failures"):
        if stats[key]:
            print(f"the daemon counted {stats[key]} {key}", file=sys.stderr)
            return 3
    doc = {"args": {k: str(v) for k, v in vars(args).items()}, "summary": report, "records": records,
           "daemon": {k: stats[k] for k in ("requested_moves", "prefetches")}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2))
    print_table(report, convs[0][1])
    print(f"saved {args.out}")
    return 0


def summarize(records: list[dict], variants: tuple[str, ...]) -> dict:
    l2 = {(r["round"], r["conversation"]): r["load_s"] for r in records if r["variant"] == "L2"}
    out = {}
    for variant in variants:
        rows = [r for r in records if r["variant"] == variant]
        out[variant] = {
            "load_ms_p50": round(1000 * statistics.median(r["load_s"] for r in rows), 2),
            "MBps_p50": round(statistics.median(r["bytes"] / r["load_s"] / 1e6 for r in rows), 1),
            "ratio_to_L2_p50": round(statistics.median(
                r["load_s"] / l2[(r["round"], r["conversation"])] for r in rows), 3),
            **({"prefetch_ms_p50": round(1000 * statistics.median(r["prefetch_s"] for r in rows), 2)}
               if "prefetch_s" in rows[0] else {}),
        }
    return out


def print_table(report: dict, sample: list[bytes]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"loading a conversation ({len(sample)} KV files, {sum(map(len, sample)) / 1e6:.1f} MB)")
    for col in ("variant", "load ms p50", "MB/s", "× L2", "prefetch ms p50"):
        table.add_column(col, justify="right")
    for variant, r in report.items():
        table.add_row(variant, f"{r['load_ms_p50']:.1f}", f"{r['MBps_p50']:.0f}", f"{r['ratio_to_L2_p50']:.2f}",
                      f"{r['prefetch_ms_p50']:.1f}" if "prefetch_ms_p50" in r else "-")
    Console().print(table)


if __name__ == "__main__":
    sys.exit(main())
