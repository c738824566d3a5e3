#!/bin/bash
# fio 1 MiB sequential reads through a kvfs mount at 1, 2 and 4 jobs, with the daemon's CPU per GB, for the front
# ends given (docs/frontend.md, "Figures"). As root (drop_caches). Usage:
#   tools/bench_fio_read.sh [SIZE_PER_JOB (default 128M)] [ENV ...]   e.g. KVFS_FRONTEND=native KVFS_FRONTEND=pyfuse3
# Each ENV is one mount (a space-free NAME=VALUE[,NAME=VALUE]); the files are written once per mount by fio
# (50% compressible buffers), then read after dropping the page cache.
set -euo pipefail
size=${1:-128M}; shift || true
[ $# -gt 0 ] || set -- KVFS_FRONTEND=pyfuse3 KVFS_FRONTEND=native
repo=$(cd "$(dirname "$0")/.." && pwd)
for envs in "$@"; do
  work=$(mktemp -d); shm=$(mktemp -d -p /dev/shm)
  mkdir "$work/mnt"
  env ${envs//,/ } PYTHONPATH="$repo" "$repo/.venv/bin/python" -m kvfs mount --foreground "$work/mnt" \
    --l2 "$shm:4G" --l3 none --state-dir "$work/state" > "$work/log" 2>&1 &
  pid=$!
  for _ in $(seq 100); do mountpoint -q "$work/mnt" && break; sleep 0.1; done
  fio --name=f --directory="$work/mnt" --rw=write --bs=1M --size="$size" --numjobs=4 --buffer_compress_percentage=50 \
      --refill_buffers --end_fsync=0 > /dev/null
  for jobs in 1 2 4; do
    sync; echo 3 > /proc/sys/vm/drop_caches
    c0=$(awk '{print $14+$15}' /proc/$pid/stat)
    out=$(fio --name=f --directory="$work/mnt" --rw=read --bs=1M --size="$size" --numjobs=$jobs --group_reporting \
          --output-format=json)
    c1=$(awk '{print $14+$15}' /proc/$pid/stat)
    python3 - "$envs" "$jobs" "$c0" "$c1" "$out" <<'PY'
import json, os, sys
envs, jobs, c0, c1, out = sys.argv[1:]
r = json.loads(out[out.index("{"):])["jobs"][0]["read"]
gb = r["io_bytes"] / 1e9
cpu = (float(c1) - float(c0)) / os.sysconf("SC_CLK_TCK")
print(f"{envs:<40} {jobs} job(s): {r['bw_bytes'] / 1e6:7.0f} MB/s  daemon {cpu / gb:.2f} CPU-s/GB")
PY
  done
  fusermount3 -u "$work/mnt"; wait $pid || true
  rm -rf "$work" "$shm"
done
