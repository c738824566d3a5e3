#!/usr/bin/env python3
"""THE data-path benchmark (issue "Node-scale data path"): plain file I/O through a kvfs mount, kvfs.direct reads
and writes past FUSE, and a plain tmpfs directory as the reference, all arms in one run (a benchmark, not a test).

Data: real KV blocks (tests/data/kv/*.kv, or --data DIR), replicated to --mb MB per arm; every copy gets a small
deterministic perturbation (the lowest mantissa bit of one element in 4099 flipped, at a per-file phase), so no two
files are equal and the compression ratio stays that of the real data. --samples-per-file N makes each file N copies
of one block (each perturbed): larger files, as a larger model's chunks are.

Each arm runs as separate worker processes (this script with --worker) that import what they need and build their
data first, then start together on a barrier (a file appearing); an arm's time runs from the barrier to the end of
its slowest worker. Before every read arm the page cache is dropped (`sync; echo 3 > /proc/sys/vm/drop_caches`).
The daemon's CPU is utime+stime from /proc/PID/stat before and after the arm. Every byte read is compared with
what was written; files written past FUSE are read back (untimed) and compared too. Any mismatch, daemon error or
failed commit aborts the run with exit status 3.

Arms (a registry, ARMS below: one line per arm):
    plain write/read 1 and 2      a tmpfs directory (/dev/shm): what the machine does without kvfs
    fuse  write/read 1 and 2      open/write/close and open/read/close through the mount
    direct read 1 and 2           kvfs.direct.read_file: names through the mount, objects decoded in-process
    direct write 1 and 2          kvfs.direct.write_file(path, data) where kvfs provides it (else skipped)
    batched write 1 and 2         kvfs.direct.write_files, BATCH_FILES files per call: one adoption for them
    base  write/read 1 and 2      the FUSE arms against another checkout's daemon (--baseline DIR)
    base direct/batched write 1, 2   the direct and batched write arms (this checkout's writer) against it
and, in this process, the codec's single-thread encode speed on the same data (the default policy, one frame after
the other, then format.build_object): the reference for direct writes (target: >= 0.8x of it).

Columns: MB/s (aggregate over the arm's processes), ratio to the plain tmpfs arm of the same operation and process
count, 2-vs-1 scaling (an arm with 2 processes over the same arm with 1), daemon CPU-s per GB, and the mean request
size that reached the daemon (from .kvfs/stats). MB = 1e6 bytes, GB = 1e9 bytes. With --rounds > 1, figures are
medians over rounds.

Targets of the issue (printed as PASS/FAIL, informational): fuse write 1 >= 2x the numbers of the issue's baseline
(164-378 MB/s) with the daemon <= 1.5 CPU-s/GB; fuse read 1 >= 1 GB/s; fuse read and fuse write 2-vs-1 >= 1.5x;
direct and batched write 1 >= 0.8x the codec's single-thread encode speed with the daemon <= 0.1 CPU-s/GB, and
2 vs 1 >= 1.7x.

Usage (as root, FUSE available):
    .venv/bin/python tools/bench_datapath.py                    # ~300 MB per arm, 3 rounds
    .venv/bin/python tools/bench_datapath.py --quick            # ~60 MB per arm, 1 round
    .venv/bin/python tools/bench_datapath.py --baseline /tmp/kvfs-base   # + the FUSE and direct-write arms of an
                                                                         #   older checkout's daemon
    # direct writes' daemon CPU, before (the base arms: the --baseline checkout's daemon) and after, in one run
    # (with --mb 1000: the daemon's CPU is read in 10 ms ticks):
    .venv/bin/python tools/bench_datapath.py --baseline /tmp/kvfs-base --only "direct write,batched,base d,base b"
    .venv/bin/python tools/bench_datapath.py --py-spy DIR       # + a py-spy profile of the daemon per kvfs arm
    # the native front end (fuse arms) against pyfuse3 (base arms), one checkout, one run:
    .venv/bin/python tools/bench_datapath.py --baseline . --daemon-env KVFS_FRONTEND=native \
        --base-env KVFS_FRONTEND=pyfuse3 --only "fuse,base write,base read,plain"
Outputs: bench-results/datapath.json and bench-results/datapath.png (--out, --plot to change).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # kvfs from this checkout, not the installed one
from bench_harness import GB, MB, REPO, BenchFailure, Mount, drop_caches, proc_cpu_s  # noqa: E402

DATA = REPO / "tests" / "data" / "kv"
PERTURB_STEP = 4099  # elements between flipped bits
BARRIER_POLL_S = 0.0005
WORKER_TIMEOUT_S = 600.0
BATCH_FILES = 16  # files per kvfs.direct.write_files call in the batched write arms
PAST_FUSE = ("direct", "batch")  # arm methods that write or read past FUSE (kvfs.direct)


# ---------------------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------------------
def sources(data_dir: Path) -> list[Path]:
    paths = sorted(p for p in data_dir.glob("*.kv") if p.is_file())
    if not paths:
        raise SystemExit(f"no .kv files in {data_dir}")
    return paths


def make_file(srcs: list[bytes], k: int, per: int = 1) -> bytes:
    """File k of the data set: source k mod n, `per` times over (one dtype per file, as an engine writes), each
    copy with one low mantissa bit in PERTURB_STEP flipped at its own phase."""
    import numpy as np
    pieces = []
    for j in range(k * per, (k + 1) * per):
        arr = np.frombuffer(srcs[k % len(srcs)], dtype=np.uint16).copy()
        arr[(j * 7919) % PERTURB_STEP::PERTURB_STEP] ^= 1
        pieces.append(arr.tobytes())
    return b"".join(pieces)


# ---------------------------------------------------------------------------------------------------
# the worker (a separate process per arm process)
# ---------------------------------------------------------------------------------------------------
def worker(spec: dict) -> None:
    srcs = [Path(p).read_bytes() for p in spec["sources"]]
    files = [(Path(path), make_file(srcs, k, spec["per_file"])) for path, k in spec["files"]]
    op, method = spec["op"], spec["method"]
    direct = None
    if method in PAST_FUSE:
        import kvfs.direct as direct  # imported before the barrier
    bufs = {len(d): bytearray(len(d)) for _, d in files}  # reused, exactly a file's size: compared by memcmp
    Path(spec["ready"]).touch()
    go = Path(spec["go"])
    while not go.exists():
        time.sleep(BARRIER_POLL_S)
    t0 = time.monotonic()
    c0 = os.times()
    past_fuse = 0
    mismatches = []
    if op == "write" and method == "batch":
        past_fuse += _write_batches(direct, files)
    for path, data in ([] if method == "batch" else files):
        if op == "write" and method == "direct":
            past_fuse += bool(direct.write_file(path, data, dtype=None, shape=None))
        elif op == "write":
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)  # kvfs commits here: inside the timing
        else:
            buf = bufs[len(data)]
            if method == "direct":
                got, went_past = direct.read_file(path, expected_size=len(data), into=buf)
                past_fuse += went_past
                n = len(got)
            else:
                n = _read_posix(path, buf)
            if n != len(data) or buf != data:  # memcmp: every byte verified, inside the timing
                mismatches.append(str(path))
    t1 = time.monotonic()
    c1 = os.times()
    Path(spec["result"]).write_text(json.dumps({
        "start": t0, "end": t1, "bytes": sum(len(d) for _, d in files), "files": len(files),
        "past_fuse": past_fuse, "mismatches": mismatches,
        "cpu_s": (c1.user - c0.user) + (c1.system - c0.system)}))


def _write_batches(direct, files: list[tuple[Path, bytes]]) -> int:
    """kvfs.direct.write_files over the files, BATCH_FILES at a time; how many went past FUSE."""
    past = 0
    for g in range(0, len(files), BATCH_FILES):
        results = direct.write_files([direct.FileToWrite(path, data) for path, data in files[g:g + BATCH_FILES]])
        for r in results:
            if isinstance(r, OSError):
                raise r
            past += r
    return past


def _read_posix(path: Path, buf: bytearray) -> int:
    """Read the file into buf (its expected size); the bytes read, or -1 if the file is longer."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        view = memoryview(buf)
        done = 0
        while True:
            n = os.readv(fd, [view[done:]])
            if n == 0:
                break
            done += n
            if done == len(buf):
                return -1 if os.read(fd, 1) else done
        return done
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------------
# arms
# ---------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Arm:
    name: str
    target: str  # "plain", "fuse" or "base": where the files are
    op: str  # "write" or "read"
    method: str  # "posix", "direct" or "batch" (direct writes, BATCH_FILES files per call)
    procs: int
    reads_from: str | None = None  # for reads: the write arm whose files they read

    @property
    def key(self) -> tuple[str, str, int]:
        return (self.target, self.op, self.procs)


def _arms() -> list[Arm]:
    arms = []
    for target in ("plain", "fuse", "base"):
        for n in (1, 2):
            arms.append(Arm(f"{target} write {n}", target, "write", "posix", n))
    for method, label in (("direct", "direct"), ("batch", "batched")):
        for n in (1, 2):  # each next to its base arm: this checkout's writer, the baseline's daemon adopting
            arms.append(Arm(f"{label} write {n}", "fuse", "write", method, n))
            arms.append(Arm(f"base {label} write {n}", "base", "write", method, n))
    for target in ("plain", "fuse", "base"):
        for n in (1, 2):
            arms.append(Arm(f"{target} read {n}", target, "read", "posix", n, reads_from=f"{target} write {n}"))
    for n in (1, 2):
        arms.append(Arm(f"direct read {n}", "fuse", "read", "direct", n, reads_from=f"fuse write {n}"))
    return arms


ARMS = _arms()


class Run:
    """One round: mounts, file sets, the arms in order."""

    def __init__(self, args, rnd: int, work: Path, shm: Path) -> None:
        self.args = args
        self.rnd = rnd
        self.work = work
        self.shm = shm
        self.mounts: dict[str, Mount] = {}
        self.roots: dict[str, Path] = {}
        self.file_sets: dict[str, list[tuple[str, int]]] = {}
        self.notes: list[str] = []
        self.next_k = 0

    def start(self, srcs_total: int) -> None:
        plain = self.shm / f"plain-r{self.rnd}"
        plain.mkdir(parents=True)
        self.roots["plain"] = plain
        capacity = 8 * self.args.mb * 1_000_000 + (1 << 30)
        variants = [("fuse", str(REPO))] + ([("base", str(self.args.baseline))] if self.args.baseline else [])
        for target, root in variants:
            env = {"PYTHONPATH": root}  # the daemon imports kvfs from this checkout
            env.update(kv.split("=", 1) for kv in self.args.daemon_env)
            if target == "base":  # e.g. this checkout as its own baseline, with native writes off
                env.update(kv.split("=", 1) for kv in self.args.base_env)
            m = Mount(self.args.kvfs, self.args.codec, self.work, self.shm, capacity, f"{target}-r{self.rnd}", env=env)
            m.cmd[0:1] = [sys.executable, "-P", "-m", "kvfs"]  # -P: not the cwd first on sys.path
            m.cmd += ["--l3", "none"]
            m.start()
            self.mounts[target] = m
            self.roots[target] = m.mountpoint

    def stop(self) -> None:
        for target, m in self.mounts.items():
            bad = m.bad_log_lines()
            code = m.stop(self.notes)
            if code != 0 or bad:
                raise BenchFailure(f"{target} daemon exited {code}; log:\n" + "\n".join(bad[-20:]))
            m.remove_dirs()
        shutil.rmtree(self.roots["plain"], ignore_errors=True)

    def files_for(self, arm: Arm, per_arm: int) -> list[list[tuple[str, int]]]:
        """Per process: [(path, k)]."""
        root = self.roots[arm.target]
        if arm.op == "read":
            files = self.file_sets[arm.reads_from]
        else:
            d = root / arm.name.replace(" ", "-")
            d.mkdir()
            files = [(str(d / f"{i:05d}.kv"), self.next_k + i) for i in range(per_arm)]
            self.next_k += per_arm
            self.file_sets[arm.name] = files
        return [files[p::arm.procs] for p in range(arm.procs)]

    def run_arm(self, arm: Arm, per_arm: int, srcs: list[Path]) -> dict:
        if arm.target not in self.roots:
            return {"skipped": "no --baseline"}
        if arm.op == "write" and arm.method in PAST_FUSE and not _has_direct_write(arm.method):
            return {"skipped": "this kvfs.direct cannot write past FUSE that way"}
        if arm.op == "read" and arm.reads_from not in self.file_sets:
            return {"skipped": f"{arm.reads_from} did not run"}
        shares = self.files_for(arm, per_arm)
        mount = self.mounts.get(arm.target)
        pid = mount.pid if mount else None
        tag = f"{arm.name.replace(' ', '-')}-r{self.rnd}"
        gate = self.work / f"gate-{tag}"
        gate.mkdir()
        go = gate / "go"
        procs = []
        for p, share in enumerate(shares):
            spec = {"sources": [str(s) for s in srcs], "files": share, "op": arm.op, "method": arm.method,
                    "per_file": self.args.samples_per_file,
                    "ready": str(gate / f"ready-{p}"), "go": str(go), "result": str(gate / f"result-{p}.json")}
            procs.append(subprocess.Popen([sys.executable, __file__, "--worker", json.dumps(spec)],
                                          env={**os.environ, "PYTHONPATH": str(REPO)}))
        deadline = time.monotonic() + WORKER_TIMEOUT_S
        while not all((gate / f"ready-{p}").exists() for p in range(len(shares))):
            if any(pr.poll() not in (None, 0) for pr in procs) or time.monotonic() > deadline:
                raise BenchFailure(f"{arm.name}: a worker died before the barrier")
            time.sleep(0.01)
        if arm.op == "read":
            drop_caches()
        stats0 = mount.stats() if mount else None
        spy = self._py_spy(pid, tag) if self.args.py_spy and pid else None
        cpu0 = proc_cpu_s(pid)
        go.touch()
        for pr in procs:
            if pr.wait(WORKER_TIMEOUT_S) != 0:
                raise BenchFailure(f"{arm.name}: a worker failed (exit {pr.returncode})")
        cpu1 = proc_cpu_s(pid)
        if spy is not None:
            spy.send_signal(2)
            spy.wait(60)
        stats1 = mount.stats() if mount else None
        results = [json.loads((gate / f"result-{p}.json").read_text()) for p in range(len(shares))]
        bad = [m for r in results for m in r["mismatches"]]
        if bad:
            raise BenchFailure(f"{arm.name}: WRONG BYTES read back from {len(bad)} file(s), e.g. {bad[0]}")
        total = sum(r["bytes"] for r in results)
        wall = max(r["end"] for r in results) - min(r["start"] for r in results)
        rec = {"bytes": total, "files": sum(r["files"] for r in results), "wall_s": wall, "mb_s": total / MB / wall,
               "daemon_cpu_s": cpu1 - cpu0, "daemon_cpu_s_per_gb": (cpu1 - cpu0) / (total / GB) if pid else None,
               "daemon_ms_per_file": (cpu1 - cpu0) * 1e3 / sum(r["files"] for r in results) if pid else None,
               "client_cpu_s": sum(r["cpu_s"] for r in results),
               "past_fuse": sum(r["past_fuse"] for r in results),
               "start_skew_s": max(r["start"] for r in results) - min(r["start"] for r in results)}
        if stats0 is not None:
            c0, c1 = stats0, stats1
            for k in ("read_requests", "write_requests", "bytes_read", "bytes_written", "commits",
                      "frames_encoded", "frames_decoded", "native_reads", "native_writes"):
                if k in c1:
                    rec[k] = c1[k] - c0.get(k, 0)
            reqs = rec.get(f"{arm.op}_requests", 0)
            moved = rec.get("bytes_read" if arm.op == "read" else "bytes_written", 0)
            rec["request_kib"] = moved / reqs / 1024 if reqs else None
            if c1.get("checksum_failures", 0) or c1.get("commit_failures", 0) or c1.get("errors", 0):
                raise BenchFailure(f"{arm.name}: the daemon counted checksum or commit failures")
        if arm.op == "write" and arm.method in PAST_FUSE:
            self._verify_direct_writes(arm, srcs)
        shutil.rmtree(gate, ignore_errors=True)
        return rec

    def _verify_direct_writes(self, arm: Arm, srcs: list[Path]) -> None:
        import kvfs.direct as direct
        raw = [p.read_bytes() for p in srcs]
        for path, k in self.file_sets[arm.name]:
            data = make_file(raw, k, self.args.samples_per_file)
            got, _ = direct.read_file(path, expected_size=len(data))
            if got != data:
                raise BenchFailure(f"{arm.name}: {path} reads back WRONG BYTES")

    def _py_spy(self, pid: int, tag: str) -> subprocess.Popen | None:
        exe = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
        if not os.path.exists(exe):
            self.notes.append("py-spy not installed: no profiles")
            return None
        out = self.args.py_spy / f"{tag}.txt"
        self.args.py_spy.mkdir(parents=True, exist_ok=True)
        p = subprocess.Popen([exe, "record", "--nonblocking", "--threads", "--idle", "-r", "250", "-f", "raw",
                              "-o", str(out), "-p", str(pid)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)  # attached before the barrier
        return p


def _has_direct_write(method: str) -> bool:
    try:
        import kvfs.direct as direct
    except ImportError:
        return False
    return hasattr(direct, "write_files" if method == "batch" else "write_file")


# ---------------------------------------------------------------------------------------------------
# the codec reference, in this process
# ---------------------------------------------------------------------------------------------------
def codec_reference(srcs: list[Path], n_files: int, frame_size: int, per: int = 1) -> dict:
    """One thread encodes files with kvfs's default policy (a fresh EncodingPolicy per file, as the daemon does),
    frame after frame, and lays out the object. Thread CPU time and wall time."""
    from kvfs import format as fmt
    from kvfs.openfile import EncodingPolicy
    raw = [p.read_bytes() for p in srcs]
    files = [make_file(raw, 1_000_000 + k, per) for k in range(n_files)]
    total = stored = 0
    t0, c0 = time.perf_counter(), time.thread_time()
    for data in files:
        policy = EncodingPolicy(None, "auto")
        view = memoryview(data)
        frames = [policy.encode(view[off:off + frame_size], off) for off in range(0, len(data), frame_size)]
        header = fmt.Header(raw_size=len(data), frame_size=frame_size, n_frames=len(frames),
                            transform=policy.transform or 0, element_size=policy.element_size,
                            codec=policy.codec_id, dtype=fmt.DTYPES.get(policy.dtype, 0))
        parts, _ = fmt.build_object(header, frames)
        total += len(data)
        stored += sum(len(p) for p in parts)
    wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    return {"bytes": total, "wall_s": wall, "cpu_s": cpu, "mb_s": total / MB / wall, "mb_per_cpu_s": total / MB / cpu,
            "stored_ratio": stored / total}


# ---------------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------------
def summarise(rounds: list[dict[str, dict]]) -> dict[str, dict]:
    out = {}
    for arm in ARMS:
        recs = [r[arm.name] for r in rounds if arm.name in r and "mb_s" in r[arm.name]]
        if not recs:
            skipped = next((r[arm.name].get("skipped") for r in rounds if arm.name in r), "not run")
            out[arm.name] = {"skipped": skipped}
            continue
        s = {"mb_s": statistics.median(r["mb_s"] for r in recs), "rounds": [r["mb_s"] for r in recs]}
        cpus = [r["daemon_cpu_s_per_gb"] for r in recs if r.get("daemon_cpu_s_per_gb") is not None]
        s["daemon_cpu_s_per_gb"] = statistics.median(cpus) if cpus else None
        per_file = [r["daemon_ms_per_file"] for r in recs if r.get("daemon_ms_per_file") is not None]
        s["daemon_ms_per_file"] = statistics.median(per_file) if per_file else None
        kib = [r["request_kib"] for r in recs if r.get("request_kib")]
        s["request_kib"] = statistics.median(kib) if kib else None
        s["past_fuse"] = recs[0].get("past_fuse")
        s["files"] = recs[0]["files"]
        s["bytes"] = recs[0]["bytes"]
        out[arm.name] = s
    for arm in ARMS:
        s = out[arm.name]
        if "mb_s" not in s:
            continue
        plain = out.get(f"plain {arm.op} {arm.procs}", {})
        s["ratio_plain"] = s["mb_s"] / plain["mb_s"] if plain.get("mb_s") else None
        if arm.procs == 2:
            one = out.get(arm.name[:-1] + "1", {})
            s["scaling_2v1"] = s["mb_s"] / one["mb_s"] if one.get("mb_s") else None
    return out


def _f(x, fmt_: str) -> str:
    return format("—", re.match(r"[<>^]?\d*", fmt_).group()) if x is None else format(x, fmt_)


def table(summary: dict[str, dict], codec: dict | None) -> str:
    lines = [f"{'arm':<20} {'MB/s':>8} {'x plain':>8} {'2 vs 1':>7} {'daemon CPU-s/GB':>16} {'req KiB':>8}  note",
             "-" * 84]
    for arm in ARMS:
        s = summary[arm.name]
        if "mb_s" not in s:
            if "no --baseline" not in s["skipped"]:
                lines.append(f"{arm.name:<20} {'skipped: ' + s['skipped']}")
            continue
        note = ""
        if arm.method in PAST_FUSE:
            note = f"{s['past_fuse']}/{s['files']} past FUSE, daemon {_f(s['daemon_ms_per_file'], '.2f')} ms/file"
        lines.append(f"{arm.name:<20} {s['mb_s']:>8.0f} {_f(s.get('ratio_plain'), '>8.2f')} "
                     f"{_f(s.get('scaling_2v1'), '>7.2f')} {_f(s['daemon_cpu_s_per_gb'], '>16.2f')} "
                     f"{_f(s['request_kib'], '>8.0f')}  {note}")
    if codec:
        lines.append(f"codec single-thread encode (default policy + build_object): {codec['mb_s']:.0f} MB/s wall, "
                     f"{codec['mb_per_cpu_s']:.0f} MB per CPU-s, stored/raw {codec['stored_ratio']:.3f}")
    return "\n".join(lines)


def targets(summary: dict[str, dict], codec: dict | None) -> list[tuple[str, bool | None, str]]:
    def get(arm, key="mb_s"):
        return summary.get(arm, {}).get(key)

    out = []
    w1, w1cpu = get("fuse write 1"), get("fuse write 1", "daemon_cpu_s_per_gb")
    out.append(("fuse write 1 >= 2x 164-378 MB/s (>= 756) and daemon <= 1.5 CPU-s/GB",
                None if w1 is None else (w1 >= 756 and (w1cpu or 99) <= 1.5), f"{_f(w1, '.0f')} MB/s, "
                f"{_f(w1cpu, '.2f')} CPU-s/GB"))
    r1 = get("fuse read 1")
    out.append(("fuse read 1 >= 1000 MB/s", None if r1 is None else r1 >= 1000, f"{_f(r1, '.0f')} MB/s"))
    for op in ("read", "write"):
        sc = get(f"fuse {op} 2", "scaling_2v1")
        out.append((f"fuse {op} 2 vs 1 >= 1.5x", None if sc is None else sc >= 1.5, f"{_f(sc, '.2f')}x"))
    ref = codec["mb_s"] if codec else None
    for arm in ("direct", "batched"):
        dw = get(f"{arm} write 1")
        out.append((f"{arm} write 1 >= 0.8x codec single-thread encode", None if dw is None or ref is None
                    else dw >= 0.8 * ref, f"{_f(dw, '.0f')} vs {_f(ref, '.0f')} MB/s"))
        cpu = get(f"{arm} write 1", "daemon_cpu_s_per_gb")
        out.append((f"{arm} write 1: daemon <= 0.1 CPU-s/GB", None if cpu is None else cpu <= 0.1,
                    f"{_f(cpu, '.2f')} CPU-s/GB"))
        sc = get(f"{arm} write 2", "scaling_2v1")
        out.append((f"{arm} write 2 vs 1 >= 1.7x", None if sc is None else sc >= 1.7, f"{_f(sc, '.2f')}x"))
    return out


def plot(summary: dict[str, dict], path: Path) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not importable: no plot"
    names = [a.name for a in ARMS if "mb_s" in summary[a.name]]
    colors = {"plain": "#999999", "fuse": "#1f77b4", "direct": "#2ca02c", "batched": "#17becf", "base": "#ff7f0e"}
    fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(names) + 2), 4.5))
    vals = [summary[n]["mb_s"] for n in names]
    ax.bar(range(len(names)), vals, color=[colors.get(n.split()[0], "#555555") for n in names])
    for i, n in enumerate(names):
        cpu = summary[n].get("daemon_cpu_s_per_gb")
        label = f"{vals[i]:.0f}" + (f"\n{cpu:.1f} s/GB" if cpu is not None else "")
        ax.text(i, vals[i], label, ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=45, ha="right", fontsize=8)
    ax.set_ylabel("MB/s (all processes of the arm)")
    ax.set_title("kvfs data path: real KV, MB/s and daemon CPU-s per GB")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return None


# ---------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--data", type=Path, default=DATA, help="directory of .kv files (default tests/data/kv)")
    p.add_argument("--mb", type=int, default=300, help="MB per arm (default 300)")
    p.add_argument("--samples-per-file", type=int, default=1, metavar="N",
                   help="each file holds N KV samples one after the other (default 1: 2.95 MB files; 8 gives 24 MB, "
                        "the size of a 256-token chunk of an 8B model in bf16)")
    p.add_argument("--rounds", type=int, default=3, help="rounds; figures are medians (default 3)")
    p.add_argument("--quick", action="store_true", help="a smoke run: 60 MB per arm, 1 round")
    p.add_argument("--only", help="comma-separated arm names or prefixes (e.g. 'fuse,plain write')")
    p.add_argument("--baseline", type=Path, help="another kvfs checkout: its daemon serves the 'base' arms")
    p.add_argument("--codec", default="auto", help="the mounts' --codec (default auto)")
    p.add_argument("--kvfs", default=str(REPO / ".venv" / "bin" / "kvfs"), help=argparse.SUPPRESS)
    p.add_argument("--shm", type=Path, default=Path("/dev/shm"), help="tmpfs for L2 and the plain arms")
    p.add_argument("--daemon-env", action="append", default=[], metavar="NAME=VALUE",
                   help="environment of the daemons (repeatable), e.g. KVFS_KEEP_WRITTEN_PAGES=0")
    p.add_argument("--base-env", action="append", default=[], metavar="NAME=VALUE",
                   help="environment of the --baseline daemon only, after --daemon-env (e.g. --baseline . "
                        "--base-env KVFS_FRONTEND=pyfuse3: both front ends side by side in one run)")
    p.add_argument("--py-spy", type=Path, metavar="DIR", help="record a py-spy profile of the daemon per kvfs arm")
    p.add_argument("--out", type=Path, default=REPO / "bench-results" / "datapath.json")
    p.add_argument("--plot", type=Path, default=REPO / "bench-results" / "datapath.png")
    args = p.parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker))
        return 0
    if args.quick:
        args.mb, args.rounds = 60, 1
    srcs = sources(args.data)
    file_size = srcs[0].stat().st_size * args.samples_per_file  # the samples are of one size
    per_arm = max(2, round(args.mb * 1_000_000 / file_size))
    only = [s.strip() for s in args.only.split(",")] if args.only else None
    chosen = [a for a in ARMS if only is None or any(a.name.startswith(o) for o in only)]
    if only:  # a read arm needs its write arm
        need = {a.reads_from for a in chosen if a.reads_from}
        chosen = [a for a in ARMS if a in chosen or a.name in need]
    if not drop_caches():
        print("note: cannot drop the page cache (not root?): read figures may be served from cache")

    work = Path(tempfile.mkdtemp(prefix="bench-datapath-"))
    shm = Path(tempfile.mkdtemp(prefix="bench-datapath-", dir=args.shm))
    rounds: list[dict[str, dict]] = []
    notes: list[str] = []
    status = 0
    try:
        codec = codec_reference(srcs, min(per_arm, 64), 1 << 20, args.samples_per_file)
        for rnd in range(args.rounds):
            run = Run(args, rnd, work, shm)
            try:
                run.start(len(srcs))
                res = {}
                for arm in chosen:
                    res[arm.name] = run.run_arm(arm, per_arm, srcs)
                    r = res[arm.name]
                    if "mb_s" in r:
                        print(f"round {rnd}: {arm.name:<20} {r['mb_s']:7.0f} MB/s  daemon "
                              f"{_f(r['daemon_cpu_s_per_gb'], '.2f')} CPU-s/GB  "
                              f"req {_f(r.get('request_kib'), '.0f')} KiB",
                              flush=True)
            finally:
                run.stop()
                notes.extend(run.notes)
            rounds.append(res)
    except BenchFailure as e:
        print(f"FAILED: {e}", file=sys.stderr)
        status = 3
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        if status == 0:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"logs kept in {work}", file=sys.stderr)
    if status:
        return status
    summary = summarise(rounds)
    print()
    print(f"{per_arm} files of {file_size} bytes per arm ({per_arm * file_size / MB:.0f} MB), {args.rounds} round(s), "
          f"codec {args.codec}, L2 on {args.shm}; {os.cpu_count()} CPUs")
    print(table(summary, codec))
    print()
    for what, ok, value in targets(summary, codec):
        print(f"{'—' if ok is None else 'PASS' if ok else 'FAIL':<5} {what}: {value}")
    for n in notes:
        print("note:", n)
    doc = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "host": platform.node(), "cpus": os.cpu_count(),
           "kernel": platform.release(), "mb_per_arm": per_arm * file_size / MB, "file_bytes": file_size,
           "rounds": args.rounds, "codec": args.codec, "baseline": str(args.baseline) if args.baseline else None,
           "codec_reference": codec, "summary": summary, "per_round": rounds, "notes": notes,
           "targets": [{"target": w, "pass": ok, "value": v} for w, ok, v in targets(summary, codec)]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1))
    msg = plot(summary, args.plot)
    print(f"results: {args.out}" + (f", {args.plot}" if msg is None else f" ({msg})"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
