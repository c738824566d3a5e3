"""Build products for the deployment tests, made once per test run and shared by the test modules.

- dist(): tools/build_wheel.sh --wheelhouse into a temporary directory: the sdist, the repaired wheel, and
  every wheel it installs (tests/test_wheel.py, the container tests);
- image(): tools/build_image.sh with that dist: the kvfs daemon image, built FROM a base made here by
  mmdebstrap + podman import (tests/test_deploy.py).

Module-level caches: pytest imports this module once per run, so every test module gets the same products.
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent


@dataclass(frozen=True)
class Dist:
    root: Path
    sdist: Path
    wheel: Path
    wheelhouse: Path


_dist: Dist | None = None
_image: str | None = None
_failure: dict[str, str] = {}


def _tmp_root() -> Path:
    """Outside the checkout, removed at exit."""
    path = Path(tempfile.mkdtemp(prefix="kvfs-deploy-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def missing_tools() -> str | None:
    """Why the deployment tests cannot run here, or None."""
    for module in ("build", "auditwheel"):
        if subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True).returncode:
            return f"python module {module} missing: run tools/install_deploy.sh"
    return None


def dist() -> Dist:
    global _dist
    if _dist is None:
        if "dist" in _failure:
            raise AssertionError(_failure["dist"])
        out = _tmp_root() / "dist"
        env = {**os.environ, "KVFS_DIST": str(out), "PYTHON": sys.executable,
               "PATH": f"{VENV_BIN}:{os.environ.get('PATH', '')}"}
        r = subprocess.run([str(REPO / "tools" / "build_wheel.sh"), "--wheelhouse"], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=900)
        if r.returncode:
            _failure["dist"] = f"tools/build_wheel.sh failed ({r.returncode}):\n{r.stdout}\n{r.stderr}"
            raise AssertionError(_failure["dist"])
        sdist, wheel = (Path(line) for line in r.stdout.split())
        _dist = Dist(out, sdist, wheel, out / "wheelhouse")
    return _dist


def image() -> str:
    """The image's name; built with tools/build_image.sh from dist()'s wheelhouse."""
    global _image
    if _image is None:
        if "image" in _failure:
            raise AssertionError(_failure["image"])
        d = dist()
        env = {**os.environ, "KVFS_DIST": str(d.root), "PYTHON": sys.executable, "KVFS_IMAGE": IMAGE,
               "KVFS_BASE_CACHE": str(BASE_CACHE), "PATH": f"{VENV_BIN}:{os.environ.get('PATH', '')}"}
        r = subprocess.run([str(REPO / "tools" / "build_image.sh"), "--base", "mmdebstrap", "--no-wheel"],
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
        if r.returncode:
            _failure["image"] = f"tools/build_image.sh failed ({r.returncode}):\n{r.stdout}\n{r.stderr}"
            raise AssertionError(_failure["image"])
        _image = IMAGE
    return _image


IMAGE = "localhost/kvfs:test"
# the mmdebstrap rootfs, kept between runs on this machine (a base image is rebuilt only when it is missing)
BASE_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvfs-build"
