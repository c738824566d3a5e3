"""The connector's worker side on a plain directory: saves and loads between a paged cache and chunk files.

The same tests run on every device the machine has (the CPU always; a CUDA GPU where torch sees one) and with
each layout family (cpu-vec is CPU-only: numpy): the GPU path is transfer.py's side streams and events, the CPU
path copies at once, and both go through the same WorkerSide code. CUDA-only tests at the end provoke the
cross-stream races the ordering rules exist for.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import threading
import time

import pytest
from kvfs_connector import chunkfile, files
from kvfs_connector.mount import MountGuard
from kvfs_connector.plan import LoadSpec, SaveSpec

torch = pytest.importorskip("torch", reason="torch comes with tools/install_vllm.sh")
from kvfs_connector import layout as layouts
from kvfs_connector.buffers import HostMemory
from kvfs_connector.worker import WorkerSide

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
CASES = [("cpu", "CPU_ATTN"), ("cpu", "FLASH_ATTN")] + ([("cuda", "FLASH_ATTN"), ("cuda", "FLASHINFER")] if CUDA else [])
ENGINES = {"CPU_ATTN": layouts.EngineLayout("CPU_ATTN", "vec"), "FLASH_ATTN": layouts.EngineLayout("FLASH_ATTN"),
           "FLASHINFER": layouts.EngineLayout("FLASHINFER")}


@pytest.fixture(params=CASES, ids=[f"{d}-{b}" for d, b in CASES])
def case(request):
    return request.param


def _worker(tmp_path, case, layers=3, blocks=10, **kw):
    device, backend = case
    g = layouts.Geometry(num_layers=layers, num_kv_heads=2, head_size=8, block_size=4, chunk_size=8,
                         dtype=torch.bfloat16)
    caches = [torch.randn(blocks, 2, 4, 16).to(torch.bfloat16).to(device) for _ in range(layers)]
    lay = layouts.choose(g, tuple(caches[0].shape), ENGINES[backend])
    w = WorkerSide(lay, caches, {f"layer.{i}": i for i in range(layers)}, 0,
                   MountGuard(str(tmp_path), require_mount=False), io_threads=2,
                   max_pending_save_bytes=kw.pop("max_pending", 1 << 30), **kw)
    tokens = list(range(300, 316))
    spec = SaveSpec("r", [str(tmp_path / "ns" / "ab" / "ab01.kv")], 8, 8, chunkfile.token_digest(tokens), [5, 2])
    return w, caches, spec, tokens


def _step_loads(w, specs, wait_layers=None):
    """One engine step's loads as vLLM drives them: start, wait before each layer's attention, finish."""
    w.start_load(specs)
    for name in (w.layer_index if wait_layers is None else wait_layers):
        w.wait_layer(name)
    w.finish_loads()
    if w.copies.device_side:
        torch.cuda.current_stream().synchronize()
    return w.take_failed_blocks()


def _load(w, spec, blocks, first=0, end=2):
    return _step_loads(w, [LoadSpec("r", spec.paths, spec.first_token, spec.n_tokens, spec.token_digest, blocks,
                                    first, end)])


def _bits(t):
    return t.view(torch.int16).cpu()


def test_worker_copies_out_before_returning_so_reused_blocks_cannot_leak(tmp_path, monkeypatch, case):
    from kvfs_connector import files

    w, caches, spec, _ = _worker(tmp_path, case)
    original = [c.clone() for c in caches]
    gate = threading.Event()
    real_write = files.write_atomic_many
    monkeypatch.setattr(files, "write_atomic_many", lambda *a, **k: gate.wait(10) and real_write(*a, **k))
    w.save([spec])
    for c in caches:  # vLLM hands blocks 5 and 2 to another request before the writer ran
        c.fill_(7.0)  # (on a GPU: queued on the forward stream, after the wait for the save's gathers)
    gate.set()
    w.flush(10)
    assert w.stats["saved_chunks"] == 1
    assert os.getxattr(spec.paths[0], "user.kvfs.dtype") == b"bf16"
    assert _load(w, spec, [0, 9]) == set()
    for c, o in zip(caches, original):
        assert torch.equal(_bits(c[0]), _bits(o[5]))
        assert torch.equal(_bits(c[9]), _bits(o[2]))
    w.save([spec])  # exists: skipped, not rewritten
    w.flush(10)
    assert w.stats["saves_existing"] == 1
    w.shutdown()


def test_worker_reports_vanished_foreign_and_damaged_chunks_as_load_errors(tmp_path, case):
    w, caches, spec, tokens = _worker(tmp_path, case)
    w.save([spec])
    w.flush(10)
    path = spec.paths[0]
    before = [c.clone() for c in caches]
    other = dataclasses.replace(spec, token_digest=chunkfile.token_digest(tokens[:-1] + [1]))
    assert _load(w, other, [0, 1]) == {0, 1}  # another prefix's KV under this name: never used
    assert all(torch.equal(_bits(c), _bits(b)) for c, b in zip(caches, before))  # nothing written
    assert _load(w, spec, [0, 1], first=1) == set()
    raw = bytearray(open(path, "rb").read())
    raw[-1] ^= 1
    open(path, "wb").write(raw)
    assert _load(w, spec, [3, 4]) == {3, 4}
    os.unlink(path)
    assert _load(w, spec, [3, 4], first=1) == {4}
    assert w.stats["load_errors"] == 3
    w.shutdown()


def test_worker_loads_many_chunks_exactly_with_few_buffers(tmp_path, case):
    """More loads in a step than readers and pooled buffers: every chunk lands in its own blocks, exactly,
    step after step; a failed load writes nothing and gives its buffer back."""
    w, caches, spec, tokens = _worker(tmp_path, case)
    saved = []
    for k, src in enumerate([[5, 2], [1, 3], [4, 6], [7, 8]]):  # four chunks with different contents
        s = dataclasses.replace(spec, paths=[str(tmp_path / "ns" / "ab" / f"ab0{k}.kv")], block_ids=src,
                                token_digest=chunkfile.token_digest(tokens + [k]))
        w.save([s])
        saved.append((s, [c[src].clone() for c in caches]))
    w.flush(10)
    w.warm_up().join(10)
    for step in range(3):
        for c in caches:
            c.fill_(3.0)
        specs = [LoadSpec("r", s.paths, s.first_token, s.n_tokens, s.token_digest, [2 * k, 2 * k + 1], 0, 2)
                 for k, (s, _) in enumerate(saved)]
        specs.append(LoadSpec("r", saved[0][0].paths, 8, 8, b"\0" * 16, [9, 9], 0, 1))  # foreign: refused
        assert _step_loads(w, specs) == {9}
        for k, (_, expected) in enumerate(saved):
            for layer, c in enumerate(caches):
                assert torch.equal(_bits(c[[2 * k, 2 * k + 1]]), _bits(expected[layer]))
        assert all(torch.equal(c[9], torch.full_like(c[9], 3.0)) for c in caches)  # untouched
        assert w.file_buffers.kept == w.file_buffers.keep == 2
    w.shutdown()


def test_worker_load_missing_a_layer_is_a_load_error(tmp_path, case):
    w, caches, spec, _ = _worker(tmp_path, case)
    w.save([spec])
    w.flush(10)
    load = LoadSpec("r", spec.paths, 8, 8, spec.token_digest, [0, 1], 0, 2)
    assert _step_loads(w, [load], wait_layers=["layer.0"]) == {0, 1}  # layers 1, 2 never waited
    w.shutdown()


def test_saves_beyond_the_pending_bound_are_dropped_not_waited_for(tmp_path, case, monkeypatch):

    w, caches, spec, tokens = _worker(tmp_path, case, max_pending=1)  # less than one chunk: every save dropped
    w.save([spec])
    w.flush(10)
    assert w.stats["saves_dropped"] == 1 and not os.path.exists(spec.paths[0])
    w.shutdown()


def test_staging_memory_is_bounded_and_pinned_only_on_a_gpu(tmp_path, case):
    w, caches, spec, _ = _worker(tmp_path, case, pinned_bytes=2 * (4096 + 3 * 2 * 2 * 4 * 16 * 2))
    w.warm_up().join(10)
    w.save([spec])
    w.flush(10)
    if w.copies.device_side:  # two reader buffers fill the bound: the save slot is pageable
        assert w.memory.pinned_bytes == 2 * w.file_size and w.memory.pageable_bytes == w.payload_bytes
    else:
        assert w.memory.pinned_bytes == 0 and w.memory.pageable_bytes == 2 * w.file_size + w.payload_bytes
    w.shutdown()


def test_failed_pinned_allocation_degrades_to_pageable_with_one_warning(caplog, monkeypatch):
    """Where pinning fails (here: no accelerator to pin for, or the pinned allocator refusing), buffers
    come from pageable memory and one warning says so; the engine never sees an error."""
    real_empty = torch.empty

    def refuse_pinned(*a, **kw):
        if kw.get("pin_memory"):
            raise RuntimeError("CUDA error: out of memory (cudaHostAlloc)")
        return real_empty(*a, **kw)

    monkeypatch.setattr(torch, "empty", refuse_pinned)
    mem = HostMemory(pinned=True, limit_bytes=1 << 30)
    with caplog.at_level(logging.WARNING, logger="vllm.kvfs_connector"):
        bufs = [mem.allocate(1 << 20) for _ in range(3)]
    assert all(b.numel() == 1 << 20 and not b.is_pinned() for b in bufs)
    assert mem.pinned_bytes == 0 and mem.pageable_bytes == 3 << 20
    warnings = [r for r in caplog.records if "pinned allocation" in r.getMessage()]
    assert len(warnings) == 1 and "out of memory" in warnings[0].getMessage()


# -- CUDA only: the orderings transfer.py promises, provoked -----------------------------------------------
def _sleep_on(stream, ms):
    """Hold a CUDA stream busy for about `ms` or longer (a spin kernel of ms x 2M cycles; the H200 clocks at
    up to 1.98 GHz): the work queued after it runs late."""
    if ms:
        with torch.cuda.stream(stream):
            torch.cuda._sleep(int(ms * 2e6))


# (forward stream late, side stream late): the first case catches a side stream that does not wait for the
# forward stream, the second a forward stream that does not wait for the side stream.
LATE = pytest.mark.parametrize("forward_ms, side_ms", [(300, 0), (0, 300)], ids=["forward-late", "side-late"])


@needs_cuda
@LATE
def test_cuda_save_waits_for_the_step_and_block_reuse_waits_for_the_save(tmp_path, forward_ms, side_ms):
    """Blocks reused while saves are in flight. The saved file must hold the step's KV even when the forward
    pass writes it late (the save stream waited for the forward stream), and the next request's writes into
    the reused blocks, queued on the forward stream right after save(), must not reach the file even when the
    save stream is slow (the forward stream waited for the gathers)."""
    w, caches, spec, _ = _worker(tmp_path, ("cuda", "FLASH_ATTN"))
    fwd = torch.cuda.current_stream()
    step_kv = [torch.randn(c[[5, 2]].shape, device="cuda").to(torch.bfloat16) for c in caches]
    torch.cuda.synchronize()
    _sleep_on(fwd, forward_ms)  # the forward pass may still be running when save() is called ...
    for c, kv in zip(caches, step_kv):
        c[[5, 2]] = kv  # ... and writes the chunk's KV at its end
    _sleep_on(w.copies.save_stream, side_ms)  # a slow save stream: its gathers run late
    w.save([spec])
    for c in caches:
        c.fill_(-1.0)  # the next step: the blocks belong to another request now
    w.flush(30)
    assert w.stats["saved_chunks"] == 1
    for c in caches:
        c.fill_(0.0)
    assert _load(w, spec, [0, 1]) == set()
    for c, kv in zip(caches, step_kv):
        assert torch.equal(_bits(c[[0, 1]]), _bits(kv))
    w.shutdown()


@needs_cuda
@LATE
def test_cuda_load_waits_for_earlier_kernels_and_attention_waits_for_its_layer(tmp_path, forward_ms, side_ms):
    """The previous step's kernels still read blocks that a load now fills: they see the old values even when
    they run late (the load waited for the forward stream as of start_load), and a layer's attention, queued
    after wait_layer, sees the loaded values even when the load stream is slow."""
    w, caches, spec, _ = _worker(tmp_path, ("cuda", "FLASH_ATTN"))
    w.save([spec])
    w.flush(10)
    expected = [c[[5, 2]].clone() for c in caches]
    for c in caches:
        c.fill_(2.0)
    fwd = torch.cuda.current_stream()
    torch.cuda.synchronize()
    _sleep_on(fwd, forward_ms)
    seen_before = [c[[0, 1]].clone() for c in caches]  # the previous step still reads blocks 0 and 1
    _sleep_on(w.copies.load_stream, side_ms)
    w.start_load([LoadSpec("r", spec.paths, 8, 8, spec.token_digest, [0, 1], 0, 2)])
    seen_after = []
    for i, name in enumerate(w.layer_index):
        w.wait_layer(name)
        seen_after.append(caches[i][[0, 1]].clone())  # "attention" of layer i, on the forward stream
    w.finish_loads()
    torch.cuda.synchronize()
    assert w.take_failed_blocks() == set()
    for before, after, exp in zip(seen_before, seen_after, expected):
        assert torch.equal(before, torch.full_like(before, 2.0))
        assert torch.equal(_bits(after), _bits(exp))
    w.shutdown()


@pytest.mark.parametrize("direct_writes", [True, False])
def test_worker_saves_into_a_kvfs_mount_past_fuse_by_default(make_mount, direct_writes):
    """On a real mount the worker encodes chunks itself and kvfs adopts them (direct_writes, the default);
    off, the chunk is written through the mount. Either way it loads back exactly."""
    m = make_mount().start()
    w, caches, spec, _ = _worker(m.mountpoint, ("cpu", "CPU_ATTN"), direct_writes=direct_writes)
    original = [c.clone() for c in caches]
    w.save([spec])
    w.flush(10)
    assert w.stats["saved_chunks"] == 1 and w.stats["saved_direct"] == int(direct_writes)
    s = m.stats()
    assert (s["direct_writes"], s["commits"]) == ((1, 0) if direct_writes else (0, 1))
    assert os.getxattr(spec.paths[0], "user.kvfs.dtype") == b"bf16"
    assert os.getxattr(spec.paths[0], "user.kvfs.shape") == w.xattrs["user.kvfs.shape"]
    assert not [p for p in os.listdir(os.path.dirname(spec.paths[0])) if p.endswith(".tmp")]
    assert _load(w, spec, [0, 9]) == set()
    for c, o in zip(caches, original):
        assert torch.equal(_bits(c[0]), _bits(o[5])) and torch.equal(_bits(c[9]), _bits(o[2]))
    w.save([spec])  # exists: skipped
    w.flush(10)
    assert w.stats["saves_existing"] == 1
    w.shutdown()


def test_a_steps_saves_are_adopted_together(make_mount):
    """Six chunks saved in one step by two writer threads: kvfs adopts each thread's chunks in one request
    (kvfs.direct.write_files), and every chunk loads back into its blocks exactly."""
    m = make_mount().start()
    w, caches, _, _ = _worker(m.mountpoint, ("cpu", "CPU_ATTN"), save_threads=2)
    original = [c.clone() for c in caches]
    specs = []
    for i in range(6):
        tokens = list(range(100 * i, 100 * i + 8))
        specs.append(SaveSpec("r", [str(m.mountpoint / "ns" / "ab" / f"ab{i:02x}.kv")], 0, 8,
                              chunkfile.token_digest(tokens), [i, i + 4]))
    before = m.stats()["adopt_requests"]
    w.save(specs)
    w.flush(10)
    assert w.stats["saved_chunks"] == 6 and w.stats["saved_direct"] == 6
    assert m.stats()["adopt_requests"] - before == 2 and m.stats()["direct_writes"] == 6
    for i, spec in enumerate(specs):
        assert _load(w, spec, [9, 8]) == set()
        for c, o in zip(caches, original):
            assert torch.equal(_bits(c[9]), _bits(o[i])) and torch.equal(_bits(c[8]), _bits(o[i + 4]))
    w.shutdown()


def test_worker_saves_and_loads_on_a_sealed_mount(make_mount, tmp_path):
    """Encryption at rest on every tier (docs/security.md): the worker holds no key, so its saves and loads go
    through the mount (no direct write is offered, no object location given), and the chunk round-trips."""
    from kvfs import crypto
    from kvfs import format as fmt

    key = tmp_path / "k.key"
    crypto.write_key_file(key)
    m = make_mount().start("--key-file", str(key), "--encrypt", "L2,L3")
    w, caches, spec, _ = _worker(m.mountpoint, ("cpu", "CPU_ATTN"))
    original = [c.clone() for c in caches]
    w.save([spec])
    w.flush(10)
    assert w.stats["saved_chunks"] == 1 and w.stats["saved_direct"] == 0
    s = m.stats()
    assert (s["direct_writes"], s["commits"]) == (0, 1)
    (obj,) = m.objects("L2")
    assert fmt.parse_header(obj.read_bytes()).sealing[0] == crypto.load_key_file(key).key_id
    assert _load(w, spec, [0, 9]) == set()
    for c, o in zip(caches, original):
        assert torch.equal(_bits(c[0]), _bits(o[5])) and torch.equal(_bits(c[9]), _bits(o[2]))
    assert m.stats()["direct_reads"] == 0
    w.shutdown()


def test_saves_are_shed_while_the_mover_is_behind_and_loads_go_on(make_mount, ceph, tmp_path):
    """Back-pressure (docs/hotcold.md): RGW paused, L2 and L3 fill, the mover falls behind (congested). New
    saves are skipped and counted — in the worker, and by the daemon for a save that arrives anyway — instead
    of waiting for room; a load of a stored chunk goes on. RGW back, the mover catches up and saves resume."""
    import uuid

    from kvfs import direct
    from test_l4 import start_with_l4
    from test_tiers import wait_for

    toml = tmp_path / "kvfs.toml"
    toml.write_text('[mount]\nmax_backlog = "10%"\n[l4]\ndeadline_s = 60\ntimeout_s = 90\nprobe_s = 1\n')
    m = start_with_l4(make_mount(), ceph, f"bp-{uuid.uuid4().hex[:8]}", "--promote", "never", "--config", str(toml),
                      l2="4M", l3="4M")
    w, caches, spec, _ = _worker(m.mountpoint, ("cpu", "CPU_ATTN"))
    original = [c.clone() for c in caches]
    w.save([spec])
    w.flush(10)
    os.setxattr(spec.paths[0], "user.kvfs.pin", b"1")  # stays in L2 whatever else moves
    assert w.stats["saved_chunks"] == 1 and os.getxattr(m.mountpoint, "user.kvfs.congested") == b"0"

    ceph.pause_rgw()
    filler = threading.Thread(target=_fill, args=(m.path("fill"), 24), daemon=True)
    try:
        filler.start()  # blocks in write() once L2 and L3 are full: the mover cannot move to L4
        wait_for(lambda: _stuck(m), timeout=30, what="L2 and L3 full, a writer waiting: congestion")
        assert os.getxattr(m.mountpoint, "user.kvfs.congested") == b"1"
        shed = SaveSpec("r", [spec.paths[0].replace("ab01", "ab02")], 8, 8, spec.token_digest, [1, 3])
        time.sleep(files.CONGESTION_RECHECK_S)  # past the worker's last answer (not congested, at the first save)
        w.save([shed])
        w.flush(10)
        assert w.stats["saves_shed"] == 1 and not os.path.exists(shed.paths[0]), (dict(w.stats), m.stats()["mover"])
        with pytest.raises(OSError) as e:  # a sheddable direct write that got past the check: refused
            direct.write_file(m.path("late.kv"), os.urandom(1 << 20), shed=True)
        assert e.value.errno == errno.EBUSY and not m.path("late.kv").exists()
        assert m.stats()["saves_shed"] == 2  # the worker's skip (reported or refused) and this one
        with pytest.raises(OSError) as e:
            os.setxattr(m.mountpoint, "user.kvfs.shed", b"many")
        assert e.value.errno == errno.EINVAL
        assert _load(w, spec, [0, 9]) == set()  # loads go on
        for c, o in zip(caches, original):
            assert torch.equal(_bits(c[0]), _bits(o[5])) and torch.equal(_bits(c[9]), _bits(o[2]))
    finally:
        ceph.resume_rgw()
        filler.join(120)
    wait_for(lambda: m.stats()["mover"]["congested"] == 0, timeout=60, what="the mover to catch up")
    time.sleep(files.CONGESTION_RECHECK_S)
    w.save([shed])
    w.flush(10)
    assert w.stats["saved_chunks"] == 2 and os.path.exists(shed.paths[0])
    w.shutdown()


def _stuck(m) -> bool:
    """Congested for good while the store is paused: L3 is full (its moves to L4 hang) and a writer waits for
    L2 room that only those moves can make. Before that, congestion comes and goes as L2 drains into L3."""
    s = m.stats()
    l3 = s["tiers"]["L3"]
    return s["mover"]["congested"] == 1 and s["mover"]["writers_waiting"] >= 1 and \
        l3["used_bytes"] + (1 << 20) > l3["capacity_bytes"]  # no room for another of the filler's files


def _fill(directory, n: int, size: int = 1 << 20) -> None:
    directory.mkdir(exist_ok=True)
    for i in range(n):
        (directory / f"f{i}").write_bytes(os.urandom(size))


# -- fp8 bytes and MLA latents: the same worker path on every device (a GPU host runs the CUDA cases) --------
DEVICES = ["cpu"] + (["cuda"] if CUDA else [])


def _real_fp8_cache(blocks: int, layer: int, scale: float = 1.0) -> torch.Tensor:
    """A token-kv paged cache `[blocks, 3 heads, 16, K(64) | V(64)]` of real-derived fp8 KV: layer `layer` of
    SmolLM2's real bf16 KV (tests/data/kv: 128 tokens, repeated along the blocks) cast to e4m3 under a
    per-tensor scale, as vLLM's cache writers do (round to nearest here; vLLM's CPU kernels truncate)."""
    raw = open(os.path.join(os.path.dirname(__file__), "data", "kv", "bf16-prose-0004.kv"), "rb").read()
    a = torch.frombuffer(bytearray(raw), dtype=torch.bfloat16).view(30, 3, 2, 8192)[layer]
    k = a[:, 0].reshape(3, 64, 128).permute(0, 2, 1)  # [head][token][dim]
    v = a[:, 1].reshape(3, 128, 64)
    kv = torch.cat([k, v], dim=-1)  # [head][token][K | V]
    tokens = kv.repeat(1, -(-blocks * 16 // 128), 1)[:, :blocks * 16]  # [head][token][128]
    cache = tokens.reshape(3, blocks, 16, 128).permute(1, 0, 2, 3).contiguous()
    return (cache.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)


def _part_worker(directory, device, kind, blocks=12, **kw):
    if kind == "fp8":
        g = layouts.Geometry(num_layers=3, num_kv_heads=3, head_size=64, block_size=16, chunk_size=32,
                             dtype=torch.uint8)
        shape, engine = (blocks, 3, 16, 128), layouts.EngineLayout("FLASH_ATTN")
    else:
        g = layouts.Geometry(num_layers=3, num_kv_heads=1, head_size=576, block_size=16, chunk_size=32,
                             dtype=torch.bfloat16)
        shape, engine = (blocks, 1, 16, 576), layouts.EngineLayout("CPU_MLA" if device == "cpu" else "FLASHMLA")
    caches = []
    for layer in range(3):
        if kind == "fp8":
            caches.append(_real_fp8_cache(blocks, 10 * layer).to(device))
        else:
            caches.append(torch.randn(shape).to(torch.bfloat16).to(device))
    lay = layouts.choose(g, shape, engine)
    w = WorkerSide(lay, caches, {f"layer.{i}": i for i in range(3)}, 0,
                   MountGuard(str(directory), require_mount=False), io_threads=2, max_pending_save_bytes=1 << 30,
                   dtype_hint=b"fp8_e4m3" if kind == "fp8" else None, **kw)
    tokens = list(range(500, 532))
    spec = SaveSpec("r", [str(directory / kind / "ab" / "ab01.kv")], 0, 32, chunkfile.token_digest(tokens), [7, 2])
    return w, caches, spec


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["fp8", "mla"])
def test_fp8_bytes_and_mla_latents_round_trip_bit_exactly(tmp_path, device, kind):
    w, caches, spec = _part_worker(tmp_path, device, kind)
    original = [c.clone() for c in caches]
    w.save([spec])
    w.flush(10)
    assert w.stats["saved_chunks"] == 1
    for c in caches:
        c.zero_()
    assert _load(w, spec, [3, 10]) == set()
    for c, o in zip(caches, original):
        assert torch.equal(c[3].view(torch.uint8).cpu(), o[7].view(torch.uint8).cpu())
        assert torch.equal(c[10].view(torch.uint8).cpu(), o[2].view(torch.uint8).cpu())
        assert not c[[0, 1, 2, 4, 5, 6, 7, 8, 9, 11]].any()
    w.shutdown()


def test_fp8_chunks_are_coded_as_one_byte_floats_in_kvfs(make_mount):
    """Real-derived e4m3 KV (128 real tokens of three layers) saved by the worker into a mount (past FUSE):
    kvfs codes it with its codec for 1-byte floats (5, entropy8) below 0.80 of raw, and it loads back
    bit-exactly."""
    m = make_mount().start()
    w, caches, _ = _part_worker(m.mountpoint, "cpu", "fp8", blocks=17)
    g = dataclasses.replace(w.layout.g, chunk_size=128)  # the 128 real tokens, none repeated
    w.shutdown()
    lay = layouts.choose(g, tuple(caches[0].shape), layouts.EngineLayout("FLASH_ATTN"))
    w = WorkerSide(lay, caches, {f"layer.{i}": i for i in range(3)}, 0,
                   MountGuard(str(m.mountpoint), require_mount=False), io_threads=2,
                   max_pending_save_bytes=1 << 30, dtype_hint=b"fp8_e4m3")
    original = [c.clone() for c in caches]
    path = str(m.mountpoint / "fp8" / "ab" / "ab02.kv")
    spec = SaveSpec("r", [path], 0, 128, chunkfile.token_digest(range(128)), list(range(8)))
    w.save([spec])
    w.flush(10)
    assert w.stats["saved_direct"] == 1
    assert os.getxattr(path, "user.kvfs.dtype") == b"fp8_e4m3" and os.getxattr(path, "user.kvfs.codec") == b"entropy8"
    ratio = int(os.getxattr(path, "user.kvfs.stored_bytes")) / os.stat(path).st_size
    print(f"fp8 chunk through the connector: stored/raw {ratio:.4f}")
    assert ratio < 0.80, ratio
    for c in caches:
        c.zero_()
    assert _load(w, spec, list(range(8, 16)), end=8) == set()
    for c, o in zip(caches, original):
        assert torch.equal(c[8:16], o[0:8])
    w.shutdown()


def test_asynchronous_loads_finish_by_request_and_fail_by_request(tmp_path, case):
    """Hybrid models' loads (LoadSpec.asynchronous): no layer waits for them; poll_async reports a request
    once every load of it is in the paged cache (device copies done), and the failed ones by request, with
    no block ids (vLLM refuses those from models of several groups)."""
    w, caches, spec, tokens = _worker(tmp_path, case)
    original = [c.clone() for c in caches]
    w.save([spec])
    w.flush(10)
    good = LoadSpec("a", spec.paths, spec.first_token, spec.n_tokens, spec.token_digest, [0, 9], 0, 2,
                    asynchronous=True)
    bad = dataclasses.replace(good, req_id="b", block_ids=[1, 8], token_digest=b"\0" * 16)
    w.start_load([good, bad])
    w.finish_loads()  # the step ends: asynchronous loads go on
    finished, failed = set(), set()
    deadline = time.monotonic() + 10
    while finished != {"a", "b"} and time.monotonic() < deadline:
        done, bad_ones = w.poll_async()
        finished |= done
        failed |= bad_ones
        time.sleep(0.005)
    assert finished == {"a", "b"} and failed == {"b"}
    assert w.take_failed_blocks() == set()
    for c, o in zip(caches, original):
        assert torch.equal(_bits(c[0]), _bits(o[5])) and torch.equal(_bits(c[9]), _bits(o[2]))
        assert torch.equal(_bits(c[1]), _bits(o[1])) and torch.equal(_bits(c[8]), _bits(o[8]))  # untouched
    assert w.poll_async() == (set(), set())
    w.shutdown()
