#!/bin/sh
# The kvfs image's entrypoint: kvfs mount --foreground [ARGS…] $KVFS_MOUNTPOINT, configured by
# /etc/kvfs/kvfs.toml (or the file KVFS_MOUNT_CONFIG names) and KVFS_MOUNT_<OPTION> variables; ARGS are more
# `kvfs mount` options, and they win over both.
set -eu
mp=${KVFS_MOUNTPOINT:-/var/lib/kvfs/mnt/main}

# A daemon that was killed leaves its mount behind, dead (ENOTCONN), here and, through shared propagation, on
# the host and in every engine's view. Detach it; the unmount propagates the same way, and this start's mount
# takes its place everywhere. A live mount is left alone (kvfs refuses to mount over it).
if ! stat "$mp" >/dev/null 2>&1; then
    if umount -l "$mp" 2>/dev/null || fusermount3 -uz "$mp" 2>/dev/null; then
        echo "kvfs-entrypoint: detached a dead mount at $mp" >&2
    fi
fi
mkdir -p "$mp"
if [ -z "${KVFS_MOUNT_CONFIG:-}" ] && [ -f /etc/kvfs/kvfs.toml ]; then
    export KVFS_MOUNT_CONFIG=/etc/kvfs/kvfs.toml
fi
exec kvfs mount --foreground "$@" "$mp"
