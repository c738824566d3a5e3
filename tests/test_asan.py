"""The native front end's C code under AddressSanitizer: the POSIX, front-end (hostile requests), native-write,
crash and model tests, run on mounts of the native front end built with KVFS_ASAN=1 (docs/frontend.md, "Build").

The ASan build goes into a copy of the kvfs package (the checkout's own extension stays as it is), which the
inner pytest and every daemon it starts import first (PYTHONPATH); libasan is preloaded, and any report aborts
the daemon, which fails the test that mounted it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SUITES = ["tests/test_posix.py", "tests/test_posix_conformance.py", "tests/test_frontend.py", "tests/test_native_write.py",
          "tests/test_crash.py", "tests/test_model.py"]

pytestmark = pytest.mark.slow


def _libasan() -> str:
    out = subprocess.run(["gcc", "-print-file-name=libasan.so"], capture_output=True, text=True, check=True)
    path = out.stdout.strip()
    if not os.path.isabs(path):
        pytest.fail("gcc has no libasan.so (Debian: libasan8, with gcc)")
    return path


def test_native_front_end_under_address_sanitizer(tmp_path):
    libasan = _libasan()
    build = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--build-temp", str(tmp_path / "obj"),
                            "--build-lib", str(tmp_path / "lib")], cwd=REPO, capture_output=True, text=True,
                           env={**os.environ, "KVFS_ASAN": "1"}, timeout=900)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    built = sorted((tmp_path / "lib").rglob("*.so"))
    assert any("_loop" in p.name for p in built), built
    pkg = tmp_path / "pkg"
    shutil.copytree(REPO / "kvfs", pkg / "kvfs", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    for so in built:
        shutil.copy(so, pkg / so.relative_to(tmp_path / "lib"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(pkg), os.environ.get("PYTHONPATH", "")]),
           "LD_PRELOAD": libasan, "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1:halt_on_error=1"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", *SUITES], cwd=REPO,
                         capture_output=True, text=True, env=env, timeout=2400)
    tail = run.stdout[-6000:] + run.stderr[-3000:]
    assert run.returncode == 0, tail
    assert "AddressSanitizer" not in run.stdout + run.stderr, tail
    # the daemons imported the ASan build (a report would have aborted them)
    probe = subprocess.run([sys.executable, "-c", "import kvfs.frontend._loop as m; print(m.__file__)"],
                           capture_output=True, text=True, env=env, cwd=tmp_path)
    assert probe.stdout.strip().startswith(str(pkg)), probe.stdout + probe.stderr
