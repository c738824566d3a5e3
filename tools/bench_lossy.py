#!/usr/bin/env python3
"""Accuracy of kvfs's lossy modes: SmolLM2-135M on vLLM (CPU) with its KV stored lossily vs losslessly.

For each mode, one engine stores the KV of several real-text contexts through the connector (lossy option),
and a fresh engine process loads it back (external hits asserted > 0) and is measured on:
    top-1 agreement  teacher-forced: the lossless engine's 256 greedy tokens after each context are fed as a
                     prompt; the share of positions where this engine's top-1 token equals that token
                     (lossless: 1.0 up to float noise; a token that diverges does not derail the rest)
    identical run    free-running greedy generation of 256 tokens: tokens until the first difference from the
                     lossless run (256 = identical)
    perplexity       of held text (the 256 tokens that follow each context in its source), conditioned on the
                     loaded context; the context's logits are never computed, only loaded KV is attended to
    stored/raw       bytes kvfs stores for the mode's chunk files / their logical size (KV of the engine dtype)

Modes are given as kvfs lossy specs. Engines here run in the dtype vllm_driver.engine_dtype() picks (float32
on CPUs without bf16 instructions, where mantissa:19/20 on float32 equal bf16's mantissa:3/4 values);
--modes takes any list. Each row also gives the stored/raw of the mode on real bf16 KV blocks (in memory, the
same code path as the mount; tools/bench_codec.py has the lossless ones).

Usage: .venv/bin/python tools/bench_lossy.py [--modes none mantissa:19 mantissa:20 fp8] [--prompts 4]
       [--json bench-results/bench_lossy.json]
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
from pathlib import Path

TOOLS = Path(__file__).resolve().parent
REPO = TOOLS.parent
sys.path.insert(0, str(TOOLS))
sys.path.insert(0, str(REPO))
import vllm_driver  # noqa: E402
from bench_ttft import MODEL, Mount, kvfs_connector  # noqa: E402

DTYPE = vllm_driver.engine_dtype()
CONTEXT, HELD, GENERATE = 768, 256, 256  # context = 3 chunks of 256 tokens
ENGINE = {"max_model_len": 2048, "kv_cache_gib": 2, "dtype": DTYPE}
ENV = {"PYTHONHASHSEED": "0"}
SOURCES = ["/usr/share/common-licenses/GPL-3", "/usr/lib/python3.11/argparse.py", "/usr/include/stdio.h",
           "/usr/share/common-licenses/Apache-2.0", "/usr/lib/python3.11/textwrap.py", "/usr/include/unistd.h"]
EQUIVALENT = {"float32": {"mantissa:19": "bf16 mantissa:3", "mantissa:20": "bf16 mantissa:4", "mantissa:21": "bf16 mantissa:5"}}


def texts(n: int) -> list[tuple[list[int], list[int], str]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MODEL)
    out = []
    for src in SOURCES:
        path = Path(src)
        if not path.exists():
            continue
        ids = tok(path.read_text(errors="replace"))["input_ids"]
        if len(ids) >= CONTEXT + HELD:
            out.append((ids[:CONTEXT], ids[CONTEXT:CONTEXT + HELD], src))
        if len(out) == n:
            return out
    raise SystemExit(f"only {len(out)} source texts of {CONTEXT + HELD} tokens found")


def engine(work: Path, name: str, rounds: list[dict], connector: dict) -> dict:
    job = {"model": str(MODEL), "connector": connector, "rounds": rounds, **ENGINE}
    return vllm_driver.spawn(job, work / f"{name}.log", timeout=1800, env=ENV)


def bf16_ratio(mode: str) -> float | None:
    """stored/raw of the mode on the committed real bf16 KV blocks, through the encoder the mount uses."""
    from kvfs import lossy
    from kvfs.openfile import EncodingPolicy

    try:
        lossy.check_applicable(lossy.parse(mode), "bf16")
    except ValueError:
        return None
    raw = stored = 0
    for f in sorted((REPO / "tests/data/kv").glob("bf16-*.kv")):
        data = f.read_bytes()
        policy = EncodingPolicy(None, "bf16", None, lossy.parse(mode))
        for off in range(0, len(data), 1 << 20):
            frame = policy.encode(data[off:off + (1 << 20)], off)
            raw += frame.raw_len
            stored += len(frame.payload)
    return stored / raw


def namespace_ratio(mount: Path) -> float:
    import os

    raw = stored = 0
    for f in mount.glob("*/*/*.kv"):
        raw += f.stat().st_size
        stored += int(os.getxattr(f, "user.kvfs.stored_bytes"))
    return stored / raw if raw else float("nan")


def measure(work: Path, mode: str, prompts, reference: list[list[int]]) -> dict:
    mount = Mount(work, f"m-{mode.replace(':', '-')}")
    try:
        conn = kvfs_connector(mount.mountpoint, lossy=mode)
        engine(work, f"store-{mode}", [{"prompts": [c for c, _, _ in prompts], "max_tokens": 1}], conn)
        ratio = namespace_ratio(mount.mountpoint)
        res = engine(work, f"load-{mode}", [
            {"prompts": [c + g for (c, _, _), g in zip(prompts, reference)], "max_tokens": 1, "prompt_logprobs": 1},
            {"prompts": [c + h for c, h, _ in prompts], "max_tokens": 1, "prompt_logprobs": 0},
            {"prompts": [c for c, _, _ in prompts], "max_tokens": GENERATE, "concurrency": len(prompts)},
        ], conn)
    finally:
        mount.umount()
    forced, held, free = res["rounds"]
    hits = [r["num_cached_tokens"] for rnd in res["rounds"] for r in rnd]
    if min(hits) <= 0:
        raise SystemExit(f"{mode}: a request had no external hit ({hits}): the KV was not loaded from kvfs")
    agree = total = 0
    for r, g in zip(forced, reference):
        lp = r["prompt_logprobs"][-(len(g) - 1):]  # positions predicting g[1:] (g[0] follows a cached token)
        if len(lp) != len(g) - 1:
            raise SystemExit(f"{mode}: {len(lp)} prompt logprobs for {len(g) - 1} generated positions")
        agree += sum(top == tok for (_, top), tok in zip(lp, g[1:]))
        total += len(lp)
    nll = [-lp for r in held for lp, _ in r["prompt_logprobs"][-(HELD - 1):]]
    if len(nll) != len(held) * (HELD - 1):
        raise SystemExit(f"{mode}: {len(nll)} held-text logprobs, expected {len(held) * (HELD - 1)}")
    identical = [next((i for i, (a, b) in enumerate(zip(r["tokens"], g)) if a != b), len(g))
                 for r, g in zip(free, reference)]
    return {"mode": mode, "stored_raw": ratio, "bf16_stored_raw": bf16_ratio(EQUIVALENT.get(DTYPE, {}).get(
                mode, mode).removeprefix("bf16 ")), "top1_agreement": agree / total, "positions": total,
            "perplexity": math.exp(sum(nll) / len(nll)), "identical_tokens": identical,
            "min_external_hit_tokens": min(hits)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--modes", nargs="+", default=["none", "mantissa:19", "mantissa:20", "mantissa:21", "fp8"]
                    if DTYPE == "float32" else ["none", "mantissa:3", "mantissa:4", "mantissa:5", "fp8"])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--json", type=Path, default=REPO / "bench-results/bench_lossy.json")
    args = ap.parse_args(argv)
    prompts = texts(args.prompts)
    work = Path(tempfile.mkdtemp(prefix="kvfs-lossy-"))
    try:
        ref = engine(work, "reference", [{"prompts": [c for c, _, _ in prompts], "max_tokens": GENERATE,
                                          "concurrency": len(prompts)}], None)
        reference = [r["tokens"] for r in ref["rounds"][0]]
        rows = [measure(work, mode, prompts, reference) for mode in args.modes]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\nSmolLM2-135M, vLLM CPU, KV {DTYPE}; {len(prompts)} contexts of {CONTEXT} tokens loaded from kvfs, "
          f"{GENERATE} tokens generated, {HELD} held tokens")
    print(f"{'mode':14} {'as bf16':16} {'stored/raw':>10} {'bf16 s/r':>9} {'top-1 agree':>11} {'perplexity':>10} "
          f"{'identical run (tokens)':>24}")
    for r in rows:
        eq = EQUIVALENT.get(DTYPE, {}).get(r["mode"], "")
        b = f"{r['bf16_stored_raw']:.3f}" if r["bf16_stored_raw"] else "-"
        print(f"{r['mode']:14} {eq:16} {r['stored_raw']:10.3f} {b:>9} {r['top1_agreement']:11.4f} "
              f"{r['perplexity']:10.3f} {str(r['identical_tokens']):>24}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"dtype": DTYPE, "sources": [s for _, _, s in prompts], "rows": rows}, indent=1))
    print(f"\nJSON: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
