"""An fsstress-style churn: several processes each run random namespace and data operations in their own
directory (as fsstress gives each process pN) on one mount with a small L2, keeping a model of what they
did. Then the tree must equal the union of the models: every name, type, link count, mode, symlink target,
xattr and byte; the daemon alive, no unexpected error, tiers accounted for, `kvfs fsck` clean.

Rerun one (OPS per process):
KVFS_FSSTRESS_SEED=<seed> KVFS_FSSTRESS_OPS=<n> .venv/bin/python -m pytest -q tests/test_fsstress.py
"""

from __future__ import annotations

import collections
import errno
import multiprocessing
import os
import random
import stat
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from conftest import KvfsMount
from test_tiers import wait_for

SEED = int(os.environ.get("KVFS_FSSTRESS_SEED", "4242"))
OPS = int(os.environ.get("KVFS_FSSTRESS_OPS", "2500"))
PROCS = 4
MAX_FILE = 512 << 10
WEIGHTS = {"creat": 12, "write": 10, "truncate": 4, "read": 10, "mkdir": 5, "rmdir": 3, "unlink": 6,
           "rename": 8, "link": 4, "symlink": 3, "mkfifo": 1, "chmod": 3, "setxattr": 3, "readdir": 4,
           "fsync": 2, "stat": 6}


@dataclass
class Model:
    """One process's view: names (relative to its directory) and the files they name (hard links share one)."""
    names: dict[str, tuple] = field(default_factory=lambda: {"": ("d",)})  # ("f", id) ("d",) ("l", t) ("p",)
    data: dict[int, bytearray] = field(default_factory=dict)
    modes: dict[int, int] = field(default_factory=dict)
    xattrs: dict[int, dict[str, bytes]] = field(default_factory=dict)
    next_id: int = 0


class Worker:
    def __init__(self, root: Path, seed: int) -> None:
        self.root = root
        self.rng = random.Random(seed)
        self.m = Model()
        self.errors: list[str] = []
        self.counts: collections.Counter = collections.Counter()
        self.serial = 0

    # -- model helpers -----------------------------------------------------------------------------------
    def p(self, rel: str) -> Path:
        return self.root / rel if rel else self.root

    def pick(self, kind: str | None = None) -> str | None:
        names = [n for n, e in self.m.names.items() if n and (kind is None or e[0] == kind)]
        return self.rng.choice(names) if names else None

    def new_name(self) -> str:
        parent = self.rng.choice([n for n, e in self.m.names.items() if e[0] == "d"])
        self.serial += 1
        return f"{parent}/n{self.serial}" if parent else f"n{self.serial}"

    def children(self, d: str) -> list[str]:
        prefix = f"{d}/" if d else ""
        return [n for n in self.m.names if n.startswith(prefix) and n != d and "/" not in n[len(prefix):]]

    def links(self, fid: int) -> int:
        return sum(1 for e in self.m.names.values() if e == ("f", fid))

    def payload(self, n: int) -> bytes:
        return self.rng.randbytes(n) if self.rng.random() < 0.7 else bytes([self.rng.randrange(256)]) * n

    def problem(self, what: str) -> None:
        self.errors.append(f"{self.root.name}: {what}")

    # -- operations ----------------------------------------------------------------------------------------
    def op_creat(self) -> None:
        name = self.new_name()
        data = self.payload(self.rng.randrange(0, MAX_FILE))
        with open(self.p(name), "xb") as fh:
            fh.write(data)
        fid = self.m.next_id = self.m.next_id + 1
        self.m.names[name] = ("f", fid)
        self.m.data[fid] = bytearray(data)
        self.m.modes[fid] = 0o644
        self.m.xattrs[fid] = {}

    def op_write(self) -> None:
        name = self.pick("f")
        if name is None:
            return
        fid = self.m.names[name][1]
        off = self.rng.randrange(0, MAX_FILE)
        data = self.payload(self.rng.randrange(1, 64 << 10))
        with open(self.p(name), "r+b") as fh:
            fh.seek(off)
            fh.write(data)
        d = self.m.data[fid]
        d.extend(bytes(max(0, off - len(d))))
        d[off:off + len(data)] = data

    def op_truncate(self) -> None:
        name = self.pick("f")
        if name is None:
            return
        fid = self.m.names[name][1]
        size = self.rng.randrange(0, MAX_FILE)
        os.truncate(self.p(name), size)
        d = self.m.data[fid]
        del d[size:]
        d.extend(bytes(size - len(d)))

    def op_read(self) -> None:
        name = self.pick("f")
        if name is None:
            return
        got = read_uncached(self.p(name))
        if got != self.m.data[self.m.names[name][1]]:
            self.problem(f"wrong content in {name}")

    def op_mkdir(self) -> None:
        name = self.new_name()
        os.mkdir(self.p(name))
        self.m.names[name] = ("d",)

    def op_rmdir(self) -> None:
        name = self.pick("d")
        if name is None:
            return
        empty = not self.children(name)
        try:
            os.rmdir(self.p(name))
        except OSError as e:
            if empty or e.errno != errno.ENOTEMPTY:
                raise
            return
        if not empty:
            self.problem(f"rmdir of non-empty {name} succeeded")
        del self.m.names[name]

    def op_unlink(self) -> None:
        name = self.rng.choice([n for n, e in self.m.names.items() if n and e[0] != "d"] or [None])
        if name is None:
            return
        os.unlink(self.p(name))
        self._forget(name)

    def _forget(self, name: str) -> None:
        entry = self.m.names.pop(name)
        if entry[0] == "f" and not self.links(entry[1]):
            for table in (self.m.data, self.m.modes, self.m.xattrs):
                del table[entry[1]]

    def op_rename(self) -> None:
        src = self.pick()
        if src is None:
            return
        kind = self.m.names[src][0]
        same_kind = [n for n, e in self.m.names.items() if n and n != src and e[0] == kind == "f"]
        if same_kind and self.rng.random() < 0.3:
            dst = self.rng.choice(same_kind)  # over an existing file
        else:
            dst = self.new_name()
        if kind == "d" and (dst + "/").startswith(src + "/"):
            try:
                os.rename(self.p(src), self.p(dst))
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                return
            self.problem(f"rename of {src} into its own subtree {dst} succeeded")
            return
        os.rename(self.p(src), self.p(dst))
        if dst in self.m.names:
            if self.m.names[dst] == self.m.names[src]:  # two links of one file: nothing happens
                return
            self._forget(dst)
        moved = {n: e for n, e in self.m.names.items() if n == src or n.startswith(src + "/")}
        for n, e in moved.items():
            del self.m.names[n]
        for n, e in moved.items():
            self.m.names[dst + n[len(src):]] = e

    def op_link(self) -> None:
        src = self.pick("f")
        if src is None:
            return
        dst = self.new_name()
        os.link(self.p(src), self.p(dst))
        self.m.names[dst] = self.m.names[src]

    def op_symlink(self) -> None:
        name, target = self.new_name(), f"target-{self.rng.randrange(1000)}"
        os.symlink(target, self.p(name))
        self.m.names[name] = ("l", target)

    def op_mkfifo(self) -> None:
        name = self.new_name()
        os.mkfifo(self.p(name), 0o600)
        self.m.names[name] = ("p",)

    def op_chmod(self) -> None:
        name = self.pick("f")
        if name is None:
            return
        mode = self.rng.choice([0o600, 0o640, 0o644, 0o664, 0o755])
        os.chmod(self.p(name), mode)
        self.m.modes[self.m.names[name][1]] = mode

    def op_setxattr(self) -> None:
        name = self.pick("f")
        if name is None:
            return
        key, value = f"user.s{self.rng.randrange(4)}", self.rng.randbytes(self.rng.randrange(1, 200))
        os.setxattr(self.p(name), key, value)
        self.m.xattrs[self.m.names[name][1]][key] = value

    def op_readdir(self) -> None:
        d = self.pick("d") if self.rng.random() < 0.7 else ""
        want = sorted(n.rsplit("/", 1)[-1] for n in self.children(d or ""))
        got = sorted(os.listdir(self.p(d or "")))
        if got != want:
            self.problem(f"readdir {d!r}: {got} != model {want}")

    def op_fsync(self) -> None:
        name = self.pick("f")
        if name is None:
            return
        fd = os.open(self.p(name), os.O_RDWR)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def op_stat(self) -> None:
        name = self.pick()
        if name is None:
            return
        problems = check_entry(self.p(name), self.m.names[name], self.m, self.links)
        self.errors += [f"{self.root.name}/{name}: {p}" for p in problems]

    def run(self, n: int) -> None:
        names = list(WEIGHTS)
        weights = [WEIGHTS[k] for k in names]
        for _ in range(n):
            op = self.rng.choices(names, weights)[0]
            try:
                getattr(self, f"op_{op}")()
            except OSError as e:
                self.problem(f"{op}: {e!r}")
            self.counts[op] += 1


def read_uncached(path: Path) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return b"".join(iter(lambda: os.read(fd, 1 << 20), b""))
    finally:
        os.close(fd)


def check_entry(path: Path, entry: tuple, model: Model, links) -> list[str]:
    """What differs between one name on the mount and its model entry."""
    st = os.lstat(path)
    kind = entry[0]
    expect_type = {"f": stat.S_ISREG, "d": stat.S_ISDIR, "l": stat.S_ISLNK, "p": stat.S_ISFIFO}[kind]
    if not expect_type(st.st_mode):
        return [f"type {oct(stat.S_IFMT(st.st_mode))}, model {kind}"]
    problems = []
    if kind == "l" and os.readlink(path) != entry[1]:
        problems.append(f"symlink to {os.readlink(path)!r}, model {entry[1]!r}")
    if kind == "f":
        fid = entry[1]
        if st.st_size != len(model.data[fid]):
            problems.append(f"size {st.st_size}, model {len(model.data[fid])}")
        if st.st_nlink != links(fid):
            problems.append(f"nlink {st.st_nlink}, model {links(fid)}")
        if stat.S_IMODE(st.st_mode) != model.modes[fid]:
            problems.append(f"mode {oct(stat.S_IMODE(st.st_mode))}, model {oct(model.modes[fid])}")
    return problems


def churn(root: str, seed: int, n: int) -> tuple[Model, list[str], dict]:
    """One fsstress process: its own directory, its own random operations."""
    directory = Path(root)
    directory.mkdir()
    w = Worker(directory, seed)
    w.run(n)
    return w.m, w.errors, dict(w.counts)


def verify_tree(directory: Path, model: Model) -> list[str]:
    """The whole tree against the model: names, then every entry, every file's bytes and xattrs, and hard
    links as one inode."""
    problems = []
    on_disk = {""}
    for top, dirs, files in os.walk(directory):
        rel = os.path.relpath(top, directory)
        rel = "" if rel == "." else rel
        on_disk |= {f"{rel}/{n}" if rel else n for n in dirs + files}
    if on_disk != set(model.names):
        problems.append(f"{directory.name}: names only on the mount {sorted(on_disk - set(model.names))[:10]}, "
                        f"only in the model {sorted(set(model.names) - on_disk)[:10]}")
    inodes: dict[int, int] = {}
    links = collections.Counter(e[1] for e in model.names.values() if e[0] == "f")
    for name, entry in model.names.items():
        path = directory / name if name else directory
        if not os.path.lexists(path):
            continue
        problems += [f"{directory.name}/{name}: {p}" for p in check_entry(path, entry, model, links.__getitem__)]
        if entry[0] != "f":
            continue
        fid = entry[1]
        if inodes.setdefault(fid, os.stat(path).st_ino) != os.stat(path).st_ino:
            problems.append(f"{directory.name}/{name}: not the same inode as the other links of its file")
        if read_uncached(path) != model.data[fid]:
            problems.append(f"{directory.name}/{name}: content differs from the model")
        got = {k: os.getxattr(path, k) for k in os.listxattr(path) if not k.startswith("user.kvfs.")}
        if got != model.xattrs[fid]:
            problems.append(f"{directory.name}/{name}: xattrs {sorted(got)}, model {sorted(model.xattrs[fid])}")
    return problems


@pytest.mark.slow
def test_fsstress_processes_churn_one_tree(make_mount):
    m: KvfsMount = make_mount()
    m.start("--l3", f"{m.root / 'stress-l3'}:1G", "--idle", "1s", l2_size="4M")
    started = time.monotonic()
    with ProcessPoolExecutor(PROCS, mp_context=multiprocessing.get_context("fork")) as pool:
        futures = [pool.submit(churn, str(m.path(f"p{i}")), SEED + i, OPS) for i in range(PROCS)]
        results = [f.result(timeout=600) for f in futures]
    elapsed = time.monotonic() - started
    counts = sum((collections.Counter(c) for _, _, c in results), collections.Counter())
    print(f"fsstress: {PROCS} processes x {OPS} operations in {elapsed:.1f} s, seed {SEED}: {dict(counts)}")
    errors = [e for _, errs, _ in results for e in errs]
    assert not errors, f"seed {SEED}: " + "\n".join(errors[:20])
    assert m.alive()
    problems = [p for i, (model, _, _) in enumerate(results) for p in verify_tree(m.path(f"p{i}"), model)]
    assert not problems, f"seed {SEED}: " + "\n".join(problems[:20])
    assert sorted(os.listdir(m.mountpoint)) == [".kvfs", *(f"p{i}" for i in range(PROCS))]

    stats = m.stats()
    l2 = stats["tiers"]["L2"]
    print(f"moves: L2 demoted {l2['demoted_files']} (idle {l2['idle_demoted_files']}), "
          f"promoted to L2 {l2['promoted_files']}")
    assert l2["demoted_files"] > 0 and l2["promoted_files"] > 0, "files must move between tiers during the run"
    assert sum(t["evicted_files"] for t in stats["tiers"].values()) == 0  # L3 holds all: nothing may be lost
    assert stats["errors"] == 0 and stats["checksum_failures"] == 0 and stats["commit_failures"] == 0
    wait_for(lambda: not m.stats()["open_files"], what="the last handles to be released")
    m.check_accounting()
    fsck = subprocess.run([sys.executable, "-m", "kvfs", "fsck", str(m.mountpoint), "--json"],
                          capture_output=True, text=True, timeout=300)
    assert fsck.returncode == 0, fsck.stdout[-3000:] + fsck.stderr[-3000:]
