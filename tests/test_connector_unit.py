"""The connector's pure parts: chunk file format, names, settings, layout round trips, the planner.

No vLLM engine here (tests/test_vllm.py runs real ones); torch is needed for the layout tests.
"""

from __future__ import annotations

import os
import types

import numpy as np
import pytest
from conftest import kv_samples
from hypothesis import given, settings
from hypothesis import strategies as st
from kvfs_connector import chunkfile, cpus, naming
from kvfs_connector.chunkfile import ChunkMismatch
from kvfs_connector.mount import MountGuard
from kvfs_connector.plan import Planner
from kvfs_connector.settings import Settings
from connector_fakes import FakeRequest

torch = pytest.importorskip("torch", reason="torch comes with tools/install_vllm.sh")
from kvfs_connector import layout as layouts

CPU_VEC = layouts.EngineLayout("CPU_ATTN", "vec")

DESC = {"layout": "cpu-vec", "dtype": "bfloat16", "layers": 2}


# -- chunk file -------------------------------------------------------------------------------------------
def _chunk(tokens=None, first=256, payload=b"\x01\x02" * 500):
    tokens = list(range(1000, 1512)) if tokens is None else tokens
    parts = chunkfile.build(first, len(tokens) - first, chunkfile.token_digest(tokens), DESC, payload)
    return b"".join(bytes(p) for p in parts), tokens


def test_chunk_round_trip_and_header_alignment():
    buf, tokens = _chunk()
    assert len(buf) == chunkfile.HEADER_SIZE + 1000
    out = chunkfile.verify(buf, first_token=256, n_tokens=256, expected_tokens=chunkfile.token_digest(tokens),
                           descriptor=DESC)
    assert bytes(out) == b"\x01\x02" * 500


@pytest.mark.parametrize("change", ["tokens", "prefix", "layout", "position", "payload", "header", "short"])
def test_chunk_mismatch_is_refused(change):
    buf, tokens = _chunk()
    buf = bytearray(buf)
    expect = dict(first_token=256, n_tokens=256, expected_tokens=chunkfile.token_digest(tokens), descriptor=DESC)
    if change == "tokens":  # the chunk's own tokens differ
        expect["expected_tokens"] = chunkfile.token_digest(tokens[:-1] + [7])
    elif change == "prefix":  # same chunk tokens, another prefix (a chained-hash collision)
        expect["expected_tokens"] = chunkfile.token_digest([5] + tokens[1:])
    elif change == "layout":
        expect["descriptor"] = {**DESC, "layers": 3}
    elif change == "position":
        expect["first_token"] = 0
    elif change == "payload":
        buf[-3] ^= 0x10
    elif change == "header":
        buf[40] ^= 0x01
    elif change == "short":
        buf = buf[:-2]
    with pytest.raises(ChunkMismatch):
        chunkfile.verify(buf, **expect)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=300), st.integers(0, 299))
def test_token_digest_sees_every_token(tokens, i):
    i %= len(tokens)
    other = list(tokens)
    other[i] ^= 1
    assert chunkfile.token_digest(tokens) != chunkfile.token_digest(other)
    assert chunkfile.token_digest(tokens) == chunkfile.token_digest(np.array(tokens, dtype=np.uint32))


# -- names and settings -------------------------------------------------------------------------------------
KEY = naming.NamespaceKey(model="/models/SmolLM2-135M-Instruct", dtype="bfloat16", num_layers=30, num_kv_heads=3,
                          head_size=64, block_size=128, chunk_size=256, layout="cpu-vec", tp_rank=0, tp_size=1,
                          pp_rank=0, pp_size=1, hash_algo="sha256", hash_seed_id="abc")


def test_namespace_is_readable_and_covers_every_field():
    ns = KEY.namespace()
    assert ns.startswith("SmolLM2-135M-Instruct-") and len(ns.rsplit("-", 1)[1]) == 12
    seen = {ns}
    for field, value in [("dtype", "float16"), ("num_layers", 29), ("num_kv_heads", 1), ("head_size", 128),
                         ("block_size", 64), ("chunk_size", 512), ("layout", "blocks:cuda-auto"), ("tp_rank", 1),
                         ("tp_size", 2), ("pp_rank", 1), ("pp_size", 2), ("hash_algo", "xxhash"),
                         ("hash_seed_id", "def"), ("lossy", "mantissa-3"), ("model", "/other/SmolLM2-135M-Instruct")]:
        seen.add(naming.NamespaceKey(**{**KEY.__dict__, field: value}).namespace())
    assert len(seen) == 16


def test_chunk_path_layout():
    h = bytes(range(32))
    assert naming.chunk_relpath("ns", h) == f"ns/00/{h.hex()}.kv"


def test_reader_threads_default_to_what_the_cache_needs():
    auto = Settings.from_extra({"mount": "/m"})
    assert auto.io_thread_count(device_side=True, available_cpus=16) == 8  # GPU: decode is the limit
    assert auto.io_thread_count(device_side=False, available_cpus=16) == 4  # CPU: cores run the model
    assert auto.io_thread_count(device_side=True, available_cpus=2) == 2
    assert Settings.from_extra({"mount": "/m", "io_threads": 3}).io_thread_count(True, 16) == 3
    with pytest.raises(ValueError, match="io_threads"):
        Settings.from_extra({"mount": "/m", "io_threads": 0})


def test_settings_are_checked():
    assert Settings.from_extra({"mount": "/mnt/kvfs"}).chunk_tokens(128) == 256
    assert Settings.from_extra({"mount": "/m"}).chunk_tokens(96) == 288  # rounded up to whole blocks
    with pytest.raises(ValueError, match="mount"):
        Settings.from_extra({})
    with pytest.raises(ValueError, match="unknown"):
        Settings.from_extra({"mount": "/m", "chunk_tokens": 256})
    with pytest.raises(ValueError, match="multiple"):
        Settings.from_extra({"mount": "/m", "chunk_size": 200}).chunk_tokens(128)
    with pytest.raises(ValueError, match="on_load_error"):
        Settings.from_extra({"mount": "/m", "on_load_error": "ignore"})
    assert Settings.from_extra({"mount": "/m"}).lossy_mode == "none"
    assert Settings.from_extra({"mount": "/m", "lossy": "FP8"}).lossy_mode == "fp8"
    with pytest.raises(ValueError, match="lossy"):
        Settings.from_extra({"mount": "/m", "lossy": "int2"})
    assert Settings.from_extra({"mount": "/m", "io_cpus": "0-1,4"}).io_cpus == "0-1,4"
    for bad in ("all", "3-1", "1,,2", ""):
        with pytest.raises(ValueError, match="io_cpus"):
            Settings.from_extra({"mount": "/m", "io_cpus": bad})
    with pytest.raises(ValueError, match="tenant_dir_secret_file without tenant_dirs"):
        Settings.from_extra({"mount": "/m", "tenant_dir_secret_file": "/etc/k"})


def test_cpu_lists_round_trip():
    assert cpus.parse_cpu_list("0-3,8") == {0, 1, 2, 3, 8}
    assert cpus.parse_cpu_list(" 5 ") == {5}
    assert cpus.format_cpu_list(frozenset({0, 1, 2, 3, 8, 10, 11})) == "0-3,8,10-11"
    for text in ("0-3,8", "7", "0-1,3-4,9"):
        assert cpus.format_cpu_list(cpus.parse_cpu_list(text)) == text


def test_numa_cpus_keeps_io_threads_on_the_workers_nodes(tmp_path):
    for node, cpulist in (("node0", "0-3"), ("node1", "4-7")):
        (tmp_path / node).mkdir()
        (tmp_path / node / "cpulist").write_text(cpulist + "\n")
    assert cpus.numa_cpus(frozenset({1}), tmp_path) == {0, 1, 2, 3}
    assert cpus.numa_cpus(frozenset({3, 4}), tmp_path) == set(range(8))
    assert cpus.numa_cpus(frozenset({1}), tmp_path / "absent") >= {1}


IO_CPUS_CHILD = """
import concurrent.futures as cf, json, os
from kvfs_connector import cpus
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # bound like a vLLM CPU worker
chosen = cpus.io_cpus("auto")
pool = cf.ThreadPoolExecutor(2, initializer=cpus.pin_current_thread, initargs=(chosen,))
print(json.dumps({"chosen": sorted(chosen) if chosen is not None else None, "mine": sorted(os.sched_getaffinity(0)),
                  "threads": pool.submit(lambda: sorted(os.sched_getaffinity(0))).result(),
                  "worker": cpus.io_cpus("worker")}))
"""


def test_io_threads_leave_a_bound_worker_for_the_cpus_of_its_parent():
    """A process bound to one CPU (as vLLM binds its CPU workers) runs the connector's I/O threads on the
    CPUs of the process that started it; "worker" leaves them where they are."""
    import json
    import subprocess
    import sys

    out = json.loads(subprocess.run([sys.executable, "-c", IO_CPUS_CHILD], capture_output=True, text=True,
                                    check=True).stdout)
    parent = sorted(os.sched_getaffinity(0))
    assert out["mine"] == parent[:1]
    assert out["worker"] is None
    if len(parent) > 1:
        assert out["chosen"] == parent
        assert out["threads"] == parent
    else:  # one CPU: nothing to move to
        assert out["chosen"] is None and out["threads"] == parent


def test_lossy_chunks_have_their_own_namespace_and_descriptor():
    """A lossy tenant never feeds lossless readers: other directory, other descriptor (a mismatch on load)."""
    lossy_key = naming.NamespaceKey(**{**KEY.__dict__, "lossy": "mantissa:3"})
    assert lossy_key.namespace() != KEY.namespace()
    buf, tokens = _chunk()
    with pytest.raises(chunkfile.ChunkMismatch, match="layout"):
        chunkfile.verify(buf, first_token=256, n_tokens=256, expected_tokens=chunkfile.token_digest(tokens),
                         descriptor={**DESC, "lossy": "fp8"})
    # a lossy chunk reads back as other values: its payload checksum is not the test (kvfs checks each frame)
    parts = chunkfile.build(256, 256, chunkfile.token_digest(tokens), {**DESC, "lossy": "fp8"}, b"\x01\x02" * 500)
    changed = bytearray(b"".join(bytes(p) for p in parts))
    changed[-3] ^= 0x10
    out = chunkfile.verify(changed, first_token=256, n_tokens=256, expected_tokens=chunkfile.token_digest(tokens),
                           descriptor={**DESC, "lossy": "fp8"})
    assert len(out) == 1000


def test_mount_guard(tmp_path):
    plain = tmp_path / "dir"
    plain.mkdir()
    assert not MountGuard(str(plain), require_mount=True).usable()  # never fill the disk under a mount point
    assert MountGuard(str(plain), require_mount=False).usable()
    assert not MountGuard(str(tmp_path / "missing"), require_mount=False).usable()


# -- layouts --------------------------------------------------------------------------------------------------
def _cpu_cache_from_block_file(path, blocks: int, dtype):
    """A paged cache per vLLM CPU layout, filled with a real KV block (vLLM CPU block order) at random slots."""
    raw = np.fromfile(path, dtype=np.uint16)
    L, H, bs, D = 30, 3, 128, 64
    per_layer = torch.from_numpy(raw.view(np.int16).copy()).view(dtype).view(L, H, bs, 2 * D)
    caches = [torch.zeros(blocks, H, bs, 2 * D, dtype=dtype) for _ in range(L)]
    return caches, per_layer


def test_cpu_vec_layout_is_channel_major_and_inverts_bit_exactly():
    g = layouts.Geometry(num_layers=30, num_kv_heads=3, head_size=64, block_size=128, chunk_size=256,
                         dtype=torch.bfloat16)
    (bf16,) = kv_samples("bf16")[:1]
    caches, real = _cpu_cache_from_block_file(bf16, 10, torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    for layer, c in enumerate(caches):
        c[7] = real[layer]
        c[2] = torch.randn(c[2].shape, generator=gen).to(torch.bfloat16)
    lay = layouts.choose(g, tuple(caches[0].shape), CPU_VEC)
    payload = lay.gather(caches, [7, 2])
    p = payload.view(30, 2, 3, 64, 256)
    # K of layer 5, head 1, channel 10 over the chunk's first block = that row of K^T in block 7
    assert torch.equal(p[5, 0, 1, 10, :128], caches[5][7, 1].reshape(-1)[10 * 128:11 * 128])
    # V of layer 5, head 2, channel 3 over the second block = column 3 of V [token][channel] in block 2
    v = caches[5][2, 2].reshape(-1)[128 * 64:].view(128, 64)
    assert torch.equal(p[5, 1, 2, 3, 128:], v[:, 3])
    # scatter into other blocks of a fresh cache: bit-exact, per layer, partial ranges honoured
    fresh = [torch.zeros_like(c) for c in caches]
    lay.scatter(fresh, payload, [4, 9], 0, 2)
    for layer in range(30):
        assert torch.equal(fresh[layer][4].view(torch.int16), caches[layer][7].view(torch.int16))
        assert torch.equal(fresh[layer][9].view(torch.int16), caches[layer][2].view(torch.int16))
    partial = [torch.zeros_like(c) for c in caches]
    lay.scatter(partial, payload, [4, 9], 1, 2)
    for layer in range(30):
        assert not partial[layer][4].any() and torch.equal(partial[layer][9], caches[layer][2])
    assert lay.shape_hint(4096) == "offset=4096 layer=30 kv=2 head=3 channel=64 token=256"


def test_layout_refuses_a_cache_it_could_only_copy():
    """A paged cache that is not one contiguous tensor per layer cannot be viewed in block order: the layout
    raises instead of writing into a copy (which would drop the load silently)."""
    g = layouts.Geometry(num_layers=1, num_kv_heads=2, head_size=8, block_size=4, chunk_size=8, dtype=torch.bfloat16)
    lay = layouts.choose(g, (6, 2, 4, 16), CPU_VEC)
    strided = torch.zeros(6, 4, 2, 16, dtype=torch.bfloat16).transpose(1, 2)  # heads outside tokens in memory
    payload = torch.ones(lay.payload_elements, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="without a copy"):
        lay.scatter([strided], payload, [0, 1], 0, 2)
    big = torch.zeros(6, 2, 4, 32, dtype=torch.bfloat16)  # strided, but viewable: the writes land in `big`
    lay.scatter([big[..., ::2]], payload, [0, 1], 0, 2)
    assert big[:2, ..., ::2].eq(1).all() and not big[..., 1::2].any() and not big[2:].any()


def _special(t):
    t[0, 0, :4] = torch.tensor([float("nan"), float("inf"), -0.0, 65504.0], dtype=t.dtype)


@pytest.mark.parametrize("physical", ["NHD", "HND"])
def test_token_kv_layout_is_channel_major_on_any_stride_order(physical):
    """GPU backends' [blocks, heads, tokens, K|V] cache, held in either physical order (vLLM permutes strides):
    the payload is channel-major K then V, and scatter inverts gather bit-exactly (NaN, inf, -0.0)."""
    g = layouts.Geometry(num_layers=2, num_kv_heads=2, head_size=8, block_size=4, chunk_size=8, dtype=torch.float16)
    caches = []
    for _ in range(2):
        raw = torch.randn(6, 4, 2, 16) if physical == "NHD" else torch.randn(6, 2, 4, 16)
        caches.append((raw.transpose(1, 2) if physical == "NHD" else raw).to(torch.float16))
    assert tuple(caches[0].shape) == (6, 2, 4, 16)
    _special(caches[1][3])
    lay = layouts.choose(g, tuple(caches[0].shape), layouts.EngineLayout("FLASH_ATTN"))
    assert lay.name == "token-kv"
    payload = lay.gather(caches, [3, 1])
    p = payload.view(2, 2, 2, 8, 2, 4)  # layer, kv, head, channel, block, token
    assert torch.equal(p[1, 0, 1, 5, 0].view(torch.int16), caches[1][3, 1, :, 5].view(torch.int16))  # K
    assert torch.equal(p[0, 1, 0, 2, 1].view(torch.int16), caches[0][1, 0, :, 8 + 2].view(torch.int16))  # V
    out = [torch.zeros_like(c) for c in caches]
    lay.scatter(out, payload, [0, 5], 0, 2)
    for layer in range(2):
        assert torch.equal(out[layer][0].view(torch.int16), caches[layer][3].view(torch.int16))
        assert torch.equal(out[layer][5].view(torch.int16), caches[layer][1].view(torch.int16))
    partial = [torch.zeros_like(c) for c in caches]
    lay.scatter(partial, payload, [0, 5], 1, 2)
    assert not partial[0][0].any() and torch.equal(partial[0][5], caches[0][1])


def test_block_bytes_layout_round_trip_for_other_cpu_kernels():
    g = layouts.Geometry(num_layers=2, num_kv_heads=2, head_size=8, block_size=4, chunk_size=8, dtype=torch.float16)
    caches = [torch.randn(6, 2, 4, 16).to(torch.float16) for _ in range(2)]
    _special(caches[1][3])
    lay = layouts.choose(g, tuple(caches[0].shape), layouts.EngineLayout("CPU_ATTN", "amx", "0.32.0+cpu"))
    assert lay.name == "blocks:cpu-amx@vllm-0.32"  # opaque bytes: another minor version may pack them otherwise
    assert layouts.EngineLayout("CPU_ATTN", "amx", "0.34.1").layout_name() == "blocks:cpu-amx@vllm-0.34"
    payload = lay.gather(caches, [3, 1])
    out = [torch.zeros_like(c) for c in caches]
    lay.scatter(out, payload, [0, 5], 0, 2)
    for layer in range(2):
        assert torch.equal(out[layer][0].view(torch.int16), caches[layer][3].view(torch.int16))
        assert torch.equal(out[layer][5].view(torch.int16), caches[layer][1].view(torch.int16))


@pytest.mark.parametrize("engine, shape, words", [
    (layouts.EngineLayout("NEW_FANCY_ATTN", None, "0.99.0"), (6, 2, 4, 16), ["0.99.0", "NEW_FANCY_ATTN"]),
    (layouts.EngineLayout("CPU_ATTN", None, "0.99.0"), (6, 2, 4, 16), ["0.99.0", "CPU_ATTN"]),
    (layouts.EngineLayout("FLASH_ATTN", None, "0.99.0"), (2, 6, 4, 2, 8), ["0.99.0", "(2, 6, 4, 2, 8)"]),
    (layouts.EngineLayout("FLASHINFER", None, "0.99.0"), (6, 4, 2, 16), ["0.99.0", "(6, 4, 2, 16)"]),
])
def test_unknown_layout_refuses_naming_version_and_layout(engine, shape, words):
    """A backend the connector does not know, or a tensor whose shape is not its backend's: never a guess."""
    g = layouts.Geometry(num_layers=2, num_kv_heads=2, head_size=8, block_size=4, chunk_size=8, dtype=torch.float16)
    with pytest.raises(layouts.UnknownLayout) as err:
        layouts.choose(g, shape, engine)
    assert all(w in str(err.value) for w in words), err.value


# -- planner --------------------------------------------------------------------------------------------------
def _planner(tmp_path, **kw):
    return Planner(mount=str(tmp_path), namespaces=lambda: ["ns"], block_size=128, hash_block_size=128,
                   chunk_size=256, save_decode=kw.get("save_decode", True),
                   guard=MountGuard(str(tmp_path), require_mount=False))


def _touch(planner, req, chunk):
    (path,) = planner.chunk_paths(req, chunk)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    open(path, "wb").close()


def test_planner_longest_prefix_never_the_last_token(tmp_path):
    p = _planner(tmp_path)
    req = FakeRequest("a", list(range(1024)), 1024)
    assert p.lookup(req, 0) == 0
    _touch(p, req, 0)
    _touch(p, req, 2)  # not contiguous with chunk 0: only chunk 0 counts
    assert p.lookup(req, 0) == 256
    _touch(p, req, 1)
    _touch(p, req, 3)
    # 1024 prompt tokens: all four chunks are there, but the last token must be computed
    assert p.lookup(req, 0) == 1023
    assert p.lookup(req, 128) == 895  # vLLM's own prefix cache had the first block
    p.allocated(req, list(range(100, 108)), 895)
    loads, _ = p.step(types.SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=_no_cached(),
                                            preempted_req_ids=set(), num_scheduled_tokens={}))
    assert [(s.first_token, s.block_ids, s.first_block, s.end_block) for s in loads] == [
        (0, [100, 101], 1, 2), (256, [102, 103], 0, 2), (512, [104, 105], 0, 2), (768, [106, 107], 0, 2)]
    # a prompt that ends inside a stored chunk's range: that chunk has no hash yet, so it is no hit
    short = FakeRequest("s", list(range(1000)), 1000)
    assert p.lookup(short, 0) == 768
    assert loads[0].token_digest == chunkfile.token_digest(range(256))


def _no_cached():
    return types.SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[])


def _new(req, blocks, computed):
    return types.SimpleNamespace(req_id=req.request_id, block_ids=(blocks,), num_computed_tokens=computed)


def test_planner_saves_prefill_and_decode_chunks_once(tmp_path):
    p = _planner(tmp_path)
    tokens = list(range(5000, 5000 + 600))
    req = FakeRequest("a", tokens, 600)
    p.lookup(req, 0)
    p.allocated(req, [1, 2, 3, 4, 5], 0)
    so = types.SimpleNamespace(scheduled_new_reqs=[_new(req, [1, 2, 3, 4, 5], 0)], scheduled_cached_reqs=_no_cached(),
                               preempted_req_ids=set(), num_scheduled_tokens={"a": 600})
    _, saves = p.step(so)
    assert [(s.first_token, s.block_ids) for s in saves] == [(0, [1, 2]), (256, [3, 4])]
    # decode up to token 767: chunk 2 (512..767) completes when the step computing token 767 runs
    more = list(range(9000, 9000 + 168))
    req2 = FakeRequest("a", tokens + more, 600)
    p.requests["a"].request = req2
    cached = types.SimpleNamespace(req_ids=["a"], resumed_req_ids=set(), new_block_ids=[([6],)],
                                   num_computed_tokens=[767])
    so = types.SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=cached, preempted_req_ids=set(),
                               num_scheduled_tokens={"a": 1})
    _, saves = p.step(so)
    assert [(s.first_token, s.block_ids) for s in saves] == [(512, [5, 6])]
    assert saves[0].token_digest == chunkfile.token_digest((tokens + more)[:768])
    _, saves = p.step(so)
    assert saves == []  # never twice


@pytest.mark.parametrize("version", ["0.32", "0.34"])
def test_planner_preempted_and_resumed_in_one_step_saves_from_the_new_blocks(tmp_path, version):
    """0.32 resumes a preempted request in scheduled_cached_reqs (resumed_req_ids), 0.34 in scheduled_new_reqs
    (no resumed_req_ids field at all). Either way, in the step that preempts and resumes it, the chunk it
    completes is saved from its new blocks."""
    p = _planner(tmp_path)
    req = FakeRequest("a", list(range(7000, 7600)), 600)
    p.lookup(req, 0)
    p.allocated(req, [1, 2, 3], 0)
    so = types.SimpleNamespace(scheduled_new_reqs=[_new(req, [1, 2, 3], 0)], scheduled_cached_reqs=_no_cached(),
                               preempted_req_ids=set(), num_scheduled_tokens={"a": 300})
    assert [s.block_ids for s in p.step(so)[1]] == [[1, 2]]
    if version == "0.32":
        cached = types.SimpleNamespace(req_ids=["a"], resumed_req_ids={"a"}, new_block_ids=[([8, 9, 10, 11],)],
                                       num_computed_tokens=[300])
        new = []
    else:
        cached = types.SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[])
        new = [_new(req, [8, 9, 10, 11], 300)]
    so = types.SimpleNamespace(scheduled_new_reqs=new, scheduled_cached_reqs=cached, preempted_req_ids={"a"},
                               num_scheduled_tokens={"a": 212})
    assert [(s.first_token, s.block_ids) for s in p.step(so)[1]] == [(256, [10, 11])]


def test_planner_without_decode_saves_and_with_existing_chunks(tmp_path):
    p = _planner(tmp_path, save_decode=False)
    req = FakeRequest("b", list(range(800)), 700)
    _touch(p, req, 0)
    assert p.lookup(req, 0) == 256
    p.allocated(req, list(range(10, 16)), 256)
    so = types.SimpleNamespace(scheduled_new_reqs=[_new(req, list(range(10, 16)), 256)],
                               scheduled_cached_reqs=_no_cached(), preempted_req_ids=set(),
                               num_scheduled_tokens={"b": 444})
    loads, saves = p.step(so)
    assert len(loads) == 1
    assert [s.first_token for s in saves] == [256]  # chunk 0 exists; chunk 2 would need decode tokens


def test_mount_guard_only_a_gone_mount_turns_everything_into_misses(tmp_path):
    import errno

    guard = MountGuard(str(tmp_path), require_mount=False)
    assert guard.usable()
    guard.failed(OSError(errno.EIO, "one damaged file"))
    guard.failed(OSError(errno.ENOSPC, "full"))
    assert guard.usable()
    guard.failed(OSError(errno.ENOTCONN, "daemon died"))
    assert not guard.usable()


@pytest.mark.parametrize("engine", [layouts.EngineLayout("FLASH_ATTN"), layouts.EngineLayout("CPU_ATTN", "amx")])
def test_batched_scatter_equals_one_chunk_at_a_time(engine):
    """The GPU copier scatters a batch of whole chunks with one call per layer: the same blocks, bit for bit,
    as scattering each chunk on its own."""
    g = layouts.Geometry(num_layers=3, num_kv_heads=2, head_size=8, block_size=4, chunk_size=8, dtype=torch.bfloat16)
    src = [torch.randn(12, 2, 4, 16).to(torch.bfloat16) for _ in range(3)]
    lay = layouts.choose(g, tuple(src[0].shape), engine)
    chunks = [([1, 7], [0, 5]), ([4, 2], [9, 3]), ([11, 0], [6, 8])]  # (from blocks, into blocks)
    payloads = torch.cat([lay.gather(src, frm) for frm, _ in chunks])
    one = [torch.zeros_like(c) for c in src]
    for k, (_, into) in enumerate(chunks):
        lay.scatter(one, payloads[k * lay.payload_elements:(k + 1) * lay.payload_elements], into, 0, 2)
    batched = [torch.zeros_like(c) for c in src]
    sources = lay.batch_sources(payloads, len(chunks))
    ids = lay.index([i for _, into in chunks for i in into], torch.device("cpu"))
    for layer, kv in enumerate(batched):
        lay.scatter_batch_layer(kv, sources, layer, ids)
    for a, b in zip(one, batched):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)) and a.any()
