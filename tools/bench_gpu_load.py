#!/usr/bin/env python3
"""Load GB/s of one engine's connector worker from kvfs L2 into a paged KV cache, on a GPU or the CPU.

What it runs is the connector's own worker (kvfs_connector.worker.WorkerSide) over a paged cache in vLLM's
GPU layout (token-kv: [blocks, kv heads, block size 16, K|V], bf16) on the device, loading one step of
`--chunks` chunk files of 256 tokens of real SmolLM2 KV (tests/data/kv, 5.9 MB each, 30 layers): reader
threads read and decode each chunk object into pinned buffers, verify it, copy it to the device on a side
stream and scatter it into its blocks, with an event per layer that the "attention" of each layer waits on.
Time = start_load to the forward stream having waited on every layer (synchronised), per GB of KV loaded.

Arms, side by side in every round (the machine is shared and noisy: compare ratios):
  kvfs-<codec>  the chunk files as kvfs L2 objects (tmpfs), encoded the way a mount encodes them (the mount's
                encoder, codec `auto` = entropy for bf16 KV, or the one named), read past FUSE as kvfs.direct
                reads them: the object is located, read and decoded in the worker. The locating getxattr
                through FUSE is replaced by a table lookup (the lent GPU machine has no FUSE stack), which
                leaves out ~0.1 ms per chunk
  plain         the chunk files on tmpfs as plain files: no decode, no kvfs (the bare-file ceiling)
  h2d           one pinned host → device copy of the same bytes (the DMA ceiling)
  decode-<codec>  the readers' part alone: the same objects read and decoded by as many threads into
                reused buffers, no connector, no device (what the host can decode)
  kvfs-<codec>-per-frame  (--per-frame) as kvfs-<codec>, with the decoder kvfs.direct had before the kernel
                decoded whole runs of frames: one kernel call per frame, the GIL held in between
Every loaded cache is checked bit for bit against the KV that was stored. Save GB/s (gather on the device,
copy to pinned slots, write chunk files to tmpfs) is measured once per thread count.

    python tools/bench_gpu_load.py [--chunks 64] [--rounds 5] [--threads 4 8] [--codecs auto none]
Table on stdout, JSON in bench-results/bench_gpu_load.json. `tools/bench_ttft.py --gpu` runs it.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "connector"))
sys.path.insert(0, str(REPO))

from kvfs import codecs, direct  # noqa: E402
from kvfs import format as fmt  # noqa: E402
from kvfs.codecs import transforms  # noqa: E402
from kvfs.openfile import EncodingPolicy  # noqa: E402
from kvfs_connector import chunkfile  # noqa: E402
from kvfs_connector import layout as layouts  # noqa: E402
from kvfs_connector.mount import MountGuard  # noqa: E402
from kvfs_connector.plan import LoadSpec, SaveSpec  # noqa: E402
from kvfs_connector.worker import WorkerSide  # noqa: E402

LAYERS, HEADS, HEAD, SAMPLE_BLOCK = 30, 3, 64, 128  # SmolLM2-135M, the real KV in tests/data/kv
BLOCK, CHUNK = 16, 256  # vLLM's GPU block size, the connector's chunk
FRAME = 1 << 20


def real_kv_payloads(n: int) -> list[np.ndarray]:
    """n chunk payloads (token-kv order: layer, kv, head, channel, token) of real bf16 KV: two 128-token
    blocks each, from the committed samples, tokens rotated per chunk so that no two chunks are equal."""
    blocks = []
    for f in sorted((REPO / "tests/data/kv").glob("bf16-*.kv")):
        a = np.fromfile(f, dtype="<u2").reshape(LAYERS, HEADS, 2, 64 * SAMPLE_BLOCK)
        k = a[:, :, 0].reshape(LAYERS, HEADS, HEAD, SAMPLE_BLOCK)  # already [channel][token]
        v = a[:, :, 1].reshape(LAYERS, HEADS, SAMPLE_BLOCK, HEAD).transpose(0, 1, 3, 2)
        blocks.append(np.stack([k, v], axis=1))  # layer, kv, head, channel, token
    out = []
    for i in range(n):
        first, second = blocks[i % len(blocks)], blocks[(i // len(blocks) + 1) % len(blocks)]
        pair = np.concatenate([np.roll(first, i, axis=-1), np.roll(second, 3 * i, axis=-1)], axis=-1)
        out.append(np.ascontiguousarray(pair).reshape(-1))
    return out


def encode_object(data: bytes, codec: str | None, shape: bytes) -> list[bytes]:
    """The kvfs object a mount would commit for this file (its encoder, 1 MiB frames, the shape hint)."""
    policy = EncodingPolicy(None if codec == "auto" else codecs.by_name(codec), "bf16", shape)
    frames = [policy.encode(data[off:off + FRAME], off) for off in range(0, len(data), FRAME)]
    header = fmt.Header(raw_size=len(data), frame_size=FRAME, n_frames=len(frames),
                        transform=policy.transform or transforms.IDENTITY, element_size=policy.element_size,
                        codec=policy.codec_id, dtype=fmt.DTYPES["bf16"],
                        extensions=fmt.tlv(fmt.EXT_SHAPE, shape))
    parts, _ = fmt.build_object(header, frames)
    return parts


@dataclasses.dataclass
class Setup:
    layout: layouts.ChunkLayout
    files: list[Path]  # chunk files (plain)
    specs: list[LoadSpec]
    expected: list[torch.Tensor]  # per layer: the blocks' contents after a load (on the device)


def build(work: Path, n: int, device: torch.device) -> tuple[Setup, list[np.ndarray]]:
    g = layouts.Geometry(LAYERS, HEADS, HEAD, BLOCK, CHUNK, torch.bfloat16)
    shape = (n * CHUNK // BLOCK, HEADS, BLOCK, 2 * HEAD)
    lay = layouts.choose(g, shape, layouts.EngineLayout("FLASH_ATTN"))
    payloads = real_kv_payloads(n)
    files, specs = [], []
    bpc = CHUNK // BLOCK
    for i, p in enumerate(payloads):
        tokens = list(range(i * 1000, i * 1000 + CHUNK))
        digest = chunkfile.token_digest(tokens)
        path = work / "plain" / f"{i:04d}.kv"
        path.parent.mkdir(parents=True, exist_ok=True)
        parts = chunkfile.build(0, CHUNK, digest, lay.descriptor(), p.view(np.uint8))
        path.write_bytes(b"".join(bytes(x) for x in parts))
        files.append(path)
        specs.append(LoadSpec(f"r{i}", [str(path)], 0, CHUNK, digest, list(range(i * bpc, (i + 1) * bpc)), 0, bpc))
    # the cache a perfect load leaves: every chunk's payload scattered into its blocks
    cache = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(LAYERS)]
    for spec, p in zip(specs, payloads):
        lay.scatter(cache, torch.from_numpy(p.view(np.int16)).view(torch.bfloat16), spec.block_ids, 0, bpc)
    expected = [c.to(device) for c in cache]
    return Setup(lay, files, specs, expected), payloads


def write_objects(setup: Setup, work: Path, codec: str) -> tuple[dict[str, direct.Location], float]:
    hint = setup.layout.shape_hint(chunkfile.HEADER_SIZE).encode()
    where, raw, stored = {}, 0, 0
    for f in setup.files:
        data = f.read_bytes()
        obj = work / f"objects-{codec}" / f.name
        obj.parent.mkdir(parents=True, exist_ok=True)
        obj.write_bytes(b"".join(encode_object(data, codec, hint)))
        size = obj.stat().st_size
        where[str(f)] = direct.Location("L2", size, len(data), str(obj))
        raw += len(data)
        stored += size
    return where, stored / raw


def per_frame_decode(fd, table, frames, first, stop, dest) -> None:
    """kvfs.direct's decoder before whole runs went to the kernel: one frame at a time from Python."""
    done = 0
    for entry in frames[first:stop]:
        direct._decode_whole(fd, entry, dest[done:done + entry.raw_len])
        done += entry.raw_len


def decode_only(where: dict[str, direct.Location], threads: int) -> float:
    """Seconds for `threads` threads to read and decode every object into reused buffers."""
    locs = list(where.values())
    bufs = [bytearray(loc.size) for loc in locs[:threads]]

    def work(k: int) -> None:
        for loc in locs[k::threads]:
            direct.read_object(loc, into=bufs[k])

    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(work, range(threads)))  # warm: buffers faulted in, threads started
        t0 = time.perf_counter()
        list(pool.map(work, range(threads)))
        return time.perf_counter() - t0


def load_step(w: WorkerSide, setup: Setup) -> float:
    """One engine step loading every chunk: seconds until every layer's copies are in."""
    sync = torch.cuda.synchronize if w.copies.device_side else (lambda: None)
    sync()
    t0 = time.perf_counter()
    w.start_load(setup.specs)
    for name in w.layer_index:
        w.wait_layer(name)  # vLLM: before each layer's attention
    w.finish_loads()
    sync()
    elapsed = time.perf_counter() - t0
    failed = w.take_failed_blocks()
    if failed:
        raise SystemExit(f"{len(failed)} blocks failed to load")
    return elapsed


def check_exact(w: WorkerSide, setup: Setup) -> None:
    for c, e in zip(w.kv_layers, setup.expected):
        if not torch.equal(c.view(torch.int16), e.view(torch.int16)):
            raise SystemExit("a loaded cache differs from the stored KV")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunks", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--codecs", nargs="+", default=["auto", "none"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--switch-interval", type=float, default=None,
                    help="sys.setswitchinterval for the run (seconds; Python's default is 0.005)")
    ap.add_argument("--per-frame", action="store_true",
                    help="also run each kvfs arm with the frame-by-frame decoder (kernel runs vs Python loop)")
    ap.add_argument("--workdir", type=Path, default=Path("/dev/shm"))
    ap.add_argument("--out", type=Path, default=REPO / "bench-results" / "bench_gpu_load.json")
    args = ap.parse_args()
    device = torch.device(args.device)
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    work = Path(tempfile.mkdtemp(prefix="kvfs-gpu-load-", dir=args.workdir))
    try:
        return run(args, device, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(args, device: torch.device, work: Path) -> int:
    setup, payloads = build(work, args.chunks, device)
    gb = args.chunks * setup.layout.payload_bytes / 1e9
    ratios, locations = {}, {}
    for codec in args.codecs:
        locations[codec], ratios[codec] = write_objects(setup, work, codec)
    arms = [f"kvfs-{c}" for c in args.codecs]
    arms += [f"{a}-per-frame" for a in arms if args.per_frame] + ["plain"]
    real_locate = direct.locate
    table = {arm: {t: [] for t in args.threads} for arm in arms}
    saves, h2d = {}, []
    decode = {c: {t: [] for t in args.threads} for c in args.codecs}
    runs_decode = direct._decode_frames
    host = torch.empty(args.chunks * setup.layout.payload_bytes, dtype=torch.uint8,
                       pin_memory=device.type == "cuda")
    dev = torch.empty_like(host, device=device)
    workers = {}
    for t in args.threads:
        cache = [torch.zeros_like(e) for e in setup.expected]
        workers[t] = WorkerSide(setup.layout, cache, {f"layer.{i}": i for i in range(LAYERS)}, 0,
                                MountGuard(str(work), require_mount=False), io_threads=t,
                                max_pending_save_bytes=1 << 40)
        workers[t].warm_up().join()
    try:
        for rnd in range(args.rounds):
            order = arms if rnd % 2 == 0 else arms[::-1]
            for t, w in workers.items():
                for arm in order:
                    where = locations.get(arm.removeprefix("kvfs-").removesuffix("-per-frame"))
                    direct.locate = (lambda p, where=where: where.get(os.fspath(p))) if where else (lambda p: None)
                    direct._decode_frames = per_frame_decode if arm.endswith("-per-frame") else runs_decode
                    for c in w.kv_layers:
                        c.zero_()
                    table[arm][t].append(load_step(w, setup))
                    if rnd == 0:
                        check_exact(w, setup)
                for codec in args.codecs:
                    decode[codec][t].append(decode_only(locations[codec], t))
            if device.type == "cuda":
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                dev.copy_(host, non_blocking=True)
                torch.cuda.synchronize()
                h2d.append(time.perf_counter() - t0)
        direct.locate, direct._decode_frames = real_locate, runs_decode
        loads = {t: w.stats["loaded_chunks"] for t, w in workers.items()}
        reader_cpu = {str(t): w.stats["load_cpu_us"] / 1e3 / max(1, loads[t]) for t, w in workers.items()}
        for t, w in workers.items():  # saves: the same chunks back out of the loaded cache into new files
            out = work / f"saved-{t}"
            specs = [SaveSpec(s.req_id, [str(out / Path(s.paths[0]).name)], 0, CHUNK, s.token_digest, s.block_ids)
                     for s in setup.specs]
            t0 = time.perf_counter()
            w.save(specs)
            w.flush(600)
            saves[t] = time.perf_counter() - t0
            if w.stats["saved_chunks"] != args.chunks or (out / setup.files[0].name).read_bytes() != setup.files[0].read_bytes():
                raise SystemExit("saved chunk files differ from the originals")
    finally:
        direct.locate, direct._decode_frames = real_locate, runs_decode
        for w in workers.values():
            w.shutdown()
    doc = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "cpus": os.cpu_count(), "switch_interval_s": sys.getswitchinterval(), "torch": torch.__version__, "chunks": args.chunks, "rounds": args.rounds,
           "gb_per_step": gb, "stored_over_raw": ratios,
           "load_gbps": {arm: {str(t): [gb / s for s in v] for t, v in per.items()} for arm, per in table.items()},
           "decode_only_gbps": {c: {str(t): [gb / s for s in v] for t, v in per.items()}
                                for c, per in decode.items()},
           "save_gbps": {str(t): gb / s for t, s in saves.items()},
           "h2d_gbps": [gb / s for s in h2d], "reader_cpu_ms_per_chunk": reader_cpu}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1))
    print_table(doc)
    return 0


def print_table(doc: dict) -> None:
    print(f"\n{doc['device']}, {doc['cpus']} CPUs, torch {doc['torch']}, GIL switch interval "
          f"{doc['switch_interval_s'] * 1e3:g} ms: one step loading {doc['chunks']} chunks "
          f"({doc['gb_per_step']:.2f} GB of KV), {doc['rounds']} rounds, medians (min-max) GB/s")
    threads = list(next(iter(doc["load_gbps"].values())))
    print("| arm | stored/raw | " + " | ".join(f"load, {t} readers" for t in threads) + " |")
    print("|---|---|" + "---|" * len(threads))
    for arm, per in doc["load_gbps"].items():
        ratio = doc["stored_over_raw"].get(arm.removeprefix("kvfs-").removesuffix("-per-frame"))
        cells = [f"{statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f})" for v in per.values()]
        print(f"| {arm} | {'%.3f' % ratio if ratio else '1.0'} | " + " | ".join(cells) + " |")
    for codec, per in doc.get("decode_only_gbps", {}).items():
        cells = [f"{statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f})" for v in per.values()]
        print(f"| decode-{codec} (readers only) | | " + " | ".join(cells) + " |")
    print("| save (gather, pinned copy, write) | | " + " | ".join(f"{doc['save_gbps'][t]:.2f}" for t in threads) + " |")
    print("reader CPU ms per chunk (read, decode, verify; all arms): "
          + ", ".join(f"{t} readers {v:.2f}" for t, v in doc["reader_cpu_ms_per_chunk"].items()))
    if doc["h2d_gbps"]:
        print(f"host→device copy ceiling (pinned, one copy): {statistics.median(doc['h2d_gbps']):.1f} GB/s")


if __name__ == "__main__":
    raise SystemExit(main())
