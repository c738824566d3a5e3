#!/usr/bin/env bash
# Install kvfs as a service, pointing at this checkout's .venv (made by tools/install.sh): the unit template
# /etc/systemd/system/kvfs@.service, the tmpfiles.d entry /etc/tmpfiles.d/kvfs.conf (L2 root /dev/shm/kvfs),
# /usr/local/bin/kvfs (the unit's ExecStart) and the mount helper /sbin/mount.fuse.kvfs. Idempotent; run as root.
# DESTDIR=DIR installs the same files under DIR and leaves the running system alone. See docs/service.md.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
root=${DESTDIR:-}

for tool in kvfs mount.fuse.kvfs; do
    [ -x ".venv/bin/$tool" ] || { echo "install_service: .venv/bin/$tool missing: run tools/install.sh first" >&2; exit 1; }
done
install -d "$root/etc/systemd/system" "$root/etc/tmpfiles.d" "$root/usr/local/bin" "$root/sbin"
[ -d "$root/etc/kvfs" ] || install -d -m 0700 "$root/etc/kvfs"  # per-mount env/TOML files; keep an admin's mode
install -m 0644 systemd/kvfs@.service "$root/etc/systemd/system/kvfs@.service"
install -m 0644 systemd/kvfs.tmpfiles "$root/etc/tmpfiles.d/kvfs.conf"
ln -sfn "$repo/.venv/bin/kvfs" "$root/usr/local/bin/kvfs"
ln -sfn "$repo/.venv/bin/mount.fuse.kvfs" "$root/sbin/mount.fuse.kvfs"

if [ -z "$root" ]; then
    command -v systemd-tmpfiles >/dev/null && systemd-tmpfiles --create kvfs.conf  # /dev/shm/kvfs now, not only at boot
    if [ -d /run/systemd/system ]; then  # systemd is PID 1
        systemctl daemon-reload
    fi
fi
echo "install_service: kvfs@.service, tmpfiles kvfs.conf, /usr/local/bin/kvfs and /sbin/mount.fuse.kvfs installed${root:+ under $root}"
