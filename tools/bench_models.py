#!/usr/bin/env python3
"""Every model family through the connector: TTFT of a full hit against recompute, and the bytes a full hit
reads from kvfs per part (a sliding window reads only its window, a recurrent state one block). One run.

Families (tools/model_families.py): tiny dummy-weight vLLM CPU engines of each attention kind. Per family,
every arm a fresh engine process (vLLM's own prefix cache off where the family allows it):
  recompute   no connector
  store       the connector on a fresh kvfs mount: computes and stores the prompts (not measured)
  hit         a fresh engine, the connector, the same prompts: full hits (TTFT measured)
  bytes       a fresh engine, the connector with direct_reads off, the same prompts: every byte of the
              load goes through the mount, whose read() counter (.kvfs/stats bytes_read) is the bytes a
              full hit reads
Prompts: --reps distinct token sequences of --tokens + 1 tokens (a hit of --tokens, a chunk multiple),
after one warm-up request per engine; prefill in steps of 256 tokens. Dummy weights make KV that says
nothing about compression, so the engines give no stored/raw.

`--latents`: stored/raw of real-derived MLA latents instead, through the connector's worker into a kvfs
mount, beside the same tokens' GQA chunks. There is no real MLA model here, so the latents come from SmolLM2's
real weights and activations the way MHA2MLA converts a GQA model: per layer, the SVD of its stacked K and V
projections, W = U S V^T, gives the latent c = S V^T h of the layer's real input h (384 dims, RMS-normalised as
DeepSeek's kv_a_layernorm does), and the rope part is the real K of head 0 after RoPE (64 dims): 448 per token.

    .venv/bin/python tools/bench_models.py [--families ...] [--tokens 2304] [--reps 3] [--latents]
Table on stdout, JSON in bench-results/bench_models.json (bench_models_latents.json with --latents).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vllm_driver  # noqa: E402
from bench_harness import REPO, Mount  # noqa: E402
from model_families import FAMILIES, fp8_unavailable, model_dir  # noqa: E402

SOURCES = sorted(Path(sys.base_prefix, "lib", f"python{sys.version_info[0]}.{sys.version_info[1]}").glob("*.py"))


def prompts(n: int, count: int, tokenizer) -> list[list[int]]:
    """count distinct token sequences of n tokens (Python standard library sources), one more for warm-up."""
    out, seen = [], set()
    for path in SOURCES:
        ids = tokenizer(path.read_text(errors="replace"))["input_ids"]
        if len(ids) >= n and tuple(ids[:64]) not in seen:
            seen.add(tuple(ids[:64]))
            out.append(ids[:n])
        if len(out) == count + 1:
            return out
    raise SystemExit(f"not enough source files of {n} tokens")


def engine(tmp: Path, model: Path, rounds: list[dict], mount: Path | None, options: dict, **extra) -> dict:
    conn = None
    if mount is not None:
        conn = {"kv_connector": "KVFSConnector", "kv_connector_module_path": "kvfs_connector",
                "kv_connector_extra_config": {"mount": str(mount), **extra}}
    # prefill steps of 256 tokens, as the engine tests run (vLLM 0.32's Mamba2 prefill fails on a
    # 2049-token step in align mode: IndexError in mamba_mixer2's varlen_states)
    job = {"model": str(model), "connector": conn, "rounds": rounds, "max_model_len": 8192,
           "dtype": vllm_driver.engine_dtype(), "in_process": True, "load_format": "dummy",
           "max_num_batched_tokens": 256, **options}
    tmp.mkdir(parents=True, exist_ok=True)
    log = tmp / f"engine-{len(list(tmp.glob('engine-*.log')))}.log"
    return vllm_driver.spawn(job, log, 900, env={"PYTHONHASHSEED": "0"})


def measure(name: str, work: Path, tokens: int, reps: int, tok) -> dict:
    fam = FAMILIES[name]
    model = model_dir(work, fam)
    seqs = prompts(tokens + 1, reps, tok)
    warm, measured = seqs[0], seqs[1:]
    rounds = [{"prompts": [warm], "max_tokens": 1}, {"prompts": measured, "max_tokens": 1, "concurrency": 1}]
    recompute = engine(work / name / "recompute", model, rounds, None, fam.options)
    m = Mount(str(REPO / ".venv" / "bin" / "kvfs"), "auto", work / name / "kvfs", Path("/dev/shm"), 4 << 30, name)
    m.start()
    try:
        engine(work / name / "store", model, rounds, m.mountpoint, fam.options)
        files = {str(p.relative_to(m.mountpoint)): p.stat().st_size for p in m.mountpoint.glob("*/*/*.kv")}
        hit = engine(work / name / "hit", model, rounds, m.mountpoint, fam.options)
        before = m.stats()["bytes_read"]
        through = engine(work / name / "bytes", model, rounds, m.mountpoint, fam.options, direct_reads=False)
        read = m.stats()["bytes_read"] - before
    finally:
        m.stop([])
        m.remove_dirs()
    hits = [r["num_cached_tokens"] for r in hit["rounds"][1]]
    if any(h < tokens for h in hits) or [r["num_cached_tokens"] for r in through["rounds"][1]] != hits:
        raise vllm_driver.EngineFailed(f"not every request was a full hit of {tokens}: {hits}")
    parts = {}
    for rel, size in files.items():
        ns = rel.split("/")[0]
        parts.setdefault(ns, []).append(size)
    ttft = lambda r: statistics.median(x["ttft_s"] for x in r["rounds"][1])  # noqa: E731
    return {"family": name, "attention": fam.attention, "parts": list(fam.parts), "hit_tokens": hits[0],
            "ttft_recompute_s": ttft(recompute), "ttft_hit_s": ttft(hit),
            "speedup": ttft(recompute) / ttft(hit), "bytes_read_per_hit": read / (reps + 1),
            "file_bytes_per_namespace": {ns: sum(v) // len(v) for ns, v in parts.items()},
            "files_per_namespace": {ns: len(v) for ns, v in parts.items()}}


def real_derived_latents(tokens: int):
    """Per layer, MHA2MLA-style latents [tokens][448] and the GQA K|V [3 heads][tokens][128] of the same tokens
    (SmolLM2-135M's real weights and a Python source as the prompt), bf16."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = REPO / ".venv" / "opt" / "models" / "SmolLM2-135M-Instruct"
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    ids = prompts(tokens, 0, tok)[0]
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True, use_cache=True)
        latents, kvs = [], []
        for layer, block in enumerate(model.model.layers):
            h = block.input_layernorm(out.hidden_states[layer][0]).float()  # what k_proj and v_proj read
            w = torch.cat([block.self_attn.k_proj.weight, block.self_attn.v_proj.weight]).float()
            _, s, vh = torch.linalg.svd(w, full_matrices=False)
            c = h @ (vh.T * s)  # [tokens][384]
            c = c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + 1e-6)
            cache = out.past_key_values.layers[layer]
            k, v = cache.keys[0], cache.values[0]  # [3 heads][tokens][64], K after RoPE
            latents.append(torch.cat([c, k[0].float()], dim=-1).to(torch.bfloat16))
            kvs.append(torch.cat([k, v], dim=-1))
    return latents, kvs


def latent_ratios(work: Path, tokens: int) -> dict:
    """stored/raw of the latents and of the GQA chunks, each saved by the connector's worker into a mount."""
    import os

    import torch
    from kvfs_connector import chunkfile
    from kvfs_connector import layout as layouts
    from kvfs_connector.mount import MountGuard
    from kvfs_connector.plan import SaveSpec
    from kvfs_connector.worker import WorkerSide

    latents, kvs = real_derived_latents(tokens)
    bs, chunk, blocks = 16, 256, tokens // 16
    m = Mount(str(REPO / ".venv" / "bin" / "kvfs"), "auto", work / "latents", Path("/dev/shm"), 1 << 30, "latents")
    m.start()
    out = {}
    try:
        for name, caches, geometry, engine in (
                ("mla-latent", [x.view(blocks, 1, bs, 448) for x in latents],
                 layouts.Geometry(len(latents), 1, 448, bs, chunk, torch.bfloat16), layouts.EngineLayout("CPU_MLA")),
                ("gqa (the same tokens)", [x.view(3, blocks, bs, 128).permute(1, 0, 2, 3).contiguous() for x in kvs],
                 layouts.Geometry(len(kvs), 3, 64, bs, chunk, torch.bfloat16), layouts.EngineLayout("FLASH_ATTN"))):
            lay = layouts.choose(geometry, tuple(caches[0].shape), engine)
            w = WorkerSide(lay, caches, {str(i): i for i in range(len(caches))}, 0,
                           MountGuard(str(m.mountpoint), require_mount=False), 2, 1 << 30)
            paths = []
            for k in range(tokens // chunk):
                path = str(m.mountpoint / name.split()[0] / "ab" / f"ab{k:02d}.kv")
                ids = list(range(k * chunk // bs, (k + 1) * chunk // bs))
                w.save([SaveSpec("r", [path], k * chunk, chunk, chunkfile.token_digest(range((k + 1) * chunk)), ids)])
                paths.append(path)
            w.flush(60)
            w.shutdown()
            stored = sum(int(os.getxattr(p, "user.kvfs.stored_bytes")) for p in paths)
            raw = sum(os.stat(p).st_size for p in paths)
            codecs = sorted({os.getxattr(p, "user.kvfs.codec").decode() for p in paths})
            out[name] = {"stored_over_raw": stored / raw, "codecs": codecs, "files": len(paths), "raw_bytes": raw}
    finally:
        m.stop([])
        m.remove_dirs()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    ap.add_argument("--tokens", type=int, default=2304,
                    help="hit length, a multiple of every family's chunk (256; 384 for the Granite-style hybrid)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--latents", action="store_true", help="stored/raw of real-derived MLA latents instead")
    args = ap.parse_args()
    if args.latents:
        with tempfile.TemporaryDirectory(prefix="bench-latents-", dir="/var/tmp") as tmp:
            ratios = latent_ratios(Path(tmp), 1024)
        print("real-derived MLA latents (MHA2MLA-style from SmolLM2's real weights), 1024 tokens, 30 layers, bf16")
        for name, r in ratios.items():
            print(f"  {name:<24} stored/raw {r['stored_over_raw']:.4f}  codec {','.join(r['codecs'])}")
        out = Path(args.out or REPO / "bench-results" / "bench_models_latents.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(ratios, indent=1))
        return 0
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(REPO / ".venv" / "opt" / "models" / "SmolLM2-135M-Instruct")
    rows, failures = [], {}
    with tempfile.TemporaryDirectory(prefix="bench-models-", dir="/var/tmp") as tmp:
        for name in args.families:
            if FAMILIES[name].options.get("kv_cache_dtype") and (why := fp8_unavailable()):
                print(f"{name}: skipped ({why})")
                continue
            t0 = time.perf_counter()
            try:
                rows.append(measure(name, Path(tmp), args.tokens, args.reps, tok))
            except vllm_driver.EngineFailed as e:  # the other families are still measured
                failures[name] = str(e)[:4000]
                print(f"{name}: FAILED: {str(e)[:300]}", flush=True)
                continue
            print(f"{name}: done in {time.perf_counter() - t0:.0f} s", flush=True)
    print(f"\nfull hit of {args.tokens} tokens, median of {args.reps} requests, vLLM {vllm_driver.engine_dtype()} "
          "on CPU, tiny dummy-weight models, prefill steps of 256 tokens")
    print(f"{'family':<11} {'parts':<12} {'recompute s':>11} {'hit s':>7} {'speedup':>7} {'read/hit MB':>11}  "
          "bytes per file (per namespace)")
    for r in rows:
        sizes = ", ".join(f"{n}x{b / 1e6:.3f} MB" for ns, b in r["file_bytes_per_namespace"].items()
                          for n in [r["files_per_namespace"][ns]])
        print(f"{r['family']:<11} {'+'.join(r['parts']):<12} {r['ttft_recompute_s']:>11.3f} {r['ttft_hit_s']:>7.3f} "
              f"{r['speedup']:>6.1f}x {r['bytes_read_per_hit'] / 1e6:>11.3f}  {sizes}")
    out = Path(args.out or REPO / "bench-results" / "bench_models.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"tokens": args.tokens, "reps": args.reps, "dtype": vllm_driver.engine_dtype(),
                               "rows": rows, "failures": failures}, indent=1))
    print(f"JSON: {out}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
