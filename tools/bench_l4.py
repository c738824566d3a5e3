#!/usr/bin/env python3
"""L4 benchmark on a real Ceph cluster (RGW, S3 API) started for the run: kvfs's moves against raw boto3.

Per round, on real KV files (tests/data/kv, or --data DIR of .kv files), with fresh mounts and prefixes:

  demotion   files written and fsync'ed into a roomy L3 are remounted with an L3 of 1 MiB: the mover demotes all
             of them to L4 (4 moves in flight). Rate = stored bytes / (mount live → L4 holds them all).
  raw PUT    the same objects' bytes PUT by boto3 under another prefix, 4 threads (the mover's concurrency).
  promotion  after one untimed promotion (a long-running daemon's L4 client is warm: connections, botocore's
             models), a third of the other files: one byte of each read through the mount by THREADS readers
             (promote always: the first read promotes the file: one whole-object GET, then served from L2); a
             third read whole by THREADS kvfs.direct readers, as the connector reads (locating a file promotes
             it, then its L2 object is read past FUSE); a third prefetched (kvfs.client.prefetch, the hot/cold
             API: the mover promotes them, MOVES_IN_FLIGHT at a time, no reader waiting): rate = stored bytes /
             (first read or prefetch → all on L2: the mover's last_move_unix, or the readers' return if later).
             L2 is a tmpfs directory (--shm), as deployed. The deletions of the L4 copies (background, held back
             while moves run) finish before the next part starts. Then every file is read whole and checked.
  raw GET    the same objects fetched whole by boto3, 4 threads: all of them, and each promotion part's own
             objects' bytes alone (their copies PUT above: a part's promotions delete its objects; the same
             bytes as that part moved, with the same tail of its last files in flight: the promotion ratios are
             against these), right beside that part: before it in even rounds, after it (and its deletions)
             in odd ones, so that neither side always meets the store and the host after the other's
             traffic. Before each promotion part, twice its bytes are written to the tmpfs
             L2 is on and deleted (warm_memory: this VM's balloon makes first writes into freed memory slow).
  CPU        per promotion part and its raw GET, the CPU seconds of the mover side (the kvfs daemon and this
             process's readers, or this process's boto3 threads) and of the store (RGW, OSD, mon, mgr; for a
             part, also the batched DELETEs of the moved objects' L4 copies that start as its moves end): on a
             small machine both sides share the cores, so the mover side's cost per MB is what sets the ratio.
  cold read  open+read+close latency of one file (p50 over the files) from L2, L3 (its object dropped from
             the page cache) and L4 (promote never), the mount's page cache dropped before each read.

--split-cores pins the store's daemons to CPU 0 and the mover side (this process, its threads, the kvfs daemon) to
the others, as when the store is another machine: on a small host the two otherwise compete for the same cores.

Ratios are kvfs / raw in the same round (this machine is shared: compare within a run). Prints a table, saves
JSON (--out). Every file read is compared with its source; wrong bytes abort (exit status 3).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))
from ceph_cluster import BUCKET, CephCluster  # noqa: E402

from kvfs import client, direct  # noqa: E402
from kvfs.index import parse_object_id  # noqa: E402

THREADS = 4
POLL_S = 0.1  # how often a wait reads .kvfs/stats; the moves' end is the mover's last_move_unix, not the poll's
SETTLE_S = 1.0


class Mount:
    def __init__(self, base: Path, tag: str, env: dict, *args: str) -> None:
        self.mountpoint = base / tag
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        self.state = base / f"{tag}-state"
        self.args = [*args, "--state-dir", str(self.state)]
        self.env = {**os.environ, **env}
        self.proc: subprocess.Popen | None = None

    def start(self, *extra: str) -> float:
        log = open(self.state.parent / f"{self.mountpoint.name}.log", "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "kvfs", "mount", "--foreground", str(self.mountpoint),
                                      *self.args, *extra], stdout=log, stderr=log, env=self.env)
        while not os.path.ismount(self.mountpoint):
            if self.proc.poll() is not None:
                raise SystemExit(f"kvfs failed to mount; see {log.name}")
            time.sleep(0.01)
        return time.time()  # wall clock, as the mover's last_move_unix

    def stop(self) -> None:
        subprocess.run(["fusermount3", "-u", str(self.mountpoint)], check=True)
        self.proc.wait(60)

    def stats(self) -> dict:
        return json.loads((self.mountpoint / ".kvfs" / "stats").read_bytes())

    def tier_of(self, name: str) -> str:
        return os.getxattr(self.mountpoint / name, "user.kvfs.tier").decode()


def kv_files(data_dir: Path, n: int) -> list[bytes]:
    paths = sorted(data_dir.rglob("*.kv"))
    if not paths:
        raise SystemExit(f"no .kv files under {data_dir}")
    return [paths[i % len(paths)].read_bytes() + i.to_bytes(4, "little") for i in range(n)]


def drop_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_checked(path: Path, expected: bytes) -> float:
    drop_page_cache(path)
    t = time.monotonic()
    with open(path, "rb", buffering=0) as f:
        data = f.read()
    elapsed = time.monotonic() - t
    if data != expected:
        print(f"WRONG BYTES from {path}", file=sys.stderr)
        sys.exit(3)
    return elapsed


def first_byte(path: Path) -> bytes:
    with open(path, "rb", buffering=0) as f:
        return f.read(1)


def direct_read(path: Path) -> int:
    """A reader as the connector: kvfs.direct locates the object (promoting it first) and reads it past FUSE."""
    data, _ = direct.read_file(path)
    return len(data)


def warm_memory(directory: Path, nbytes: int) -> None:
    """Write and delete `nbytes` in a tmpfs directory, so that the part measured next writes L2 objects into
    memory the guest already has. This VM's balloon reports freed guest memory to its host (free page
    reporting), and the first write into such pages faults on the host: perf showed copy_folio_from_iter_atomic
    at 22% of all CPU in the parts it hit, against 1% otherwise, and those parts ran at half their rate. The raw
    side reuses its heap and does not meet it; nor does a host whose memory stays backed (bare metal, a VM
    without free page reporting)."""
    junk = bytes(2 << 20)
    paths = [directory / f"warm-{i}" for i in range(nbytes // len(junk) + 1)]  # deleted below
    for path in paths:
        path.write_bytes(junk)
    for path in paths:
        path.unlink()


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """CPU seconds the mover side (`pids`) and the store (the cluster's daemons) spend inside a `with`."""

    def __init__(self, cluster: CephCluster, *pids: int) -> None:
        self.sides = {"mover": list(pids), "store": cluster.pids()}
        self.used: dict[str, float] = {}

    def _now(self) -> dict[str, float]:
        return {side: sum(map(cpu_s, pids)) for side, pids in self.sides.items()}

    def __enter__(self) -> "CpuMeter":
        self._start = self._now()
        return self

    def __exit__(self, *exc) -> None:
        self.used = {side: t - self._start[side] for side, t in self._now().items()}


def pin(pids: list[int], cpus: set[int]) -> None:
    """Pin every thread of these processes (threads they start later inherit it)."""
    for pid in pids:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                os.sched_setaffinity(int(tid), cpus)
            except ProcessLookupError:
                pass  # a thread that just ended


def wait_until(mount: Mount, done) -> tuple[float, dict]:
    while True:
        st = mount.stats()
        if done(st):
            return time.monotonic(), st
        time.sleep(POLL_S)


def l4_objects(s3, prefix: str) -> list[tuple[str, int]]:
    keys = []
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=f"{prefix}/"):
        keys += [(o["Key"], o["Size"]) for o in page.get("Contents", [])]
    return keys


def raw_get(s3, keys: list[str]) -> tuple[float, int]:
    """Seconds to GET these objects whole, THREADS at a time, and their bytes."""
    with concurrent.futures.ThreadPoolExecutor(THREADS) as pool:
        t = time.monotonic()
        sizes = list(pool.map(lambda k: len(s3.get_object(Bucket=BUCKET, Key=k)["Body"].read()), keys))
        return time.monotonic() - t, sum(sizes)


def raw_get_put(s3, keys: list[str], prefix: str) -> tuple[float, float, int]:
    """Seconds to GET the objects kvfs stored, and to PUT the same bytes under `prefix`, THREADS at a time."""
    with concurrent.futures.ThreadPoolExecutor(THREADS) as pool:
        t = time.monotonic()
        bodies = list(pool.map(lambda k: s3.get_object(Bucket=BUCKET, Key=k)["Body"].read(), keys))
        get_s = time.monotonic() - t
        t = time.monotonic()
        list(pool.map(lambda kb: s3.put_object(Bucket=BUCKET, Key=f"{prefix}/{kb[0]}", Body=kb[1]),
                      zip(keys, bodies)))
        put_s = time.monotonic() - t
    return get_s, put_s, sum(map(len, bodies))


def one_round(rnd: int, files: list[bytes], cluster: CephCluster, base: Path, shm: Path, s3) -> dict:
    env = cluster.env
    l2 = shm / f"r{rnd}-l2"  # L2 is DRAM: a tmpfs directory, as deployed (a page cache on disk costs 2-3x the CPU)
    names = [f"f{i:03d}.kv" for i in range(len(files))]
    prefix = f"bench-{os.getpid()}-{rnd}"
    roomy = ["--l2", f"{l2}:2G", "--l3", f"{base / f'r{rnd}-l3'}:4G"]
    m = Mount(base, f"r{rnd}", env, "--l4", f"s3://{BUCKET}/{prefix}", "--promote", "never")
    m.start(*roomy)
    for name, data in zip(names, files):
        with open(m.mountpoint / name, "wb") as f:
            f.write(data)
    cold = {"L2": [read_checked(m.mountpoint / n, d) for n, d in zip(names, files)]}
    for name in names:
        fd = os.open(m.mountpoint / name, os.O_RDONLY)
        os.fsync(fd)  # → L3
        os.close(fd)
    for obj in (base / f"r{rnd}-l3").glob("*/*"):
        drop_page_cache(obj)
    cold["L3"] = [read_checked(m.mountpoint / n, d) for n, d in zip(names, files)]
    stored = m.stats()["tiers"]["L3"]["used_bytes"]
    m.stop()

    # demotion: the same mount with a 1 MiB L3 drains everything to L4
    live = m.start("--l2", f"{l2}:2G", "--l3", f"{base / f'r{rnd}-l3'}:1M")
    _, st = wait_until(m, lambda s: s["tiers"]["L4"]["files"] == len(files) and not s["mover"]["backlog_bytes"])
    demote_s = st["mover"]["last_move_unix"] - live
    assert st["tiers"]["L4"]["used_bytes"] == stored, (st["tiers"]["L4"], stored)
    inos = {n: os.stat(m.mountpoint / n).st_ino for n in names}  # an object's key ends in <ino hex>-<gen>
    cold["L4"] = [read_checked(m.mountpoint / n, d) for n, d in zip(names, files)]
    m.stop()

    objects = l4_objects(s3, prefix)
    keys = [k for k, _ in objects]
    get_s, put_s, raw_bytes = raw_get_put(s3, keys, f"{prefix}-raw")
    assert raw_bytes == stored and len(keys) == len(files)
    key_of = {parse_object_id(k.rpartition("/")[2])[0]: k for k in keys}
    size_of = dict(objects)
    warm, measured = names[0], names[1:]  # the first promotion of a mount sets up its L4 client: not timed
    third = len(measured) // 3  # consecutive thirds: kv_files cycles through the data's files, so each part
    parts = {"read": measured[:third], "direct": measured[third:2 * third],  # holds the same mix of them
             "prefetch": measured[2 * third:]}
    raw_part, cpu, wall = {}, {}, {}  # cpu and wall by part: "read", …, and "raw read", …

    def raw_side(how: str) -> float:
        """The part's raw GET, measured; returns the seconds it took, set-up included."""
        started = time.monotonic()
        with CpuMeter(cluster, os.getpid()) as meter:
            raw_part[how] = raw_get(s3, [f"{prefix}-raw/{key_of[inos[n]]}" for n in parts[how]])
        cpu[f"raw {how}"], wall[f"raw {how}"] = meter.used, raw_part[how][0]
        return time.monotonic() - started

    # promotion: read each file once with promotion on; each part beside its raw GET, in turns (raw first in
    # even rounds, kvfs first in odd ones), so that both meet the store and the host in the same state
    m.start("--l2", f"{l2}:2G", "--l3", f"{base / f'r{rnd}-l3'}:1M", "--promote", "always")
    time.sleep(SETTLE_S)  # the new mount's start-up work (its first mover pass, reconcile) is not a promotion
    first_byte(m.mountpoint / warm)  # a long-running daemon's client is warm (connections, botocore's models)
    wait_until(m, lambda s: not s["mover"]["moves_in_flight"] and not s["mover"]["deletions_in_flight"])
    promote_s, t0, aside_s = {}, time.monotonic(), 0.0
    raw_first = rnd % 2 == 0
    for how, reader in (("read", first_byte), ("direct", direct_read), ("prefetch", None)):
        if raw_first:
            aside_s += raw_side(how)
        want = m.stats()["tiers"]["L2"]["files"] + len(parts[how])
        t_warm = time.monotonic()
        part_bytes = sum(size_of[key_of[inos[n]]] for n in parts[how])
        warm_memory(shm, 2 * part_bytes)  # the tmpfs L2 is on, beside L2 (not in it: kvfs owns that)
        aside_s += time.monotonic() - t_warm
        with CpuMeter(cluster, m.proc.pid, os.getpid()) as meter:
            start = time.time()
            if reader is None:
                client.prefetch([m.mountpoint / n for n in parts[how]])  # returns at once; the mover promotes
            else:
                with concurrent.futures.ThreadPoolExecutor(THREADS) as pool:  # THREADS readers: a file's first
                    list(pool.map(reader, (m.mountpoint / n for n in parts[how])))  # read promotes it
            readers_done = time.time()
            _, st = wait_until(m, lambda s: s["tiers"]["L2"]["files"] == want and not s["mover"]["moves_in_flight"])
        promote_s[how] = max(st["mover"]["last_move_unix"], readers_done) - start
        cpu[how], wall[how] = meter.used, promote_s[how]
        wait_until(m, lambda s: not s["mover"]["deletions_in_flight"])  # the next part starts on a quiet store
        if not raw_first:
            aside_s += raw_side(how)
    t_clean, st = wait_until(m, lambda s: not s["mover"]["deletions_in_flight"])
    cleaned_s = t_clean - t0 - aside_s
    for name, data in zip(names, files):
        read_checked(m.mountpoint / name, data)
    m.stop()
    shutil.rmtree(l2)
    mb = stored / 1e6
    by_part = {how: raw_part[how][1] / 1e6 for how in parts}  # stored MB each
    raw_mbps = {how: by_part[how] / raw_part[how][0] for how in parts}
    return {"files": len(files), "logical_bytes": sum(map(len, files)), "stored_bytes": stored,
            "demotion_MBps": mb / demote_s, "raw_put_MBps": mb / put_s,
            "promotion_MBps": by_part["read"] / promote_s["read"], "raw_get_MBps": mb / get_s,
            "promotion_direct_MBps": by_part["direct"] / promote_s["direct"],
            "promotion_prefetch_MBps": by_part["prefetch"] / promote_s["prefetch"],
            "promotion_with_deletes_MBps": mb / cleaned_s,
            "demotion_vs_put": put_s / demote_s,
            "raw_get_part_MBps": raw_mbps,
            "promotion_vs_get": raw_part["read"][0] / promote_s["read"],
            "promotion_direct_vs_get": raw_part["direct"][0] / promote_s["direct"],
            "promotion_prefetch_vs_get": raw_part["prefetch"][0] / promote_s["prefetch"],
            "promotion_vs_get_all": by_part["read"] / promote_s["read"] / (mb / get_s),
            "cpu_ms_per_MB": {part: {side: 1e3 * t / by_part[part.split()[-1]] for side, t in used.items()}
                              for part, used in cpu.items()},
            "cores_busy": {part: sum(used.values()) / wall[part] for part, used in cpu.items()},
            "cold_read_ms_p50": {t: statistics.median(v) * 1e3 for t, v in cold.items()}}


def report(rounds: list[dict], args) -> dict:
    def med(key: str) -> float:
        return statistics.median(r[key] for r in rounds)

    summary = {k: med(k) for k in ("demotion_MBps", "raw_put_MBps", "promotion_MBps", "raw_get_MBps",
                                   "demotion_vs_put", "promotion_vs_get", "promotion_with_deletes_MBps",
                                   "promotion_direct_MBps", "promotion_direct_vs_get", "promotion_prefetch_MBps",
                                   "promotion_prefetch_vs_get")}
    summary["cold_read_ms_p50"] = {t: statistics.median(r["cold_read_ms_p50"][t] for r in rounds)
                                   for t in ("L2", "L3", "L4")}
    summary["raw_get_part_MBps"] = {how: statistics.median(r["raw_get_part_MBps"][how] for r in rounds)
                                    for how in ("read", "direct", "prefetch")}
    summary["promotion_vs_get_all"] = med("promotion_vs_get_all")
    r0 = rounds[0]
    cores = "store on CPU 0, mover side on the rest" if args.split_cores else "store and mover side share the CPUs"
    print(f"\nL4 on Ceph RGW ({args.store}, 1 OSD; {cores}), {r0['files']} real KV files, "
          f"{r0['logical_bytes'] / 1e6:.0f} MB logical / {r0['stored_bytes'] / 1e6:.0f} MB stored, "
          f"median of {len(rounds)} rounds; raw = boto3 on the same objects (a promotion part: its own third)")
    print(f"{'move':<14}{'kvfs MB/s':>11}{'boto3 MB/s':>12}{'kvfs/raw':>10}   target >= 0.80")
    raw = summary["raw_get_part_MBps"]
    for label, ours, theirs, ratio in (("demotion", "demotion_MBps", summary["raw_put_MBps"], "demotion_vs_put"),
                                       ("promo read", "promotion_MBps", raw["read"], "promotion_vs_get"),
                                       ("promo direct", "promotion_direct_MBps", raw["direct"],
                                        "promotion_direct_vs_get"),
                                       ("prefetch", "promotion_prefetch_MBps", raw["prefetch"],
                                        "promotion_prefetch_vs_get")):
        verdict = "PASS" if summary[ratio] >= 0.8 else "MISS"
        print(f"{label:<14}{summary[ours]:>11.1f}{theirs:>12.1f}{summary[ratio]:>10.2f}   {verdict}")
    print(f"raw GET of all {r0['files']} objects at once: {summary['raw_get_MBps']:.1f} MB/s (promo read against "
          f"it: {summary['promotion_vs_get_all']:.2f})")
    print(f"promotion until the L4 copies are deleted too (background DELETEs): "
          f"{summary['promotion_with_deletes_MBps']:.1f} MB/s")
    cpu = {part: {side: statistics.median(r["cpu_ms_per_MB"][part][side] for r in rounds)
                  for side in ("mover", "store")} for part in r0["cpu_ms_per_MB"]}
    busy = {part: statistics.median(r["cores_busy"][part] for r in rounds) for part in r0["cores_busy"]}
    summary["cpu_ms_per_MB"], summary["cores_busy"] = cpu, busy
    print(f"CPU ms per stored MB (mover side: kvfs daemon + readers / boto3; store: RGW, OSD, mon, mgr), "
          f"and cores busy of {os.cpu_count()}:")
    print(f"{'part':<14}{'kvfs':>8}{'boto3':>8}{'store':>8}{'store raw':>11}{'cores':>7}{'cores raw':>11}")
    for how in ("read", "direct", "prefetch"):
        ours, theirs = cpu[how], cpu[f"raw {how}"]
        print(f"{'promo ' + how:<14}{ours['mover']:>8.2f}{theirs['mover']:>8.2f}{ours['store']:>8.2f}"
              f"{theirs['store']:>11.2f}{busy[how]:>7.2f}{busy[f'raw {how}']:>11.2f}")
    size = r0["logical_bytes"] / r0["files"] / 1e6
    print(f"cold read of one {size:.1f} MB file, p50 ms: " +
          "  ".join(f"{t} {v:.1f}" for t, v in summary["cold_read_ms_p50"].items()))
    return {"benchmark": "l4", "store": args.store, "split_cores": args.split_cores, "threads": THREADS,
            "rounds": rounds, "summary": summary}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--files", type=int, default=288, help="96 per promotion part: ~0.3 s of moves each")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--data", type=Path, default=REPO / "tests" / "data" / "kv")
    p.add_argument("--store", choices=["memstore", "bluestore"], default="memstore")
    p.add_argument("--shm", type=Path, default=Path("/dev/shm"), help="tmpfs for the L2 directories")
    p.add_argument("--split-cores", action="store_true",
                   help="the store on CPU 0, the mover side on the other CPUs (as with a remote store)")
    p.add_argument("--out", type=Path, default=REPO / "bench-results" / "bench_l4.json")
    args = p.parse_args(argv)
    if args.split_cores and (os.cpu_count() or 1) < 2:
        raise SystemExit("--split-cores needs 2 CPUs or more")
    files = kv_files(args.data, args.files + 1)  # + the warm-up file
    with tempfile.TemporaryDirectory(prefix="kvfs-bench-l4-") as tmp, \
            tempfile.TemporaryDirectory(prefix="kvfs-bench-l4-l2-", dir=args.shm) as shm:
        base = Path(tmp)
        # beside a test cluster; room for every round's objects and raw copies (a full OSD blocks writes)
        capacity = max(2 << 30, 3 * args.rounds * sum(map(len, files)))
        cluster = CephCluster(base / "ceph", store=args.store, port=7490, mon_ports=(3310, 6799), capacity=capacity)
        cluster.start()
        try:
            if args.split_cores:
                pin(cluster.pids(), {0})
                os.sched_setaffinity(0, set(range(1, os.cpu_count())))  # boto3's threads and each mount inherit it
            import boto3
            from botocore.config import Config

            env = cluster.env
            s3 = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                              aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"], region_name="us-east-1",
                              config=Config(s3={"addressing_style": "path"}, max_pool_connections=16))
            rounds = []
            for r in range(args.rounds):
                rounds.append(one_round(r, files, cluster, base, Path(shm), s3))
                print(f"round {r}: demotion {rounds[-1]['demotion_vs_put']:.2f}x raw PUT, promotion "
                      f"{rounds[-1]['promotion_vs_get']:.2f}x / {rounds[-1]['promotion_direct_vs_get']:.2f}x / "
                      f"{rounds[-1]['promotion_prefetch_vs_get']:.2f}x raw GET (mount reads / kvfs.direct / "
                      f"prefetch)", flush=True)
        finally:
            cluster.stop()
    doc = report(rounds, args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
