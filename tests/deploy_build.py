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


IMAGE = "localhost/kvfs:test"
ENGINE_IMAGE = "localhost/kvfs-engine:test"
BASE = "localhost/kvfs-base:bookworm"  # tools/build_image.sh --base mmdebstrap: made once, kept in podman's store


def image() -> tuple[str, str]:
    """(the kvfs image, the engine stand-in), built from dist()'s wheelhouse: the first with
    tools/build_image.sh --base mmdebstrap, the second FROM the same base (tests/deploy/engine.Containerfile)."""
    global _image
    if _image is None:
        if "image" in _failure:
            raise AssertionError(_failure["image"])
        d = dist()
        env = {**os.environ, "KVFS_DIST": str(d.root), "PYTHON": sys.executable, "KVFS_IMAGE": IMAGE,
               "PATH": f"{VENV_BIN}:{os.environ.get('PATH', '')}"}
        steps = [[str(REPO / "tools" / "build_image.sh"), "--base", "mmdebstrap", "--no-wheel"],
                 ["podman", "build", "--quiet", "--build-arg", f"BASE={BASE}", "--build-context",
                  f"wheels={d.wheelhouse}", "-f", str(REPO / "tests" / "deploy" / "engine.Containerfile"),
                  "-t", ENGINE_IMAGE, str(REPO / "tests" / "deploy")]]
        for cmd in steps:
            r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
            if r.returncode:
                _failure["image"] = f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}"
                raise AssertionError(_failure["image"])
            if cmd[0].endswith("build_image.sh"):
                BUILD_REPORT.append(r.stdout.strip())
        _image = IMAGE
        atexit.register(_remove_images)
    return IMAGE, ENGINE_IMAGE


BUILD_REPORT: list[str] = []


def _remove_images() -> None:
    """The test images and the build stages they left (dangling); the base stays for the next run."""
    subprocess.run(["podman", "rmi", "-f", IMAGE, ENGINE_IMAGE], capture_output=True)
    subprocess.run(["podman", "image", "prune", "-f", "--filter", "label=io.kvfs.image"], capture_output=True)
