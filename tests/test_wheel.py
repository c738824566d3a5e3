"""The wheel and the sdist (tools/build_wheel.sh), and the wheel alone in a fresh venv outside the checkout.

Built once per run (tests/deploy_build.py). The fresh venv installs the wheel from the wheelhouse with
--no-index (the same wheels PyPI gave the build), then runs tests/wheel_smoke.py
from a directory outside the checkout with a PATH and environment that name nothing of it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

import deploy_build
import kvfs

pytestmark = pytest.mark.slow
REPO = deploy_build.REPO
KV = REPO / "tests" / "data" / "kv" / "bf16-prose-0004.kv"


@pytest.fixture(scope="module")
def dist():
    if why := deploy_build.missing_tools():
        pytest.skip(why)
    return deploy_build.dist()


def test_version_from_one_place(dist):
    assert f"kvfs-{kvfs.__version__}.tar.gz" == dist.sdist.name
    assert dist.wheel.name.startswith(f"kvfs-{kvfs.__version__}-cp311-cp311-")
    pyproject = (REPO / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in pyproject and "\nversion =" not in pyproject.split("[tool.setuptools.dynamic]")[0]


def test_wheel_is_manylinux_with_both_extensions(dist):
    assert "manylinux_2_" in dist.wheel.name, dist.wheel.name
    names = zipfile.ZipFile(dist.wheel).namelist()
    for ext in ("kvfs/codecs/_entropy.", "kvfs/frontend/_loop."):
        assert any(n.startswith(ext) and n.endswith(".so") for n in names), ext
    assert "kvfs_connector/connector.py" in names
    # libfuse3 is left to the system (auditwheel --exclude), nothing vendored
    assert not [n for n in names if ".libs/" in n], [n for n in names if ".libs/" in n]
    metadata = zipfile.ZipFile(dist.wheel).read(f"kvfs-{kvfs.__version__}.dist-info/METADATA").decode()
    for extra in ("vllm", "lmcache", "test"):
        assert f"Provides-Extra: {extra}" in metadata, extra
    show = subprocess.run([sys.executable, "-m", "auditwheel", "show", str(dist.wheel)], capture_output=True,
                          text=True, check=True).stdout
    assert "libfuse3.so.3" in show  # an external library the system provides


def test_sdist_has_the_sources(dist):
    names = {n.split("/", 1)[1] for n in tarfile.open(dist.sdist).getnames() if "/" in n}
    for path in ("setup.py", "pyproject.toml", "kvfs/codecs/_classes.c", "kvfs/codecs/huf0/LICENSE",
                 "kvfs/frontend/_loop.c", "connector/kvfs_connector/__init__.py"):
        assert path in names, path


def test_wheel_alone_in_a_fresh_venv(dist, tmp_path):
    assert not tmp_path.is_relative_to(REPO)
    venv = tmp_path / "venv"
    base_python = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base_python, "-m", "venv", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    env = {"PATH": f"{venv / 'bin'}:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": str(tmp_path / "home"),
           "LANG": "C.UTF-8"}
    r = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-index", "--find-links", str(dist.wheelhouse),
                        str(dist.wheel)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    smoke = tmp_path / "wheel_smoke.py"  # a copy: nothing runs from the checkout
    shutil.copy(REPO / "tests" / "wheel_smoke.py", smoke)
    kv = tmp_path / KV.name
    shutil.copy(KV, kv)
    (tmp_path / "home").mkdir()
    r = subprocess.run([str(py), "-I", str(smoke), str(tmp_path), str(kv), kvfs.__version__], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    print(r.stdout)
    l2 = next((line.split(" ", 1)[1] for line in r.stdout.splitlines() if line.startswith("L2: ")), "None")
    if l2 != "None" and "/dev/shm/" in l2:
        shutil.rmtree(l2, ignore_errors=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "bit-exact through the mount and past it; codec entropy" in r.stdout
    assert "QATzip: " in r.stdout  # found, or reported absent (a fresh venv has no .venv/opt/qatzip)
    os.sync()
