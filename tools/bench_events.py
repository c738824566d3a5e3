#!/usr/bin/env python3
"""KV events: their latency (a commit or a move, to a subscriber's receipt) and what they cost the writer, in
one run (a benchmark, not a test).

Two mounts side by side on /dev/shm, the same real KV files (tests/data/kv, each copy perturbed as in
bench_datapath), written as the connector saves: kvfs.direct.write_file with a user.kvfs.blocks record
(16 blocks, 256 tokens). The mounts alternate which goes first each round.
    events   --events ipc://…  (a ZMQ SUB in this process receives every batch)
    off      no events
Measured per round:
- write throughput, events / off;
- the latency from write_file's return to the BlockStored's arrival;
- a demotion (user.kvfs.tier = L3) to the arrival of its BlockStored(L3).
Prints a table and saves JSON (--out).

Usage: .venv/bin/python tools/bench_events.py --files 200 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))
sys.path.insert(1, str(REPO))
from bench_datapath import make_file, sources  # noqa: E402
from bench_harness import MB, BenchFailure, Mount  # noqa: E402

from kvfs import direct, events  # noqa: E402


class Receiver:
    """A SUB socket in a thread: arrival time of each (medium, last block hash)."""

    def __init__(self, endpoint: str) -> None:
        import zmq

        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.arrived: dict[tuple[str, bytes], float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.sock.poll(50):
                _, _, payload = self.sock.recv_multipart()
                now = time.perf_counter()
                for ev in events.decode_batch(payload).events:
                    if isinstance(ev, events.BlockStored):
                        self.arrived[(ev.medium, ev.block_hashes[-1])] = now

    def wait_for(self, keys: list[tuple[str, bytes]], timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while any(k not in self.arrived for k in keys):
            if time.monotonic() > deadline:
                raise BenchFailure(f"{sum(k not in self.arrived for k in keys)} events never arrived")
            time.sleep(0.01)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.ctx.destroy(linger=0)


def record(k: int) -> tuple[bytes, bytes]:
    hashes = [os.urandom(32) for _ in range(16)]
    rec = events.BlockRecord(block_hashes=hashes, block_size=16, parent_block_hash=os.urandom(32),
                             token_ids=[(k * 256 + i) % 49152 for i in range(256)])
    return hashes[-1], events.encode_record(rec)


def run_arm(m: Mount, files: list[bytes], receiver: Receiver | None, round_no: int) -> dict:
    d = m.mountpoint / f"r{round_no}"
    d.mkdir()
    recs = [record(k) for k in range(len(files))]
    done: dict[bytes, float] = {}
    t0 = time.perf_counter()
    for k, (body, (last, rec)) in enumerate(zip(files, recs)):
        direct.write_file(d / f"{k:05d}.kv", body, xattrs={events.XA_BLOCKS.decode(): rec}, mode=0o644)
        done[last] = time.perf_counter()
    elapsed = time.perf_counter() - t0
    out = {"write_MBps": sum(map(len, files)) / elapsed / MB, "files_per_s": len(files) / elapsed}
    if receiver is None:
        return out
    receiver.wait_for([("L2", last) for last, _ in recs])
    out["commit_ms"] = [1e3 * (receiver.arrived[("L2", h)] - t) for h, t in done.items()]
    moved: dict[bytes, float] = {}
    for k, (last, _) in enumerate(recs[:50]):
        os.setxattr(d / f"{k:05d}.kv", "user.kvfs.tier", b"L3")
        moved[last] = time.perf_counter()
    receiver.wait_for([("L3", h) for h in moved])
    out["move_ms"] = [1e3 * (receiver.arrived[("L3", h)] - t) for h, t in moved.items()]
    return out


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--files", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=REPO / "bench-results" / "events.json")
    args = ap.parse_args()
    srcs = [p.read_bytes() for p in sources(REPO / "tests" / "data" / "kv")]
    files = [make_file(srcs, k) for k in range(args.files)]
    base = Path(tempfile.mkdtemp(prefix="kvfs-bench-events-"))
    shm = Path(tempfile.mkdtemp(prefix="kvfs-bench-events-", dir="/dev/shm"))
    endpoint = f"ipc://{base}/events"
    mounts = {}
    for tag in ("events", "off"):
        m = Mount(sys.executable, "auto", base, shm, 4 << 30, tag, l3=(base, 8 << 30), promote="never")
        m.cmd[0:1] = [sys.executable, "-P", "-m", "kvfs"]
        if tag == "events":
            m.cmd += ["--events", endpoint]
        mounts[tag] = m
    receiver = None
    results: dict[str, list[dict]] = {"events": [], "off": []}
    notes: list[str] = []
    try:
        for m in mounts.values():
            m.start()
        receiver = Receiver(endpoint)
        time.sleep(1.5)  # the subscription is in place and the start's AllBlocksCleared has gone out
        for r in range(args.rounds):
            order = ("events", "off") if r % 2 == 0 else ("off", "events")
            for tag in order:
                results[tag].append(run_arm(mounts[tag], files, receiver if tag == "events" else None, r))
    finally:
        if receiver is not None:
            receiver.close()
        for m in mounts.values():
            try:
                m.stop(notes)
            except BenchFailure as e:
                notes.append(str(e))
                m.kill()
    commit = [x for r in results["events"] for x in r["commit_ms"]]
    move = [x for r in results["events"] for x in r["move_ms"]]
    ratios = [e["write_MBps"] / o["write_MBps"] for e, o in zip(results["events"], results["off"])]
    summary = {
        "files": args.files, "rounds": args.rounds, "file_bytes": sum(map(len, files)) // len(files),
        "write_MBps": {tag: statistics.median(r["write_MBps"] for r in rs) for tag, rs in results.items()},
        "write_ratio_events_over_off": {"median": statistics.median(ratios), "rounds": ratios},
        "commit_to_event_ms": {"p50": pct(commit, 0.5), "p99": pct(commit, 0.99), "max": max(commit)},
        "move_to_event_ms": {"p50": pct(move, 0.5), "p99": pct(move, 0.99), "max": max(move)},
        "notes": notes,
    }
    print(f"{args.files} files of {summary['file_bytes'] / MB:.1f} MB, {args.rounds} rounds (medians)")
    print(f"{'':28} {'events':>10} {'off':>10} {'ratio':>7}")
    print(f"{'direct write MB/s':28} {summary['write_MBps']['events']:>10.0f} {summary['write_MBps']['off']:>10.0f} "
          f"{summary['write_ratio_events_over_off']['median']:>7.2f}")
    for what in ("commit_to_event_ms", "move_to_event_ms"):
        s = summary[what]
        print(f"{what:28} p50 {s['p50']:.1f}  p99 {s['p99']:.1f}  max {s['max']:.1f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
