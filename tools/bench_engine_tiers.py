#!/usr/bin/env python3
"""Store and load throughput of other engines' file tiers in a kvfs mount vs a plain tmpfs directory, one run.

The engines' own storage code, driven as tests/test_engines.py drives it (docs/engines.md), with real KV
(the blocks in tests/data/kv, replicated under distinct keys to --size-mb):
  vllm    vLLM 0.32's TieringOffloadingSpec, its `fs` secondary tier (FileSystemTierManager, the C batch I/O
          in vllm.fs_io_C, n_read_threads/n_write_threads --threads): one process stores the blocks through
          the manager (CPU primary tier -> fs tier: one 2,949,120-byte .bin file per 128-token block, temp
          file + rename, O_DIRECT where the directory takes it: on kvfs and on tmpfs it does); a fresh
          process looks them up and promotes them into its primary tier (the load). Store time: from
          complete_store until the cascade to the files is done; load time: from the first lookup until every
          block is a HIT. The blocks loaded are compared with the originals.
  sglang  SGLang 0.5.23's HiCache `file` backend (HiCacheFile), in .venv-sglang: one process stores 64-token
          pages (1,474,560 bytes, page_first layout) with batch_set (numpy tofile to a temp file, rename);
          a fresh process reads them with batch_get (one readinto per file) into preallocated tensors. Timed:
          those two calls. The pages read are compared with the originals.
Arms: `kvfs` (a directory in a kvfs mount) and `plain` (a directory on tmpfs). The loads run twice: `load`
right after the store (the page cache as the store left it: after buffered writes kvfs keeps what a
writer wrote in the page cache, kvfs/pagecache.py; O_DIRECT writes and reads pass it by) and `load cold` after
the files' cached pages were dropped (posix_fadvise DONTNEED; on tmpfs the pages are the storage itself, so
nothing changes there): reads reach the kvfs daemon. Every timed phase is its own process after imports;
MB = 1e6 bytes; the ratio is kvfs / plain of the same round; with --rounds > 1 the medians are reported.

As a module: `run(mount_dir, plain_dir, ...) -> list[dict]` (one row per engine and arm). Standalone it
mounts its own kvfs (L2 on /dev/shm) and uses a tmpfs directory under /dev/shm as the plain arm:

    .venv/bin/python tools/bench_engine_tiers.py [--size-mb 200] [--rounds 1] [--engines vllm sglang]
Table on stdout, JSON in bench-results/bench_engine_tiers.json.
Needs tools/install_vllm.sh (vLLM) and tools/install_sglang.sh (.venv-sglang); an engine whose environment is
missing is skipped, and the output says so. The main process and the vLLM workers use this interpreter.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TOOLS = Path(__file__).resolve().parent
REPO = TOOLS.parent
KV_DATA = REPO / "tests" / "data" / "kv"
SGLANG_PY = REPO / ".venv-sglang" / "bin" / "python"
BLOCK_TOKENS, BLOCK_BYTES, PAGE_TOKENS = 128, 2949120, 64
ENGINES = ("vllm", "sglang")


def samples() -> list[Path]:
    return sorted(KV_DATA.glob("bf16-*.kv")) + sorted(KV_DATA.glob("fp16-*.kv"))


# ---------------------------------------------------------------------------------------------------------------
# workers (run in their own process: `bench_engine_tiers.py --worker NAME ...`)

def _vllm_manager(root: str, n: int, threads: int, tag: str):
    from vllm.v1.kv_offload.config import (OffloadingCacheConfig, OffloadingConfig, OffloadingGroupConfig,
                                           OffloadingModelConfig, OffloadingParallelConfig)
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    config = OffloadingConfig(  # what OffloadingConnector builds for SmolLM2-135M on one worker (tests/test_engines.py)
        groups=(OffloadingGroupConfig(tokens_per_block=BLOCK_TOKENS, group_id=0,
                                      layer_names=tuple(f"model.layers.{i}.self_attn.attn" for i in range(30))),),
        worker_kv_bytes_per_block=BLOCK_BYTES, enable_kv_cache_events=False,
        extra_config={"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": (n + 8) * BLOCK_BYTES,
                      "secondary_tiers": [{"type": "fs", "root_dir": root, "n_read_threads": threads,
                                           "n_write_threads": threads}]},
        engine_id=f"kvfs-bench-{tag}-{os.getpid()}",
        model=OffloadingModelConfig(name="SmolLM2-135M-Instruct", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=BLOCK_TOKENS, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                          data_parallel_index=0, data_parallel_size=1,
                                          data_parallel_rank_local=None, is_parallelism_agnostic=True))
    return OffloadingSpecFactory.create_spec(config).get_manager()


def worker_vllm(mode: str, root: str, n: int, threads: int) -> dict:
    import numpy as np
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import hash_block_tokens, init_none_hash
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key

    blocks = [p.read_bytes() for p in samples()]
    manager = _vllm_manager(root, n, threads, mode)
    tier = manager.secondary_tiers[0]
    init_none_hash(sha256)
    keys, parent = [], None
    for i in range(n):  # vLLM's chained block hashes of distinct token ids
        parent = hash_block_tokens(sha256, parent, list(range(i * BLOCK_TOKENS, (i + 1) * BLOCK_TOKENS)))
        keys.append(make_offload_key(parent, 0))
    view = manager.primary_tier.get_kv_memoryview()
    rows = np.frombuffer(view, dtype=np.uint8).reshape(view.shape)
    request = ReqContext(req_id="r0")
    manager.on_new_request(request)

    def step():
        manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))

    out = {"o_direct": tier._use_o_direct, "files": n, "bytes": n * BLOCK_BYTES}
    if mode == "store":
        prepared = manager.prepare_store(keys, request)
        for i, chunk in enumerate(prepared.store_spec.chunk_ids):  # the worker's GPU -> CPU copy
            rows[int(chunk), :BLOCK_BYTES] = np.frombuffer(blocks[i % len(blocks)], dtype=np.uint8)
        t0 = time.perf_counter()
        manager.complete_store(keys, request)  # cascades every block to the fs tier
        while manager.has_pending_work():
            step()
            time.sleep(0.001)
        out["seconds"] = time.perf_counter() - t0
        step()
    else:
        t0 = time.perf_counter()
        deadline = time.monotonic() + 600
        while True:  # asynchronous lookups (RETRY), then promotions (HIT_PENDING), then HIT
            results = [manager.lookup(k, request) for k in keys]
            if all(r is LookupResult.HIT for r in results):
                break
            if LookupResult.MISS in results or time.monotonic() > deadline:
                raise SystemExit(f"lookups: {[r.name for r in results]}")
            step()
            time.sleep(0.001)
        out["seconds"] = time.perf_counter() - t0
        loaded = manager.prepare_load(keys, request)
        out["equal"] = all(bytes(rows[int(c), :BLOCK_BYTES]) == blocks[i % len(blocks)]
                           for i, c in enumerate(loaded.chunk_ids))
        manager.complete_load(keys, request)
    manager.on_request_finished(request)
    del rows, view
    manager.shutdown()
    return out


def worker_sglang(mode: str, root: str, n: int, pages_file: str) -> dict:
    from sglang_cpu import stub_triton  # this script's directory is on sys.path
    stub_triton()
    import numpy as np
    import torch
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig

    data = np.load(pages_file)
    names = sorted(data.files)
    pages = [torch.from_numpy(data[name].copy()).view(torch.bfloat16) for name in names]
    config = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                  is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                                  model_name="HuggingFaceTB/SmolLM2-135M-Instruct",
                                  extra_config={"file_storage_path": root})
    store = HiCacheFile(config)
    keys, prior = [], b""
    for i in range(n):  # SHA-256-chained page keys, like HiCache's
        prior = hashlib.sha256(prior + str(i).encode()).digest()
        keys.append(prior.hex())
    values = [pages[i % len(pages)] for i in range(n)]
    out = {"files": n, "bytes": sum(v.numel() * v.element_size() for v in values)}
    if mode == "store":
        t0 = time.perf_counter()
        ok = store.batch_set(keys, values)
        out["seconds"] = time.perf_counter() - t0
        if not ok:
            raise SystemExit("batch_set failed")
    else:
        targets = [torch.empty_like(v) for v in values]
        for t in targets:  # touch the destination: page faults are not the storage's cost
            t.view(torch.uint8).fill_(0)
        t0 = time.perf_counter()
        got = store.batch_get(keys, targets)
        out["seconds"] = time.perf_counter() - t0
        out["equal"] = all(g is not None and torch.equal(g.view(torch.uint8), v.view(torch.uint8))
                           for g, v in zip(got, values))
    return out


# ---------------------------------------------------------------------------------------------------------------
# the driver

def sglang_pages(out: Path) -> Path:
    """The sample blocks (vLLM CPU block order) as SGLang host pages, page_first: [k/v][token][layer][head][dim]."""
    import numpy as np

    pages = {}
    for sample in samples():
        a = np.fromfile(sample, dtype="<u2").reshape(30, 3, 2, 8192)
        k = a[:, :, 0].reshape(30, 3, 64, BLOCK_TOKENS).transpose(0, 1, 3, 2)
        v = a[:, :, 1].reshape(30, 3, BLOCK_TOKENS, 64)
        kv = np.stack([k, v]).transpose(0, 3, 1, 2, 4)
        for p in range(BLOCK_TOKENS // PAGE_TOKENS):
            pages[f"{sample.stem}-p{p}"] = np.ascontiguousarray(kv[:, p * PAGE_TOKENS:(p + 1) * PAGE_TOKENS]).ravel()
    np.savez(out, **pages)
    return out


def _worker(python: str, args: list[str], log: Path, env: dict | None = None) -> dict:
    with open(log, "ab") as f:
        proc = subprocess.run([python, str(Path(__file__).resolve()), "--worker", *args], stdout=subprocess.PIPE,
                              stderr=f, env={**os.environ, **(env or {})}, timeout=1800)
    last = next((ln for ln in reversed(proc.stdout.decode(errors="replace").splitlines()) if ln.startswith("{")), "")
    if proc.returncode != 0 or not last:
        tail = log.read_text(errors="replace")[-4000:]
        raise RuntimeError(f"worker {args[:2]} failed (status {proc.returncode}), log {log}:\n{tail}")
    return json.loads(last)


def drop_page_cache(directory: Path) -> None:
    from bench_tiers import fadvise_dontneed  # this script's directory is on sys.path
    for f in directory.rglob("*"):
        if f.is_file():
            fadvise_dontneed(f)


def _daemon_pid(path: Path) -> int | None:
    """The kvfs daemon serving `path` (its mount's .kvfs/stats), or None outside a kvfs mount."""
    p = path.resolve()
    while not os.path.ismount(p) and p != p.parent:
        p = p.parent
    try:
        return json.loads((p / ".kvfs" / "stats").read_bytes())["pid"]
    except (OSError, ValueError, KeyError):
        return None


def _cpu_s(pid: int | None) -> float:
    if pid is None:
        return 0.0
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _one(engine: str, arm: str, directory: Path, n: int, threads: int, pages_file: Path | None, work: Path,
         cold: bool) -> dict:
    python = str(SGLANG_PY) if engine == "sglang" else sys.executable
    log = work / f"{engine}-{arm}.log"
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    args = [str(directory), str(n), str(threads if engine == "vllm" else pages_file)]
    pid = _daemon_pid(directory)
    row = {"engine": engine, "arm": arm}
    phases = [("store", "store"), ("load", "load")] + ([("load_cold", "load")] if cold else [])
    for phase, mode in phases:
        if phase == "load_cold":
            drop_page_cache(directory)
        cpu0 = _cpu_s(pid)
        r = _worker(python, [engine, mode, *args], log)
        if phase == "store" and pid is not None:
            files = [f for f in directory.rglob("*") if f.is_file()]
            row["stored_ratio"] = (sum(int(os.getxattr(f, "user.kvfs.stored_bytes")) for f in files)
                                   / max(1, sum(f.stat().st_size for f in files)))
        if mode == "load" and not r.get("equal"):
            raise RuntimeError(f"{engine} {arm}: the data loaded differs from what was stored (log {log})")
        row[f"{phase}_MBps"] = r["bytes"] / r["seconds"] / 1e6
        if pid is not None:  # the daemon's CPU over the whole worker, imports included (they do no I/O here)
            row[f"{phase}_daemon_cpu_s_per_GB"] = (_cpu_s(pid) - cpu0) / (r["bytes"] / 1e9)
        row.update(MB=r["bytes"] / 1e6, files=r["files"])
        if "o_direct" in r:
            row["o_direct"] = r["o_direct"]
    shutil.rmtree(directory, ignore_errors=True)
    return row


def run(mount_dir: str, plain_dir: str, size_mb: float = 200, engines=ENGINES, threads: int = 2,
        rounds: int = 1, cold: bool = True, work: str | None = None, notes: list[str] | None = None) -> list[dict]:
    """Store/load MB/s of each engine's file tier in `mount_dir` (in a kvfs mount) and in `plain_dir` (a plain
    directory, tmpfs for the comparison the docs make), arms alternating, `rounds` times. Returns one row per
    engine and arm: engine, arm, MB, files, store_MBps, load_MBps, load_cold_MBps (medians over rounds) and
    the kvfs/plain ratios of the same round (x_plain_store, x_plain_load, x_plain_load_cold, medians);
    the kvfs rows also carry the daemon's CPU-s per GB of each phase."""
    notes = notes if notes is not None else []
    work_dir = Path(work or tempfile.mkdtemp(prefix="kvfs-bench-tiers-"))
    work_dir.mkdir(parents=True, exist_ok=True)
    pages_file = sglang_pages(work_dir / "pages.npz")
    page_bytes = 2 * PAGE_TOKENS * 30 * 3 * 64 * 2
    rows: list[dict] = []
    for engine in engines:
        if engine == "sglang" and not SGLANG_PY.exists():
            notes.append("sglang skipped: .venv-sglang is missing (tools/install_sglang.sh)")
            continue
        if engine == "vllm":
            try:
                import vllm  # noqa: F401
            except ImportError:
                notes.append("vllm skipped: not importable here (tools/install_vllm.sh)")
                continue
        n = max(1, round(size_mb * 1e6 / (BLOCK_BYTES if engine == "vllm" else page_bytes)))
        per_round: list[dict[str, dict]] = []
        for rnd in range(rounds):
            order = [("kvfs", Path(mount_dir)), ("plain", Path(plain_dir))]
            if rnd % 2:
                order.reverse()
            got = {}
            for arm, base in order:
                got[arm] = _one(engine, arm, base / f"{engine}-tier", n, threads, pages_file, work_dir, cold)
                print(f"  {engine} {arm} round {rnd + 1}: " + ", ".join(
                    f"{k} {v:.0f}" for k, v in got[arm].items() if k.endswith("MBps")), flush=True)
            per_round.append(got)
        for arm in ("kvfs", "plain"):
            row = dict(per_round[0][arm])
            for key in [k for k in row if k.endswith("MBps") or k.endswith("per_GB")]:
                row[key] = statistics.median(r[arm][key] for r in per_round)
            for phase in ("store", "load", "load_cold"):
                key = f"{phase}_MBps"
                if key in row:
                    row[f"x_plain_{phase}"] = statistics.median(r[arm][key] / r["plain"][key] for r in per_round)
            row["rounds"] = rounds
            rows.append(row)
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"\n{'engine':<8}{'arm':<7}{'MB':>6}{'store MB/s':>12}{'load MB/s':>11}{'load cold':>11}"
          f"   {'x plain: store':>14}{'load':>7}{'cold':>7}   daemon CPU-s/GB store/load/cold")
    for r in rows:
        cpu = "/".join(f"{r[k]:.1f}" for k in ("store_daemon_cpu_s_per_GB", "load_daemon_cpu_s_per_GB",
                                                "load_cold_daemon_cpu_s_per_GB") if k in r)
        print(f"{r['engine']:<8}{r['arm']:<7}{r['MB']:>6.0f}{r['store_MBps']:>12.0f}{r['load_MBps']:>11.0f}"
              f"{r.get('load_cold_MBps', float('nan')):>11.0f}   {r['x_plain_store']:>14.2f}{r['x_plain_load']:>7.2f}"
              f"{r.get('x_plain_load_cold', float('nan')):>7.2f}   {cpu}")


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        engine, mode, root, n, extra = sys.argv[2:7]
        if engine == "vllm":
            out = worker_vllm(mode, root, int(n), int(extra))
        else:
            out = worker_sglang(mode, root, int(n), extra)
        print(json.dumps(out), flush=True)
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mb", type=float, default=200)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2, help="vLLM fs tier n_read_threads / n_write_threads")
    ap.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    ap.add_argument("--no-cold", action="store_true", help="skip the loads after dropping the page cache")
    ap.add_argument("--mount-dir", help="a directory in an existing kvfs mount (default: mount one)")
    ap.add_argument("--plain-dir", help="the plain directory (default: a new one under /dev/shm)")
    ap.add_argument("--out", type=Path, default=REPO / "bench-results" / "bench_engine_tiers.json")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvfs-bench-tiers-", dir="/var/tmp"))
    plain = Path(args.plain_dir or tempfile.mkdtemp(prefix="kvfs-bench-plain-", dir="/dev/shm"))
    mountpoint = l2 = None
    if args.mount_dir is None:
        mountpoint, l2 = work / "mnt", Path(tempfile.mkdtemp(prefix="kvfs-bench-l2-", dir="/dev/shm"))
        mountpoint.mkdir()
        l2_size = f"{l2}:{max(2048, 4 * args.size_mb):.0f}M"
        subprocess.run([sys.executable, "-m", "kvfs", "mount", str(mountpoint), "--l2", l2_size,
                        "--state-dir", str(work / "state")], check=True, capture_output=True, cwd=REPO)
    notes: list[str] = []
    t0 = time.time()
    try:
        rows = run(args.mount_dir or str(mountpoint), str(plain), args.size_mb, args.engines, args.threads,
                   args.rounds, not args.no_cold, str(work), notes)
    finally:
        if mountpoint is not None:
            subprocess.run([sys.executable, "-m", "kvfs", "umount", str(mountpoint)], capture_output=True, cwd=REPO)
            shutil.rmtree(l2, ignore_errors=True)
        if not args.plain_dir:
            shutil.rmtree(plain, ignore_errors=True)
    doc = {"bench": "engine_tiers", "size_mb": args.size_mb, "rounds": args.rounds, "threads": args.threads,
           "elapsed_s": round(time.time() - t0, 1), "notes": notes, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print_table(rows)
    for note in notes:
        print("note:", note)
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
