"""Other engines' file-based KV tiers on a real kvfs mount, as real code in real processes.

- vLLM 0.32's own offloading file tier (OffloadingConnector + TieringOffloadingSpec, secondary tier "fs"):
  a CPU engine refuses the connector (its GPU<->CPU worker is CUDA/XPU-only; the test keeps the error in
  view). Its scheduler side, where the file tier lives, runs on CPU: one process stores real KV blocks
  through vLLM's real TieringOffloadingManager (CPU primary tier in its shared-memory region -> "fs" tier
  -> files in the mount) and a second, fresh process finds and promotes them and compares the bytes. The one
  part replaced is the worker's copy between the GPU and the primary tier: the test writes and reads the
  blocks' bytes in the primary tier's region directly.
- SGLang 0.5.23's HiCache file backend (HiCacheFile): the engine does not install on a CPU host from PyPI
  (docs/engines.md); the storage backend does (tools/install_sglang.sh, its own venv .venv-sglang). One
  process stores pages of real KV, in SGLang's page_first layout, with HiCacheFile.batch_set (what the
  engine's batch_set_v2 calls per page: set(key, flat page)); a second one checks batch_exists and reads
  them back with get, byte for byte.
- LMCache 0.5.6 (multiprocess mode, fs L2 adapter) runs end to end with vLLM in
  tests/test_vllm.py::test_lmcache_fs_backend_in_a_kvfs_directory.

Each test checks that kvfs compressed the files it was given: stored/raw of bf16 KV below 0.75 (measured
0.656 for vLLM's blocks, 0.674 for SGLang's pages), fp16 below 0.9. Needs tools/install_vllm.sh (without
vLLM these tests fail, unless KVFS_TESTS_WITHOUT_VLLM=1 says to skip them) and, for the SGLang test,
tools/install_sglang.sh (without .venv-sglang that test is skipped).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, drop_page_cache, kv_samples

sys.path.insert(0, str(REPO / "tools"))
import vllm_driver

MODEL = Path(os.environ.get("KVFS_TEST_MODEL", REPO / ".venv/opt/models/SmolLM2-135M-Instruct"))
SGLANG_PY = REPO / ".venv-sglang" / "bin" / "python"
SGLANG_ENV = {"PYTHONPATH": str(REPO / "tools")}  # tools/sglang_cpu.py
BLOCK_TOKENS, BLOCK_BYTES = 128, 2949120  # one sample file: a 128-token block of SmolLM2, all 30 layers
BF16_RATIO, FP16_RATIO = 0.75, 0.9        # stored/raw bounds (measured: bf16 0.656-0.674, fp16 0.84-0.86)
CPU_REFUSAL = "CPU Offloading is currently only supported on CUDA-alike and XPU GPUs"

pytestmark = pytest.mark.slow


def _require_vllm() -> None:
    try:
        import vllm  # noqa: F401
    except ImportError:
        if os.environ.get("KVFS_TESTS_WITHOUT_VLLM") == "1":
            pytest.skip("KVFS_TESTS_WITHOUT_VLLM=1")
        pytest.fail("vLLM is missing: run tools/install_vllm.sh")


def run_script(python: Path | str, script: str, args: list[str], log: Path, timeout: float = 180,
               env: dict | None = None) -> dict:
    """Run `script` in a new process (own session, killed with everything it started afterwards); returns the
    JSON object it prints on its last line."""
    path = log.with_suffix(".py")
    path.write_text(script)
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(python), str(path), *args], stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, env={**os.environ, **(env or {})})
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    text = log.read_text(errors="replace")
    last = next((line for line in reversed(text.splitlines()) if line.startswith("{")), "")
    if proc.returncode != 0 or not last:
        pytest.fail(f"{path.name} failed (status {proc.returncode}), log {log}:\n{text[-6000:]}")
    return json.loads(last)


def stored_ratio(files: list[Path]) -> float:
    return (sum(int(os.getxattr(f, "user.kvfs.stored_bytes")) for f in files)
            / sum(f.stat().st_size for f in files))


def check_compressed(files_by_dtype: dict[str, list[Path]]) -> dict[str, float]:
    ratios = {dtype: stored_ratio(files) for dtype, files in files_by_dtype.items() if files}
    for dtype, files in files_by_dtype.items():
        bound = BF16_RATIO if dtype == "bf16" else FP16_RATIO
        for f in files:
            assert os.getxattr(f, "user.kvfs.codec") != b"none", f
            assert int(os.getxattr(f, "user.kvfs.stored_bytes")) < bound * f.stat().st_size, (f, dtype)
    print("stored/raw:", {k: round(v, 3) for k, v in ratios.items()})
    return ratios


# --------------------------------------------------------------------------------------------------------
# vLLM: OffloadingConnector with TieringOffloadingSpec and its "fs" secondary tier

def offloading_connector(root: Path) -> dict:
    """How a vLLM engine points its own file tier at a kvfs mount (the configuration docs/engines.md gives)."""
    return {"kv_connector": "OffloadingConnector",
            "kv_connector_extra_config": {
                "spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 256 << 20, "block_size": 256,
                "secondary_tiers": [{"type": "fs", "root_dir": str(root), "n_read_threads": 2,
                                     "n_write_threads": 2}]}}


def test_vllm_offloading_fs_tier_is_refused_by_a_cpu_engine(kvfs, tmp_path):
    """A real vLLM CPU engine with the OffloadingConnector and its fs tier in the mount: the worker refuses
    it at start (CPUOffloadingSpec.get_worker). When a vLLM release lifts this, this test fails: then run the
    engine end to end here instead."""
    _require_vllm()
    if not (MODEL / "config.json").exists():
        pytest.fail("the test model is missing: run tools/install_vllm.sh")
    job = {"model": str(MODEL), "max_model_len": 1024, "max_num_batched_tokens": 256,
           "connector": offloading_connector(kvfs.path("vllm-fs")),
           "rounds": [{"prompts": [list(range(1, 300))], "max_tokens": 2}], "in_process": True}
    with pytest.raises(vllm_driver.EngineFailed) as failed:
        vllm_driver.spawn(job, tmp_path / "engine.log", timeout=300, env={"PYTHONHASHSEED": "0"})
    assert CPU_REFUSAL in str(failed.value)
    assert not list(Path("/dev/shm").glob("vllm_offload_*.mmap"))


VLLM_FS_TIER = r'''
"""vLLM's TieringOffloadingSpec, scheduler side (CPU primary tier + "fs" secondary tier), on CPU: the blocks'
bytes go into / come out of the primary tier's shared region where the (CUDA-only) worker would copy them."""
import json, os, sys, time
import numpy as np
from vllm.v1.core.kv_cache_utils import hash_block_tokens, init_none_hash
from vllm.utils.hashing import sha256
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key
from vllm.v1.kv_offload.config import (OffloadingCacheConfig, OffloadingConfig, OffloadingGroupConfig,
                                       OffloadingModelConfig, OffloadingParallelConfig)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

mode, root, files = sys.argv[1], sys.argv[2], sys.argv[5:]
block_tokens, block_bytes = int(sys.argv[3]), int(sys.argv[4])
blocks = [open(f, "rb").read() for f in files]
config = OffloadingConfig(  # what OffloadingConnector builds for SmolLM2-135M on one worker (128-token blocks)
    groups=(OffloadingGroupConfig(tokens_per_block=block_tokens, group_id=0,
                                  layer_names=tuple(f"model.layers.{i}.self_attn.attn" for i in range(30))),),
    worker_kv_bytes_per_block=block_bytes, enable_kv_cache_events=False,
    extra_config={"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 8 * block_bytes,
                  "secondary_tiers": [{"type": "fs", "root_dir": root, "n_read_threads": 2, "n_write_threads": 2}]},
    engine_id=f"kvfs-test-{mode}-{os.getpid()}",
    model=OffloadingModelConfig(name="SmolLM2-135M-Instruct", dtype="bfloat16"),
    cache=OffloadingCacheConfig(tokens_per_hash=block_tokens, blocks_per_chunk=1),
    parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                      data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
                                      is_parallelism_agnostic=True))
spec = OffloadingSpecFactory.create_spec(config)
manager = spec.get_manager()  # TieringOffloadingManager: CPU primary tier + FileSystemTierManager
tier = manager.secondary_tiers[0]
init_none_hash(sha256)
keys, parent = [], None
for i in range(len(blocks)):  # vLLM's chained block hashes (sha256) of the blocks' token ids
    parent = hash_block_tokens(sha256, parent, list(range(i * block_tokens, (i + 1) * block_tokens)))
    keys.append(make_offload_key(parent, 0))
view = manager.primary_tier.get_kv_memoryview()
rows = np.frombuffer(view, dtype=np.uint8).reshape(view.shape)
request = ReqContext(req_id="r0")
manager.on_new_request(request)
step = lambda: manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
out = {"o_direct": tier._use_o_direct, "paths": [tier.file_mapper.get_file_name(k) for k in keys],
       "config": tier.file_mapper.get_config_file_path()}
t0 = time.perf_counter()
if mode == "store":
    prepared = manager.prepare_store(keys, request)
    for chunk, data in zip(prepared.store_spec.chunk_ids, blocks):  # the worker's GPU -> CPU copy
        rows[int(chunk), :len(data)] = np.frombuffer(data, dtype=np.uint8)
    manager.complete_store(keys, request)  # cascades every block to the fs tier
    while manager.has_pending_work():
        step()
        time.sleep(0.01)
    step()
else:
    deadline = time.monotonic() + 60
    while True:  # the fs tier looks files up asynchronously (RETRY), then promotes them (HIT_PENDING)
        results = [manager.lookup(k, request) for k in keys]
        out.setdefault("first_lookup", [r.name for r in results])
        if all(r is LookupResult.HIT for r in results):
            break
        assert LookupResult.MISS not in results and time.monotonic() < deadline, results
        step()
        time.sleep(0.01)
    loaded = manager.prepare_load(keys, request)
    out["equal"] = [bytes(rows[int(c), :len(b)]) == b for c, b in zip(loaded.chunk_ids, blocks)]
    out["sources"] = [manager.get_load_source(k, request).name for k in keys]
    manager.complete_load(keys, request)
out["seconds"] = time.perf_counter() - t0
manager.on_request_finished(request)
del rows, view
manager.shutdown()
print(json.dumps(out))
'''


def test_vllm_fs_tier_stores_and_loads_through_kvfs(kvfs, tmp_path):
    """vLLM's own fs tier code (FileSystemTierManager, its C batch I/O, FileMapper) writes real KV blocks into
    the mount from one process; a fresh process finds them, promotes them into its primary tier and gets the
    same bytes; the files read back through the mount are the blocks, compressed by kvfs."""
    _require_vllm()
    samples = kv_samples("bf16") + kv_samples("fp16")
    root = kvfs.path("vllm-fs")
    args = [str(root), str(BLOCK_TOKENS), str(BLOCK_BYTES), *map(str, samples)]
    stored = run_script(sys.executable, VLLM_FS_TIER, ["store", *args], tmp_path / "store.log")
    loaded = run_script(sys.executable, VLLM_FS_TIER, ["load", *args], tmp_path / "load.log")
    assert stored["paths"] == loaded["paths"]  # same names across processes (fixed NONE_HASH seed)
    assert loaded["equal"] == [True] * len(samples)
    assert loaded["sources"] == ["DISK"] * len(samples) and "RETRY" in loaded["first_lookup"]
    files = [Path(p) for p in stored["paths"]]
    assert all(f.parent.parent.parent.parent == root for f in files)  # <root>/<model>_<digest>_r0/hhh/hh_g0/
    assert Path(stored["config"]).is_file()
    assert sorted(p for p in root.rglob("*.bin")) == sorted(files)  # no temporary files left behind
    for f, sample in zip(files, samples):
        assert f.read_bytes() == sample.read_bytes()
    check_compressed({"bf16": [f for f, s in zip(files, samples) if s.name.startswith("bf16")],
                      "fp16": [f for f, s in zip(files, samples) if s.name.startswith("fp16")]})
    assert kvfs.stats()["tiers"]["L2"]["hits"] >= len(samples)
    assert not list(Path("/dev/shm").glob("vllm_offload_kvfs-test-*"))


# --------------------------------------------------------------------------------------------------------
# SGLang: HiCache's file storage backend

def sglang_pages(samples: list[Path], page_size: int = 64) -> dict[str, np.ndarray]:
    """Real KV blocks (vLLM CPU block order) rearranged into SGLang's host pages, page_first layout:
    [k/v][token][layer][head][head_dim] per page of `page_size` tokens (MHATokenToKVPoolHost.get_data_page)."""
    pages = {}
    for sample in samples:
        a = np.fromfile(sample, dtype="<u2").reshape(30, 3, 2, 8192)
        k = a[:, :, 0].reshape(30, 3, 64, BLOCK_TOKENS).transpose(0, 1, 3, 2)  # [layer][head][token][dim]
        v = a[:, :, 1].reshape(30, 3, BLOCK_TOKENS, 64)
        kv = np.stack([k, v]).transpose(0, 3, 1, 2, 4)                        # [k/v][token][layer][head][dim]
        for p in range(BLOCK_TOKENS // page_size):
            pages[f"{sample.stem}-p{p}"] = np.ascontiguousarray(kv[:, p * page_size:(p + 1) * page_size]).ravel()
    return pages


SGLANG_HICACHE = r'''
"""SGLang's HiCacheFile on CPU: set/exists/get of KV pages (flat page tensors, as HiCache's page I/O passes)."""
import hashlib, json, os, sys, time

from sglang_cpu import stub_triton  # tools/, on PYTHONPATH

stub_triton()
import numpy as np, torch
from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig

mode, pages_file = sys.argv[1], sys.argv[2]
extra = json.loads(sys.argv[3]) if len(sys.argv) > 3 else None
pages = np.load(pages_file)
names = sorted(pages.files)
dtype = lambda name: torch.bfloat16 if name.startswith("bf16") else torch.float16
config = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                              is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                              model_name="HuggingFaceTB/SmolLM2-135M-Instruct", extra_config=extra)
store = HiCacheFile(config)
keys, prior = [], b""
for name in names:  # SHA-256-chained page keys, like HiCache's (its native hash needs a JIT-built extension)
    prior = hashlib.sha256(prior + name.encode()).digest()
    keys.append(prior.hex())
absent = hashlib.sha256(b"never stored").hexdigest()
out = {"dir": store.file_path, "suffix": store.config_suffix}
t0 = time.perf_counter()
if mode == "set":
    out["exists_before"] = store.batch_exists(keys)
    out["batch_set"] = store.batch_set(keys, [torch.from_numpy(pages[n].copy()).view(dtype(n)) for n in names])
    out["exists"] = [store.exists(k) for k in keys]
else:
    out["batch_exists"] = store.batch_exists(keys + [absent])
    out["batch_exists_v2"] = store.batch_exists_v2(keys + [absent]).kv_hit_pages
    out["equal"] = []
    for name, key in zip(names, keys):
        target = torch.empty(pages[name].size, dtype=dtype(name))
        got = store.get(key, target)
        out["equal"].append(got is not None and got.view(torch.uint16).numpy().tobytes() == pages[name].tobytes())
    out["absent"] = store.get(absent, torch.empty(64, dtype=torch.bfloat16)) is None and not store.exists(absent)
out["seconds"] = time.perf_counter() - t0
print(json.dumps(out))
'''


def test_sglang_hicache_file_backend_through_kvfs(kvfs, tmp_path):
    """SGLang's HiCacheFile stores pages of real KV in the mount (directory from
    SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR) from one process; another one (directory from the backend's
    extra_config "file_storage_path") finds them and reads them back byte for byte; kvfs compressed them."""
    if not SGLANG_PY.exists():
        pytest.skip("SGLang's HiCache backend is not installed: run tools/install_sglang.sh (.venv-sglang)")
    samples = kv_samples("bf16") + kv_samples("fp16")
    pages = sglang_pages(samples)
    np.savez(tmp_path / "pages.npz", **pages)
    root = kvfs.path("sglang-hicache")
    stored = run_script(SGLANG_PY, SGLANG_HICACHE, ["set", str(tmp_path / "pages.npz")], tmp_path / "set.log",
                        env={"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(root), **SGLANG_ENV})
    loaded = run_script(SGLANG_PY, SGLANG_HICACHE,
                        ["get", str(tmp_path / "pages.npz"), json.dumps({"file_storage_path": str(root)})],
                        tmp_path / "get.log", env={"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": "", **SGLANG_ENV})
    assert stored["dir"] == loaded["dir"] == str(root)
    assert stored["exists_before"] == 0 and stored["batch_set"] and all(stored["exists"])
    assert loaded["batch_exists"] == loaded["batch_exists_v2"] == len(pages)  # the prefix, not the absent key
    assert loaded["equal"] == [True] * len(pages) and loaded["absent"]
    files = sorted(root.iterdir())
    assert len(files) == len(pages) and all(f.name.endswith(stored["suffix"] + ".bin") for f in files)  # no .tmp
    page_bytes = next(iter(pages.values())).nbytes
    assert all(f.stat().st_size == page_bytes for f in files)
    by_name = {f.name: f for f in files}
    keys = _chained_keys(sorted(pages))
    files_of = {name: by_name[key + stored["suffix"] + ".bin"] for name, key in zip(sorted(pages), keys)}
    for name, f in files_of.items():
        drop_page_cache(f)  # SGLang's loads were served from the pages its stores left (kvfs/pagecache.py)
        assert f.read_bytes() == pages[name].tobytes()  # now from the objects kvfs stored
    check_compressed({"bf16": [f for n, f in files_of.items() if n.startswith("bf16")],
                      "fp16": [f for n, f in files_of.items() if n.startswith("fp16")]})
    assert kvfs.stats()["tiers"]["L2"]["hits"] >= len(pages)


def _chained_keys(names: list[str]) -> list[str]:
    """The page keys the SGLANG_HICACHE script uses (SHA-256 chain over the page names)."""
    keys, prior = [], b""
    for name in names:
        prior = hashlib.sha256(prior + name.encode()).digest()
        keys.append(prior.hex())
    return keys
