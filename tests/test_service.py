"""kvfs as a service: the systemd unit and tmpfiles entry, sd_notify readiness, and the mount(8) helper.

This machine has no systemd as PID 1, so the unit cannot be started for real: `systemd-analyze verify`, the
sd_notify exchange with a listening socket and a mount under the unit's capability bounding set stand in.
The helper is exercised through util-linux mount(8) itself (`mount -t fuse.kvfs`, `mount --fstab`), which
needs /sbin/mount.fuse.kvfs (tools/install.sh installs it).
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import FUSERMOUNT, REPO, KvfsMount
from kvfs import mount_helper, sdnotify

UNIT = REPO / "systemd" / "kvfs@.service"
TMPFILES = REPO / "systemd" / "kvfs.tmpfiles"
HELPER = Path("/sbin/mount.fuse.kvfs")
VENV_BIN = Path(sys.executable).parent


def unit_value(key: str) -> str:
    """The value of the unit's (single) KEY= line."""
    values = [line.split("=", 1)[1] for line in UNIT.read_text().splitlines() if line.startswith(f"{key}=")]
    assert len(values) == 1, (key, values)
    return values[0]


def analyze_verify(unit: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)


def about_unit(output: str, unit: Path) -> list[str]:
    """Lines of systemd-analyze output about our unit (it may also grumble about the host's own units)."""
    return [line for line in output.splitlines() if unit.name in line or str(unit.parent) in line]


# -- the unit and tmpfiles ------------------------------------------------------------------------------------
def test_unit_verifies_cleanly(tmp_path):
    instance = tmp_path / "kvfs@tmp-x.service"  # the instance for the mountpoint /tmp/x
    instance.write_text(UNIT.read_text().replace("/usr/local/bin/kvfs", str(VENV_BIN / "kvfs")))
    res = analyze_verify(instance)
    assert res.returncode == 0 and not about_unit(res.stdout + res.stderr, instance), res.stdout + res.stderr
    # the same check does see our unit: a typo and a missing binary are reported
    instance.write_text(instance.read_text().replace("UMask=", "UMaks=").replace(str(VENV_BIN), "/nonexistent"))
    res = analyze_verify(instance)
    complaints = about_unit(res.stdout + res.stderr, instance)
    assert res.returncode != 0 and any("UMaks" in c for c in complaints), res.stderr
    assert any("/nonexistent/kvfs" in c for c in complaints), res.stderr


def test_install_service_is_idempotent_and_tmpfiles_creates_private_l2_root(tmp_path):
    root = tmp_path / "root"
    for _ in range(2):
        subprocess.run([REPO / "tools" / "install_service.sh"], env={**os.environ, "DESTDIR": str(root)},
                       check=True, capture_output=True, timeout=60)
    assert (root / "etc/systemd/system/kvfs@.service").read_text() == UNIT.read_text()
    assert os.readlink(root / "usr/local/bin/kvfs") == str(REPO / ".venv/bin/kvfs")
    assert os.readlink(root / "sbin/mount.fuse.kvfs") == str(REPO / ".venv/bin/mount.fuse.kvfs")
    assert (root / "etc/tmpfiles.d/kvfs.conf").read_text() == TMPFILES.read_text()
    l2_root = root / "dev/shm/kvfs"
    for _ in range(2):  # created, then a wrong mode put right
        subprocess.run(["systemd-tmpfiles", "--create", f"--root={root}", "kvfs.conf"], check=True, timeout=60)
        st = l2_root.stat()
        assert (oct(st.st_mode & 0o7777), st.st_uid) == ("0o700", 0)
        l2_root.chmod(0o755)


# -- the daemon under the unit's conditions --------------------------------------------------------------------
def launch(m: KvfsMount, cmd: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    """Run a foreground daemon for m (m's fixture stops it and checks its log)."""
    with open(m.log_path, "ab") as log:
        m.proc = subprocess.Popen(cmd, stdout=log, stderr=log, env={**os.environ, **(env or {})})
    return m.proc


def kvfs_options(m: KvfsMount) -> str:
    return f"--l2 {m.l2}:64M --state-dir {m.state}"


def unit_exec_start(m: KvfsMount) -> list[str]:
    """The unit's ExecStart as systemd runs it for m's mountpoint, with m's options as $KVFS_OPTS."""
    line = unit_value("ExecStart").replace("/usr/local/bin/kvfs", str(VENV_BIN / "kvfs"))
    return shlex.split(line.replace("$KVFS_OPTS", kvfs_options(m)).replace("%f", str(m.mountpoint)))


def wait_mounted(m: KvfsMount, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.ismount(m.mountpoint):
        assert m.proc.poll() is None, f"kvfs exited with {m.proc.returncode}:\n{m.log_text()}"
        assert time.monotonic() < deadline, f"not mounted after {timeout}s:\n{m.log_text()}"
        time.sleep(0.02)


def next_notification(sock: socket.socket, proc: subprocess.Popen, timeout: float = 20.0) -> list[str]:
    deadline = time.monotonic() + timeout
    sock.settimeout(0.05)
    while True:
        try:
            return sock.recv(4096).decode().split("\n")
        except TimeoutError:
            assert proc.poll() is None, f"kvfs exited with {proc.returncode} before notifying"
            assert time.monotonic() < deadline, "no sd_notify message"


@pytest.mark.parametrize("abstract", [False, True], ids=["socket-file", "abstract-socket"])
def test_sd_notify_ready_once_mounted_stopping_at_sigterm(make_mount, tmp_path, abstract):
    m = make_mount()
    address = f"@kvfs-test-{os.getpid()}-{tmp_path.name}" if abstract else str(tmp_path / "notify")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + address[1:] if abstract else address)
        proc = launch(m, unit_exec_start(m), env={"NOTIFY_SOCKET": address})
        ready = next_notification(sock, proc)
        assert os.path.ismount(m.mountpoint), "READY=1 before the mount existed"
        assert ready == ["READY=1", f"STATUS=mounted {m.mountpoint}"]
        m.path("f").write_bytes(b"kv" * 100_000)  # live: serves requests
        assert m.path("f").read_bytes() == b"kv" * 100_000
        assert m.signal(signal.SIGTERM) == 0  # systemd's stop
        assert next_notification(sock, proc, timeout=1) == ["STOPPING=1", f"STATUS=unmounting {m.mountpoint}"]
    assert not os.path.ismount(m.mountpoint)
    assert "unmounted" in m.log_text()


def test_sd_notify_without_socket_or_listener_is_harmless(monkeypatch, tmp_path, caplog):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert sdnotify.notify("READY=1") is False
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "nobody-listens"))
    assert sdnotify.notify("READY=1") is False
    assert "sd_notify" in caplog.text


def test_mount_works_within_unit_capability_bounding_set(make_mount):
    caps = unit_value("CapabilityBoundingSet").split()
    assert unit_value("NoNewPrivileges") == "yes"
    bounding = "-all," + ",".join("+" + cap.removeprefix("CAP_").lower() for cap in caps)
    umask = unit_value("UMask")
    m = make_mount()
    launch(m, ["setpriv", f"--bounding-set={bounding}", "--no-new-privs", "--",
               "sh", "-c", f'umask {umask} && exec "$@"', "sh", *unit_exec_start(m)])
    wait_mounted(m)
    status = dict(line.split(":\t", 1) for line in Path(f"/proc/{m.proc.pid}/status").read_text().splitlines())
    assert bin(int(status["CapBnd"], 16)).count("1") == len(caps) and status["CapEff"] == status["CapBnd"]
    assert status["NoNewPrivs"].strip() == "1" and int(status["Umask"], 8) == int(umask, 8)
    data = os.urandom(3_000_000)
    m.path("d").mkdir()
    m.path("d", "f").write_bytes(data)
    assert m.path("d", "f").read_bytes() == data
    assert m.stop() == 0


# -- the mount(8) helper -----------------------------------------------------------------------------------
@pytest.fixture
def helper_mount(make_mount):
    """A KvfsMount for mounts made by mount(8) through the helper: its log is the background daemon's."""
    assert HELPER.exists() and HELPER.resolve() == (VENV_BIN / "mount.fuse.kvfs").resolve(), \
        f"{HELPER} must link to {VENV_BIN / 'mount.fuse.kvfs'}: run tools/install.sh"
    mounts: list[KvfsMount] = []

    def factory(name: str = "mnt") -> KvfsMount:
        m = make_mount(name)
        m.log_path = m.state / "kvfs.log"  # `kvfs mount` in background mode logs there
        mounts.append(m)
        return m

    yield factory
    for m in mounts:
        if os.path.ismount(m.mountpoint):
            subprocess.run([FUSERMOUNT, "-u", "-z", str(m.mountpoint)], capture_output=True)


def run_mount(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["mount", *args], capture_output=True, text=True, timeout=60, cwd=cwd)


def umount_and_wait(m: KvfsMount, pid: int, timeout: float = 30.0) -> None:
    """`umount` (the kernel's unmount, no kvfs tool), then the daemon must finish by itself."""
    res = subprocess.run(["umount", str(m.mountpoint)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    deadline = time.monotonic() + timeout
    while _running(pid):
        assert time.monotonic() < deadline, f"daemon {pid} still running {timeout}s after umount"
        time.sleep(0.05)
    assert "unmounted" in m.log_text().splitlines()[-1]


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_mount_t_fuse_kvfs_mounts_and_umount_ends_daemon(helper_mount, tmp_path):
    m = helper_mount()
    l3 = tmp_path / "l3"
    options = f"l2={m.l2}:64M,l3={l3}:128M,state_dir={m.state},codec=zstd"
    res = run_mount("-t", "fuse.kvfs", "kvfs", str(m.mountpoint), "-o", options, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert os.path.ismount(m.mountpoint)
    data = os.urandom(1_500_000) + bytes(1_500_000)
    m.path("f.kv").write_bytes(data)
    assert m.path("f.kv").read_bytes() == data
    doc = m.stats()
    assert doc["codec"] == "zstd"
    assert {name: (t["path"], t["capacity_bytes"]) for name, t in doc["tiers"].items()} == {
        "L2": (str(m.l2), 64 << 20), "L3": (str(l3), 128 << 20)}
    umount_and_wait(m, doc["pid"])
    res = run_mount("-t", "fuse.kvfs", "kvfs", str(m.mountpoint), "-o", options, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert m.path("f.kv").read_bytes() == data
    umount_and_wait(m, m.stats()["pid"])


def test_fstab_entry_mounts(helper_mount, tmp_path):
    m = helper_mount()
    l3 = tmp_path / "l3,with-comma"  # a quoted value: libmount keeps the quotes, the helper honours them
    fstab = tmp_path / "fstab"
    fstab.write_text(f"# kvfs for the KV cache\nkvfs {m.mountpoint} fuse.kvfs noauto,nofail,_netdev,"
                     f"x-systemd.requires=network-online.target,l2={m.l2}:64M,l3=\"{l3}:128M\","
                     f"state_dir={m.state},allow_other 0 0\n")
    res = run_mount("--fstab", str(fstab), str(m.mountpoint), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    doc = m.stats()
    assert doc["tiers"]["L2"]["path"] == str(m.l2) and doc["tiers"]["L3"]["path"] == str(l3)
    assert "allow_other" in Path("/proc/self/mounts").read_text().split(f" {m.mountpoint} ")[1].split("\n")[0]
    m.path("x").write_text("hello")
    assert m.path("x").read_text() == "hello"
    umount_and_wait(m, doc["pid"])


@pytest.mark.parametrize("option, message", [
    ("bogus=1", "mount.fuse.kvfs: unknown option bogus (kvfs options: "),
    ("ro", "mount.fuse.kvfs: option ro: kvfs has no read-only mode"),
    ("debug=yes", "mount.fuse.kvfs: option debug is a flag and takes no value"),
    ("codec", "mount.fuse.kvfs: option codec needs a value"),
])
def test_bad_option_fails_clearly_and_mounts_nothing(helper_mount, tmp_path, option, message):
    m = helper_mount()
    res = run_mount("-t", "fuse.kvfs", "kvfs", str(m.mountpoint), "-o", f"l2={m.l2}:64M,{option}", cwd=tmp_path)
    assert res.returncode == 1
    assert res.stderr.startswith(message) and len(res.stderr.splitlines()) == 1, res.stderr
    assert not os.path.ismount(m.mountpoint) and not m.state.exists()


def test_kvfs_refusal_is_passed_on(helper_mount, tmp_path):
    m = helper_mount()
    res = run_mount("-t", "fuse.kvfs", "kvfs", str(m.mountpoint), "-o", f"l2={m.l2}:lots", cwd=tmp_path)
    assert res.returncode == 1 and "not a size" in res.stderr
    assert not os.path.ismount(m.mountpoint)


def test_helper_options_come_from_kvfs_mount():
    """Every `kvfs mount` option is a mount option (a new one needs no change in the helper)."""
    from kvfs.cli import mount

    table = mount_helper.kvfs_options()
    for param in mount.params:
        for opt in [*param.opts, *param.secondary_opts]:
            if opt.startswith("--") and opt != "--foreground":
                assert table[opt[2:].replace("-", "_")][0] == opt
    assert "foreground" not in table
    call = mount_helper.parse(["kvfs", "/mnt/x", "-o", "rw,l4_virtual_host,state-dir=/s,l2=/a:1G", "-o",
                               "defaults,x-systemd.automount,comment=x", "-n", "-v"])
    assert (call.mountpoint, call.verbose, call.fake) == ("/mnt/x", True, False)
    assert call.kvfs_args == ["--l4-virtual-host", "--state-dir", "/s", "--l2", "/a:1G"]
    assert mount_helper.parse(["kvfs", "/m", "-s", "-o", "unknown=1,debug"]).kvfs_args == ["--debug"]
    with pytest.raises(mount_helper.HelperError, match="read-only"):
        mount_helper.parse(["kvfs", "/m", "-s", "-o", "ro"])


def test_fake_mount_prints_command_and_mounts_nothing(helper_mount, tmp_path):
    m = helper_mount()
    res = run_mount("-f", "-t", "fuse.kvfs", "kvfs", str(m.mountpoint), "-o", f"l2={m.l2}:64M,debug", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert f"kvfs mount {m.mountpoint} --l2 {m.l2}:64M --debug" in res.stderr
    assert not os.path.ismount(m.mountpoint)

