#!/usr/bin/env bash
# The connector's GPU checks on a CUDA host, with or without vLLM: the worker tests with their CUDA cases
# (side streams, pinned staging, the cross-stream race tests, fp8 bytes and MLA latents on the device) and the
# load benchmark (tools/bench_gpu_load.py). With KVFS_GPU_ENGINES=1 also the model-family engine tests on the
# GPU (tests/test_vllm_models.py: fp8 KV, MLA, sliding windows; needs a CUDA build of vLLM, /dev/fuse and the
# SmolLM2 tokenizer in .venv/opt/models, as tools/install_vllm.sh leaves it).
# Uses the host's python3 and torch; kvfs's own Python deps must be importable (pip install -e . does it; on
# a machine without an index, put wheels on PYTHONPATH). Output: $OUT (default bench-results/).
#
#   tools/gpu_checks.sh [bench_gpu_load.py args...]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench-results}
mkdir -p "$OUT"
export PYTHONPATH=$PWD:$PWD/connector${PYTHONPATH:+:$PYTHONPATH}
PY=${PYTHON:-python3}

# the entropy codec's kernel: a plain C library (no Python API), built here if this interpreter has none
if ! "$PY" -c "import kvfs.codecs" 2>/dev/null; then
    suffix=$("$PY" -c 'import importlib.machinery as m; print(m.EXTENSION_SUFFIXES[0])')
    srcs=$("$PY" -c 'import runpy; s = runpy.run_path("kvfs/codecs/kernel_sources.py"); print(" ".join(s["C_SOURCES"] + [s["X86_64_ASM"]]))')
    gcc -O3 -std=c11 -shared -fPIC -o "kvfs/codecs/_entropy$suffix" $srcs -lm || exit 1
fi
{ nvidia-smi -L; nproc; "$PY" -c 'import torch, sys; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.cuda.is_available())'; "$PY" -c 'from kvfs.codecs import kernel; print("zstd decoded in the kernel:", kernel.ZSTD_IN_KERNEL)'; } 2>&1 | tee "$OUT/gpu-env.txt"
"$PY" -m pytest -q -p no:cacheprovider --noconftest -rs tests/test_connector_worker.py 2>&1 | tee "$OUT/gpu-pytest.log"
tests=${PIPESTATUS[0]}
"$PY" tools/bench_gpu_load.py --out "$OUT/bench_gpu_load.json" "$@" 2>&1 | tee "$OUT/gpu-bench.log"
bench=${PIPESTATUS[0]}
engines=0
if [ "${KVFS_GPU_ENGINES:-0}" = 1 ]; then
    "$PY" -m pytest -q -p no:cacheprovider -rs tests/test_vllm_models.py -k "fp8 or mla or gemma3" 2>&1 \
        | tee "$OUT/gpu-engines.log"
    engines=${PIPESTATUS[0]}
fi
echo "tests rc=$tests bench rc=$bench engines rc=$engines"
exit $((tests || bench || engines))
