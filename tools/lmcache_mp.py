#!/usr/bin/env python3
"""LMCache 0.5.6 in multiprocess (MP) mode on CPU: start/stop an `lmcache server` whose L2 is its `fs` adapter
on a directory, and the KVTransferConfig that points vLLM 0.32's LMCacheMPConnector at it.

Install: `KVFS_WITH_LMCACHE=1 tools/install_vllm.sh` (lmcache==0.5.6 --no-deps, plus sortedcontainers, aiofile,
caio, aiofiles). Facts: ../shared/notes/vllm-cpu.md.

Usage as a module (the benchmark):

    from tools.lmcache_mp import start_server, stop_server      # or importlib from the file
    proc, connector = start_server("/var/tmp/l2", chunk_size=256)
    job = {"model": ..., "connector": connector, "rounds": [...]}   # tools/vllm_driver.py job
    ...
    stop_server(proc)

CLI:  tools/lmcache_mp.py serve --l2-dir DIR     (runs a server, prints the connector JSON, Ctrl-C stops it)
      tools/lmcache_mp.py [selfcheck]            (two vLLM runs with a server restart between them; see below)

What the server is (read from lmcache 0.5.6 in site-packages; everything is a CLI flag, no YAML/env config):
- `lmcache server` = lmcache/cli/commands/server.py -> lmcache.v1.multiprocess.http_server.run_http_server:
  a FastAPI/uvicorn HTTP admin API (--http-host/--http-port, default 127.0.0.1:8080; GET /healthcheck answers
  200 once the cache engine exists, GET /status reports L1/L2 state) that starts the ZMQ request server the
  connector talks to (--host/--port, default localhost:5555) in its lifespan hook. Flags come from
  lmcache/v1/multiprocess/config.py (add_mp_server_args: --chunk-size, default 256) and
  lmcache/v1/distributed/config.py (add_storage_manager_args / parse_args_to_config).
- L1 (server CPU memory): legacy flags `--l1-size-gb G --eviction-policy LRU` (both required unless
  `--l1-manager JSON` is used). On CPU the lazy allocator is switched off ("requires memory pinning"), so the
  whole G is allocated at start: keep it small. `--l2-store-policy skip_l1` (BufferOnlyStorePolicy in
  lmcache/v1/distributed/storage_controllers/store_policy.py) deletes every key from L1 as soon as it is
  stored to all L2 adapters, so L1 is only a staging buffer and lookups/loads of stored chunks go to L2
  (the prefetch controller loads L2 -> L1 -> engine). A size of 0 is not accepted in practice: L1 must hold
  the chunks being staged (one 256-token chunk of SmolLM2-135M = 256 x 23,040 B = 5.9 MB).
- L2 fs adapter: `--l2-adapter '{"type": "fs", "base_path": DIR}'` (FSL2AdapterConfig in
  lmcache/v1/distributed/l2_adapters/fs_l2_adapter.py; optional keys relative_tmp_dir, read_ahead_size,
  use_odirect). One raw file per chunk, no header:
  `<model with "/" -> "-SEP-">@0x<kv_rank, 8 hex>@<object group hex>@<chunk hash hex>[@<cache salt>].data`.
  Lookups test the file's existence on disk (aiofiles.os.path.exists), so a restarted server finds chunks
  written by an earlier one: no index to rebuild. Only full chunks are stored and hit: a 1000-token prompt
  gets 768 cached tokens with chunk 256 (three 5,898,240-byte files for SmolLM2-135M, bf16). Chunk hashes
  (blake3, fixed seed) are the same across server and vLLM restarts.
- Transfer mode (the data path between vLLM's worker and the server): on CPU the connector's worker adapter
  (lmcache.mp.mp_transfer_mode "auto", lmcache/v1/multiprocess/transfer_context/worker_transfer.py) picks
  "engine_driven" because the CPU device spec has no lmcache-driven (IPC handle) path, while the server's
  default is `--supported-transfer-mode lmcache_driven`. With that default the server logs "No handler
  registered for operation register_kv_cache_engine_driven_context" and vLLM hangs in register_kv_caches
  until lmcache.mp.mq_timeout (300 s). So: `--supported-transfer-mode engine_driven`, plus `--shm-name NAME`
  so that the L1 pool (sized by --l1-size-gb) is a POSIX shared-memory segment (/dev/shm/NAME) that the
  worker copies KV into and out of ("Using shm non-GPU transfer strategy" in the server log); without a name
  (default "") KV bytes are pickled over ZMQ. stop_server() unlinks a segment a killed server leaves behind.
- `--disable-metrics` is required here: with metrics on, the server imports opentelemetry.exporter.prometheus,
  which the --no-deps install does not bring ("ModuleNotFoundError: No module named
  'opentelemetry.exporter.prometheus'", application startup failed). It also avoids the Prometheus port 9090.
- LMCACHE_TRACK_USAGE=false / DO_NOT_TRACK=1 turn off LMCache's usage telemetry (lmcache/usage_telemetry,
  which otherwise posts to stats.lmcache.ai); LMCACHE_DISABLE_BANNER=1 drops the banner.

The connector: vLLM's kv_connector "LMCacheMPConnector" is registered in vLLM's connector factory (no module
path needed); vllm/distributed/kv_transfer/kv_connector/v1/lmcache_mp_connector.py prefers the class shipped by
lmcache (lmcache.integration.vllm.lmcache_mp_connector) when importable. Its extra config keys:
"lmcache.mp.host" (a ZMQ URL prefix, default "tcp://localhost") and "lmcache.mp.port" (default 5555); also
lmcache.mp.mq_timeout, lmcache.mp.heartbeat_interval. Its chunk size comes from the server.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vllm_driver

HOST = "127.0.0.1"
SERVER_ENV = {"LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1", "LMCACHE_DISABLE_BANNER": "1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _log_tail(path: str, n: int = 40) -> str:
    try:
        lines = Path(path).read_text(errors="replace").splitlines()
    except OSError as e:
        return f"(no log: {e})"
    return "\n".join(lines[-n:])


def _http_json(url: str, timeout: float = 2.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def server_status(proc: subprocess.Popen) -> dict:
    """The server's GET /status (L1 object count and bytes, L2 adapters, store/prefetch controllers)."""
    return _http_json(f"http://{HOST}:{proc.http_port}/status")  # type: ignore[attr-defined]


def start_server(l2_dir: str, chunk_size: int = 256, l1_gib: float = 0.25, port: int | None = None, *,
                 skip_l1: bool = True, http_port: int | None = None, log_path: str | None = None,
                 timeout_s: float = 120.0, extra_args: list[str] | None = None
                 ) -> tuple[subprocess.Popen, dict]:
    """Start `lmcache server` (MP mode) with its fs L2 adapter on l2_dir; wait until it answers.

    l1_gib: L1 (server DRAM) size, allocated up front on CPU. skip_l1=True (`--l2-store-policy skip_l1`)
    drops each chunk from L1 once it is on L2, so that hits are served from the fs directory.
    Returns (process, connector) where connector goes into vLLM's KVTransferConfig(kv_role="kv_both",
    **connector). The process has attributes port, http_port, log_path, l2_dir, shm_name.
    """
    l2 = Path(l2_dir).resolve()
    l2.mkdir(parents=True, exist_ok=True)
    port = port or _free_port()
    http_port = http_port or _free_port()
    shm_name = f"lmcache_l1_pool_kvfs_{port}"  # LMCache prefixes names lacking "lmcache_l1_pool_" with it
    if log_path is None:
        fd, log_path = tempfile.mkstemp(prefix="lmcache_server_", suffix=".log")
        os.close(fd)
    cmd = [sys.executable, "-m", "lmcache.cli.main", "server",
           "--host", HOST, "--port", str(port), "--http-host", HOST, "--http-port", str(http_port),
           "--chunk-size", str(chunk_size),
           "--supported-transfer-mode", "engine_driven", "--shm-name", shm_name,
           "--l1-size-gb", repr(float(l1_gib)), "--eviction-policy", "LRU",
           "--l2-store-policy", "skip_l1" if skip_l1 else "default",
           "--l2-adapter", json.dumps({"type": "fs", "base_path": str(l2)}),
           "--disable-metrics", *(extra_args or [])]
    env = {**os.environ, **SERVER_ENV}
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    attrs = {"port": port, "http_port": http_port, "log_path": log_path, "l2_dir": str(l2), "shm_name": shm_name}
    for k, v in attrs.items():
        setattr(proc, k, v)
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            stop_server(proc)
            raise RuntimeError(f"lmcache server exited with status {proc.returncode} during start "
                               f"(log {log_path}):\n{_log_tail(log_path)}")
        try:
            if _http_json(f"http://{HOST}:{http_port}/healthcheck", timeout=1.0).get("status") == "healthy":
                break
        except (OSError, ValueError, urllib.error.URLError):
            pass
        if time.monotonic() > deadline:
            stop_server(proc)
            raise TimeoutError(f"lmcache server not healthy after {timeout_s:.0f} s (log {log_path}):\n"
                               f"{_log_tail(log_path)}")
        time.sleep(0.25)
    connector = {"kv_connector": "LMCacheMPConnector",
                 "kv_connector_extra_config": {"lmcache.mp.host": f"tcp://{HOST}", "lmcache.mp.port": port}}
    return proc, connector


def wait_stores_settled(proc: subprocess.Popen, timeout_s: float = 30.0) -> dict:
    """Poll /status until the store controller has no pending keys or in-flight L2 stores; return status."""
    deadline = time.monotonic() + timeout_s
    while True:
        st = server_status(proc)
        sc = st["storage_manager"]["store_controller"]
        if sc["pending_keys_count"] == 0 and sc["in_flight_task_count"] == 0:
            return st
        if time.monotonic() > deadline:
            raise TimeoutError(f"L2 stores still pending after {timeout_s} s: {sc}")
        time.sleep(0.2)


def stop_server(proc: subprocess.Popen, timeout_s: float = 15.0) -> None:
    """SIGTERM the server's process group, wait, SIGKILL the group if it is still there."""
    try:
        pgid = os.getpgid(proc.pid)
    except ProcessLookupError:
        pgid = proc.pid  # already reaped or gone; start_new_session made pid the group id
    for sig, wait in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
        # leader gone; make sure nothing else of the group survives
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            break
    proc.wait(timeout=5)
    shm = Path("/dev/shm", getattr(proc, "shm_name", "") or "-")
    if shm.name != "-" and shm.exists():  # left behind when the server had to be killed
        shm.unlink(missing_ok=True)


# ---------------------------------------------------------------- self-check

REPO = Path(__file__).resolve().parent.parent
MODEL = REPO / ".venv/opt/models/SmolLM2-135M-Instruct"
VLLM_ENV = {"VLLM_HOST_IP": "127.0.0.1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
            "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "VLLM_NO_USAGE_STATS": "1", **SERVER_ENV}


def _l2_files(l2_dir: str) -> list[tuple[str, int]]:
    return sorted((str(p.relative_to(l2_dir)), p.stat().st_size) for p in Path(l2_dir).rglob("*") if p.is_file())


def selfcheck(prompt_tokens: int = 1000, max_tokens: int = 16, chunk_size: int = 256, l1_gib: float = 0.25,
              keep: bool = False) -> int:
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(MODEL))
    ids = tok(Path("/usr/share/common-licenses/GPL-3").read_text())["input_ids"][:prompt_tokens]
    work = Path(tempfile.mkdtemp(prefix="lmcache_mp_check_"))
    l2_dir = str(work / "l2")
    print(f"work dir {work}; prompt {len(ids)} tokens; chunk {chunk_size}; L1 {l1_gib} GiB, skip_l1")
    results = []
    for run in (1, 2):
        proc, connector = start_server(l2_dir, chunk_size=chunk_size, l1_gib=l1_gib,
                                       log_path=str(work / f"server{run}.log"))
        try:
            st = server_status(proc)["storage_manager"]["l1_manager"]
            print(f"run {run}: server pid {proc.pid} port {proc.port}; L1 at start: "
                  f"{st['total_object_count']} objects, {st['memory_used_bytes']} B used; "
                  f"L2 dir: {len(_l2_files(l2_dir))} files")
            job = {"model": str(MODEL), "connector": connector, "max_model_len": 2048,
                   "rounds": [{"prompts": [ids], "max_tokens": max_tokens}]}
            t0 = time.perf_counter()
            r = vllm_driver.spawn(job, work / f"vllm{run}.log", 330, env=VLLM_ENV)["rounds"][0][0]
            st = wait_stores_settled(proc)["storage_manager"]["l1_manager"]
            print(f"run {run}: {time.perf_counter() - t0:.1f} s, num_cached_tokens {r['num_cached_tokens']}, "
                  f"ttft {r['ttft_s']:.3f} s, tokens {r['tokens']}; L1 after: {st['total_object_count']} "
                  f"objects, {st['memory_used_bytes']} B")
            results.append(r)
        finally:
            stop_server(proc)
    files = _l2_files(l2_dir)
    print(f"L2 files under {l2_dir}:")
    for name, size in files:
        print(f"  {size:>10}  {name}")
    hit = results[1]["num_cached_tokens"] > 0
    same = results[0]["tokens"] == results[1]["tokens"]
    summary = {"run1_cached": results[0]["num_cached_tokens"], "run2_cached": results[1]["num_cached_tokens"],
               "run2_hit": hit, "identical_tokens": same, "l2_files": len(files),
               "l2_bytes": sum(s for _, s in files), "ttft_s": [r["ttft_s"] for r in results]}
    print(json.dumps(summary))
    if not keep:
        import shutil
        shutil.rmtree(work, ignore_errors=True)
    return 0 if hit and same and files else 1


def main() -> int:
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd")
    s = sub.add_parser("serve", help="run a server until interrupted; print the connector JSON")
    s.add_argument("--l2-dir", required=True)
    c = sub.add_parser("selfcheck", help="two vLLM runs, server restarted with an empty L1 in between")
    c.add_argument("--prompt-tokens", type=int, default=1000)
    c.add_argument("--keep", action="store_true", help="keep the temp dir (logs, L2 files)")
    for p in (s, c):
        p.add_argument("--chunk-size", type=int, default=256)
        p.add_argument("--l1-gib", type=float, default=0.25)
    s.add_argument("--port", type=int)
    args = ap.parse_args()
    if args.cmd == "serve":
        proc, connector = start_server(args.l2_dir, args.chunk_size, args.l1_gib, args.port)
        print(json.dumps(connector), flush=True)
        print(f"log: {proc.log_path}", file=sys.stderr)  # type: ignore[attr-defined]
        try:
            proc.wait()
        except KeyboardInterrupt:
            pass
        finally:
            stop_server(proc)
        return 0
    if args.cmd == "selfcheck":
        return selfcheck(args.prompt_tokens, chunk_size=args.chunk_size, l1_gib=args.l1_gib, keep=args.keep)
    return selfcheck()


if __name__ == "__main__":
    sys.exit(main())
