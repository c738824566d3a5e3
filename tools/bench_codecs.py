#!/usr/bin/env python3
"""Benchmark the deflate-family codecs (QATzip, ISA-L, zlib) and zstd on real KV-cache block files, in memory.

No mount is involved: each file is cut into 1 MiB frames (kvfs's frame size), each frame goes through the
transform (none, or byteplane2 as kvfs applies to 2-byte floats) and is compressed on its own, as kvfs does.
Every frame is decompressed again and compared with its input byte for byte (and the byteplane2 inverse is
checked against the raw frame once), so a codec that garbles data aborts the run with exit status 3.

Rows (codec -> decoder), each on the raw bytes and on the byte planes:
    qat -> QATzip    kvfs.codecs.qat.QatCodec: compress through QATzip, decode with qzDecompress
    qat -> ISA-L     the same frames decoded by ISA-L (kvfs's reader in software mode: same bitstream)
    deflate -> ISA-L kvfs.codecs.deflate.DeflateCodec: ISA-L level 1, gzip members of 64 KiB with QZ header
    zlib -> zlib     Python's zlib, level 1, raw deflate in 64 KiB chunks, CRC-32 per chunk, + 32 bytes of
                     gzip-member overhead per chunk in the stored size: the software baseline (QATzip's
                     software fallback is zlib)
    zstd -> zstd     kvfs's tuned zstd, for reference

Per row, dtype and transform (bf16 and fp16 are separate data sets):
    stored/raw       compressed payload bytes / raw bytes (lower is better); deterministic, no kvfs headers
    comp / decomp MB/s   raw bytes / wall time over all frames of the data set (aggregate over --threads)
    CPU s/GB         process CPU time (time.process_time: all threads, user+sys) per 1e9 raw bytes, per direction
The transform itself is timed apart (its cost is the same under every codec) and is not in the codec figures.

The machine this runs on is shared and noisy, so every round runs every codec once, in a rotating order;
figures are medians over rounds, and the "vs zlib" ratios are taken per round (paired, same noise) and then
the median of those. A CPU-time ratio (zlib CPU / codec CPU) is given too: it is insensitive to other load.

Target (PASS/FAIL printed, exit status 1 if it fails): deflate and qat stored/raw <= 0.71 on bf16 byte planes
(a codec left out with --codecs is reported as not measured).

Input: /work/kvdata/{bf16,fp16}/*.kv (tools/dump_kv.py; files checked against manifest.json), else the
committed samples tests/data/kv/*.kv (replicated to --files); the output says which.

QATzip on a machine without a QAT device ("software fallback") prints notices ("[Error] ... no hardware")
to stderr on every call. The run sends file descriptor 2 to a temporary file while it measures (Python's
own errors still reach the terminal) and at the end counts those lines and shows any unexpected one.
Without a device QATzip also re-runs its init on every call and leaks a pthread key each time; after ~1020
calls the process has none left ("Init local thread key failed"). The run reports this; it does not
change the figures (compression still works, every round trip is verified).

Usage:
    .venv/bin/python tools/bench_codecs.py                        # 24 files per dtype, 3 rounds, 1 thread
    .venv/bin/python tools/bench_codecs.py --files 160 --rounds 5 --plot bench-results/bench_codecs.png
    .venv/bin/python tools/bench_codecs.py --codecs deflate,zlib,zstd   # without libqatzip

On a machine with an Intel QAT device:
    1. Install the QAT driver stack and QATzip. Debian 13 / Ubuntu 24.04: `apt install libqatzip3` (it
       pulls in libqat4/libusdm0) and the qat service (qatlib's qat_service), with the device's virtual
       functions bound to vfio-pci (SR-IOV enabled, IOMMU on, the user in the qat group / memlock limit
       raised) as Intel's QATlib documentation describes. Elsewhere: tools/install_qatzip.sh fetches the
       Debian 13 packages into .venv/opt/qatzip. KVFS_QATZIP_LIB=/path/to/libqatzip.so.3 picks a specific
       library (it is then the only one tried).
    2. Run as above and check that the table title says "QAT: HARDWARE" (with "SOFTWARE FALLBACK" the
       device was not found: see the stderr lines reported at the end).
    3. A QAT device reaches its throughput only with several requests in flight; one thread submits one
       1 MiB frame at a time. Use --threads N (e.g. 8-32): N threads compress and decompress frames
       concurrently, each with its own QATzip session (QatCodec makes one per thread), and MB/s is the
       aggregate over all threads. CPU s/GB stays per byte, so it shows how much CPU the offload saves.
       Compare the software codecs at the same --threads (they scale with cores, not with requests).

MB = 1e6 bytes, GB = 1e9 bytes. JSON: bench-results/bench_codecs.json (--out); --plot draws a PNG.
Everything is held in memory: about 5x the input (--files 160 per dtype: ~3 GB).
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import ctypes
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Self

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

# same inputs (and manifest checks) as the fs benchmark
from bench_harness import DEFAULT_DATA, SetupError, load_datasets

from kvfs.codecs import by_name, transforms
from kvfs.codecs.deflate import DeflateCodec, decompress_members
from kvfs.config import DEFAULT_FRAME_SIZE

MB = 1e6
GB = 1e9
FRAME_SIZE = DEFAULT_FRAME_SIZE
ZLIB_CHUNK = 64 << 10  # the member size ISA-L and QAT hardware write
GZIP_MEMBER_OVERHEAD = 32  # QZ gzip header (24) + trailer (8): what a zlib chunk would cost as a member
TRANSFORMS = {"raw": transforms.IDENTITY, "byteplane2": transforms.BYTEPLANE2}
ALL_CODECS = ("qat", "deflate", "zlib", "zstd")
BASELINE = "zlib"
TARGET_RATIO = 0.71
TARGET_CODECS = ("deflate", "qat")
TARGET_DATA = ("bf16", "byteplane2")
KEY_FAILURE = "Init local thread key failed"  # QATzip: pthread_key_create failed in its (re-)init
METRICS = ("stored_ratio", "compress_MBps", "decompress_MBps", "compress_cpu_s_per_GB", "decompress_cpu_s_per_GB")


class BenchFailure(Exception):
    """A round trip that did not give back the input: the figures are meaningless."""


# ---------------------------------------------------------------------------------------------------
# codecs under test
# ---------------------------------------------------------------------------------------------------
@dataclass
class Candidate:
    """One encoder and the decoders that read its output back (each decoder is a row of the table)."""
    name: str
    compress: Callable[[bytes], object]
    decoders: dict[str, Callable[[object, int], bytes]]
    stored_len: Callable[[object], int] = len


def zlib_compress(frame: bytes) -> list[tuple[bytes, int]]:
    """(raw deflate body, CRC-32) per 64 KiB chunk: the work of a gzip member writer, minus the header bytes."""
    view = memoryview(frame)
    chunks = (view[i:i + ZLIB_CHUNK] for i in range(0, len(view), ZLIB_CHUNK))
    return [(zlib.compress(c, 1, -15), zlib.crc32(c)) for c in chunks]


def zlib_stored_len(payload: list[tuple[bytes, int]]) -> int:
    return sum(len(body) + GZIP_MEMBER_OVERHEAD for body, _ in payload)


def zlib_decompress(payload: list[tuple[bytes, int]], raw_len: int) -> bytes:
    parts = []
    for body, crc in payload:
        part = zlib.decompress(body, -15)
        if zlib.crc32(part) != crc:  # a gzip reader checks the CRC too: keep the work comparable
            raise BenchFailure("zlib: CRC-32 mismatch")
        parts.append(part)
    out = b"".join(parts)
    if len(out) != raw_len:
        raise BenchFailure(f"zlib: {len(out)} bytes decoded, {raw_len} expected")
    return out


def make_candidates(names: list[str], qat_codec) -> list[Candidate]:
    deflate, zstd = DeflateCodec(), by_name("zstd")
    every = {
        "qat": lambda: Candidate("qat", qat_codec.compress,
                                 {"QATzip": qat_codec.decompress_with_qatzip, "ISA-L": decompress_members}),
        "deflate": lambda: Candidate("deflate", deflate.compress, {"ISA-L": deflate.decompress}),
        "zlib": lambda: Candidate("zlib", zlib_compress, {"zlib": zlib_decompress}, zlib_stored_len),
        "zstd": lambda: Candidate("zstd", zstd.compress, {"zstd": zstd.decompress}),
    }
    return [every[n]() for n in ALL_CODECS if n in names]


def row_name(codec: str, decoder: str) -> str:
    return f"{codec} -> {decoder}"


def load_qat() -> tuple[object, dict]:
    """The QATzip codec and what to report about it; raises qat.QatUnavailable without the library."""
    from kvfs.codecs import qat
    library = qat.load()
    hardware = qat.probe_hardware(library)
    codec = qat.QatCodec(library, hardware)
    return codec, {"library": library.path, "mode": codec.mode, "request_bytes": qat.HW_BUFF_SZ,
                   "level": codec.level}


# ---------------------------------------------------------------------------------------------------
# input frames
# ---------------------------------------------------------------------------------------------------
@dataclass
class Input:
    dtype: str
    transform: str
    frames: list[bytes]

    @property
    def nbytes(self) -> int:
        return sum(map(len, self.frames))


def cut_frames(data: bytes) -> list[bytes]:
    return [data[i:i + FRAME_SIZE] for i in range(0, len(data), FRAME_SIZE)]


def to_planes(frame: bytes) -> bytes:
    planes = bytes(transforms.apply(transforms.BYTEPLANE2, frame))
    if bytes(transforms.invert(transforms.BYTEPLANE2, planes)) != frame:
        raise BenchFailure("byteplane2: the inverse does not give back the raw frame")
    return planes


def build_inputs(datasets: dict) -> list[Input]:
    inputs = []
    for dtype, ds in datasets.items():
        raw = [fr for f in ds.files for fr in cut_frames(f.data)]
        inputs.append(Input(dtype, "raw", raw))
        inputs.append(Input(dtype, "byteplane2", [to_planes(fr) for fr in raw]))
    return inputs


# ---------------------------------------------------------------------------------------------------
# measurement
# ---------------------------------------------------------------------------------------------------
def timed(fn: Callable, items: list, pool) -> tuple[list, float, float]:
    """fn over items (on the pool's threads if any, in order); (results, wall s, process CPU s)."""
    c0, t0 = time.process_time(), time.perf_counter()
    out = list(pool.map(fn, items)) if pool else [fn(x) for x in items]
    return out, time.perf_counter() - t0, time.process_time() - c0


def verify(outputs: list, inp: Input, row: str) -> None:
    for i, (got, want) in enumerate(zip(outputs, inp.frames)):
        if bytes(got) != want:
            raise BenchFailure(f"{row}: frame {i} of {inp.dtype}/{inp.transform} decoded to different bytes "
                               f"({len(got)} vs {len(want)} bytes)")
    if len(outputs) != len(inp.frames):
        raise BenchFailure(f"{row}: {len(outputs)} frames decoded of {len(inp.frames)}")


def measure(cand: Candidate, inp: Input, pool, rnd: int) -> list[dict]:
    """One record per decoder; the compress figures are the same measurement in each."""
    payloads, c_s, c_cpu = timed(cand.compress, inp.frames, pool)
    base = {"round": rnd, "dtype": inp.dtype, "transform": inp.transform, "codec": cand.name,
            "bytes": inp.nbytes, "frames": len(inp.frames), "stored_bytes": sum(map(cand.stored_len, payloads)),
            "compress_s": c_s, "compress_cpu_s": c_cpu}
    items = [(p, len(f)) for p, f in zip(payloads, inp.frames)]
    records = []
    for label, decode in cand.decoders.items():
        outs, d_s, d_cpu = timed(lambda item, dec=decode: dec(*item), items, pool)
        verify(outs, inp, row_name(cand.name, label))
        records.append({**base, "decoder": label, "row": row_name(cand.name, label),
                        "decompress_s": d_s, "decompress_cpu_s": d_cpu})
    return records


def measure_transform(inp: Input, raw: Input, rnd: int) -> dict:
    """byteplane2 alone (encode raw -> planes, decode planes -> raw), single-threaded."""
    _, e_s, e_cpu = timed(lambda f: transforms.apply(transforms.BYTEPLANE2, f), raw.frames, None)
    _, d_s, d_cpu = timed(lambda f: transforms.invert(transforms.BYTEPLANE2, f), inp.frames, None)
    return {"round": rnd, "dtype": inp.dtype, "bytes": inp.nbytes, "encode_s": e_s, "encode_cpu_s": e_cpu,
            "decode_s": d_s, "decode_cpu_s": d_cpu}


def warm_up(cands: list[Candidate], frame: bytes, pool, threads: int) -> None:
    """Every codec once on every pool thread before timing: QATzip sessions, zstd contexts, buffers."""
    barrier = threading.Barrier(threads, timeout=120)

    def once(_):
        for c in cands:
            payload = c.compress(frame)
            for decode in c.decoders.values():
                decode(payload, len(frame))
        barrier.wait()  # holds each task on its own thread, so all `threads` threads get warmed

    if pool is None:
        once(0)
    else:
        list(pool.map(once, range(threads)))


def run_rounds(cands: list[Candidate], inputs: list[Input], args, console) -> tuple[list[dict], list[dict]]:
    pool = concurrent.futures.ThreadPoolExecutor(args.threads) if args.threads > 1 else None
    records, transform_records = [], []
    try:
        warm_up(cands, inputs[0].frames[0], pool, args.threads)
        raw_of = {i.dtype: i for i in inputs if i.transform == "raw"}
        for rnd in range(args.rounds):
            t0 = time.monotonic()
            k = rnd % len(cands)
            order = cands[k:] + cands[:k]  # rotate, so no codec always runs first or after the same one
            for inp in inputs:
                if inp.transform == "byteplane2":
                    transform_records.append(measure_transform(inp, raw_of[inp.dtype], rnd))
                for cand in order:
                    records += measure(cand, inp, pool, rnd)
            console.print(f"round {rnd + 1}/{args.rounds}: {time.monotonic() - t0:.1f}s "
                          f"(order {', '.join(c.name for c in order)})")
    finally:
        if pool is not None:
            pool.shutdown()
    return records, transform_records


# ---------------------------------------------------------------------------------------------------
# aggregation
# ---------------------------------------------------------------------------------------------------
def derive(r: dict) -> dict:
    n = r["bytes"]
    return {"stored_ratio": r["stored_bytes"] / n,
            "compress_MBps": n / MB / r["compress_s"], "decompress_MBps": n / MB / r["decompress_s"],
            "compress_cpu_s_per_GB": r["compress_cpu_s"] / (n / GB),
            "decompress_cpu_s_per_GB": r["decompress_cpu_s"] / (n / GB)}


def summarize(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def paired_vs_baseline(recs: list[dict], base: dict[int, dict]) -> dict:
    """Per round: codec speed / zlib speed, and zlib CPU / codec CPU (speed-up if both were CPU-bound)."""
    out = collections.defaultdict(list)
    for r in recs:
        b = base.get(r["round"])
        if b is None:
            continue
        m, bm = derive(r), derive(b)
        out["compress_speed"].append(m["compress_MBps"] / bm["compress_MBps"])
        out["decompress_speed"].append(m["decompress_MBps"] / bm["decompress_MBps"])
        out["compress_cpu"].append(bm["compress_cpu_s_per_GB"] / m["compress_cpu_s_per_GB"])
        out["decompress_cpu"].append(bm["decompress_cpu_s_per_GB"] / m["decompress_cpu_s_per_GB"])
    return {k: statistics.median(v) for k, v in out.items()}


def aggregate(records: list[dict]) -> dict:
    """results[row][dtype][transform] = {metric: {median, min, max}, "vs_zlib": {...}}"""
    groups = collections.defaultdict(list)
    for r in records:
        groups[(r["row"], r["dtype"], r["transform"])].append(r)
    baseline = {(r["dtype"], r["transform"], r["round"]): r for r in records if r["codec"] == BASELINE}
    results: dict = {}
    for (row, dtype, tf), recs in groups.items():
        derived = [derive(r) for r in recs]
        entry = {m: summarize([d[m] for d in derived]) for m in METRICS}
        entry["codec"], entry["decoder"] = recs[0]["codec"], recs[0]["decoder"]
        base = {rnd: b for (dt, t, rnd), b in baseline.items() if (dt, t) == (dtype, tf)}
        if base and recs[0]["codec"] != BASELINE:
            entry["vs_zlib"] = paired_vs_baseline(recs, base)
        results.setdefault(row, {}).setdefault(dtype, {})[tf] = entry
    return results


def aggregate_transform(records: list[dict]) -> dict:
    out = {}
    for dtype in dict.fromkeys(r["dtype"] for r in records):
        recs = [r for r in records if r["dtype"] == dtype]
        out[dtype] = {
            "encode_MBps": statistics.median(r["bytes"] / MB / r["encode_s"] for r in recs),
            "decode_MBps": statistics.median(r["bytes"] / MB / r["decode_s"] for r in recs),
            "encode_cpu_s_per_GB": statistics.median(r["encode_cpu_s"] / (r["bytes"] / GB) for r in recs),
            "decode_cpu_s_per_GB": statistics.median(r["decode_cpu_s"] / (r["bytes"] / GB) for r in recs),
        }
    return out


def check_targets(results: dict) -> list[dict]:
    dtype, tf = TARGET_DATA
    targets = []
    for codec in TARGET_CODECS:
        row = next((r for r, v in results.items() if any(e[tf]["codec"] == codec for e in v.values())), None)
        entry = results.get(row, {}).get(dtype, {}).get(tf)
        value = entry["stored_ratio"]["median"] if entry else None
        # a codec left out with --codecs is reported as not measured, not as a failure
        targets.append({"target": f"{codec} stored/raw on {dtype} {tf} <= {TARGET_RATIO}", "value": value,
                        "pass": None if value is None else value <= TARGET_RATIO})
    return targets


# ---------------------------------------------------------------------------------------------------
# stderr of the native library
# ---------------------------------------------------------------------------------------------------
class NativeStderr:
    """File descriptor 2 goes to a temporary file (QATzip's per-call notices); Python's sys.stderr keeps
    writing to the original, so the script's own errors and tracebacks stay visible."""

    def __enter__(self) -> Self:
        sys.stderr.flush()
        self.sink = tempfile.TemporaryFile()
        self.saved_fd = os.dup(2)
        self.python_stderr = sys.stderr
        sys.stderr = os.fdopen(os.dup(self.saved_fd), "w", buffering=1, errors="replace")
        os.dup2(self.sink.fileno(), 2)
        self.lines: list[str] = []
        return self

    def __exit__(self, *exc) -> None:
        sys.stderr.flush()
        os.dup2(self.saved_fd, 2)
        os.close(self.saved_fd)
        sys.stderr.close()
        sys.stderr = self.python_stderr
        self.sink.seek(0)
        self.lines = [ln for ln in self.sink.read().decode(errors="replace").splitlines() if ln.strip()]
        self.sink.close()

    def report(self) -> dict:
        from kvfs.native_stderr import KNOWN_NOTICES
        key_failures = [ln for ln in self.lines if KEY_FAILURE in ln]
        other = [ln for ln in self.lines if not KNOWN_NOTICES.search(ln) and KEY_FAILURE not in ln]
        return {"lines": len(self.lines), "known_notices": len(self.lines) - len(other) - len(key_failures),
                "thread_key_failures": len(key_failures), "pthread_keys_exhausted": not pthread_key_available(),
                "other": other[:50]}


def pthread_key_available() -> bool:
    """Whether this process can still create a pthread key. QATzip without a device retries its init on
    every call, and each retry creates a pthread key it never deletes (PTHREAD_KEYS_MAX is 1024)."""
    libc = ctypes.CDLL(None)
    key = ctypes.c_uint()  # pthread_key_t is an unsigned int in glibc
    if libc.pthread_key_create(ctypes.byref(key), None) != 0:
        return False
    libc.pthread_key_delete(key)
    return True


# ---------------------------------------------------------------------------------------------------
# output
# ---------------------------------------------------------------------------------------------------
def print_report(doc: dict, console) -> None:
    from rich.table import Table
    results, dtypes = doc["results"], list(doc["data"])
    qat = doc["qat"]
    mode = f"QAT: {qat['mode'].upper()}" if qat else "QAT: NOT MEASURED"
    t = Table(title=f"[bold]codec benchmark — {mode}[/bold] — {doc['config']['threads']} thread(s), "
                    f"medians of {doc['config']['rounds']} rounds, 1 MiB frames")
    t.add_column("codec -> decoder")
    t.add_column("transform")
    for dt in dtypes:
        for col in ("stored/raw", "comp MB/s", "decomp MB/s", "CPU s/GB\ncomp / dec"):
            t.add_column(f"{dt}\n{col}", justify="right")
    for tf in TRANSFORMS:
        for i, row in enumerate(results):
            cells = []
            for dt in dtypes:
                e = results[row][dt][tf]
                cells += [f"{e['stored_ratio']['median']:.4f}", f"{e['compress_MBps']['median']:.0f}",
                          f"{e['decompress_MBps']['median']:.0f}",
                          f"{e['compress_cpu_s_per_GB']['median']:.2f} / {e['decompress_cpu_s_per_GB']['median']:.2f}"]
            t.add_row(row, tf, *cells, end_section=(i == len(results) - 1))
    console.print(t)
    print_vs_zlib(doc, console)
    tr = doc["transform_cost"]
    console.print("byteplane2 transform alone (not in the figures above; 1 thread): " + "; ".join(
        f"{dt} encode {v['encode_MBps']:.0f} MB/s ({v['encode_cpu_s_per_GB']:.2f} CPU s/GB), decode "
        f"{v['decode_MBps']:.0f} MB/s ({v['decode_cpu_s_per_GB']:.2f})" for dt, v in tr.items()))
    print_targets(doc["targets"], console)


def print_vs_zlib(doc: dict, console) -> None:
    from rich.table import Table
    results, dtypes = doc["results"], list(doc["data"])
    t = Table(title="vs zlib-1, same data: speed = median of paired per-round MB/s ratios; "
                    "CPU = zlib CPU s / codec CPU s")
    t.add_column("codec -> decoder")
    t.add_column("transform")
    for dt in dtypes:
        t.add_column(f"{dt}\nspeed comp / dec", justify="right")
        t.add_column(f"{dt}\nCPU comp / dec", justify="right")
    for tf in TRANSFORMS:
        rows = [r for r in results if "vs_zlib" in results[r][dtypes[0]][tf]]
        for i, row in enumerate(rows):
            cells = []
            for dt in dtypes:
                v = results[row][dt][tf]["vs_zlib"]
                cells += [f"{v['compress_speed']:.2f}x / {v['decompress_speed']:.2f}x",
                          f"{v['compress_cpu']:.2f}x / {v['decompress_cpu']:.2f}x"]
            t.add_row(row, tf, *cells, end_section=(i == len(rows) - 1))
    if t.row_count:
        console.print(t)


def print_targets(targets: list[dict], console) -> None:
    for tg in targets:
        if tg["pass"] is None:
            console.print(f"target {tg['target']}: [yellow]not measured (--codecs)[/yellow]")
            continue
        verdict = "[green]PASS[/green]" if tg["pass"] else "[bold red]FAIL[/bold red]"
        console.print(f"target {tg['target']}: {tg['value']:.4f} {verdict}")


def make_plot(doc: dict, path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    results = doc["results"]
    groups = [(dt, tf) for dt in doc["data"] for tf in TRANSFORMS]
    rows = list(results)
    width = 0.8 / len(rows)
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    for ax, key, title in zip(axes, ("stored_ratio", "compress_MBps", "decompress_MBps"),
                              ("stored / raw (lower is better)", "compress MB/s", "decompress MB/s")):
        for j, row in enumerate(rows):
            xs = [i + (j - (len(rows) - 1) / 2) * width for i in range(len(groups))]
            entries = [results[row][dt][tf][key] for dt, tf in groups]
            ax.bar(xs, [e["median"] for e in entries], width, label=row,
                   yerr=[[e["median"] - e["min"] for e in entries], [e["max"] - e["median"] for e in entries]])
        ax.set_xticks(range(len(groups)), [f"{dt}\n{tf}" for dt, tf in groups])
        ax.set_title(title)
    axes[0].axhline(TARGET_RATIO, color="red", linestyle="dashed", linewidth=1)
    lowest = min(e[dt][tf]["stored_ratio"]["min"] for e in results.values() for dt, tf in groups)
    axes[0].set_ylim(bottom=min(lowest, TARGET_RATIO) - 0.05)  # from 0 the differences would not show
    axes[1].legend(fontsize=8, loc="upper left")
    mode = doc["qat"]["mode"] if doc["qat"] else "not measured"
    fig.suptitle(f"kvfs codecs on real KV, QAT {mode}, {doc['config']['threads']} thread(s), "
                 f"medians of {doc['config']['rounds']} rounds (min-max)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ---------------------------------------------------------------------------------------------------
# environment
# ---------------------------------------------------------------------------------------------------
def cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), None)
    except OSError:
        return None


def git_head() -> str | None:
    try:
        res = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, check=False)
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--", "kvfs", "tools/bench_codecs.py"],
                               capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        return None
    return res.stdout.strip() + ("+dirty" if dirty else "") if res.returncode == 0 else None


def environment() -> dict:
    import isal
    import zstandard
    return {"hostname": platform.node(), "kernel": platform.release(), "cpu_model": cpu_model(),
            "cpus": os.cpu_count(), "cpus_usable": len(os.sched_getaffinity(0)), "python": platform.python_version(),
            "isal": {"python_isal": isal.__version__, "isa_l": isal.ISAL_VERSION},
            "zlib": zlib.ZLIB_RUNTIME_VERSION, "zstd": ".".join(map(str, zstandard.ZSTD_VERSION)),
            "git": git_head(), "loadavg_before": os.getloadavg()}


# ---------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", action="append", metavar="[DTYPE=]DIR",
                   help="directory of .kv block files (repeatable; default: " + ", ".join(map(str, DEFAULT_DATA))
                        + ", else tests/data/kv)")
    p.add_argument("--files", type=int, default=24, metavar="N", help="files per dtype (default 24, ~71 MB)")
    p.add_argument("--rounds", type=int, default=3, metavar="R", help="rounds (default 3)")
    p.add_argument("--threads", type=int, default=1, metavar="N",
                   help="frames compressed/decompressed by N threads at once; aggregate MB/s (default 1; "
                        "on QAT hardware use several to keep requests in flight)")
    p.add_argument("--codecs", default=",".join(ALL_CODECS),
                   help=f"comma-separated subset of {','.join(ALL_CODECS)} (default all; zlib is the baseline)")
    p.add_argument("--out", type=Path, default=REPO / "bench-results" / "bench_codecs.json", help="JSON results")
    p.add_argument("--plot", type=Path, metavar="PNG", help="bar chart (only if matplotlib is importable)")
    args = p.parse_args(argv)
    args.codecs = [c.strip() for c in args.codecs.split(",") if c.strip()]
    unknown = set(args.codecs) - set(ALL_CODECS)
    if unknown or not args.codecs:
        p.error(f"--codecs: unknown {', '.join(sorted(unknown)) or '(empty)'}; choose from {', '.join(ALL_CODECS)}")
    if args.files < 1 or args.rounds < 1 or args.threads < 1:
        p.error("--files, --rounds and --threads must be >= 1")
    return args


def setup(args, console) -> tuple[dict, list[str], list[Candidate], dict | None]:
    """Data and codecs; SetupError (exit 2) if either is missing."""
    datasets, notes = load_datasets(args.data, args.files)
    qat_codec, qat_info = None, None
    if "qat" in args.codecs:
        from kvfs.codecs.qat import QatUnavailable
        try:
            qat_codec, qat_info = load_qat()
        except QatUnavailable as e:
            raise SetupError(f"{e} (or leave qat out: --codecs deflate,zlib,zstd)") from None
    return datasets, notes, make_candidates(args.codecs, qat_codec), qat_info


def announce(datasets: dict, notes: list[str], qat_info: dict | None, args, console) -> None:
    for dtype, ds in datasets.items():
        console.print(f"[bold]{dtype}[/bold]: {len(ds.files)} files, {ds.total_bytes / MB:.1f} MB, "
                      f"{ds.distinct_files} distinct, from {', '.join(ds.sources)}")
    for n in notes:
        console.print(f"[yellow]note:[/yellow] {n}")
    if qat_info:
        style = "bold green" if qat_info["mode"] == "hardware" else "bold yellow"
        console.print(f"[{style}]QAT mode: {qat_info['mode'].upper()}[/{style}] ({qat_info['library']})")
        if qat_info["mode"] != "hardware":  # why qat's stored/raw here is not the device's
            console.print("[yellow]note:[/yellow] QATzip's software fallback is zlib level 1 and writes one gzip "
                          "member per call (per 1 MiB frame); the device writes 64 KiB members (its own "
                          "encoder), so stored/raw and speeds on hardware differ")
    if args.threads > os.cpu_count():
        console.print(f"[yellow]note:[/yellow] --threads {args.threads} > {os.cpu_count()} CPUs")


def build_doc(args, env, datasets, qat_info, records, transform_records, native, t_start) -> dict:
    results = aggregate(records)
    targets = check_targets(results)
    env["loadavg_after"] = os.getloadavg()
    return {
        "tool": "tools/bench_codecs.py",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": env, "git": env["git"], "qat": qat_info, "native_stderr": native,
        "config": {"files_per_dtype": args.files, "rounds": args.rounds, "threads": args.threads,
                   "codecs": args.codecs, "frame_size": FRAME_SIZE, "zlib_chunk": ZLIB_CHUNK,
                   "gzip_member_overhead": GZIP_MEMBER_OVERHEAD, "units": {"MB": MB, "GB": GB},
                   "duration_s": round(time.monotonic() - t_start, 1)},
        "data": {dt: {"bytes": ds.total_bytes, "files": len(ds.files), "distinct_files": ds.distinct_files,
                      "replicated": ds.replicated, "sources": ds.sources,
                      "file_names": sorted({f.source.name for f in ds.files})} for dt, ds in datasets.items()},
        "fields": {"stored_ratio": "codec payload bytes / raw bytes (zlib: + 32 bytes per 64 KiB chunk)",
                   "cpu_s_per_GB": "time.process_time() delta (all threads) per 1e9 raw bytes",
                   "vs_zlib": "median over rounds of codec/zlib MB/s (speed) and zlib/codec CPU s (cpu), "
                              "same dtype, transform and round"},
        "results": results, "transform_cost": aggregate_transform(transform_records),
        "targets": targets, "all_targets_pass": all(t["pass"] is not False for t in targets),
        "rounds": records, "transform_rounds": transform_records,
    }


def report_native(native: dict, console) -> None:
    from rich.text import Text
    if native["lines"]:
        console.print(f"native stderr: {native['lines']} line(s) captured, {native['known_notices']} of them "
                      "QATzip's known no-device notices")
    if native["thread_key_failures"] or native["pthread_keys_exhausted"]:
        console.print(f"[bold yellow]note:[/bold yellow] QATzip failed to create a pthread key "
                      f"{native['thread_key_failures']} time(s) ('{KEY_FAILURE}'); pthread keys exhausted in "
                      f"this process: {native['pthread_keys_exhausted']}. Without a device QATzip leaks one key per "
                      "call (~1020 calls exhaust them); round trips were still verified")
    for ln in native["other"][:10]:
        console.print(Text("native stderr: ", style="yellow") + Text(ln))


def measure_all(args, console) -> tuple[int, tuple | None]:
    """(0, (datasets, qat info, records, transform records)) or (exit status, None)."""
    try:
        datasets, notes, cands, qat_info = setup(args, console)
        announce(datasets, notes, qat_info, args, console)
        inputs = build_inputs(datasets)
        records, transform_records = run_rounds(cands, inputs, args, console)
    except SetupError as e:
        console.print(f"[bold red]setup error:[/bold red] {e}")
        return 2, None
    except BenchFailure as e:
        console.print(f"[bold red]BENCHMARK FAILED:[/bold red] {e}")
        return 3, None
    except KeyboardInterrupt:
        console.print("[red]interrupted[/red]")
        return 130, None
    return 0, (datasets, qat_info, records, transform_records)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from rich.console import Console
    console = Console(width=None if sys.stdout.isatty() else 170)
    t_start = time.monotonic()
    env = environment()
    with NativeStderr() as native:
        rc, run = measure_all(args, console)
    native_report = native.report()
    report_native(native_report, console)  # also after a failure: a native error may explain it
    if rc:
        return rc
    datasets, qat_info, records, transform_records = run
    doc = build_doc(args, env, datasets, qat_info, records, transform_records, native_report, t_start)
    print_report(doc, console)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    console.print(f"results: {args.out}")
    if args.plot:
        if make_plot(doc, args.plot):
            console.print(f"plot: {args.plot}")
        else:
            console.print("[yellow]note:[/yellow] matplotlib is not importable; no plot")
    return 0 if doc["all_targets_pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
