"""The kvfs command as a user runs it: background mount with the embedded defaults, stat, umount."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

KVFS = [sys.executable, "-m", "kvfs"]


def _run(*args, env=None, check=True):
    return subprocess.run([*KVFS, *args], capture_output=True, text=True, env=env, check=check, timeout=120)


@pytest.fixture
def home(tmp_path):
    """A private HOME/XDG cache so the default state directory is the test's own."""
    env = dict(os.environ, HOME=str(tmp_path / "home"), XDG_CACHE_HOME=str(tmp_path / "cache"))
    return env


def test_default_mount_stat_umount(tmp_path, home):
    mnt = tmp_path / "kv"
    mnt.mkdir()
    res = _run("mount", str(mnt), env=home)
    assert "mounted" in res.stdout
    l2 = None
    try:
        assert os.path.ismount(mnt)
        (mnt / "ns").mkdir()
        (mnt / "ns" / "f.kv").write_bytes(b"\x3c\x3f" * 500_000)
        doc = json.loads((mnt / ".kvfs" / "stats").read_bytes())
        l2 = Path(doc["tiers"]["L2"]["path"])
        assert str(l2).startswith("/dev/shm/kvfs-") and doc["tiers"]["L2"]["capacity_bytes"] == 1 << 30
        assert (tmp_path / "cache" / "kvfs").is_dir()  # state under the user's cache directory
        assert oct(l2.stat().st_mode & 0o777) == "0o700"
        assert all(oct(p.stat().st_mode & 0o777) == "0o600" for p in l2.glob("*/*"))
        table = _run("stat", str(mnt), env=home).stdout
        assert "L2" in table and "checksum_failures" in table
        assert json.loads(_run("stat", "--json", str(mnt), env=home).stdout)["tiers"]["L2"]["files"] == 1
    finally:
        _run("umount", str(mnt), env=home)
    assert not os.path.ismount(mnt)
    log = next((tmp_path / "cache" / "kvfs").glob("*/kvfs.log")).read_text()
    assert "unmounted" in log and "ERROR" not in log
    # remount with the same defaults: the file is still there
    _run("mount", str(mnt), env=home)
    try:
        assert (mnt / "ns" / "f.kv").read_bytes() == b"\x3c\x3f" * 500_000
    finally:
        _run("umount", str(mnt), env=home)
        if l2 is not None:
            subprocess.run(["rm", "-rf", str(l2)])


def test_mount_errors_are_clear(tmp_path, home):
    mnt = tmp_path / "kv"
    mnt.mkdir()
    res = _run("mount", str(mnt), "--l2", "/dev/shm/x:lots", env=home, check=False)
    assert res.returncode != 0 and "not a size" in res.stderr
    res = _run("mount", str(tmp_path / "missing"), env=home, check=False)
    assert res.returncode != 0 and "not a directory" in res.stderr
    res = _run("stat", str(tmp_path), env=home, check=False)
    assert res.returncode != 0 and "does not look like a kvfs mount" in res.stderr


def test_second_daemon_on_same_state_is_refused(make_mount):
    m = make_mount().start()
    other = m.root / "other"
    other.mkdir()
    res = _run("mount", "--foreground", str(other), "--state-dir", str(m.state), "--l2", f"{m.l2}:64M",
               check=False)
    assert res.returncode != 0 and "in use by another kvfs daemon" in res.stderr
    assert m.alive()


def _proc_state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]


def test_umount_treats_an_unreaped_daemon_as_stopped(make_mount):
    """A foreground daemon whose parent has not waited for it yet is a zombie once it exits: umount must
    report success then, not wait out its timeout for a process only the parent can remove."""
    m = make_mount().start()
    assert m.proc is not None
    started = time.monotonic()
    _run("umount", str(m.mountpoint))  # check=True: a "still running" failure raises here
    elapsed = time.monotonic() - started
    assert not os.path.ismount(m.mountpoint)
    assert _proc_state(m.proc.pid) == "Z"  # the case under test: exited, not yet waited for
    assert elapsed < 20, f"umount took {elapsed:.1f}s"
    assert m.stop() == 0  # waits the Popen


def test_stat_piped_prints_whole_cells(make_mount, tmp_path):
    """Off a terminal rich assumed 80 columns and cut the table's cells with "…"; piped, every cell is whole."""
    l2 = tmp_path / ("l2-with-a-long-directory-name-" + "x" * 60)
    m = make_mount().start("--l2", f"{l2}:64M")
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    out = _run("stat", str(m.mountpoint), env=env).stdout
    assert str(l2) in out and str(m.state / "l3") in out
    assert "…" not in out
    assert "compression_ratio" in out and "promoted" in out
