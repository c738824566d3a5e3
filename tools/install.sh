#!/usr/bin/env bash
# Set up kvfs on a fresh Debian/Ubuntu machine: system packages, a project venv (.venv), kvfs + test and
# benchmark deps (the tools/bench_*.py plots).
# Idempotent; run as root (or with sudo available) for the apt step.
set -euo pipefail
cd "$(dirname "$0")/.."

source tools/apt_install.sh
# systemd: systemd-analyze and systemd-tmpfiles check the service files (tests/test_service.py)
apt_install_missing fuse3 libfuse3-dev pkg-config gcc fio stress-ng attr util-linux systemd rsync iproute2 e2fsprogs

PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[test,bench]'
# Intel QATzip for codec qat (Debian 13's packages, unpacked into .venv/opt/qatzip); kvfs works without it
./tools/install_qatzip.sh || echo "install: QATzip not installed; codec qat unavailable (deflate writes the same format)" >&2
# the helper mount(8) runs for `mount -t fuse.kvfs` and fstab entries (tools/install_service.sh: the service too)
$([ "$(id -u)" -eq 0 ] || echo sudo) ln -sfn "$PWD/.venv/bin/mount.fuse.kvfs" /sbin/mount.fuse.kvfs
echo "kvfs installed: $(.venv/bin/kvfs --version)"
