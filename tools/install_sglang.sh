#!/usr/bin/env bash
# Install SGLang's HiCache file storage backend (HiCacheFile) on CPU into its own venv, .venv-sglang, for
# tests/test_engines.py. Idempotent. Not the SGLang engine: that does not run on a CPU host from PyPI (see
# docs/engines.md: its CPU kernels, sglang-kernel-cpu, are built from the GitHub tree, and its CPU recipe takes
# torch/torchvision/triton from PyTorch's own CPU index).
#
# What it installs: torch 2.13.0+cpu from the local wheel (refusing any plan that would fetch a CUDA torch,
# nvidia-* or triton), the sglang wheel without its dependencies (they list CUDA packages: flashinfer,
# sglang-kernel, nvidia-cutlass-dsl, cuda-python, torch==2.14.1 with its CUDA toolkit), and the few pure-Python
# packages that importing sglang.srt.mem_cache.hicache_storage needs. Its own venv because sglang pins
# transformers/torch versions that differ from vLLM's.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv-sglang
SGLANG_VERSION=0.5.23
TORCH_VERSION=2.13.0
PY=$VENV/bin/python
PIP=("$PY" -m pip install -q)
DEPS=(numpy orjson psutil pybase64 requests packaging pillow starlette msgspec pydantic pyzmq tqdm ipython aiohttp)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

installed() {
    [ -x "$PY" ] && "$PY" - "$SGLANG_VERSION" "${DEPS[@]}" 2>/dev/null <<'EOF'
import importlib.metadata as m, sys
assert m.version("sglang") == sys.argv[1] and "+cpu" in m.version("torch")
for dep in sys.argv[2:]: m.version(dep)
EOF
}

if ! installed; then
    [ -x "$PY" ] || python3.11 -m venv "$VENV" 2>/dev/null || "$(readlink -f .venv/bin/python)" -m venv "$VENV"
    "$PY" -m pip install -q --dry-run --report "$WORK/plan.json" "torch==$TORCH_VERSION" "${DEPS[@]}"
    "$PY" tools/refuse_gpu_plan.py "$WORK/plan.json" install_sglang
    "${PIP[@]}" "torch==$TORCH_VERSION" "${DEPS[@]}"
    # --no-deps: pip then lists sglang's unmet (CUDA) requirements as conflicts, harmlessly (filtered out here;
    # a failed install is caught by the check below)
    "${PIP[@]}" --no-deps "sglang==$SGLANG_VERSION" 2>&1 | grep -v "requires\|dependency resolver\|conflicts" || true
    installed || { echo "install_sglang: the install did not complete" >&2; exit 1; }
fi

echo "sglang $("$PY" -c 'import importlib.metadata as m; print(m.version("sglang"))') (HiCacheFile) installed in $VENV"
