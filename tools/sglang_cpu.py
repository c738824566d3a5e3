"""SGLang's storage code on a CPU-only host, in .venv-sglang (tests/test_engines.py, tools/bench_engine_tiers.py)."""

import importlib.util
import os
import platform
import sys


def stub_triton() -> None:
    """sglang.srt.utils imports triton at import time; triton is not installed (no CPU use here, several hundred
    MB). Install SGLang's own Triton stub, the one it installs where Triton does not exist (Apple Silicon)."""
    import torch
    path = os.path.join(importlib.util.find_spec("sglang").submodule_search_locations[0], "_platform_stubs.py")
    spec = importlib.util.spec_from_file_location("_sglang_platform_stubs", path)
    stubs = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = stubs
    spec.loader.exec_module(stubs)
    saved = sys.platform, platform.machine, torch.backends.mps.is_available
    sys.platform, platform.machine, torch.backends.mps.is_available = "darwin", lambda: "arm64", lambda: True
    try:
        stubs.install_platform_stubs()
    finally:
        sys.platform, platform.machine, torch.backends.mps.is_available = saved
