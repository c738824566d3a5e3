"""What kvfs's file-system benchmarks share (tools/bench_fs.py, tools/bench_tiers.py, tools/bench_codecs.py):
real KV data sets, a kvfs mount run as a daemon with its CPU time and log checked, file I/O helpers.

MB = 1e6 bytes, GB = 1e9 bytes.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DATA = [Path("/work/kvdata/bf16"), Path("/work/kvdata/fp16")]
FALLBACK_DATA = REPO / "tests" / "data" / "kv"
KNOWN_DTYPES = ("bf16", "fp16")
MB = 1e6
GB = 1e9
MOUNT_TIMEOUT_S = 30.0
UNMOUNT_TIMEOUT_S = 60.0
BAD_LOG_LINE = re.compile(r"\b(ERROR|CRITICAL)\b|Traceback")
CLK_TCK = os.sysconf("SC_CLK_TCK")


class BenchFailure(Exception):
    """Wrong data read back or a daemon fault: the figures are meaningless."""


class SetupError(Exception):
    """Bad options or input; nothing was measured."""


# ---------------------------------------------------------------------------------------------------
# input data
# ---------------------------------------------------------------------------------------------------
@dataclass
class KvFile:
    name: str  # name used inside the benchmark (unique per dtype, also when replicated)
    source: Path
    data: bytes
    sha256: str


@dataclass
class DataSet:
    dtype: str
    files: list[KvFile]
    sources: list[str]
    distinct_files: int
    replicated: bool
    notes: list[str] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(len(f.data) for f in self.files)


def _dtype_of_name(name: str) -> str | None:
    prefix = name.split("-", 1)[0].lower()
    return prefix if prefix in KNOWN_DTYPES else None


def _scan_dir(directory: Path, label: str | None, notes: list[str]) -> dict[str, list[tuple[Path, str | None]]]:
    """dtype -> [(path, expected sha256 or None)] of usable .kv files in one directory."""
    paths = sorted(p for p in directory.glob("*.kv") if p.is_file())
    manifest = {}
    mpath = directory / "manifest.json"
    if mpath.is_file():
        try:
            doc = json.loads(mpath.read_text())
            manifest = {e["file"]: e for e in doc.get("files", [])}
        except (OSError, ValueError, KeyError, TypeError) as e:
            notes.append(f"{mpath}: unreadable manifest ({e}); using all files of the common size")
            manifest = {}
    out: dict[str, list[tuple[Path, str | None]]] = collections.defaultdict(list)
    if manifest:
        unlisted = [p.name for p in paths if p.name not in manifest]
        if unlisted:
            notes.append(f"{directory}: {len(unlisted)} file(s) not (yet) in manifest.json skipped")
        for p in paths:
            entry = manifest.get(p.name)
            if entry is None:
                continue
            if p.stat().st_size != entry.get("bytes", -1):
                notes.append(f"{p}: size differs from manifest (still being written?); skipped")
                continue
            dtype = label or entry.get("dtype") or _dtype_of_name(p.name) or directory.name
            out[dtype].append((p, entry.get("sha256")))
        return out
    sizes = collections.Counter(p.stat().st_size for p in paths)
    common = sizes.most_common(1)[0][0] if sizes else 0
    for p in paths:
        if p.stat().st_size != common:
            notes.append(f"{p}: size {p.stat().st_size} differs from the common {common}; skipped")
            continue
        dtype = label or _dtype_of_name(p.name) or directory.name
        out[dtype].append((p, None))
    return out


def _pick(candidates: list, n: int) -> list:
    """n items spread evenly over the sorted candidates (covers every prompt), or all of them."""
    if len(candidates) <= n:
        return list(candidates)
    return [candidates[(i * len(candidates)) // n] for i in range(n)]


def load_datasets(specs: list[str] | None, n_files: int) -> tuple[dict[str, DataSet], list[str]]:
    notes: list[str] = []
    dirs: list[tuple[str | None, Path]] = []
    if specs:
        for spec in specs:
            label, sep, path = spec.partition("=")
            if sep and label and "/" not in label:
                dirs.append((label, Path(path)))
            else:
                dirs.append((None, Path(spec)))
        missing = [str(d) for _, d in dirs if not d.is_dir()]
        if missing:
            raise SetupError(f"--data directory not found: {', '.join(missing)}")
    else:
        present = [d for d in DEFAULT_DATA if d.is_dir() and any(d.glob("*.kv"))]
        if present:
            dirs = [(None, d) for d in present]
            absent = [str(d) for d in DEFAULT_DATA if d not in present]
            if absent:
                notes.append(f"default data directory missing or empty: {', '.join(absent)}")
        elif FALLBACK_DATA.is_dir() and any(FALLBACK_DATA.glob("*.kv")):
            dirs = [(None, FALLBACK_DATA)]
            notes.append(f"no real dumps in {', '.join(map(str, DEFAULT_DATA))}: FALLING BACK to the committed "
                         f"samples in {FALLBACK_DATA} (replicated to {n_files} files per dtype)")
        else:
            raise SetupError(f"no KV data: neither {', '.join(map(str, DEFAULT_DATA))} nor {FALLBACK_DATA}/*.kv "
                             "exist; run tools/dump_kv.py or pass --data DIR")

    by_dtype: dict[str, list[tuple[Path, str | None]]] = collections.defaultdict(list)
    source_dirs: dict[str, list[str]] = collections.defaultdict(list)
    for label, d in dirs:
        for dtype, items in _scan_dir(d, label, notes).items():
            by_dtype[dtype].extend(items)
            source_dirs[dtype].append(str(d))
    if not by_dtype:
        raise SetupError("no usable .kv files in " + ", ".join(str(d) for _, d in dirs))

    datasets: dict[str, DataSet] = {}
    for dtype in sorted(by_dtype, key=lambda t: (t not in KNOWN_DTYPES, t)):
        candidates = sorted(by_dtype[dtype], key=lambda item: item[0].name)
        chosen = _pick(candidates, n_files)
        loaded: list[tuple[Path, bytes, str]] = []
        for path, expected in chosen:
            data = path.read_bytes()
            digest = hashlib.sha256(data).hexdigest()
            if expected and digest != expected:
                notes.append(f"{path}: SHA-256 differs from manifest.json (still being written?); skipped")
                continue
            loaded.append((path, data, digest))
        if not loaded:
            notes.append(f"{dtype}: no file passed the checks; dtype dropped")
            continue
        files = []
        for i in range(n_files):
            path, data, digest = loaded[i % len(loaded)]
            files.append(KvFile(f"{i:05d}-{path.name}", path, data, digest))
        ds_notes = []
        replicated = len(loaded) < n_files
        if replicated:
            ds_notes.append(f"{dtype}: only {len(loaded)} distinct file(s); REPLICATED to {n_files}")
        datasets[dtype] = DataSet(dtype, files, source_dirs[dtype], len(loaded), replicated, ds_notes)
        notes.extend(ds_notes)
    if not datasets:
        raise SetupError("no usable data set")
    return datasets, notes


# ---------------------------------------------------------------------------------------------------
# processes and measurement helpers
# ---------------------------------------------------------------------------------------------------
def proc_cpu_s(pid: int | None) -> float:
    """utime+stime of a whole process (all threads), in seconds; 0 for None."""
    if pid is None:
        return 0.0
    with open(f"/proc/{pid}/stat", "rb") as f:
        raw = f.read().decode()
    fields = raw[raw.rindex(")") + 2:].split()  # fields[0] is field 3 (state)
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def self_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def drop_caches() -> bool:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def write_file(path: Path, data: bytes, io_size: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        view = memoryview(data)
        step = io_size or len(view)
        off = 0
        while off < len(view):
            off += os.write(fd, view[off:off + step])
    finally:
        os.close(fd)  # kvfs commits the file here (flush), inside the timing


def read_file(path: Path, size: int, io_size: int) -> bytearray:
    buf = bytearray(size)
    view = memoryview(buf)
    step = io_size or size
    with open(path, "rb", buffering=0) as f:
        got = 0
        while got < size:
            n = f.readinto(view[got:got + step])
            if not n:
                raise BenchFailure(f"{path}: short read, {got} of {size} bytes")
            got += n
        if f.read(1):
            raise BenchFailure(f"{path}: longer than the {size} bytes written")
    return buf


def _holders(mountpoint: Path) -> list[str]:
    """'pid comm' of processes with their cwd or an open file under mountpoint (diagnostics only)."""
    prefix = str(mountpoint)
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            links = [os.readlink(f"/proc/{pid}/cwd")]
            links += [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
            if any(ln == prefix or ln.startswith(prefix + "/") for ln in links):
                with open(f"/proc/{pid}/comm") as f:
                    found.append(f"{pid} {f.read().strip()}")
        except OSError:
            continue
    return found


class Mount:
    """One kvfs daemon in the foreground, as a child process of the benchmark."""

    def __init__(self, kvfs: str, codec: str, base: Path, shm_base: Path, l2_capacity: int, tag: str,
                 dtype: str | None = None, *, l3: tuple[Path, int] | None = None, promote: str | None = None,
                 env: dict[str, str] | None = None, cwd: Path | None = None) -> None:
        """l3: (directory under which this mount's L3 goes, capacity); None leaves kvfs its default L3 (in the
        state dir). env: added to the daemon's environment; cwd: its working directory. A Mount with the tag
        of a stopped one remounts the same state, L2 and L3."""
        self.codec = codec
        self.mountpoint = base / f"mnt-{tag}"
        self.state = base / f"state-{tag}"
        self.l2 = shm_base / f"l2-{tag}"
        self.l3 = l3[0] / f"l3-{tag}" if l3 else None
        self.log_path = base / f"kvfs-{tag}.log"
        self.cmd = [kvfs, "mount", str(self.mountpoint), "--foreground", "--l2", f"{self.l2}:{l2_capacity}",
                    "--codec", codec, "--state-dir", str(self.state), *(["--dtype", dtype] if dtype else []),
                    *(["--l3", f"{self.l3}:{l3[1]}"] if l3 else []), *(["--promote", promote] if promote else [])]
        self.env = dict(os.environ, **(env or {}))
        self.cwd = cwd
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.mountpoint.mkdir(parents=True, exist_ok=True)  # exists when remounting
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=self.env,
                                         cwd=self.cwd)
        deadline = time.monotonic() + MOUNT_TIMEOUT_S
        while not os.path.ismount(self.mountpoint):
            if self.proc.poll() is not None:
                raise BenchFailure(f"kvfs exited with {self.proc.returncode} at start:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise BenchFailure(f"kvfs did not mount within {MOUNT_TIMEOUT_S}s:\n{self.log_tail()}")
            time.sleep(0.02)
        pid = self.stats()["pid"]
        if pid != self.proc.pid:
            raise BenchFailure(f"stats pid {pid} is not the daemon we started ({self.proc.pid})")

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def stats(self) -> dict:
        return json.loads((self.mountpoint / ".kvfs" / "stats").read_bytes())

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def stop(self, notes: list[str]) -> int:
        """Clean unmount; waits for the daemon to exit and returns its status. A mount kept busy by some
        other process (a stray scanner of /tmp) is retried for a while, then detached lazily (noted)."""
        if self.proc is None:
            return 0
        deadline = time.monotonic() + 10.0
        while os.path.ismount(self.mountpoint):
            res = subprocess.run(["fusermount3", "-u", str(self.mountpoint)], capture_output=True, text=True)
            if res.returncode == 0:
                break
            if "busy" not in res.stderr or time.monotonic() > deadline:
                holders = _holders(self.mountpoint)
                if "busy" in res.stderr:
                    notes.append(f"{self.mountpoint} busy at unmount (held by {holders or 'unknown'}); "
                                 "detached lazily")
                    subprocess.run(["fusermount3", "-u", "-z", str(self.mountpoint)], capture_output=True)
                    break
                raise BenchFailure(f"fusermount3 -u {self.mountpoint}: {res.stderr.strip()}")
            time.sleep(0.2)
        try:
            try:
                code = self.proc.wait(UNMOUNT_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                notes.append(f"daemon {self.proc.pid} still running {UNMOUNT_TIMEOUT_S}s after unmount; SIGTERM")
                self.proc.terminate()
                code = self.proc.wait(30)
        finally:
            self.proc = None
        return code

    def kill(self) -> None:
        """Emergency cleanup (our own child only)."""
        if self.proc is not None and self.proc.poll() is None:
            subprocess.run(["fusermount3", "-u", "-z", str(self.mountpoint)], capture_output=True)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.send_signal(signal.SIGKILL)
                self.proc.wait(15)
        self.proc = None

    def remove_dirs(self) -> None:
        """After a clean stop: the backing directories and the mountpoint go, the log stays."""
        for d in (self.l2, self.state, self.l3):
            if d is not None:
                shutil.rmtree(d, ignore_errors=True)
        try:
            self.mountpoint.rmdir()
        except OSError:
            pass

    def bad_log_lines(self) -> list[str]:
        try:
            return [ln for ln in self.log_path.read_text(errors="replace").splitlines() if BAD_LOG_LINE.search(ln)]
        except OSError:
            return []


# ---------------------------------------------------------------------------------------------------
# one variant, one round
# ---------------------------------------------------------------------------------------------------


def fs_type(path: Path) -> str:
    """Filesystem type of the mount holding `path` (longest matching mount point in /proc/mounts)."""
    best, kind = "", "?"
    target = str(path.resolve()).rstrip("/") + "/"
    with open("/proc/mounts") as f:
        for line in f:
            mnt, typ = line.split()[1:3]
            mnt = mnt.replace("\\040", " ")
            if target.startswith(mnt.rstrip("/") + "/") and len(mnt) >= len(best):
                best, kind = mnt, typ
    return kind
