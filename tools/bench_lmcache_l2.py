#!/usr/bin/env python3
"""TTFT of vLLM (CPU) + LMCache 0.5.6 (multiprocess mode) with its `fs` L2 adapter in a kvfs mount vs on a
plain directory, in one run (docs/engines.md, "LMCache").

Arms, each: two engines with their own LMCache servers on the same L2 directory run side by side, paced
prompt by prompt (tools/vllm_driver.py wait_file/done_file): the storing engine (server 1) computes a prompt
and LMCache writes its chunks; once they are on L2, the measured engine (server 2, its L1 empty as after a
restart) runs the same prompt: every full chunk is a hit loaded from the files, seconds after they were
written. Why not the old order (store everything, restart the server, start the measured engine:
--sequential): on this host (a VM), DAMON proactive reclaim drops page-cache pages idle for about a minute
(/sys/kernel/mm/damon/admin/kdamonds/0: pageout, min age 12 aggregations of 5 s), and storing the prompts and
starting an engine take minutes on 2 busy cores in float32; then both arms read cold files (the plain one
from its disk, the kvfs one through the daemon) and the run measures the host's reclaim, not the storage.
  plain        the L2 directory on a plain directory (--plain-dir, default /var/tmp: a disk, page cache warm)
  kvfs         the L2 directory in a fresh kvfs mount (defaults, L2 on /dev/shm)
  kvfs-nokeep  the same with KVFS_KEEP_WRITTEN_PAGES=0 in the daemon's environment: the chunk files LMCache
               wrote are not kept in the kernel's page cache after their close (kvfs/pagecache.py), so every
               load reads them through the daemon. This is how kvfs behaved before that change.
  recompute    no connector (the reference; not run unless named)
Prompts: distinct token sequences from Python's standard library sources; per length one unmeasured warm-up
prompt, then --reps prompts one at a time, max_tokens 1; TTFT = submission to the step that produced the
first token (tools/vllm_driver.py); the median per length is reported. vLLM's prefix cache is off. LMCache:
chunk 256 tokens, L1 --l1-gib (default 1 GiB), store policy default (not skip_l1). For the kvfs arms the
daemon's read requests during the measured engine are counted (.kvfs/stats): reads the page cache did not
serve.

    .venv/bin/python tools/bench_lmcache_l2.py [--lengths 1024 4096] [--reps 3] [--arms ...]
    .venv/bin/python tools/bench_lmcache_l2.py --replay 16 [--reps 5]   # no engine, seconds: see replay()
Table on stdout, JSON in bench-results/bench_lmcache_l2.json. About 5 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

TOOLS = Path(__file__).resolve().parent
REPO = TOOLS.parent
sys.path.insert(0, str(TOOLS))
import lmcache_mp  # noqa: E402
import vllm_driver  # noqa: E402

MODEL = REPO / ".venv/opt/models/SmolLM2-135M-Instruct"
KVFS = [sys.executable, "-m", "kvfs"]
ARMS = ["plain", "kvfs", "kvfs-nokeep", "recompute"]
DEFAULT_ARMS = ARMS[:3]  # recompute: minutes per prompt in float32 on 2 cores
CHUNK = 256
ENGINE = {"max_model_len": 8192, "kv_cache_gib": 2}
ENV = {"PYTHONHASHSEED": "0", **lmcache_mp.SERVER_ENV}


def prompts_for(lengths: list[int], reps: int) -> dict[int, list[list[int]]]:
    """reps + 1 distinct prompts per length (the first is the warm-up)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(MODEL))
    need = (reps + 1) * sum(lengths)
    pool: list[int] = []
    for path in sorted(Path(os.__file__).parent.glob("*.py")):
        pool += tok(path.read_text(errors="replace"))["input_ids"]
        if len(pool) >= need:
            break
    out, at = {}, 0
    for n in lengths:
        out[n] = [pool[at + k * n: at + (k + 1) * n] for k in range(reps + 1)]
        at += (reps + 1) * n
    return out


class Mount:
    def __init__(self, work: Path, name: str, env: dict[str, str], l2_size: str) -> None:
        self.dir = work / name
        self.mountpoint = self.dir / "mnt"
        self.mountpoint.mkdir(parents=True)
        self.l2 = Path(tempfile.mkdtemp(prefix=f"kvfs-lmc-{name}-", dir="/dev/shm"))
        subprocess.run([*KVFS, "mount", str(self.mountpoint), "--l2", f"{self.l2}:{l2_size}", "--state-dir",
                        str(self.dir / "state")], check=True, capture_output=True, env={**os.environ, **env})

    def stats(self) -> dict:
        return json.loads((self.mountpoint / ".kvfs" / "stats").read_bytes())

    def umount(self) -> None:
        subprocess.run([*KVFS, "umount", str(self.mountpoint)], check=True, capture_output=True)
        shutil.rmtree(self.l2, ignore_errors=True)


def engine(work: Path, name: str, rounds: list[dict], connector: dict | None, **extra) -> dict:
    job = {"model": str(MODEL), "connector": connector, "rounds": rounds, **ENGINE, **extra}
    return vllm_driver.spawn(job, work / f"{name}.log", timeout=1800, env=ENV)


def run_arm(work: Path, arm: str, prompts: dict[int, list[list[int]]], l1_gib: float, plain_dir: Path,
            sequential: bool = False) -> dict:
    lengths = list(prompts)
    store = [{"prompts": [p for n in lengths for p in prompts[n]], "max_tokens": 1, "label": "store"}]
    measured = [{"prompts": [prompts[n][0]], "max_tokens": 1, "label": f"warmup {n}"} for n in lengths]
    measured += [{"prompts": prompts[n][1:], "max_tokens": 1, "label": f"{n}"} for n in lengths]
    if arm == "recompute":
        res = engine(work, arm, measured, None)
        return {"rounds": res["rounds"][len(lengths):]}
    mount = None
    if arm == "plain":
        l2 = Path(tempfile.mkdtemp(prefix="kvfs-lmc-plain-", dir=plain_dir))
    else:
        mount = Mount(work, arm, {"KVFS_KEEP_WRITTEN_PAGES": "0"} if arm == "kvfs-nokeep" else {}, "4G")
        l2 = mount.mountpoint / "lmcache" / "l2"
    out: dict = {"l2_dir": str(l2)}
    servers = []

    def server(phase: str):
        proc, conn = lmcache_mp.start_server(str(l2), CHUNK, l1_gib=l1_gib, skip_l1=False,
                                             log_path=str(work / f"lmcache-{arm}-{phase}.log"))
        servers.append(proc)
        return proc, conn

    try:
        if sequential:  # store, restart the server, start the measured engine: the gap is an engine start
            proc, conn = server("store")
            engine(work, f"{arm}-store", store, conn)
            lmcache_mp.wait_stores_settled(proc, 300)
            lmcache_mp.stop_server(proc)
            _, conn = server("measure")
            before = mount.stats() if mount else None
            res = engine(work, f"{arm}-measure", measured, conn)
        else:  # two engines up at once, paced prompt by prompt: store prompt k, then load it seconds later
            order = [(n, 0) for n in lengths] + [(n, k) for n in lengths for k in range(1, len(prompts[n]))]
            flags = work / f"{arm}-flags"
            flags.mkdir()
            f = [{x: flags / f"{x}{i}" for x in ("store", "stored", "load", "loaded")} for i in range(len(order))]
            store_rounds = [{"prompts": [prompts[n][k]], "max_tokens": 1, "wait_file": str(f[i]["store"]),
                             "done_file": str(f[i]["stored"])} for i, (n, k) in enumerate(order)]
            load_rounds = [{"prompts": [prompts[n][k]], "max_tokens": 1, "wait_file": str(f[i]["load"]),
                            "done_file": str(f[i]["loaded"])} for i, (n, k) in enumerate(order)]
            proc_s, conn_s = server("store")
            _, conn_m = server("measure")  # its own L1, empty: every hit is a load from the L2 files
            box: dict = {}
            engines = [threading.Thread(target=lambda: box.update(store=engine(work, f"{arm}-store", store_rounds,
                                                                               conn_s))),
                       threading.Thread(target=lambda: box.update(res=engine(work, f"{arm}-measure", load_rounds,
                                                                             conn_m)))]
            for t in engines:
                t.daemon = True
                t.start()
            before = mount.stats() if mount else None

            def wait(path: Path, by: threading.Thread) -> None:
                while not path.exists():
                    if not by.is_alive():
                        raise SystemExit(f"{arm}: an engine ended early (logs in {work})")
                    time.sleep(0.02)

            try:
                for i in range(len(order)):
                    f[i]["store"].touch()
                    wait(f[i]["stored"], engines[0])
                    lmcache_mp.wait_stores_settled(proc_s, 300)
                    f[i]["load"].touch()
                    wait(f[i]["loaded"], engines[1])
            finally:  # on a failure, let both engines run through to their end rather than wait forever
                for flag in f:
                    flag["store"].touch()
                    flag["load"].touch()
            for t in engines:
                t.join()
            if "res" not in box or "store" not in box:
                raise SystemExit(f"{arm}: an engine failed (logs in {work})")
            res = box["res"]
            rounds, at = [], len(lengths)  # regroup the measured prompts per length
            for n in lengths:
                k = len(prompts[n]) - 1
                rounds.append([r[0] for r in res["rounds"][at:at + k]])
                at += k
            res = {"rounds": [[r[0]] for r in res["rounds"][:len(lengths)]] + rounds}
        if mount:
            after = mount.stats()
            out["measure_daemon_read_requests"] = after["read_requests"] - before["read_requests"]
            out["measure_daemon_read_bytes"] = after["bytes_read"] - before["bytes_read"]
        files = sorted(l2.glob("*.data"))
        out["files"], out["bytes"] = len(files), sum(f.stat().st_size for f in files)
        if mount:
            out["stored_ratio"] = mount.stats()["compression_ratio"]
        out["rounds"] = res["rounds"][len(lengths):]
        return out
    finally:
        for proc in servers:
            lmcache_mp.stop_server(proc)
        if mount:
            mount.umount()
        else:
            shutil.rmtree(l2, ignore_errors=True)


def replay(work: Path, arms: list[str], n_chunks: int, reps: int, plain_dir: Path) -> dict:
    """No engine: LMCache's own FSL2Adapter stores n_chunks chunk files (real KV blocks of tests/data/kv) and a
    fresh adapter looks them up and loads them, as the server does for one prompt, `reps` times per arm. The
    store-to-load gap is short, so the page cache is what the store left."""
    import hashlib
    import mmap

    from lmcache.v1.distributed.api import ObjectKey
    from lmcache.v1.distributed.l2_adapters.fs_l2_adapter import FSL2Adapter, FSL2AdapterConfig

    blocks = [f.read_bytes() for f in sorted((REPO / "tests" / "data" / "kv").glob("bf16-*.kv"))]
    chunk = 2 * len(blocks[0])  # 256 tokens of bf16 KV
    shm = mmap.mmap(-1, n_chunks * chunk)

    class Obj:  # what the adapter needs of an L1 memory object
        def __init__(self, mv):
            self.byte_array = mv

    objs = [Obj(memoryview(shm)[i * chunk:(i + 1) * chunk]) for i in range(n_chunks)]

    def until(fn, task):
        while (r := fn(task)) is None:
            time.sleep(0.0005)
        return r

    out = {}
    for arm in arms:
        mount = None if arm == "plain" else Mount(
            work, arm, {"KVFS_KEEP_WRITTEN_PAGES": "0"} if arm == "kvfs-nokeep" else {}, "2G")
        base = mount.mountpoint / "l2" if mount else Path(tempfile.mkdtemp(prefix="kvfs-lmc-replay-", dir=plain_dir))
        rows = []
        try:
            for rep in range(reps):
                keys = [ObjectKey(chunk_hash=hashlib.sha256(f"{rep}-{i}".encode()).digest(), model_name="m",
                                  kv_rank=0) for i in range(n_chunks)]
                for i, o in enumerate(objs):
                    o.byte_array[:] = blocks[i % len(blocks)] + blocks[(i + 1) % len(blocks)]
                a = FSL2Adapter(FSL2AdapterConfig(base_path=str(base)))
                t0 = time.perf_counter()
                tid = a.submit_store_task(keys, objs)
                while tid not in (done := a.pop_completed_store_tasks()):
                    time.sleep(0.0005)
                t_store = time.perf_counter() - t0
                a.close()
                before = mount.stats() if mount else None
                a = FSL2Adapter(FSL2AdapterConfig(base_path=str(base)))
                t0 = time.perf_counter()
                hits = until(a.query_lookup_and_lock_result, a.submit_lookup_and_lock_task(keys, {}))
                t1 = time.perf_counter()
                loaded = until(a.query_load_result, a.submit_load_task(keys, objs))
                t2 = time.perf_counter()
                a.close()
                assert len(hits.get_indices_list()) == len(loaded.get_indices_list()) == n_chunks, arm
                assert all(bytes(o.byte_array) == blocks[i % len(blocks)] + blocks[(i + 1) % len(blocks)]
                           for i, o in enumerate(objs)), arm
                row = {"store_s": t_store, "lookup_s": t1 - t0, "load_s": t2 - t1}
                if mount:
                    row["daemon_read_requests"] = mount.stats()["read_requests"] - before["read_requests"]
                rows.append(row)
        finally:
            if mount:
                mount.umount()
            else:
                shutil.rmtree(base, ignore_errors=True)
        out[arm] = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        print(f"replay {arm}: " + ", ".join(f"{k} {v:.4g}" for k, v in out[arm].items()), flush=True)
    return {"chunks": n_chunks, "chunk_bytes": chunk, "reps": reps, "arms": out}


def summarize(result: dict, lengths: list[int]) -> dict[int, dict]:
    rows = {}
    for n, rnd in zip(lengths, result["rounds"]):
        rows[n] = {"ttft_p50_s": statistics.median(r["ttft_s"] for r in rnd),
                   "ttft_s": [round(r["ttft_s"], 4) for r in rnd],
                   "cached_tokens": [r["num_cached_tokens"] for r in rnd]}
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--arms", nargs="+", default=DEFAULT_ARMS, choices=ARMS)
    ap.add_argument("--l1-gib", type=float, default=1.0)
    ap.add_argument("--plain-dir", type=Path, default=Path("/var/tmp"))
    ap.add_argument("--sequential", action="store_true",
                    help="start the measured engine after the store (minutes later on a busy host)")
    ap.add_argument("--out", type=Path, default=REPO / "bench-results" / "bench_lmcache_l2.json")
    ap.add_argument("--replay", type=int, metavar="CHUNKS",
                    help="no engine: LMCache's fs adapter stores and loads CHUNKS chunk files per arm (16: one "
                         "4096-token prompt), --reps times")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    work = Path(tempfile.mkdtemp(prefix="kvfs-bench-lmc-", dir="/var/tmp"))
    print(f"work dir {work}", flush=True)
    if args.replay:
        doc = replay(work, [a for a in args.arms if a != "recompute"], args.replay, args.reps, args.plain_dir)
        out = args.out.with_name(args.out.stem + "-replay.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=1) + "\n")
        shutil.rmtree(work, ignore_errors=True)
        return 0
    prompts = prompts_for(args.lengths, args.reps)
    t0 = time.time()
    arms = {}
    for arm in args.arms:
        print(f"arm {arm} ...", flush=True)
        r = run_arm(work, arm, prompts, args.l1_gib, args.plain_dir, args.sequential)
        if arm != "recompute":
            for n, rnd in zip(args.lengths, r["rounds"]):
                expect = min(n // CHUNK * CHUNK, n - 1)  # full chunks; vLLM computes the last token
                if any(x["num_cached_tokens"] != expect for x in rnd):
                    raise SystemExit(f"{arm}: cached tokens {[x['num_cached_tokens'] for x in rnd]} at {n}, "
                                     f"expected {expect} (logs in {work})")
        arms[arm] = {k: v for k, v in r.items() if k != "rounds"}
        arms[arm]["rows"] = summarize(r, args.lengths)
        print(f"arm {arm}: " + ", ".join(f"{n}: {row['ttft_p50_s']:.3f} s" for n, row in arms[arm]["rows"].items()),
              flush=True)
    doc = {"bench": "lmcache_l2", "model": "SmolLM2-135M-Instruct, vLLM 0.32 CPU", "dtype": vllm_driver.engine_dtype(),
           "lmcache": "0.5.6 MP, fs L2 adapter", "chunk_tokens": CHUNK, "lengths": args.lengths, "reps": args.reps,
           "l1_gib": args.l1_gib, "sequential": args.sequential, "elapsed_s": round(time.time() - t0, 1), "arms": arms}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print_table(doc)
    shutil.rmtree(work, ignore_errors=True)
    return 0


def print_table(doc: dict) -> None:
    arms = doc["arms"]
    print(f"\nTTFT p50 (s), {doc['reps']} prompts per length, full hits from LMCache's fs L2 (L1 empty)")
    print(f"{'arm':<12}" + "".join(f"{n:>10}" for n in doc["lengths"]) + "   x plain   daemon reads (measured engine)")
    for arm, a in arms.items():
        ttft = [a["rows"][n]["ttft_p50_s"] for n in doc["lengths"]]
        ratio = ""
        if "plain" in arms and arm != "plain":
            ratio = " ".join(f"{t / arms['plain']['rows'][n]['ttft_p50_s']:.2f}" for t, n in zip(ttft, doc["lengths"]))
        reads = a.get("measure_daemon_read_requests", "")
        print(f"{arm:<12}" + "".join(f"{t:>10.3f}" for t in ttft) + f"   {ratio:<9} {reads}")


if __name__ == "__main__":
    sys.exit(main())
