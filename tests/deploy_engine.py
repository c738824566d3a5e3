"""The engine's side of the container tests (tests/test_deploy.py), run inside a plain Python container that
has only the kvfs wheel installed and sees the kvfs container's mount through an rslave bind, with the tier
directories at the same paths. It does what the vLLM connector does with a mount, with the same calls:
kvfs_connector's MountGuard, files.exists and kvfs.direct's read_file / write_file. Prints one JSON object.

  python deploy_engine.py roundtrip MOUNT SRC_DIR   write SRC_DIR's files through the mount and past it, read
                                                   each back both ways, bit-exact
  python deploy_engine.py read MOUNT SRC_DIR        read the files `roundtrip` wrote (both ways), bit-exact
  python deploy_engine.py until-dead MOUNT SRC_DIR  read them in a loop until the mount dies, then a little more
"""

from __future__ import annotations

import errno
import json
import os
import sys
import time
from pathlib import Path

from kvfs import direct
from kvfs_connector import files
from kvfs_connector.mount import MountGuard

mode, mount, src = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
sources = sorted(p for p in src.glob("*.kv"))
guard = MountGuard(str(mount), require_mount=True)
report: dict = {"mode": mode, "usable_at_start": guard.usable()}


def targets(p: Path) -> tuple[Path, Path]:
    return mount / "engine" / "fuse" / p.name, mount / "engine" / "direct" / p.name


def read_back(path: Path, want: bytes) -> dict:
    tier_before = os.getxattr(path, "user.kvfs.tier").decode()  # where it was before this read promoted it
    with open(path, "rb") as f:
        through = f.read()
    got, past_fuse = direct.read_file(str(path))
    return {"through_mount_exact": through == want, "direct_exact": got == want, "direct_past_fuse": past_fuse,
            "tier_before": tier_before}


if mode == "roundtrip":
    out = []
    for p in sources:
        data = p.read_bytes()
        via_fuse, via_direct = targets(p)
        via_fuse.parent.mkdir(parents=True, exist_ok=True)
        via_direct.parent.mkdir(parents=True, exist_ok=True)
        with open(via_fuse, "wb") as f:
            f.write(data)
        wrote_past_fuse = direct.write_file(str(via_direct), data)
        out.append({"file": p.name, "bytes": len(data), "write_past_fuse": wrote_past_fuse,
                    "fuse_written": read_back(via_fuse, data), "direct_written": read_back(via_direct, data)})
    report["files"] = out
elif mode == "read":
    report["files"] = [{"file": p.name, "exists": files.exists(str(targets(p)[1])),
                        "fuse_written": read_back(targets(p)[0], p.read_bytes()),
                        "direct_written": read_back(targets(p)[1], p.read_bytes())} for p in sources]
elif mode == "until-dead":
    # Reads as the connector's loads do, each timed, until the daemon is killed; then a few more rounds, to
    # show that every later call fails at once too. Misses are what the connector counts when guard says no.
    wants = {p.name: p.read_bytes() for p in sources}
    ops, slowest, errors, misses, died_at, good = 0, 0.0, {}, 0, None, 0
    start = time.monotonic()
    deadline = start + 60
    while time.monotonic() < deadline:
        for name, want in wants.items():
            for how in ("exists", "through", "direct"):
                path = targets(Path(name))[0 if how == "through" else 1]
                t0 = time.monotonic()
                try:
                    if not guard.usable():
                        misses += 1
                        continue
                    if how == "exists":
                        ok = files.exists(str(path))
                    elif how == "through":
                        with open(path, "rb") as f:
                            ok = f.read() == want
                    else:
                        got, _ = direct.read_file(str(path))
                        ok = got == want
                    assert ok, f"{how} {name}: wrong bytes"
                    good += 1
                except OSError as e:
                    errors[errno.errorcode.get(e.errno, str(e.errno))] = errors.get(
                        errno.errorcode.get(e.errno, str(e.errno)), 0) + 1
                    guard.failed(e)
                    if died_at is None:
                        died_at = time.monotonic()
                finally:
                    ops += 1
                    slowest = max(slowest, time.monotonic() - t0)
        if died_at is not None and time.monotonic() - died_at > 2:
            break
        if died_at is None:
            time.sleep(0.01)
    report.update(ops=ops, good=good, slowest_op_s=round(slowest, 3), errors=errors, misses=misses,
                  saw_enotconn="ENOTCONN" in errors or "ECONNABORTED" in errors, usable_at_end=guard.usable(),
                  seconds_after_death=round(time.monotonic() - died_at, 2) if died_at else None)
else:
    sys.exit(f"unknown mode {mode}")
print(json.dumps(report))
