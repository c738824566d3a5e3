"""Smoke test of an installed kvfs wheel, run by the python of a fresh venv outside the checkout
(tests/test_wheel.py): python wheel_smoke.py WORKDIR KV_FILE VERSION.

It uses only what the wheel installed: the `kvfs` command of the venv, kvfs.direct and kvfs_connector. It
mounts on the embedded default configuration (HOME is WORKDIR/home, so the state and L3 land there), copies
real KV in and reads it back bit-exact through the mount and past it, runs `kvfs stat` and `kvfs fsck`, and
unmounts. Prints one line per step; exits non-zero at the first failure.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

work, kv_file, version = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
bindir = Path(sys.executable).parent
kvfs_cmd = str(bindir / "kvfs")
site = Path(sysconfig.get_paths()["platlib"])


def run(*args: str, ok=(0,)) -> str:
    r = subprocess.run(args, capture_output=True, text=True, timeout=120)
    if r.returncode not in ok:
        sys.exit(f"FAIL {' '.join(args)}: exit {r.returncode}\n{r.stdout}\n{r.stderr}")
    return r.stdout


out = run(kvfs_cmd, "--version")
assert out.startswith(f"kvfs, version {version}\n"), out
assert "codec kernel: built in" in out and "native front end: available" in out, out
qat_line = next(line for line in out.splitlines() if line.startswith("QATzip: "))
print("version:", out.replace("\n", " | "))

import kvfs  # noqa: E402
import kvfs_connector  # noqa: E402
from kvfs import direct  # noqa: E402
from kvfs.codecs import kernel  # noqa: E402, F401  (the compiled codec kernel loads)

for module in (kvfs, kvfs_connector):
    assert Path(module.__file__).is_relative_to(site), f"{module.__name__} from {module.__file__}, not {site}"
print("imports: kvfs, kvfs_connector and the codec kernel from", site)

mnt = work / "mnt"
mnt.mkdir()
out = run(kvfs_cmd, "mount", str(mnt))  # the embedded default: no options at all
print("mount:", out.strip())
l2_dir = None
try:
    assert os.path.ismount(mnt)
    data = kv_file.read_bytes()
    target = mnt / "smoke" / "ab" / "0123abcd.kv"
    target.parent.mkdir(parents=True)
    target.write_bytes(data)
    assert target.read_bytes() == data, "read through the mount differs"
    got, past_fuse = direct.read_file(str(target))
    assert got == data and past_fuse, f"kvfs.direct: equal {got == data}, past FUSE {past_fuse}"
    codec = os.getxattr(target, "user.kvfs.codec").decode()
    where = os.getxattr(target, "user.kvfs.object").decode().split(" ", 3)
    l2_dir = Path(where[3]).parent.parent
    stats = json.loads((mnt / ".kvfs" / "stats").read_text())
    assert stats["direct_reads"] >= 1, stats
    print(f"data: {len(data)} bytes bit-exact through the mount and past it; codec {codec}, "
          f"stored {where[1]} in {where[0]}")
    print("stat:", run(kvfs_cmd, "stat", str(mnt)).count("\n"), "lines")
    print("fsck:", run(kvfs_cmd, "fsck", str(mnt)).strip().splitlines()[-1])
    print(qat_line)
finally:
    if os.path.ismount(mnt):
        run(kvfs_cmd, "umount", str(mnt))
deadline = time.monotonic() + 10
while os.path.ismount(mnt) and time.monotonic() < deadline:
    time.sleep(0.05)
assert not os.path.ismount(mnt)
print("umount: done")
print("L2:", l2_dir)
