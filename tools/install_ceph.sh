#!/usr/bin/env bash
# The Ceph packages for kvfs's L4 tests and benchmarks (a one-host cluster: tools/ceph_cluster.py). Idempotent;
# run as root (or with sudo available). Debian 12 ships Ceph 16.2 (pacific).
set -euo pipefail
source "$(dirname "$0")/apt_install.sh"
apt_install_missing --no-install-recommends ceph-mon ceph-osd ceph-mgr radosgw ceph-common uuid-runtime
echo "ceph installed: $(ceph --version)"
