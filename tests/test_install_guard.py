"""The install scripts' guard (tools/refuse_gpu_plan.py): a pip plan that would fetch GPU packages is refused."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

GUARD = Path(__file__).resolve().parent.parent / "tools" / "refuse_gpu_plan.py"


def _run(tmp_path, packages: dict[str, str]) -> subprocess.CompletedProcess:
    report = tmp_path / "plan.json"
    report.write_text(json.dumps({"install": [{"metadata": {"name": n, "version": v}} for n, v in packages.items()]}))
    return subprocess.run([sys.executable, str(GUARD), str(report), "install_x", "docs/x.md"],
                          capture_output=True, text=True)


def test_cpu_plans_pass(tmp_path):
    assert _run(tmp_path, {"torch": "2.13.0+cpu", "numpy": "2.3.0", "triton-cpu-notes": "1"}).returncode == 0
    assert _run(tmp_path, {}).returncode == 0


def test_gpu_packages_are_refused_and_named(tmp_path):
    for bad, named in [({"nvidia-cublas-cu12": "12.8"}, "nvidia-cublas-cu12"), ({"triton": "3.5"}, "triton"),
                       ({"torch": "2.13.0"}, "torch 2.13.0"), ({"cuda-bindings": "13"}, "cuda-bindings")]:
        r = _run(tmp_path, {"numpy": "2.3.0", **bad})
        assert r.returncode == 1
        assert named in r.stderr and "install_x" in r.stderr and "docs/x.md" in r.stderr
