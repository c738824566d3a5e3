#!/bin/bash
# fio on a kvfs mount: 1 MiB sequential writes, then reads after dropping the page cache, at 1, 2 and 4 jobs, with
# the daemon's CPU per GB (issue 38's fio arms; docs/datapath.md). As root (drop_caches). Usage:
#   tools/bench_fio.sh [SIZE_PER_JOB (default 128M)] [ARM ...]
# An ARM is a kvfs checkout whose daemon serves the mount (default: this one), optionally followed by
# ,NAME=VALUE settings of the daemon's environment, e.g. the front end before and after, in one run:
#   git worktree add /tmp/kvfs-base b993f46      # the last commit with pyfuse3 (its .venv: this one's, with pyfuse3)
#   tools/bench_fio.sh 128M /tmp/kvfs-base,KVFS_FRONTEND=pyfuse3 .
# fio's buffers are 50% compressible (--buffer_compress_percentage=50), rewritten for every block.
set -euo pipefail
size=${1:-128M}; shift || true
repo=$(cd "$(dirname "$0")/.." && pwd)
[ $# -gt 0 ] || set -- "$repo"
report() {  # arm, rw, jobs, cpu before, cpu after, fio's JSON
  python3 - "$@" <<'PY'
import json, os, sys
arm, rw, jobs, c0, c1, out = sys.argv[1:]
r = json.loads(out[out.index("{"):])["jobs"][0][rw]
gb = r["io_bytes"] / 1e9
cpu = (float(c1) - float(c0)) / os.sysconf("SC_CLK_TCK")
print(f"{arm:<50} {rw:<5} {jobs} job(s): {r['bw_bytes'] / 1e6:7.0f} MB/s  daemon {cpu / gb:.2f} CPU-s/GB")
PY
}
for arm in "$@"; do
  dir=$(cd "${arm%%,*}" && pwd); envs=""; [[ "$arm" == *,* ]] && envs=${arm#*,}
  work=$(mktemp -d); shm=$(mktemp -d -p /dev/shm)
  mkdir "$work/mnt"
  (cd "$dir" && env ${envs//,/ } PYTHONPATH="$dir" "$repo/.venv/bin/python" -m kvfs mount --foreground "$work/mnt" \
    --l2 "$shm:6G" --l3 none --state-dir "$work/state" > "$work/log" 2>&1) &
  pid=""
  for _ in $(seq 100); do mountpoint -q "$work/mnt" && break; sleep 0.1; done
  pid=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['pid'])" "$work/mnt/.kvfs/stats")
  for jobs in 1 2 4; do
    for rw in write read; do
      sync; echo 3 > /proc/sys/vm/drop_caches
      c0=$(awk '{print $14+$15}' /proc/$pid/stat)
      out=$(fio --name="j$jobs" --directory="$work/mnt" --rw=$rw --bs=1M --size="$size" --numjobs=$jobs \
            --buffer_compress_percentage=50 --refill_buffers --group_reporting --output-format=json)
      c1=$(awk '{print $14+$15}' /proc/$pid/stat)
      report "$arm" "$rw" "$jobs" "$c0" "$c1" "$out"
    done
  done
  fusermount3 -u "$work/mnt"; wait || true
  rm -rf "$work" "$shm"
done
