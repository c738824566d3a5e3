"""kvfs in containers, with real podman (docs/deploy.md): the daemon image of tools/build_image.sh, and an engine
stand-in (a plain Python image with only the kvfs wheel, no FUSE packages) that sees the mount through an
rslave bind of the same host directory, as a vLLM pod does with HostToContainer propagation.

The host directory is made a shared mount; the kvfs container binds it rshared and mounts kvfs below it, so
the mount propagates to the host and from there to the engine. L2 (a host tmpfs directory) and L3 are bound
at the same paths in both containers, so the engine's kvfs.direct reads and writes go past FUSE. The tests
run in order on one host layout: mount, real KV both ways, a clean restart, a kill (with podman's poststop
hook, deploy/podman), and a kill without the hook followed by a new container (what Kubernetes does).

Both images are built once per run (tests/deploy_build.py).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import time
from pathlib import Path

import pytest

import deploy_build

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/dev/fuse") or not shutil.which("podman"),
                                 reason="needs root, /dev/fuse and podman (tools/install_deploy.sh)")]
REPO = deploy_build.REPO
KV_DIR = REPO / "tests" / "data" / "kv"
KV_FILES = sorted(p.name for p in KV_DIR.glob("*.kv"))
IN_MNT = "/var/lib/kvfs/mnt"  # the image's defaults (deploy/container): the mountpoint's parent, shared
IN_MOUNTPOINT = f"{IN_MNT}/main"


def podman(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout)
    if check and r.returncode:
        raise AssertionError(f"podman {' '.join(args)}: exit {r.returncode}\n{r.stdout}\n{r.stderr}")
    return r


def mounted(path: Path) -> list[str]:
    """The mountinfo lines of mounts at path in this (the host's) mount namespace."""
    return [line for line in Path("/proc/self/mountinfo").read_text().splitlines() if line.split()[4] == str(path)]


class Host:
    def __init__(self, root: Path, images: tuple[str, str], owner: int | None = None) -> None:
        self.image, self.engine_image = images
        self.root = root
        self.share = root / "share"  # the mountpoint's parent: a shared mount on the host
        self.mountpoint = self.share / "main"
        self.l3 = root / "l3"
        self.state = root / "state"
        self.l2 = Path("/dev/shm") / f"kvfs-test-{os.getpid()}-{root.name}"
        for d in (self.share, self.l3, self.state, self.l2):
            d.mkdir(parents=True, exist_ok=True)
            if owner is not None:
                os.chown(d, owner, owner)
        # /dev/fuse as podman passes it on: the host's node (mode 0600 on these VMs: root only), or for a
        # non-root daemon a node of our own with the usual 0666 (what udev gives /dev/fuse on most hosts)
        self.fuse_device = "/dev/fuse"
        if owner is not None:
            self.fuse_device = str(root / "fuse")
            os.mknod(self.fuse_device, 0o666 | stat.S_IFCHR, os.stat("/dev/fuse").st_rdev)
            os.chmod(self.fuse_device, 0o666)
        subprocess.run(["mount", "--bind", str(self.share), str(self.share)], check=True)
        subprocess.run(["mount", "--make-shared", str(self.share)], check=True)
        # podman's OCI hooks: only this test's kvfs-unmount hook (deploy/podman), pointing at the checkout
        self.hooks = root / "hooks.d"
        self.hooks.mkdir()
        hook = json.loads((REPO / "deploy" / "podman" / "kvfs-unmount.json").read_text())
        hook["hook"]["path"] = str(REPO / "deploy" / "podman" / "kvfs-unmount-hook")
        (self.hooks / "kvfs-unmount.json").write_text(json.dumps(hook))
        self.containers: list[str] = []

    def volumes(self, propagation: str) -> list[str]:
        return ["-v", f"{self.share}:{IN_MNT}:{propagation}", "-v", f"{self.l2}:/dev/shm/kvfs",
                "-v", f"{self.l3}:/var/lib/kvfs/l3"]

    def start_kvfs(self, name: str, *options: str, hook: bool = True, timeout: float = 60) -> str:
        """podman run the kvfs image; returns once its mount is seen on the host."""
        hooks = ["--hooks-dir", str(self.hooks)] if hook else []
        podman(*hooks, "run", "-d", "--name", name, "--annotation", f"io.kvfs.mountpoint={self.mountpoint}",
               "--health-interval", "disable", "--device", f"{self.fuse_device}:/dev/fuse", "--cap-add", "SYS_ADMIN",
               *self.volumes("rshared"), "-v", f"{self.state}:/var/lib/kvfs/state", *options, self.image)
        self.containers.append(name)
        # Its own "mounted" line first: a dead mount left by a killed predecessor can look alive for a moment
        # (stat answered from the kernel's attribute cache) until this container's entrypoint detaches it.
        deadline = time.monotonic() + timeout
        while True:
            logs = podman("logs", name, check=False).stderr
            if " kvfs: mounted " in logs and mounted(self.mountpoint):
                os.statvfs(self.mountpoint)  # alive: statfs always reaches the daemon
                return name
            state = podman("inspect", "--format", "{{.State.Status}}", name).stdout.strip()
            if state != "running" or time.monotonic() > deadline:
                raise AssertionError(f"kvfs container {state}, no mount at {self.mountpoint}:\n{logs}")
            time.sleep(0.1)

    def engine_cmd(self, mode: str, user: str = "root", name: str = "kvfs-test-engine") -> list[str]:
        return ["podman", "run", "--rm", "--name", name, "--user", user, *self.volumes("rslave"),
                "-v", f"{REPO / 'tests' / 'deploy_engine.py'}:/engine.py:ro", "-v", f"{KV_DIR}:/kv:ro",
                self.engine_image, "python", "/engine.py", mode, IN_MOUNTPOINT, "/kv"]

    def engine(self, mode: str, user: str = "root", timeout: float = 120) -> dict:
        r = subprocess.run(self.engine_cmd(mode, user), capture_output=True, text=True, timeout=timeout)
        assert r.returncode == 0, f"engine {mode}: exit {r.returncode}\n{r.stdout}\n{r.stderr}\n{self.logs()}"
        return json.loads(r.stdout.strip().splitlines()[-1])

    def logs(self) -> str:
        """Every kvfs container's log, for a failure's message."""
        return "\n".join(f"--- {name}\n" + podman("logs", name, check=False).stderr for name in self.containers)

    def stats(self) -> dict:
        return json.loads((self.mountpoint / ".kvfs" / "stats").read_text())

    def close(self) -> None:
        for name in self.containers:
            podman("rm", "-f", "-t", "5", name, check=False)
        subprocess.run(["podman", "rm", "-f", "kvfs-test-engine"], capture_output=True)
        for _ in range(3):
            if mounted(self.mountpoint):
                subprocess.run(["umount", "-l", str(self.mountpoint)], capture_output=True)
        subprocess.run(["umount", "-l", str(self.share)], capture_output=True)
        shutil.rmtree(self.l2, ignore_errors=True)


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    if why := deploy_build.missing_tools():
        pytest.skip(why)
    images = deploy_build.image()
    h = Host(tmp_path_factory.mktemp("deploy"), images)
    yield h
    h.close()


def test_kvfs_container_mounts_on_a_shared_host_directory(host):
    host.start_kvfs("kvfs-test-1", "-e", "KVFS_MOUNT_PROMOTE=never", "--memory", "2g")
    assert " - fuse.kvfs " in mounted(host.mountpoint)[0]
    stats = host.stats()
    # the image's /etc/kvfs/kvfs.toml set the tiers; the environment (KVFS_MOUNT_PROMOTE) one more setting
    assert stats["tiers"]["L2"]["path"] == "/dev/shm/kvfs/main", stats["tiers"]["L2"]
    assert stats["tiers"]["L3"]["path"] == "/var/lib/kvfs/l3", stats["tiers"]["L3"]
    assert stats["mover"]["promotion"] == "never", stats["mover"]
    assert podman("healthcheck", "run", "kvfs-test-1", check=False).returncode == 0
    # the container's memory limit bounds the default for unsaved writes (the image's TOML sets max_dirty)
    default = podman("exec", "kvfs-test-1", "python", "-c",
                     "from kvfs.config import default_max_dirty as d; print(d())").stdout
    assert int(default) == (2 << 30) // 4, default
    print(deploy_build.BUILD_REPORT)


def test_engine_container_writes_and_reads_real_kv_both_ways(host):
    before = host.stats()["direct_reads"]
    report = host.engine("roundtrip")
    assert report["usable_at_start"]
    assert [f["file"] for f in report["files"]] == KV_FILES
    for f in report["files"]:
        assert f["write_past_fuse"], f  # kvfs.direct.write_file: encoded in the engine, adopted by the daemon
        for written in (f["fuse_written"], f["direct_written"]):
            assert written["through_mount_exact"] and written["direct_exact"], f
            assert written["direct_past_fuse"], f  # the object was read from L2 in the engine, not via FUSE
    # the daemon counted the engine's direct reads: the path past FUSE was taken, not the fallback
    assert host.stats()["direct_reads"] - before >= 2 * len(KV_FILES)
    for name in KV_FILES:  # and the host sees the same bytes
        assert (host.mountpoint / "engine" / "direct" / name).read_bytes() == (KV_DIR / name).read_bytes()


def test_clean_restart_keeps_l3(host):
    for how in ("fuse", "direct"):  # fsync puts a file on L3
        for name in KV_FILES:
            fd = os.open(host.mountpoint / "engine" / how / name, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
            assert os.getxattr(host.mountpoint / "engine" / how / name, "user.kvfs.tier") == b"L3"
    podman("stop", "-t", "120", "kvfs-test-1", timeout=180)
    assert podman("inspect", "--format", "{{.State.ExitCode}}", "kvfs-test-1").stdout.strip() == "0"
    assert "unmounted" in podman("logs", "kvfs-test-1").stderr
    assert not mounted(host.mountpoint), "podman stop left a mount on the host"
    for entry in host.l2.iterdir():  # as after a reboot: only L3 and the index are left
        shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    host.start_kvfs("kvfs-test-2")
    report = host.engine("read")
    for f in report["files"]:
        assert f["exists"], f
        for written in (f["fuse_written"], f["direct_written"]):
            assert written["tier_before"] == "L3", f
            assert written["through_mount_exact"] and written["direct_exact"] and written["direct_past_fuse"], f


def test_killed_daemon_never_hangs_the_engine(host):
    engine = subprocess.Popen(host.engine_cmd("until-dead"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
    try:
        time.sleep(4)  # the engine is reading
        assert engine.poll() is None, engine.communicate()
        killed_at = time.monotonic()
        podman("kill", "kvfs-test-2")
        out, err = engine.communicate(timeout=60)  # ends by itself 2 s after its first ENOTCONN
        ended_after = time.monotonic() - killed_at
    finally:
        if engine.poll() is None:
            engine.kill()
    assert engine.returncode == 0, out + err
    report = json.loads(out.strip().splitlines()[-1])
    assert report["good"] > 0 and report["saw_enotconn"], report
    assert report["slowest_op_s"] < 2.0, report  # no call hung: each ended at once, ENOTCONN or data
    assert not report["usable_at_end"] and report["misses"] > 0, report  # the connector's guard: a miss
    assert ended_after < 30, ended_after
    assert set(report["errors"]) <= {"ENOTCONN", "ECONNABORTED", "ENOENT"}, report
    # the poststop hook (deploy/podman) detached the dead mount: nothing is left mounted on the host
    deadline = time.monotonic() + 10
    while mounted(host.mountpoint) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not mounted(host.mountpoint), mounted(host.mountpoint)


def test_kill_without_the_hook_next_container_takes_over(host):
    """Where no hook runs (Kubernetes on containerd), the dead mount stays until the next kvfs container: its
    entrypoint detaches it, mounts again, and the engine, which never restarted, reads L3 again."""
    host.start_kvfs("kvfs-test-3", hook=False)
    podman("kill", "kvfs-test-3")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.statvfs(host.mountpoint)
        except OSError:
            break
        time.sleep(0.1)
    assert mounted(host.mountpoint), "expected the dead mount the kernel leaves without the hook"
    with pytest.raises(OSError):
        os.statvfs(host.mountpoint)
    host.start_kvfs("kvfs-test-4", hook=False)
    assert "detached a dead mount" in podman("logs", "kvfs-test-4").stderr
    assert len(mounted(host.mountpoint)) == 1, host.logs()
    report = host.engine("read")
    assert all(w["direct_exact"] and w["through_mount_exact"] for f in report["files"]
               for w in (f["fuse_written"], f["direct_written"])), report
    podman("stop", "-t", "120", "kvfs-test-4", timeout=180)
    assert not mounted(host.mountpoint)


def test_non_root_daemon(tmp_path_factory):
    """--user kvfs (uid 10001): the daemon mounts through the image's setuid fusermount3 and runs unprivileged.
    An engine under the same uid reads and writes past FUSE; a root engine reads past FUSE (root may open the
    daemon's 0600 objects) while its direct writes fall back to the mount (the daemon cannot read a root-owned
    staged object): slower, never wrong."""
    if why := deploy_build.missing_tools():
        pytest.skip(why)
    h = Host(tmp_path_factory.mktemp("deploy-nonroot"), deploy_build.image(), owner=10001)
    try:
        h.start_kvfs("kvfs-test-nonroot", "--user", "kvfs")
        assert "user_id=10001" in mounted(h.mountpoint)[0]
        top = podman("top", "kvfs-test-nonroot", "user", "args").stdout
        assert "kvfs mount" in top and all(line.split()[0] != "root" for line in top.splitlines()[1:]), top
        for user, writes_past_fuse in (("10001", True), ("root", False)):
            report = h.engine("roundtrip", user=user)
            for f in report["files"]:
                assert f["write_past_fuse"] is writes_past_fuse, (user, f)
                for written in (f["fuse_written"], f["direct_written"]):
                    assert written["through_mount_exact"] and written["direct_exact"], (user, f)
                    assert written["direct_past_fuse"], (user, f)
        podman("stop", "-t", "120", "kvfs-test-nonroot", timeout=180)
        assert podman("inspect", "--format", "{{.State.ExitCode}}", "kvfs-test-nonroot").stdout.strip() == "0"
        assert not mounted(h.mountpoint)
    finally:
        h.close()
