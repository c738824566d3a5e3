#!/usr/bin/env python3
"""Refuse a pip install plan that would fetch GPU packages on this CPU-only machine (the install scripts' guard).

    python tools/refuse_gpu_plan.py REPORT.json WHO [SEE]

REPORT.json is `pip install --dry-run --report`; exit 1 with one line naming the GPU packages (nvidia-*, triton,
CUDA bindings, a torch build without +cpu) when there are any: they are gigabytes and cannot run here.
"""

import json
import sys

GPU_PACKAGES = ("triton", "cuda-python", "cuda-bindings", "cuda-toolkit")


def gpu_packages(plan: list[dict]) -> list[str]:
    names = [i["metadata"]["name"].lower() for i in plan]
    bad = [n for n in names if n.startswith("nvidia-") or n in GPU_PACKAGES]
    return bad + [f"torch {i['metadata']['version']}" for i in plan
                  if i["metadata"]["name"].lower() == "torch" and "+cpu" not in i["metadata"]["version"]]


def main(report: str, who: str, see: str = "") -> int:
    with open(report) as f:
        bad = gpu_packages(json.load(f)["install"])
    if bad:
        print(f"{who}: pip would fetch GPU packages {bad}; refusing" + (f" (see {see})" if see else ""),
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
