#!/usr/bin/env bash
# The Ceph packages for kvfs's L4 tests and benchmarks (a one-host cluster: tools/ceph_cluster.py). Idempotent;
# run as root (or with sudo available). Debian 12 ships Ceph 16.2 (pacific).
set -euo pipefail
PACKAGES=(ceph-mon ceph-osd ceph-mgr radosgw ceph-common uuid-runtime)
missing=()
for p in "${PACKAGES[@]}"; do
    dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if ((${#missing[@]})); then
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
echo "ceph installed: $(ceph --version)"
