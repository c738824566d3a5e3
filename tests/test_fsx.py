"""An fsx-style run: random reads, writes, mmap reads and writes, truncations, fsyncs and close/reopens on a
few files, each checked against an in-memory model, on a mount whose small L2 keeps files moving between L2
and L3 while it runs. Deterministic from its seed: a failure prints the seed and the last operations.

Rerun one: KVFS_FSX_SEED=<seed> KVFS_FSX_OPS=<n> .venv/bin/python -m pytest -q tests/test_fsx.py
"""

from __future__ import annotations

import collections
import mmap
import os
import random
import time
from pathlib import Path

import pytest

from conftest import KvfsMount

SEED = int(os.environ.get("KVFS_FSX_SEED", "20261204"))
OPS = int(os.environ.get("KVFS_FSX_OPS", "100000"))
FILES = 6
MAX_LEN = 2 << 20  # per file; the L2 (4 MiB) holds about two of them, L3 holds all
MAX_OP = 128 << 10
PAGE = mmap.PAGESIZE
# operation weights, in the spirit of fsx's defaults (fallocate and hole punching: unsupported, see docs/posix.md)
WEIGHTS = {"read": 24, "write": 24, "mapread": 12, "mapwrite": 12, "truncate": 8, "uncached_read": 10,
           "closeopen": 6, "fsync": 1, "stat": 3}


class FsxFailure(AssertionError):
    pass


class Fsx:
    """The model (one bytearray per file) and the open descriptors of the files under test."""

    def __init__(self, directory: Path, seed: int) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.paths = [directory / f"fsx-{i}" for i in range(FILES)]
        self.model = [bytearray() for _ in range(FILES)]
        self.fds = [os.open(p, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644) for p in self.paths]
        self.log: collections.deque[str] = collections.deque(maxlen=60)
        self.counts = collections.Counter()
        self.ops_done = 0

    # -- helpers -------------------------------------------------------------------------------------------
    def fail(self, what: str) -> None:
        raise FsxFailure(f"fsx seed {self.seed}, operation {self.ops_done}: {what}\nlast operations:\n"
                         + "\n".join(self.log))

    def compare(self, i: int, off: int, got: bytes, how: str) -> None:
        want = bytes(self.model[i][off:off + len(got)])
        if got != want:
            bad = next(k for k in range(min(len(got), len(want)) + 1)
                       if k == min(len(got), len(want)) or got[k] != want[k])
            self.fail(f"{how} of file {i} at {off}+{len(got)}: first wrong byte at {off + bad} "
                      f"(got {got[bad:bad + 8].hex()}, model {want[bad:bad + 8].hex()}), "
                      f"model size {len(self.model[i])}")

    def extent(self, i: int) -> tuple[int, int]:
        size = len(self.model[i])
        inside = size and self.rng.random() < 0.8  # mostly within the file, sometimes past its end
        off = self.rng.randrange(0, size) if inside else self.rng.randrange(0, MAX_LEN)
        length = self.rng.randrange(1, MAX_OP)
        return off, min(length, MAX_LEN - off)

    def payload(self, n: int) -> bytes:
        if self.rng.random() < 0.3:  # some compressible data too: other codecs, other stored sizes
            return bytes([self.rng.randrange(256)]) * n
        return self.rng.randbytes(n)

    # -- operations ----------------------------------------------------------------------------------------
    def op_read(self, i: int) -> None:
        off, n = self.extent(i)
        self.log.append(f"read {i} {off}+{n}")
        self.compare(i, off, os.pread(self.fds[i], n, off), "read")

    def op_uncached_read(self, i: int) -> None:
        os.posix_fadvise(self.fds[i], 0, 0, os.POSIX_FADV_DONTNEED)  # the daemon answers, not the page cache
        off, n = self.extent(i)
        self.log.append(f"uncached_read {i} {off}+{n}")
        self.compare(i, off, os.pread(self.fds[i], n, off), "uncached read")

    def op_write(self, i: int) -> None:
        off, n = self.extent(i)
        data = self.payload(n)
        self.log.append(f"write {i} {off}+{n}")
        if os.pwrite(self.fds[i], data, off) != n:
            self.fail("short write")
        m = self.model[i]
        if len(m) < off:
            m.extend(bytes(off - len(m)))
        m[off:off + n] = data

    def op_truncate(self, i: int) -> None:
        size = self.rng.randrange(0, MAX_LEN)
        self.log.append(f"truncate {i} {len(self.model[i])} -> {size}")
        os.ftruncate(self.fds[i], size)
        m = self.model[i]
        del m[size:]
        m.extend(bytes(size - len(m)))

    def op_mapread(self, i: int) -> None:
        size = len(self.model[i])
        if size == 0:
            return self.op_write(i)
        off = self.rng.randrange(0, size)
        n = min(self.rng.randrange(1, MAX_OP), size - off)
        start = off - off % PAGE
        self.log.append(f"mapread {i} {off}+{n}")
        with mmap.mmap(self.fds[i], off + n - start, mmap.MAP_SHARED, mmap.PROT_READ, offset=start) as mm:
            got = mm[off - start:]
        self.compare(i, off, got, "mmap read")

    def op_mapwrite(self, i: int) -> None:
        off, n = self.extent(i)
        m = self.model[i]
        if off + n > len(m):  # a mapping cannot grow the file: extend it first, as fsx does
            os.ftruncate(self.fds[i], off + n)
            m.extend(bytes(off + n - len(m)))
        start = off - off % PAGE
        data = self.payload(n)
        sync = self.rng.random() < 0.5
        self.log.append(f"mapwrite {i} {off}+{n}{' msync' if sync else ''}")
        with mmap.mmap(self.fds[i], off + n - start, mmap.MAP_SHARED, offset=start) as mm:
            mm[off - start:] = data
            if sync:
                mm.flush()
        m[off:off + n] = data

    def op_closeopen(self, i: int) -> None:
        self.log.append(f"closeopen {i}")
        os.close(self.fds[i])  # commits: a new object, which the mover may then move
        self.fds[i] = os.open(self.paths[i], os.O_RDWR)

    def op_fsync(self, i: int) -> None:
        self.log.append(f"fsync {i}")
        os.fsync(self.fds[i])  # commits and moves the file to the persistent tier

    def op_stat(self, i: int) -> None:
        self.log.append(f"stat {i}")
        size = os.fstat(self.fds[i]).st_size
        if size != len(self.model[i]):
            self.fail(f"file {i} has size {size}, the model {len(self.model[i])}")

    def run(self, n: int) -> None:
        names = list(WEIGHTS)
        weights = [WEIGHTS[k] for k in names]
        for self.ops_done in range(n):
            name = self.rng.choices(names, weights)[0]
            i = self.rng.randrange(FILES)
            try:
                getattr(self, f"op_{name}")(i)
            except OSError as e:
                self.fail(f"{name} on file {i}: {e!r}")
            self.counts[name] += 1

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)

    def verify_files(self, how: str) -> None:
        for i, path in enumerate(self.paths):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                data = b"".join(iter(lambda: os.read(fd, 1 << 20), b""))
            finally:
                os.close(fd)
            if len(data) != len(self.model[i]):
                self.fail(f"{how}: file {i} has {len(data)} bytes, the model {len(self.model[i])}")
            self.compare(i, 0, data, how)


@pytest.mark.slow
def test_fsx_random_operations_against_a_model(make_mount):
    m: KvfsMount = make_mount()
    m.start("--l3", f"{m.root / 'fsx-l3'}:512M", l2_size="4M")
    fsx = Fsx(m.mountpoint, SEED)
    started = time.monotonic()
    try:
        fsx.run(OPS)
    finally:
        fsx.close()
    elapsed = time.monotonic() - started
    print(f"fsx: {OPS} operations in {elapsed:.1f} s, seed {SEED}: {dict(fsx.counts)}")
    fsx.verify_files("final read")
    stats = m.stats()
    l2, l3 = stats["tiers"]["L2"], stats["tiers"]["L3"]
    print(f"moves: L2 demoted {l2['demoted_files']}, promoted to L2 {l2['promoted_files']}")
    assert l2["demoted_files"] > 0 and l2["promoted_files"] > 0, "files must move between tiers during the run"
    assert l2["evicted_files"] == l3["evicted_files"] == 0  # L3 holds everything: nothing may be lost
    assert stats["errors"] == 0 and stats["checksum_failures"] == 0 and stats["commit_failures"] == 0
    m.check_accounting()
    m.stop()
    m.start(*m.args)
    fsx.verify_files("read after a remount")
