"""The connector in real vLLM engines (CPU, SmolLM2-135M, bf16 — or float32 on CPUs without bf16 instructions,
see vllm_driver.engine_dtype) on real kvfs mounts.

Every engine runs in its own process (tools/vllm_driver.py), like separate production engines: a hit in a
"fresh engine" can only have come through the filesystem. vLLM's own prefix cache is off, so
num_cached_tokens counts the connector's hits. Outputs are greedy and compared token for token with an
engine that has no connector.

Exact comparison needs the same arithmetic: in bf16, a GEMM over 220 rows and one over 1500 rows round
differently, and this small model has near-ties that flip on such noise (seen: the same prompt alone or
batched with two others gives different tokens, with no connector at all). So the comparing engines prefill
in steps of one chunk (max_num_batched_tokens = 256) and run one request at a time: an engine that loads
chunks 0-4 then computes tokens 1280-1499 in one step, exactly like the engine that computed everything.
Any wrong byte, block or layer in a load changes the arithmetic and shows. The block-reuse test batches on
purpose and compares the stored KV itself, with a tolerance. Needs tools/install_vllm.sh (CI runs it); without vLLM these tests fail,
unless KVFS_TESTS_WITHOUT_VLLM=1 says to skip them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import FUSERMOUNT, REPO, KvfsMount, drop_page_cache
from test_tiers import wait_for

sys.path.insert(0, str(REPO / "tools"))
import vllm_driver

MODEL = Path(os.environ.get("KVFS_TEST_MODEL", REPO / ".venv/opt/models/SmolLM2-135M-Instruct"))
TEXTS = ["/usr/share/common-licenses/GPL-3", "/usr/share/common-licenses/Apache-2.0",
         "/usr/share/common-licenses/GPL-2", "/usr/share/common-licenses/LGPL-2.1",
         "/usr/share/common-licenses/MPL-2.0", "/usr/share/common-licenses/Artistic"]
BLOCK, CHUNK = 128, 256
DTYPE = vllm_driver.engine_dtype()
ELEMENT = {"bfloat16": 2, "float32": 4}[DTYPE]
BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * ELEMENT  # all layers' K and V
DTYPE_XATTR = {"bfloat16": b"bf16", "float32": b"fp32"}[DTYPE]
# stored/raw a compressed chunk stays under: bf16 byte planes compress to ~0.67; float32 KV, whose low
# mantissa bytes are noise, to ~0.92 (issue 6 adds 4-byte planes)
COMPRESSED = {"bfloat16": 0.75, "float32": 0.95}[DTYPE]

pytestmark = pytest.mark.slow


def expected_shape_hint() -> bytes:
    """The layout hint of a chunk: channel-major K/V where vLLM's CPU kernels keep the portable block order,
    the engine's block bytes as they are where they pack blocks for AMX (bf16 on Sapphire Rapids and later)."""
    import torch
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(getattr(torch, DTYPE), BLOCK, 64, "auto")
    if isa == "vec":
        return b"offset=4096 layer=30 kv=2 head=3 channel=64 token=256"
    assert isa == "amx", isa
    return b"offset=4096 layer=30 block=2 element=%d" % (3 * BLOCK * 2 * 64)


def _require_vllm() -> None:
    try:
        import vllm  # noqa: F401
        ok = (MODEL / "config.json").exists()
    except ImportError:
        ok = False
    if not ok:
        if os.environ.get("KVFS_TESTS_WITHOUT_VLLM") == "1":
            pytest.skip("KVFS_TESTS_WITHOUT_VLLM=1")
        pytest.fail("vLLM or the test model is missing: run tools/install_vllm.sh")


@pytest.fixture(scope="module")
def tokens():
    _require_vllm()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MODEL)
    return [tok(Path(t).read_text(errors="replace"))["input_ids"] for t in TEXTS]


def connector(mount: Path, **extra) -> dict:
    return {"kv_connector": "KVFSConnector", "kv_connector_module_path": "kvfs_connector",
            "kv_connector_extra_config": {"mount": str(mount), **extra}}


def run_engine(tmp: Path, rounds: list[dict], conn: dict | None, timeout: float = 420, in_process: bool = True,
               **job) -> dict:
    """One engine process over `rounds`; returns the driver's result plus the engine's log text. in_process:
    the engine core and its worker in that one process (half the start-up time, the same arithmetic); the
    `stored` fixture and the fresh engine that loads from it keep vLLM's production layout instead, a
    scheduler process and a worker process, each with its half of the connector."""
    job = {"model": str(MODEL), "connector": conn, "rounds": rounds, "max_model_len": 4096, "dtype": DTYPE,
           "max_num_batched_tokens": CHUNK, "in_process": in_process, **job}
    tmp.mkdir(parents=True, exist_ok=True)
    logfile = tmp / f"engine-{len(list(tmp.glob('engine-*.log')))}.log"
    try:
        result = vllm_driver.spawn(job, logfile, timeout, env={"PYTHONHASHSEED": "0"})
    except vllm_driver.EngineFailed as e:
        pytest.fail(str(e))
    text = result["log"]
    errors = [line for line in text.splitlines() if "kvfs_connector" in line and " ERROR " in line]
    assert not errors, errors
    return result


def outputs(result: dict, rnd: int = 0) -> list[list[int]]:
    return [r["tokens"] for r in result["rounds"][rnd]]


def cached(result: dict, rnd: int = 0) -> list[int]:
    return [r["num_cached_tokens"] for r in result["rounds"][rnd]]


def chunk_files(mount: Path) -> list[Path]:
    return sorted(p for p in mount.glob("*/*/*.kv"))


def expected_hit(prompt_len: int, stored_tokens: int) -> int:
    """What a fresh engine should load: the stored chunks inside the prompt, never the last prompt token."""
    return min(stored_tokens // CHUNK * CHUNK, prompt_len // CHUNK * CHUNK, prompt_len - 1)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("vllm")


@pytest.fixture(scope="module")
def prompts(tokens):
    return [tokens[0][:1000], tokens[1][:1500], tokens[2][:700]]


ROUND = {"max_tokens": 16, "concurrency": 1}


@pytest.fixture(scope="module")
def baseline(workdir, prompts, tokens):
    """No connector: the reference tokens for every prompt the tests use (one engine). Its own prefix cache
    is on, for the conversation: turn 2 then reuses turn 1's blocks, prompt and answer, in memory — what
    the connector must match from files in a fresh engine."""
    rounds = [{"prompts": prompts, **ROUND},
              {"prompts": [tokens[3][:600]], "max_tokens": 300},
              {"prompts": [{"extend": [1, 0], "extra": tokens[4][:100]}], "max_tokens": 16}]
    result = run_engine(workdir / "baseline", rounds, None, prefix_caching=True)
    assert cached(result, 0) == [0, 0, 0] and cached(result, 2) == [896]
    return result


@pytest.fixture(scope="module")
def stored(workdir, prompts, baseline):
    """A kvfs mount that engine 1 has filled (module scope: later tests reuse what it stored). Both publish
    KV events, vLLM's own prefix cache and kvfs's mount: result["events"] has what one subscriber got."""
    from kv_events import EventCollector  # imports vLLM

    m = KvfsMount(workdir, "shared")
    kvfs_events, vllm_events = f"ipc://{workdir}/kvfs.events", f"ipc://{workdir}/vllm.events"
    m.start("--promote", "never", "--events", kvfs_events)
    with EventCollector([kvfs_events, vllm_events]) as collector:
        result = run_engine(workdir / "e1", [{"prompts": prompts, **ROUND}],
                            connector(m.mountpoint), prefix_caching=True, kv_events_endpoint=vllm_events,
                            in_process=False)
        chunks = len(chunk_files(m.mountpoint))
        wait_for(lambda: len(collector.events(kvfs_events)) > chunks, what="kvfs's events for every chunk")
    result["events"] = {"kvfs": collector.events(kvfs_events), "vllm": collector.events(vllm_events)}
    yield m, result
    if m.proc is not None:
        assert m.stop() == 0
    assert not m.unexpected_log_lines(), m.unexpected_log_lines()


def test_fresh_engine_loads_what_another_stored(stored, baseline, prompts, workdir):
    m, first = stored
    assert outputs(first) == outputs(baseline)
    assert cached(first) == [0, 0, 0]
    files = chunk_files(m.mountpoint)
    # every full chunk of prompt + output (16 tokens) was stored, none twice
    assert len(files) == sum((len(p) + 15) // CHUNK for p in prompts)
    f = files[0]
    assert os.getxattr(f, "user.kvfs.dtype") == DTYPE_XATTR
    assert os.getxattr(f, "user.kvfs.shape") == expected_shape_hint()
    assert f.stat().st_size == 4096 + 256 * BYTES_PER_TOKEN
    assert f.parent.name == f.name[:2] and f.parent.parent.name.startswith("SmolLM2-135M-Instruct-")
    assert int(os.getxattr(f, "user.kvfs.stored_bytes")) < COMPRESSED * f.stat().st_size
    s = m.stats()  # saved past FUSE: encoded in the engine's worker, adopted by the daemon
    assert s["direct_writes"] == len(files) and s["commits"] == 0, s

    second = run_engine(workdir / "e2", [{"prompts": prompts, **ROUND}],
                        connector(m.mountpoint), in_process=False)
    assert outputs(second) == outputs(baseline)
    assert cached(second) == [expected_hit(len(p), len(p) + 15) for p in prompts]
    assert all(c > 0 for c in cached(second))
    assert m.stats()["tiers"]["L2"]["hits"] >= len(files) - 1


def test_kvfs_announces_the_blocks_vllm_announced(stored):
    """A router that follows vLLM's KV events finds kvfs's chunks under the same block hashes, with the same
    tokens: every block kvfs announces in L2, vLLM announced (medium GPU) for the same tokens."""
    from vllm.distributed.kv_events import AllBlocksCleared, BlockStored

    m, first = stored
    kvfs_events, vllm_events = first["events"]["kvfs"], first["events"]["vllm"]
    vllm_tokens = {}
    for ev in vllm_events:
        if isinstance(ev, BlockStored):
            for i, h in enumerate(ev.block_hashes):
                vllm_tokens[h] = ev.token_ids[i * ev.block_size:(i + 1) * ev.block_size]
    assert vllm_tokens and {ev.medium for ev in vllm_events if isinstance(ev, BlockStored)} == {"GPU"}
    assert isinstance(kvfs_events[0], AllBlocksCleared)
    stored_events = kvfs_events[1:]
    assert all(isinstance(ev, BlockStored) and ev.medium == "L2" for ev in stored_events)
    assert len(stored_events) == len(chunk_files(m.mountpoint))  # one per chunk file: rank 0's
    for ev in stored_events:
        assert len(ev.block_hashes) == CHUNK // ev.block_size
        for i, h in enumerate(ev.block_hashes):
            assert vllm_tokens.get(h) == ev.token_ids[i * ev.block_size:(i + 1) * ev.block_size]
    # the chunk files are named by the last block's hash: the events name the same blocks (in vLLM's external
    # form: its low 64 bits as an int by default, VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)
    external = {p.stem[-16:] if isinstance(stored_events[0].block_hashes[-1], int) else p.stem
                for p in chunk_files(m.mountpoint)}
    assert {h.hex() if isinstance(h, bytes) else f"{h:016x}" for h in (ev.block_hashes[-1] for ev in stored_events)
            } == external


def test_restarted_daemon_and_data_only_in_l3(stored, baseline, prompts, workdir):
    m, _ = stored
    names = chunk_files(m.mountpoint)
    m.stop()
    m.start("--promote", "never", "--l2", f"{m.l2}:1M")  # L2 too small for any chunk: the mover drains it
    deadline = time.monotonic() + 60
    while any(os.getxattr(f, "user.kvfs.tier") != b"L3" for f in names):
        assert time.monotonic() < deadline, [os.getxattr(f, "user.kvfs.tier") for f in names]
        time.sleep(0.2)
    assert chunk_files(m.mountpoint) == names
    result = run_engine(workdir / "e3", [{"prompts": prompts, **ROUND}],
                        connector(m.mountpoint))
    assert outputs(result) == outputs(baseline)
    assert cached(result) == [expected_hit(len(p), len(p) + 15) for p in prompts]
    st = m.stats()["tiers"]
    assert st["L3"]["hits"] >= len(names) - 1 and st["L2"]["files"] == 0


def test_flipped_byte_in_a_backing_object_is_recomputed(stored, baseline, prompts, workdir):
    m, _ = stored
    m.expect_log(r"corrupt object for inode")
    victim = chunk_files(m.mountpoint)[0]
    ino = os.stat(victim).st_ino
    m.stop()
    (obj,) = [p for p in m.objects() if p.name.startswith(f"{ino:x}-")]
    raw = bytearray(obj.read_bytes())
    raw[len(raw) // 2] ^= 0x04
    obj.write_bytes(bytes(raw))
    m.start("--promote", "never")
    result = run_engine(workdir / "e4", [{"prompts": prompts, **ROUND}],
                        connector(m.mountpoint))
    assert outputs(result) == outputs(baseline)  # the damaged chunk was recomputed, never used
    assert "unusable" in result["log"] and "vLLM recomputes" in result["log"]
    assert m.stats()["checksum_failures"] >= 1
    assert not victim.exists()  # kvfs dropped it: a miss from now on


def test_second_turn_hits_the_chunks_saved_while_decoding(make_mount, baseline, tokens, workdir):
    """Chunks of one block (128 tokens), so the hit matches the baseline's in-memory prefix cache exactly."""
    m = make_mount().start()
    turn1 = [{"prompts": [tokens[3][:600]], "max_tokens": 300}]
    first = run_engine(workdir / "t1", turn1, connector(m.mountpoint, chunk_size=BLOCK))
    assert outputs(first) == outputs(baseline, 1)
    # 600 prompt + 300 generated tokens (the last one has no KV yet): 7 chunks, the last 2 all answer
    assert len(chunk_files(m.mountpoint)) == 7
    turn2 = {"prompts": [first["rounds"][0][0]["prompt"] + outputs(first)[0] + tokens[4][:100]], "max_tokens": 16}
    second = run_engine(workdir / "t2", [turn2], connector(m.mountpoint, chunk_size=BLOCK))
    assert cached(second) == [896]  # 1000-token prompt: blocks 0-6, three of them from the first answer
    assert outputs(second) == outputs(baseline, 2)


def test_blocks_reused_while_saving_store_each_requests_own_kv(make_mount, tokens, workdir):
    """A KV cache of 28 blocks for 4 concurrent requests of ~1100 tokens (36 blocks): vLLM preempts and reuses
    blocks all the time. Every chunk file must hold the KV of the tokens its name and digest say."""
    small, ref = make_mount("small").start(), make_mount("ref").start()
    prompts = [t[:1100] for t in tokens[:4]]
    run_engine(workdir / "small", [{"prompts": prompts, "max_tokens": 40, "concurrency": 4}],
               connector(small.mountpoint), num_gpu_blocks_override=28, max_num_batched_tokens=2048,
               max_model_len=2048)
    run_engine(workdir / "ref", [{"prompts": prompts, "max_tokens": 40, "concurrency": 1}],
               connector(ref.mountpoint), max_num_batched_tokens=2048, max_model_len=2048)
    got, want = chunk_files(small.mountpoint), chunk_files(ref.mountpoint)
    names = [p.name for p in want]
    assert len(want) == 4 * (1140 // CHUNK)
    assert sorted(p.name for p in got) == sorted(names)

    def kv(p: Path) -> np.ndarray:
        raw = p.read_bytes()[4096:]
        if DTYPE == "float32":
            return np.frombuffer(raw, dtype=np.float32).astype(np.float64)
        return np.frombuffer(raw, dtype=np.uint16).astype(np.uint32).__lshift__(16).view(np.float32).astype(np.float64)

    by_name = {p.name: p for p in got}
    for r in want:
        a, b = kv(by_name[r.name]), kv(r)
        assert np.linalg.norm(a - b) <= 0.02 * np.linalg.norm(b), r.name  # same tokens: rounding at most
    # the check can tell: the same chunk position of two other requests differs by far more
    a, b = kv(want[0]), kv(want[-1])
    assert np.linalg.norm(a - b) > 0.2 * np.linalg.norm(b)


def test_tenants_with_different_cache_salts_share_no_chunk(make_mount, tokens, workdir):
    """Tenant isolation: the same prompts with another cache_salt get no hit from what a first tenant stored,
    and are stored under other names; the same salt again hits. One engine with its prefix cache off, so every
    cached token is a load from the mount; the salts name tenants as vLLM's API does."""
    m = make_mount("salts").start()
    prompts = [tokens[5][:530], tokens[1][:530]]
    rnd = lambda salt: {"prompts": [{"tokens": p, "cache_salt": salt} for p in prompts], **ROUND}  # noqa: E731
    result = run_engine(workdir / "salts", [rnd("tenant-a"), rnd("tenant-b"), rnd("tenant-a")],
                        connector(m.mountpoint))
    hit = [expected_hit(len(p), len(p) + 15) for p in prompts]
    assert [cached(result, r) for r in range(3)] == [[0, 0], [0, 0], hit]
    assert all(outputs(result, r) == outputs(result, 0) for r in range(3))  # loaded KV: the same tokens
    per_tenant = sum((len(p) + 15) // CHUNK for p in prompts)
    files = chunk_files(m.mountpoint)
    assert len(files) == 2 * per_tenant, files  # tenant b's chunks have names of their own
    assert len({f.parent.parent for f in files}) == 1  # in the same namespace: the salt is in the hash alone


def test_unmounted_path_is_a_miss_and_writes_nothing(baseline, prompts, workdir):
    plain = workdir / "not-mounted"
    plain.mkdir()
    result = run_engine(workdir / "plain", [{"prompts": prompts, **ROUND}],
                        connector(plain))
    assert outputs(result) == outputs(baseline)
    assert cached(result) == [0, 0, 0]
    assert list(plain.iterdir()) == []
    assert "is not a mount point" in result["log"]


def test_dead_mount_is_a_miss(make_mount, baseline, prompts, workdir):
    m = make_mount("dead").start()
    m.proc.send_signal(signal.SIGKILL)  # the daemon dies, the mount stays: every access is ENOTCONN
    m.proc.wait(30)
    m.proc = None
    try:
        with pytest.raises(OSError):
            os.listdir(m.mountpoint)
        result = run_engine(workdir / "dead", [{"prompts": prompts, **ROUND}],
                            connector(m.mountpoint))
    finally:
        subprocess.run([FUSERMOUNT, "-u", "-z", str(m.mountpoint)], capture_output=True)
    assert outputs(result) == outputs(baseline)
    assert cached(result) == [0, 0, 0]
    assert "acting as a miss" in result["log"]


def test_a_cache_the_connector_cannot_store_is_refused_at_start(make_mount, prompts, workdir):
    """Per-token-head fp8 keeps its scales in side tensors the connector does not store: the engine does not
    start, and says why, rather than run with a connector that would store KV it cannot restore."""
    m = make_mount("per-token-head").start()
    with pytest.raises(pytest.fail.Exception) as failed:
        run_engine(workdir / "per-token-head", [{"prompts": prompts[:1], **ROUND}], connector(m.mountpoint),
                   kv_cache_dtype="fp8_per_token_head")
    text = str(failed.value)
    assert "KV cache dtype fp8_per_token_head: per-token-head quantisation keeps its scales" in text, text[-3000:]
    assert "refusing to start" in text
    assert chunk_files(m.mountpoint) == []


def test_lmcache_fs_backend_in_a_kvfs_directory(make_mount, baseline, prompts, workdir):
    """Any engine that does file I/O: LMCache 0.5.6 (multiprocess mode) with its fs L2 adapter in the mount.
    The LMCache server is restarted between the engines with an empty L1: the hits come from kvfs."""
    import lmcache_mp

    m = make_mount("lmc").start()
    l2 = m.mountpoint / "lmcache" / "l2"
    results = []
    l1_gib = 0.05 * ELEMENT / 2  # LMCache loads through its L1: it must hold one prompt's chunks
    for run in (1, 2):
        proc, conn = lmcache_mp.start_server(str(l2), chunk_size=CHUNK, l1_gib=l1_gib,
                                             log_path=str(workdir / f"lmcache-server-{run}.log"))
        try:
            # vLLM's own processes: LMCache in the engine's process breaks vLLM's CPU kernel registration
            results.append(run_engine(workdir / f"lmc{run}", [{"prompts": prompts, **ROUND}], conn,
                                      in_process=False))
            lmcache_mp.wait_stores_settled(proc)
        finally:
            lmcache_mp.stop_server(proc)
        for f in l2.rglob("*.data"):  # the second engine's loads decode the stored objects, not the pages
            drop_page_cache(f)        # that the first one's writes left in the page cache (kvfs/pagecache.py)
    first, second = results
    files = sorted(l2.rglob("*.data"))
    assert len(files) == sum(len(p) // CHUNK for p in prompts), files  # LMCache stores the prompts' full chunks
    assert all(f.stat().st_size == CHUNK * BYTES_PER_TOKEN for f in files)
    assert all(int(os.getxattr(f, "user.kvfs.stored_bytes")) < max(0.8, COMPRESSED) * f.stat().st_size
               for f in files)
    assert outputs(first) == outputs(baseline) and outputs(second) == outputs(baseline)
    assert cached(first) == [0, 0, 0]
    assert cached(second) == [(len(p) - 1) // CHUNK * CHUNK for p in prompts]
    assert m.stats()["tiers"]["L2"]["hits"] >= len(files)


def test_idle_chunks_go_down_and_a_returning_session_is_prefetched(make_mount, baseline, prompts, workdir):
    """demote_after_idle_s: the chunks an engine saved go to L3 once idle; prefetch: the next engine's lookup
    sends kvfs a prefetch for every chunk it found (they were on L3: each one queued), and it still loads
    exactly what the first stored."""
    m = make_mount("hotcold").start("--l3", f"{workdir / 'hotcold-l3'}:2G", l2_size="256M")
    first = run_engine(workdir / "hc1", [{"prompts": prompts, **ROUND}], connector(m.mountpoint, demote_after_idle_s=2))
    files = chunk_files(m.mountpoint)
    assert files and all(os.getxattr(f, "user.kvfs.idle") == b"2" for f in files)
    deadline = time.monotonic() + 30
    while any(os.getxattr(f, "user.kvfs.tier") != b"L3" for f in files):
        assert time.monotonic() < deadline, [os.getxattr(f, "user.kvfs.tier") for f in files]
        time.sleep(0.2)
    assert m.stats()["tiers"]["L2"]["idle_demoted_files"] == len(files)
    second = run_engine(workdir / "hc2", [{"prompts": prompts, **ROUND}], connector(m.mountpoint, prefetch=True))
    assert outputs(first) == outputs(baseline) and outputs(second) == outputs(baseline)
    assert cached(second) == [expected_hit(len(p), len(p) + 15) for p in prompts]
    hits = sum(-(-expected_hit(len(p), len(p) + 15) // CHUNK) for p in prompts)
    assert m.stats()["prefetches"] >= hits


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


@pytest.mark.skipif(not _cuda(), reason="needs vLLM on a CUDA GPU (torch.cuda.is_available() is False)")
def test_gpu_engines_store_and_load_the_same_tokens_as_plain_vllm(make_mount, prompts, workdir):
    """On a GPU host: a plain engine, an engine that stores through the connector's CUDA path, and a fresh one
    that loads what it stored (side streams, pinned staging, layer events), all greedy: the same tokens."""
    from vllm.platforms import current_platform

    assert current_platform.is_cuda(), "torch sees a GPU but this vLLM is not a CUDA build"
    base = run_engine(workdir / "gpu-base", [{"prompts": prompts, **ROUND}], None)
    m = make_mount("gpu").start()
    first = run_engine(workdir / "gpu-e1", [{"prompts": prompts, **ROUND}], connector(m.mountpoint))
    second = run_engine(workdir / "gpu-e2", [{"prompts": prompts, **ROUND}], connector(m.mountpoint))
    assert outputs(first) == outputs(base) == outputs(second)
    assert cached(first) == [0, 0, 0] and all(c > 0 for c in cached(second))
    assert "layout token-kv" in second["log"]
