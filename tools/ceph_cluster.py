#!/usr/bin/env python3
"""A one-host Ceph cluster for kvfs's L4 tests and benchmarks: mon, mgr, OSDs and RGW (S3 API) on 127.0.0.1.

    tools/ceph_cluster.py start DIR [--osds N] [--store memstore|bluestore] [--capacity GIB] [--port 7480]
    tools/ceph_cluster.py stop DIR

`start` creates a new cluster in DIR (which must be empty or absent: no state is shared between runs), waits
for its OSDs and for RGW to answer, creates an S3 user and a bucket, and writes DIR/env with the standard
variables (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY) and KVFS_TEST_BUCKET. `stop` kills the
daemons by their pid files. The packages come from tools/install_ceph.sh.

What makes a one-host cluster work (../shared/notes/remote.md): cephx on (with auth none radosgw hangs
fetching the mon config), one keyring with every daemon's key given to `ceph-mon --mkfs`, every path under
DIR, pools of size N with chooseleaf type 0 (one host), small placement-group counts, the disk-space
warning threshold low (a nearly full root disk must not block the mon).

Capacity: each OSD holds `capacity` bytes (default 2 GiB; memstore keeps them in RAM as they are written).
A full OSD does not refuse writes: Ceph blocks them, so a client sees PUTs that never answer (kvfs: EIO at
its deadline). Size the cluster for the data a run stores (with 3-way replication each OSD holds a copy).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

RGW_USER = "kvfs"
BUCKET = "kvfs-test"


class CephError(RuntimeError):
    pass


class CephCluster:
    def __init__(self, root: Path, osds: int = 1, store: str = "memstore", port: int = 7480,
                 mon_ports: tuple[int, int] = (3300, 6789), capacity: int = 2 << 30) -> None:
        self.root = Path(root).resolve()
        self.mon_v2, self.mon_v1 = mon_ports
        self.osds = osds
        self.store = store
        self.capacity = capacity  # bytes per OSD
        self.port = port
        self.conf = self.root / "ceph.conf"
        self.access_key = ""
        self.secret_key = ""

    # -- the public surface ----------------------------------------------------------------------------
    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        """What a client needs, the standard way (boto3 and kvfs read these)."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": self.access_key,
                "AWS_SECRET_ACCESS_KEY": self.secret_key, "AWS_DEFAULT_REGION": "us-east-1",
                "KVFS_TEST_BUCKET": BUCKET}

    def start(self, timeout: float = 180.0) -> "CephCluster":
        if self.root.exists() and any(self.root.iterdir()):
            raise CephError(f"{self.root} is not empty: a cluster starts from nothing")
        for tool in ("ceph-mon", "ceph-osd", "ceph-mgr", "radosgw", "monmaptool", "ceph-authtool"):
            if shutil.which(tool) is None:
                raise CephError(f"{tool} not found: run tools/install_ceph.sh")
        _port_free(self.port)
        _port_free(self.mon_v2)
        deadline = time.monotonic() + timeout
        for sub in ("run", "log", "mon", "mgr", "osd", "rgw"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        fsid = str(uuid.uuid4())
        self.conf.write_text(self._conf_text(fsid))
        self._keyring()
        self._tool("monmaptool", "--create", "--addv", "a", f"[v2:127.0.0.1:{self.mon_v2},v1:127.0.0.1:{self.mon_v1}]",
                   "--fsid", fsid, str(self.root / "monmap"))
        self._tool("ceph-mon", "--mkfs", "-i", "a", "--monmap", str(self.root / "monmap"),
                   "--keyring", str(self.root / "keyring"))
        self._tool("ceph-mon", "-i", "a")
        self._tool("ceph-mgr", "-i", "x")
        for osd in range(self.osds):
            self._new_osd(osd)
        self._wait(lambda: self.osds_up() == self.osds, deadline, f"{self.osds} OSDs up")
        self._tool("radosgw", "-n", "client.rgw.a")
        self._wait(self._rgw_answers, deadline, "RGW answering")
        self._user()
        self._bucket(deadline)
        (self.root / "env").write_text("".join(f"export {k}={v}\n" for k, v in self.env.items()))
        return self

    def stop(self) -> None:
        pids = [p for p in (self.root / "run").glob("*.pid")]
        for pidfile in pids:
            _kill(pidfile, signal.SIGTERM)
        end = time.monotonic() + 20
        for pidfile in pids:
            while _alive(pidfile) and time.monotonic() < end:
                time.sleep(0.1)
            _kill(pidfile, signal.SIGKILL)

    def pids(self) -> list[int]:
        """The running daemons' pids (mon, mgr, OSDs, RGW)."""
        return [pid for pid in map(_pid, (self.root / "run").glob("*.pid")) if pid is not None]

    def stop_rgw(self) -> None:
        _kill(self._rgw_pidfile, signal.SIGKILL)
        _wait_dead(self._rgw_pidfile)

    def pause_rgw(self) -> None:
        """A hung store: RGW stopped (SIGSTOP) keeps its port; connections are accepted and never answered.
        Returns once every RGW thread is stopped: the signal is delivered asynchronously."""
        pid = _pid(self._rgw_pidfile)
        if pid is None:
            raise CephError(f"RGW has no pid in {self._rgw_pidfile}: nothing to pause")
        os.kill(pid, signal.SIGSTOP)
        end = time.monotonic() + 10
        while not _stopped(pid):
            if time.monotonic() > end:
                raise CephError(f"RGW (pid {pid}) did not stop within 10 s of SIGSTOP")
            time.sleep(0.01)

    def resume_rgw(self) -> None:
        _kill(self._rgw_pidfile, signal.SIGCONT)

    @property
    def _rgw_pidfile(self) -> Path:
        return self.root / "run" / "client.rgw.a.pid"

    def start_rgw(self, timeout: float = 60.0) -> None:
        self._tool("radosgw", "-n", "client.rgw.a")
        self._wait(self._rgw_answers, time.monotonic() + timeout, "RGW answering")

    def kill_osd(self, osd: int) -> None:
        pidfile = self.root / "run" / f"osd.{osd}.pid"
        _kill(pidfile, signal.SIGKILL)
        _wait_dead(pidfile)

    def start_osd(self, osd: int) -> None:
        self._tool("ceph-osd", "-i", str(osd))

    def osds_up(self) -> int:
        out = self.ceph("osd", "stat", "-f", "json")
        return int(json.loads(out)["num_up_osds"])

    def ceph(self, *args: str) -> str:
        return self._tool("ceph", *args)

    # -- steps -----------------------------------------------------------------------------------------
    def _conf_text(self, fsid: str) -> str:
        r = self.root
        store = {"memstore": f"osd_objectstore = memstore\nmemstore_device_bytes = {self.capacity}\n",
                 "bluestore": (f"osd_objectstore = bluestore\nbluestore_block_path = {r}/osd/$cluster-$id.block\n"
                               # bluestore's own metadata and WAL need room beside the data
                               f"bluestore_block_create = true\nbluestore_block_size = {max(self.capacity, 4 << 30)}\n"
                               "bluestore_cache_size = 268435456\n")}[self.store]
        return f"""[global]
fsid = {fsid}
mon_host = [v2:127.0.0.1:{self.mon_v2},v1:127.0.0.1:{self.mon_v1}]
public_network = 127.0.0.0/8
auth_cluster_required = cephx
auth_service_required = cephx
auth_client_required = cephx
keyring = {r}/keyring
run_dir = {r}/run
admin_socket = {r}/run/$cluster-$name.asok
pid_file = {r}/run/$name.pid
log_file = {r}/log/$cluster-$name.log
mon_data = {r}/mon/$cluster-$id
mgr_data = {r}/mgr/$cluster-$id
osd_data = {r}/osd/$cluster-$id
osd_pool_default_size = {self.osds}
osd_pool_default_min_size = 1
osd_crush_chooseleaf_type = 0
osd_pool_default_pg_num = 8
osd_pool_default_pgp_num = 8
osd_pool_default_pg_autoscale_mode = off
mon_allow_pool_size_one = true
mon_allow_pool_delete = true
mon_data_avail_warn = 5
mon_data_avail_crit = 1
mon_warn_on_pool_no_redundancy = false
osd_heartbeat_grace = 6
osd_heartbeat_interval = 1
mon_osd_min_down_reporters = 1
mon_osd_down_out_interval = 0
{store}
[client.rgw.a]
rgw_frontends = beast endpoint=127.0.0.1:{self.port} tcp_nodelay=1
rgw_data = {r}/rgw
rgw_dns_name = 127.0.0.1
"""

    def _keyring(self) -> None:
        keyring = str(self.root / "keyring")
        entities = [("mon.", ["mon", "allow *"]),
                    ("client.admin", ["mon", "allow *", "osd", "allow *", "mds", "allow *", "mgr", "allow *"]),
                    ("mgr.x", ["mon", "allow profile mgr", "osd", "allow *", "mds", "allow *"]),
                    ("client.rgw.a", ["mon", "allow rw", "osd", "allow rwx", "mgr", "allow rw"])]
        entities += [(f"osd.{i}", ["mon", "allow profile osd", "mgr", "allow profile osd", "osd", "allow *"])
                     for i in range(self.osds)]
        for n, (name, caps) in enumerate(entities):
            args = ["--create-keyring"] if n == 0 else []
            for i in range(0, len(caps), 2):
                args += ["--cap", caps[i], caps[i + 1]]
            self._tool("ceph-authtool", keyring, *args, "--gen-key", "-n", name, conf=False)

    def _new_osd(self, osd: int) -> None:
        osd_uuid = str(uuid.uuid4())
        got = self.ceph("osd", "new", osd_uuid, str(osd)).strip()
        if got != str(osd):
            raise CephError(f"ceph osd new gave id {got!r}, expected {osd}")
        (self.root / "osd" / f"ceph-{osd}").mkdir()
        self._tool("ceph-osd", "-i", str(osd), "--mkfs", "--osd-uuid", osd_uuid)
        self._tool("ceph-osd", "-i", str(osd))

    def _rgw_answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                s.sendall(b"GET / HTTP/1.0\r\n\r\n")
                return s.recv(12).startswith(b"HTTP/")
        except OSError:
            return False

    def _user(self) -> None:
        self.access_key = secrets.token_hex(10).upper()
        self.secret_key = secrets.token_hex(20)
        self._tool("radosgw-admin", "user", "create", f"--uid={RGW_USER}", f"--display-name={RGW_USER}",
                   f"--access-key={self.access_key}", f"--secret-key={self.secret_key}")

    def _bucket(self, deadline: float) -> None:
        import boto3  # the test environment has it (kvfs depends on it)
        from botocore.config import Config

        s3 = boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=self.access_key,
                          aws_secret_access_key=self.secret_key, region_name="us-east-1",
                          config=Config(s3={"addressing_style": "path"}))
        last: Exception | None = None
        while time.monotonic() < deadline:  # the user may take a moment to be visible to RGW
            try:
                s3.create_bucket(Bucket=BUCKET)
                break
            except Exception as e:  # noqa: BLE001 - retried until the deadline, then reported
                last = e
                time.sleep(0.5)
        else:
            raise CephError(f"could not create bucket {BUCKET}: {last}")
        # RGW creates its data pool at the first object written (~2 s): pay that here, not in a measurement
        s3.put_object(Bucket=BUCKET, Key="warm-up", Body=bytes(1 << 20))
        s3.delete_object(Bucket=BUCKET, Key="warm-up")

    def _tool(self, *argv: str, conf: bool = True) -> str:
        cmd = [argv[0], *(["-c", str(self.conf)] if conf else []), *argv[1:]]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if out.returncode != 0:
            raise CephError(f"{' '.join(cmd)} failed ({out.returncode}): {out.stderr.strip()[-2000:]}")
        return out.stdout

    def _wait(self, ready, deadline: float, what: str) -> None:
        while time.monotonic() < deadline:
            try:
                if ready():
                    return
            except CephError:
                pass
            time.sleep(0.3)
        raise CephError(f"timed out waiting for {what}; logs in {self.root / 'log'}")


def _port_free(port: int) -> None:
    with socket.socket() as s:
        if s.connect_ex(("127.0.0.1", port)) == 0:
            raise CephError(f"127.0.0.1:{port} is in use: is another cluster running? (tools/ceph_cluster.py stop)")


def _pid(pidfile: Path) -> int | None:
    try:
        return int(pidfile.read_text().strip())
    except (OSError, ValueError):
        return None


def _alive(pidfile: Path) -> bool:
    pid = _pid(pidfile)
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _stopped(pid: int) -> bool:
    """Every thread of `pid` is stopped by a signal (state T)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
        states = [Path(f"/proc/{pid}/task/{t}/stat").read_text().rsplit(")", 1)[1].split()[0] for t in tasks]
    except OSError:
        return False
    return all(state in ("T", "t") for state in states)


def _kill(pidfile: Path, sig: int) -> None:
    pid = _pid(pidfile)
    if pid is not None:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _wait_dead(pidfile: Path, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while _alive(pidfile) and time.monotonic() < end:
        time.sleep(0.05)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("action", choices=["start", "stop"])
    p.add_argument("dir", type=Path)
    p.add_argument("--osds", type=int, default=1)
    p.add_argument("--store", choices=["memstore", "bluestore"], default="memstore")
    p.add_argument("--capacity", type=float, default=2.0, metavar="GIB", help="bytes per OSD, in GiB (default 2)")
    p.add_argument("--port", type=int, default=7480)
    args = p.parse_args(argv)
    cluster = CephCluster(args.dir, args.osds, args.store, args.port, capacity=int(args.capacity * (1 << 30)))
    if args.action == "stop":
        cluster.stop()
        return 0
    t = time.monotonic()
    try:
        cluster.start()
    except CephError as e:
        cluster.stop()
        print(f"ceph: {e}", file=sys.stderr)
        return 1
    print(f"ceph: {args.osds} {args.store} OSD(s), RGW at {cluster.endpoint}, bucket {BUCKET} "
          f"({time.monotonic() - t:.0f} s); environment in {args.dir / 'env'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
