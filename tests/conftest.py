"""Test fixtures: a real kvfs mount run as `kvfs mount --foreground` in a subprocess.

The fixture fails the test when the daemon died, exited non-zero, or logged an unexpected error
(ERROR/CRITICAL lines or tracebacks not declared with `mount.expect_log(pattern)`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
KV_DATA = REPO / "tests" / "data" / "kv"
FUSERMOUNT = shutil.which("fusermount3") or "fusermount3"
# KVFS_TEST_FRONTEND=X adds `--frontend X` to every mount of the suite (native is the default and only one)
FRONTEND = os.environ.get("KVFS_TEST_FRONTEND", "")
# the level field of a log line (QATzip's own "[Error] ..." notices, routed into the log at INFO, are not kvfs errors)
_BAD_LINE = re.compile(r"^\d{4}-\d\d-\d\d [\d:,]+ (ERROR|CRITICAL) |Traceback")


class KvfsMount:
    def __init__(self, root: Path, name: str = "mnt") -> None:
        self.root = root
        self.mountpoint = root / name
        self.l2 = root / f"{name}-l2"
        self.state = root / f"{name}-state"
        self.l3 = self.state / "l3"  # the default L3 place (inside the state directory)
        self.log_path = root / f"{name}.log"
        self.mountpoint.mkdir(exist_ok=True)
        self.proc: subprocess.Popen | None = None
        self.allowed: list[re.Pattern] = []
        self.args: list[str] = []
        self.exit_codes: list[int] = []
        self.launcher: list[str] = []  # a command prefix for the daemon, e.g. nsenter into a network namespace

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self, *args: str, l2_size: str = "512M", timeout: float = 20.0,
              env: dict[str, str] | None = None) -> "KvfsMount":
        self.args = [*args]
        if not any(a.startswith("--l2") for a in args):
            self.args += ["--l2", f"{self.l2}:{l2_size}"]
        if "--state-dir" not in args:
            self.args += ["--state-dir", str(self.state)]
        if FRONTEND and not any(a.startswith("--frontend") for a in args):
            self.args += ["--frontend", FRONTEND]
        for a in args:
            if a.startswith("--l3="):
                self.l3 = Path(a.split("=", 1)[1].rpartition(":")[0])
        if "--l3" in args:
            self.l3 = Path(args[args.index("--l3") + 1].rpartition(":")[0])
        cmd = [*self.launcher, sys.executable, "-m", "kvfs", "mount", "--foreground", str(self.mountpoint), *self.args]
        log = open(self.log_path, "ab")
        log.write(f"=== start {' '.join(cmd)}\n".encode())
        log.flush()
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=log, cwd=self.root,
                                     env={**os.environ, **env} if env else None)
        log.close()
        deadline = time.monotonic() + timeout
        while not os.path.ismount(self.mountpoint):
            if self.proc.poll() is not None:
                raise AssertionError(f"kvfs exited with {self.proc.returncode} at start:\n{self.log_text()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"kvfs did not mount within {timeout}s:\n{self.log_text()}")
            time.sleep(0.02)
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None and os.path.ismount(self.mountpoint)

    def stop(self, timeout: float = 60.0) -> int:
        """Clean unmount; returns the daemon's exit status."""
        assert self.proc is not None
        if os.path.ismount(self.mountpoint):
            subprocess.run([FUSERMOUNT, "-u", str(self.mountpoint)], check=True, capture_output=True)
        code = self.proc.wait(timeout)
        self.exit_codes.append(code)
        self.proc = None
        return code

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        self.proc = None
        subprocess.run([FUSERMOUNT, "-u", "-z", str(self.mountpoint)], capture_output=True)

    def signal(self, signum: int, timeout: float = 60.0) -> int:
        assert self.proc is not None
        self.proc.send_signal(signum)
        code = self.proc.wait(timeout)
        self.exit_codes.append(code)
        self.proc = None
        return code

    # -- inspection -------------------------------------------------------------------------------
    def path(self, *parts: str | bytes) -> Path:
        return self.mountpoint.joinpath(*[os.fsdecode(p) for p in parts])

    def stats(self) -> dict:
        return json.loads((self.mountpoint / ".kvfs" / "stats").read_bytes())

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def expect_log(self, pattern: str) -> None:
        """Declare an error line this test provokes on purpose."""
        self.allowed.append(re.compile(pattern))

    def unexpected_log_lines(self) -> list[str]:
        return [line for line in self.log_text().splitlines()
                if _BAD_LINE.search(line) and not any(p.search(line) for p in self.allowed)]

    def tier_dir(self, tier: str) -> Path:
        return {"L2": self.l2, "L3": self.l3}[tier]

    def objects(self, tier: str | None = None) -> list[Path]:
        """Object files in one tier's directory, or in all of them."""
        tiers = [tier] if tier else ["L2", "L3"]
        return sorted(p for t in tiers for p in self.tier_dir(t).glob("*/*")
                      if p.is_file() and p.parent.name != "staging")

    def check_accounting(self, stats: dict | None = None) -> None:
        """Each tier's counters equal what its directory holds: no leaked, missing or half-written objects.
        Without given stats, waits up to 10 s for a quiet moment: no move in flight (a move charges its
        destination before the copy's file appears) and the same directory listing before and after the
        stats (the daemon releases an object's space, then removes its file in a worker thread)."""
        if stats is None:
            for _ in range(100):
                before = {t: self.objects(t) for t in ("L2", "L3")}
                stats = self.stats()
                after = {t: self.objects(t) for t in ("L2", "L3")}
                mover = stats["mover"]
                quiet = not (mover["moves_in_flight"] or mover["deletions_in_flight"] or mover["draining"]
                             or mover["promotions_queued"])
                if quiet and before == after and all(t["files"] == len(after[name])
                                                     for name, t in stats["tiers"].items() if name in after):
                    break
                time.sleep(0.1)
        for name, t in stats["tiers"].items():
            objects = self.objects(name)
            assert not [p for p in objects if p.name.endswith(".tmp")], objects
            assert t["files"] == len(objects), (name, t, objects)
            assert t["used_bytes"] == sum(p.stat().st_size for p in objects), (name, t)
            assert t["used_bytes"] <= t["capacity_bytes"], (name, t)


@pytest.fixture
def make_mount(tmp_path):
    mounts: list[KvfsMount] = []

    def factory(name: str = "mnt") -> KvfsMount:
        m = KvfsMount(tmp_path, name)
        mounts.append(m)
        return m

    yield factory
    problems = []
    for m in mounts:
        if m.proc is not None:
            if m.proc.poll() is not None:
                problems.append(f"kvfs {m.mountpoint} died with status {m.proc.returncode}")
            else:
                code = m.stop()
                if code != 0:
                    problems.append(f"kvfs {m.mountpoint} exited with status {code}")
        problems += [f"{m.mountpoint}: unexpected log line: {line}" for line in m.unexpected_log_lines()]
    if problems:
        pytest.fail("\n".join(problems) + "\n--- log ---\n" + "\n".join(m.log_text()[-6000:] for m in mounts))


@pytest.fixture
def kvfs(make_mount) -> KvfsMount:
    """A fresh mount with the default codec (auto) and a 512 MiB L2."""
    return make_mount().start()


def drop_page_cache(path) -> None:
    """Make the kernel forget the cached pages of a file in a mount: the next read reaches the daemon. A file
    written through the mount stays in the page cache after its close (kvfs/pagecache.py), as on any
    filesystem, so damage done to its object under a live mount shows only then."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def kv_samples(dtype: str) -> list[Path]:
    files = sorted(KV_DATA.glob(f"{dtype}-*.kv"))
    if not files:
        pytest.fail(f"no real KV sample for {dtype} in {KV_DATA} (produced by tools/dump_kv.py)")
    return files


@pytest.fixture(scope="session")
def ceph(tmp_path_factory):
    """A real one-host Ceph cluster (1 memstore OSD, RGW on 127.0.0.1:7480) for the whole session; every test
    that uses it works under its own bucket prefix. tools/install_ceph.sh installs the packages (CI runs it)."""
    yield from running_ceph(tmp_path_factory.mktemp("ceph"))


def running_ceph(root: Path, **options):
    """A fixture body: a cluster started in `root` (tools/ceph_cluster.py options), stopped afterwards."""
    sys.path.insert(0, str(REPO / "tools"))
    from ceph_cluster import CephCluster

    cluster = CephCluster(root, **options)
    try:
        cluster.start()
    except Exception:
        cluster.stop()
        raise
    yield cluster
    cluster.stop()


def s3_client(cluster):
    import boto3
    from botocore.config import Config

    env = cluster.env
    return boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"], region_name="us-east-1",
                        config=Config(s3={"addressing_style": "path"}))
