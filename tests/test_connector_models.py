"""Model families in the connector's pure parts: how vLLM's KV-cache groups become parts (full attention,
sliding window, MLA), what is refused and why, window arithmetic, the planner over several groups (null
blocks, window-only loads and saves), and the layouts of several groups and of MLA latents.

vLLM's own spec classes where they matter (tests/test_vllm_api.py drives the connector through vLLM's
objects; tests/test_vllm.py runs real engines of each family)."""

from __future__ import annotations

import os
import types

import pytest
from connector_fakes import FakeRequest
from kvfs_connector import chunkfile
from kvfs_connector.model import Part, UnsupportedModel, check_cache_dtype, describe_model, restorable
from kvfs_connector.mount import MountGuard
from kvfs_connector.plan import Planner

torch = pytest.importorskip("torch", reason="torch comes with tools/install_vllm.sh")
vllm = pytest.importorskip("vllm")
from kvfs_connector import layout as layouts  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

BF16 = torch.bfloat16


def _config(*groups):
    return types.SimpleNamespace(kv_cache_groups=[types.SimpleNamespace(layer_names=names, kv_cache_spec=spec)
                                                  for names, spec in groups])


def _layers(*ids):
    return [f"model.layers.{i}.self_attn.attn" for i in ids]


FULL = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=BF16)
WINDOW = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=BF16, sliding_window=100)
MLA = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=BF16)


def test_a_gemma_style_model_is_a_full_part_and_one_window_part_over_its_groups():
    # vLLM makes groups of equal size: 5 sliding-window layers : 1 full -> 6 groups of one layer
    groups = [(_layers(5), FULL)] + [(_layers(i), WINDOW) for i in range(5)]
    model = describe_model(_config(*groups), "auto")
    assert [p.kind for p in model.parts] == ["full", "window"] and model.hybrid and model.has_window
    full, window = model.parts
    assert full.groups == (0,) and full.layer_names == tuple(_layers(5))
    assert window.groups == (1, 2, 3, 4, 5) and window.layer_names == tuple(_layers(0, 1, 2, 3, 4))
    assert window.layer_groups == (0, 1, 2, 3, 4) and window.window == 100
    assert model.chunk_multiple() == 16
    # layer 10 sorts after layer 9, not after layer 1
    names = _layers(10, 9, 1)
    part = describe_model(_config((names, FULL)), "auto").parts[0]
    assert part.layer_names == tuple(_layers(1, 9, 10))


def test_mla_is_one_replicated_part_and_plain_gqa_one_full_part():
    mla = describe_model(_config((_layers(0, 1, 2), MLA)), "auto")
    assert [p.kind for p in mla.parts] == ["mla"] and mla.parts[0].replicated_over_tp and not mla.hybrid
    gqa = describe_model(_config((_layers(0, 1), FULL)), "auto")
    assert [p.kind for p in gqa.parts] == ["full"] and not gqa.parts[0].replicated_over_tp


def test_what_cannot_be_stored_is_refused_with_its_reason():
    mamba = MambaSpec(block_size=16, shapes=((4, 8),), dtypes=(BF16,))
    with pytest.raises(UnsupportedModel, match="recurrent state.*Mamba"):
        describe_model(_config((_layers(0), FULL), (_layers(1), mamba)), "auto")
    for mode in ("fp8_per_token_head", "int8_per_token_head"):
        with pytest.raises(UnsupportedModel, match=f"{mode}: per-token-head quantisation keeps its scales"):
            check_cache_dtype(mode)
    with pytest.raises(UnsupportedModel, match="nvfp4"):
        check_cache_dtype("nvfp4")
    for ok in ("auto", "fp8", "fp8_e4m3", "fp8_e5m2"):
        check_cache_dtype(ok)
    assert describe_model(_config((_layers(0), FULL)), "fp8_e4m3").fp8
    with pytest.raises(UnsupportedModel, match="context parallelism"):
        describe_model(_config((_layers(0), MLA)), "auto", context_parallel=2)


def test_a_window_part_stores_the_blocks_a_hit_at_the_chunks_end_needs():
    part = Part("window", (1,), (), (), 16, 2, 64, window=100)
    assert part.stored_blocks(256) == 7  # ceil(99 / 16): positions end-99 .. end-1
    assert Part("window", (1,), (), (), 16, 2, 64, window=1000).stored_blocks(256) == 16  # the whole chunk
    assert Part("full", (0,), (), (), 16, 2, 64).stored_blocks(256) == 16
    # a hit at a chunk boundary is restorable; one inside the last chunk reaches before its stored tail
    assert restorable([part], 512, 2, 256) and restorable([part], 256, 2, 256)
    assert restorable([part], 500, 2, 256)  # needs 401..499: stored 400..511
    assert not restorable([part], 490, 2, 256)  # needs 391..489
    assert not restorable([part], 768, 2, 256)  # chunk 2 is not stored
    wide = Part("window", (1,), (), (), 16, 2, 64, window=1000)
    assert restorable([wide], 700, 3, 256) and not restorable([wide], 700, 2, 256)


# -- the planner over several groups ----------------------------------------------------------------------
C, BS, W = 256, 16, 100
PARTS = [Part("full", (0,), (), (), BS, 2, 64), Part("window", (1, 2), (), (), BS, 2, 64, window=W)]


def _planner(tmp_path):
    return Planner(mount=str(tmp_path), namespaces=lambda: [["full"], ["win"]], block_size=BS, hash_block_size=BS,
                   chunk_size=C, save_decode=True, guard=MountGuard(str(tmp_path), require_mount=False),
                   parts=PARTS, groups=3, asynchronous=True)


def _touch(planner, req, chunk):
    for path in planner.all_chunk_paths(req, chunk):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        open(path, "wb").close()


def _so(new=(), cached=None, tokens=None):
    cached = cached or types.SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[],
                                             num_computed_tokens=[])
    return types.SimpleNamespace(scheduled_new_reqs=list(new), scheduled_cached_reqs=cached,
                                 preempted_req_ids=set(), num_scheduled_tokens=tokens or {})


def _window_table(n_blocks, skipped, start):
    """A sliding-window group's block table as vLLM hands it: the null block 0 at skipped positions."""
    return [0] * skipped + list(range(start + skipped, start + n_blocks))


def test_hybrid_hits_are_whole_chunks_and_need_every_parts_file(tmp_path):
    p = _planner(tmp_path)
    req = FakeRequest("a", list(range(1000, 1700)), 700, hash_block=BS)
    _touch(p, req, 0)
    _touch(p, req, 1)
    # 700 prompt tokens, chunks 0-1 stored: the hit is 512 (a chunk boundary), never 699
    assert p.lookup(req, 0) == 512
    os.unlink(p.chunk_paths(req, 1, part=1)[0])  # chunk 1's window file is gone: only chunk 0 is whole
    assert p.lookup(req, 0) == 256
    # a prompt of exactly two chunks: the hit 511 needs 412..510, inside chunk 1's stored window
    _touch(p, req, 1)
    exact = FakeRequest("b", list(range(1000, 1512)), 512, hash_block=BS)
    assert p.lookup(exact, 0) == 511
    # 491 tokens: the hit 490 would need 391..489, before the stored window: back to the chunk boundary
    short = FakeRequest("c", list(range(1000, 1491)) + [0] * 21, 491, hash_block=BS)
    assert p.lookup(short, 0) == 256


def test_hybrid_loads_read_only_the_window_and_never_the_null_block(tmp_path):
    p = _planner(tmp_path)
    req = FakeRequest("a", list(range(1000, 1700)), 700, hash_block=BS)
    for k in range(2):
        _touch(p, req, k)
    hit = p.lookup(req, 0)
    assert hit == 512
    # vLLM: full group 32 blocks; window groups skip (512 - 100 + 1) // 16 = 25 blocks (null), then 7 real
    full = list(range(100, 132))
    win1, win2 = _window_table(32, 25, 200), _window_table(32, 25, 300)
    p.allocated(req, (full, win1, win2), hit)
    loads, _ = p.step(_so())
    by_part = [[(s.first_token, s.first_block, s.end_block, s.groups) for s in loads if s.part == k] for k in (0, 1)]
    assert by_part[0] == [(0, 0, 16, [full[:16]]), (256, 0, 16, [full[16:]])]
    # the window file of chunk 1 holds its last 7 blocks (25..31); every one is needed, none is block 0
    assert by_part[1] == [(256, 0, 7, [win1[25:], win2[25:]])]
    assert all(s.asynchronous for s in loads) and all(0 not in g for s in loads for g in s.groups)
    assert loads[0].token_digest == chunkfile.token_digest(range(1000, 1256))


def test_hybrid_saves_store_the_window_tail_of_each_group(tmp_path):
    p = _planner(tmp_path)
    req = FakeRequest("a", list(range(1000, 1700)), 700, hash_block=BS)
    p.lookup(req, 0)
    full, w1, w2 = list(range(1, 33)), list(range(101, 133)), list(range(201, 233))
    p.allocated(req, (full, w1, w2), 0)
    new = types.SimpleNamespace(req_id="a", block_ids=(full, w1, w2), num_computed_tokens=0)
    _, saves = p.step(_so([new], tokens={"a": 512}))
    got = [(s.first_token, s.part, s.groups) for s in saves]
    assert got == [(0, 0, [full[:16]]), (0, 1, [w1[9:16], w2[9:16]]),
                   (256, 0, [full[16:32]]), (256, 1, [w1[25:32], w2[25:32]])]
    from kvfs.events import parse_record

    # every part's file announces the chunk's blocks under each of its groups (kvfs's KV events, like vLLM's)
    from kvfs.events import record_groups

    assert [record_groups(parse_record(s.blocks)) for s in saves] == [[0], [1, 2], [0], [1, 2]]


def test_a_window_freed_before_its_save_is_never_stored_from_stale_ids(tmp_path):
    """A chunk saved late (its hash came later: asynchronous scheduling) whose window blocks vLLM freed in
    the meantime: the ids the planner holds may belong to another request now. Its window file is not
    saved (counted); its full-attention file is, for longer hits."""
    p = _planner(tmp_path)
    req = FakeRequest("a", list(range(1000, 1700)), 700, hash_block=BS)
    p.lookup(req, 0)
    full, w1, w2 = list(range(1, 45)), list(range(101, 145)), list(range(201, 245))
    p.allocated(req, (full, w1, w2), 0)
    req.block_hashes = req.block_hashes[:15]  # chunk 0's last hash not there yet
    new = types.SimpleNamespace(req_id="a", block_ids=(full, w1, w2), num_computed_tokens=0)
    assert p.step(_so([new], tokens={"a": 300}))[1] == []
    req.block_hashes = FakeRequest("a", list(range(1000, 1700)), 700, hash_block=BS).block_hashes
    cached = types.SimpleNamespace(req_ids=["a"], resumed_req_ids=set(), new_block_ids=[None],
                                   num_computed_tokens=[600])
    _, saves = p.step(_so(cached=cached, tokens={"a": 100}))
    # at 600 computed tokens vLLM freed window blocks below (600 - 99) // 16 = 31: chunk 0's tail (9..15) and
    # chunk 1's (25..31) are gone, chunk 2 is not complete
    assert [(s.first_token, s.part) for s in saves] == [(0, 0), (256, 0)]
    assert p.stats["tails_not_saved"] == 2 and p.stats["unsaveable_chunks"] == 0


def test_null_blocks_in_a_window_load_fail_the_load_instead_of_writing_block_0(tmp_path):
    p = _planner(tmp_path)
    req = FakeRequest("a", list(range(1000, 1700)), 700, hash_block=BS)
    for k in range(2):
        _touch(p, req, k)
    p.lookup(req, 0)
    full = list(range(100, 132))
    bad = _window_table(32, 28, 200)  # vLLM skipped more than the window rule says
    p.allocated(req, (full, bad, bad), 512)
    loads, _ = p.step(_so())
    (window,) = [s for s in loads if s.part == 1]
    assert window.paths == []  # the worker fails it: vLLM recomputes the request


# -- layouts: several groups in one part, MLA latents ------------------------------------------------------
def test_a_part_of_several_groups_gathers_each_layer_from_its_own_block_table():
    g = layouts.Geometry(num_layers=3, num_kv_heads=2, head_size=8, block_size=4, chunk_size=8, dtype=BF16)
    caches = [torch.randn(12, 2, 4, 16).to(BF16) for _ in range(3)]
    lay = layouts.choose(g, tuple(caches[0].shape), layouts.EngineLayout("FLASH_ATTN"))
    lay.layer_groups = (0, 1, 0)
    tables = [[3, 5], [7, 9]]
    payload = lay.gather(caches, tables)
    for layer, table in zip(range(3), (tables[0], tables[1], tables[0])):
        alone = layouts.choose(layouts.Geometry(1, 2, 8, 4, 8, BF16), tuple(caches[0].shape),
                               layouts.EngineLayout("FLASH_ATTN")).gather([caches[layer]], table)
        assert torch.equal(lay.layer_slice(payload, layer).view(torch.int16), alone.view(torch.int16))
    out = [torch.zeros_like(c) for c in caches]
    lay.scatter(out, payload, [[1, 2], [10, 11]], 0, 2)
    assert torch.equal(out[1][10:12].view(torch.int16), caches[1][7:10:2].view(torch.int16))
    assert not out[1][1:3].any() and torch.equal(out[2][1:3].view(torch.int16), caches[2][3:6:2].view(torch.int16))
    with pytest.raises(ValueError, match="2 block tables"):
        lay.layer_groups = (0, 1, 2)
        lay.gather(caches, tables)


@pytest.mark.parametrize("shape", [(10, 16, 576), (10, 1, 16, 576)])
@pytest.mark.parametrize("dtype", [BF16, torch.uint8])
def test_mla_latents_are_channel_major_and_round_trip_bit_exactly(shape, dtype):
    g = layouts.Geometry(num_layers=2, num_kv_heads=1, head_size=576, block_size=16, chunk_size=32, dtype=dtype)
    caches = [(torch.randn(*shape) * 4).to(dtype) for _ in range(2)]
    lay = layouts.choose(g, shape, layouts.EngineLayout("CPU_MLA"))
    assert lay.name == "mla-latent" and lay.shape_hint(4096) == "offset=4096 layer=2 channel=576 token=32"
    payload = lay.gather(caches, [4, 7])
    latent = caches[1].reshape(10, 16, 576)
    # layer 1, channel 5, token 16 + 3 (block 7, slot 3)
    assert payload[lay.layer_elements + 5 * 32 + 16 + 3] == latent[7, 3, 5]
    out = [torch.zeros_like(c) for c in caches]
    lay.scatter(out, payload, [1, 2], 0, 2)
    for src, dst in zip(caches, out):
        a, b = src.reshape(10, 16, 576), dst.reshape(10, 16, 576)
        assert torch.equal(a[4].view(torch.uint8), b[1].view(torch.uint8))
        assert torch.equal(a[7].view(torch.uint8), b[2].view(torch.uint8)) and not b[3:].any()
    with pytest.raises(layouts.UnknownLayout, match="MLA backend CPU_MLA"):
        layouts.choose(g, (10, 16, 512), layouts.EngineLayout("CPU_MLA"))


# -- recurrent state ----------------------------------------------------------------------------------------
SBS = 128
STATE_PARTS = [Part("full", (3,), (), (), SBS, 2, 64), Part("state", (0, 1, 2), (), (), SBS, 0, 4096, state="m")]


def _state_planner(tmp_path, **kw):
    return Planner(mount=str(tmp_path), namespaces=lambda: [["full"], ["state"]], block_size=SBS,
                   hash_block_size=SBS, chunk_size=C, save_decode=True,
                   guard=MountGuard(str(tmp_path), require_mount=False), parts=STATE_PARTS, groups=4,
                   asynchronous=True, **kw)


def test_a_recurrent_state_is_restored_only_at_the_end_of_the_chunk_it_was_saved_at(tmp_path):
    mamba = MambaSpec(block_size=SBS, shapes=((3, 640), (8, 64, 64)), dtypes=(BF16, torch.float32),
                      mamba_cache_mode="align")
    full = FullAttentionSpec(block_size=SBS, num_kv_heads=2, head_size=64, dtype=BF16)
    model = describe_model(_config((_layers(0), mamba), (_layers(1), mamba), (_layers(3), full)), "auto")
    assert [p.kind for p in model.parts] == ["full", "state"] and model.parts[1].stored_blocks(256) == 1
    assert "float32" in model.parts[1].state
    with pytest.raises(UnsupportedModel, match="mamba_cache_mode 'none'.*align"):
        describe_model(_config((_layers(0), MambaSpec(block_size=SBS, shapes=((4,),), dtypes=(BF16,))),), "auto")
    p = _state_planner(tmp_path)
    req = FakeRequest("a", list(range(1000, 1700)), 700, hash_block=SBS)
    for k in range(2):
        _touch(p, req, k)
    # 699 would need the state after 699 tokens: only chunk ends have one
    assert p.lookup(req, 0) == 512
    p.allocated(req, ([0, 0, 0, 41, 42], [0, 0, 0, 51, 52], [0, 0, 0, 61, 62], list(range(1, 7))), 512)
    loads, _ = p.step(_so())
    state = [(s.first_token, s.first_block, s.end_block, s.groups) for s in loads if s.part == 1]
    # the state after 512 tokens goes into block (512 - 1) // 128 = 3 of each state group: chunk 1's last
    assert state == [(256, 0, 1, [[41], [51], [61]])]


def test_a_state_is_saved_only_in_the_step_that_ends_at_the_chunks_end(tmp_path):
    p = _state_planner(tmp_path)
    req = FakeRequest("a", list(range(1000, 1700)), 700, hash_block=SBS)
    p.lookup(req, 0)
    tables = ([1, 2, 3, 4, 5, 6], [11, 12, 13, 14, 15, 16], [21, 22, 23, 24, 25, 26], [31, 32, 33, 34, 35, 36])
    p.allocated(req, tables, 0)
    new = types.SimpleNamespace(req_id="a", block_ids=tables, num_computed_tokens=0)
    _, saves = p.step(_so([new], tokens={"a": 256}))  # ends at chunk 0's end: its state is block 1
    assert [(s.first_token, s.part, s.groups) for s in saves] == [
        (0, 0, [[31, 32]]), (0, 1, [[2], [12], [22]])]
    cached = types.SimpleNamespace(req_ids=["a"], resumed_req_ids=set(), new_block_ids=[None],
                                   num_computed_tokens=[256])
    _, saves = p.step(_so(cached=cached, tokens={"a": 400}))  # ran past chunk 1's end (512) to 656
    assert [(s.first_token, s.part) for s in saves] == [(256, 0)] and p.stats["tails_not_saved"] == 1


def test_chunks_without_their_state_serve_longer_hits(tmp_path):
    """vLLM computed chunks 0-2 in one step: only chunk 2's end has a state. Chunks 0-1 keep their attention
    files, and a hit ends where a state is: 768, never 256 or 512 (no state there) nor 699."""
    p = _state_planner(tmp_path)
    req = FakeRequest("a", list(range(1000, 1900)), 900, hash_block=SBS)
    for k in range(3):
        for path in p.chunk_paths(req, k, 0):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            open(path, "wb").close()
    assert p.lookup(req, 0) == 0  # no state at any chunk end
    (state,) = p.chunk_paths(req, 2, 1)
    os.makedirs(os.path.dirname(state), exist_ok=True)
    open(state, "wb").close()
    assert p.lookup(req, 0) == 768
    os.unlink(p.chunk_paths(req, 1, 0)[0])  # a body file gone: nothing beyond chunk 0 is restorable
    assert p.lookup(req, 0) == 0


def test_every_part_of_a_tenants_chunk_is_under_its_directory_and_carries_its_group(tmp_path):
    from kvfs.events import parse_record

    p = Planner(mount=str(tmp_path), namespaces=lambda: [["full"], ["win"]], block_size=BS, hash_block_size=BS,
                chunk_size=C, save_decode=True, guard=MountGuard(str(tmp_path), require_mount=False),
                parts=PARTS, groups=3, asynchronous=True, tenant_dirs=True)
    req = FakeRequest("a", list(range(1000, 1700)), 700, hash_block=BS)
    req.cache_salt = "tenant-a"
    paths = p.all_chunk_paths(req, 0)
    assert len(paths) == 2 and len({os.path.relpath(x, tmp_path).split("/")[0] for x in paths}) == 1
    assert all(os.path.relpath(x, tmp_path).startswith("tenant-") for x in paths)
    record = parse_record(p.block_record(req, 0, group=0))
    assert record.group_idx == 0 and len(record.block_hashes) == C // BS
