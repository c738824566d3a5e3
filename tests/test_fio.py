"""fio against a real mount, with data verification (crc32c in every block).

Every workload is checked three ways: fio's own verify phase right after writing (do_verify=1), a second
`verify_only` pass with O_DIRECT reads (so the data comes from the daemon, not the page cache), and — after an
unmount and a fresh mount — a third `verify_only` pass that reads the committed objects. fio must exit 0 with
`error == 0` for every job; the daemon must stay alive and log no errors (the fixture checks the log), and the
tier's capacity accounting must match the objects on disk.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

FIO = shutil.which("fio") or "fio"  # missing fio fails the test: tools/install.sh installs it
pytestmark = [
    pytest.mark.slow,
]

MiB = 1 << 20


def run_fio(kvfs, name: str, *opts: str, timeout: float = 120.0) -> list[dict]:
    """Run one fio job (possibly numjobs > 1) in the mount; return its per-job JSON results."""
    out = kvfs.root / f"fio-{name}-{len(list(kvfs.root.glob(f'fio-{name}-*.json')))}.json"
    cmd = [FIO, f"--name={name}", f"--directory={kvfs.mountpoint}", "--fallocate=none",
           "--verify=crc32c", "--verify_fatal=1", "--verify_state_save=0", "--output-format=json",
           f"--output={out}", *opts]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=kvfs.root)
    text = out.read_text(errors="replace") if out.exists() else ""
    # fio writes its warnings ("fio: ...") into the --output file ahead of the JSON document
    start = text.find("\n{") + 1 if not text.startswith("{") else 0
    context = (f"fio {' '.join(cmd[1:])}\nexit {proc.returncode}\nstderr:\n{proc.stderr[-3000:]}\n"
               f"stdout:\n{proc.stdout[-2000:]}\noutput:\n{text[:start][-2000:]}\n"
               f"--- kvfs log ---\n{kvfs.log_text()[-4000:]}")
    assert proc.returncode == 0, context
    assert kvfs.alive(), "kvfs died during fio\n" + context
    try:
        jobs = json.loads(text[start:])["jobs"]
    except (ValueError, KeyError) as e:
        raise AssertionError(f"unparsable fio output ({e})\n{context}") from None
    assert jobs, context
    for job in jobs:
        assert job["error"] == 0, f"job {job['jobname']} error {job['error']}\n{context}"
    return jobs


def total(jobs: list[dict], direction: str) -> int:
    return sum(j[direction]["io_bytes"] for j in jobs)


def remount(kvfs) -> None:
    code = kvfs.stop()
    assert code == 0, f"kvfs exited with {code}\n{kvfs.log_text()[-4000:]}"
    kvfs.start(*kvfs.args)


def check_accounting(kvfs) -> None:
    """No leaked or missing objects: the tier's counters equal what is on disk, nothing is left dirty."""
    stats = kvfs.stats()
    assert stats["errors"] == 0 and stats["checksum_failures"] == 0 and stats["commit_failures"] == 0, stats
    assert stats["open_files"] == 0 and stats["dirty_bytes"] == 0, stats
    kvfs.check_accounting(stats)


def write_verify_reread(kvfs, name: str, opts: list[str], *, numjobs: int, size: int) -> None:
    """Write with fio's verify phase, re-verify with O_DIRECT, remount, verify again from the objects."""
    jobs = run_fio(kvfs, name, *opts, f"--numjobs={numjobs}", "--do_verify=1")
    assert len(jobs) == numjobs
    assert total(jobs, "write") >= numjobs * size
    assert total(jobs, "read") == numjobs * size, "fio's verify phase did not read everything back"

    # verify_only replays the same job (same seeds) and only reads; O_DIRECT bypasses the page cache
    base = [o for o in opts if not o.startswith(("--ioengine", "--iodepth", "--fsync", "--direct"))]
    jobs = run_fio(kvfs, name, *base, f"--numjobs={numjobs}", "--verify_only", "--direct=1")
    assert total(jobs, "read") == numjobs * size

    remount(kvfs)
    for i in range(numjobs):
        assert os.path.getsize(kvfs.path(f"{name}.{i}.0")) == size
    jobs = run_fio(kvfs, name, *base, f"--numjobs={numjobs}", "--verify_only")
    assert total(jobs, "read") == numjobs * size
    check_accounting(kvfs)


def test_sequential_write_verify(kvfs):
    """Three files of 32 MiB written sequentially in 1 MiB blocks (the frame size)."""
    size = 32 * MiB
    write_verify_reread(kvfs, "seq", ["--rw=write", "--bs=1M", f"--size={size}"], numjobs=3, size=size)


RANDOM_VARIANTS = {
    # the plain case: buffered psync writes, committed on close
    "psync": [],
    # O_DIRECT async writes, several in flight per file
    "libaio-direct": ["--ioengine=libaio", "--iodepth=8", "--direct=1"],
    # writes through a shared mapping: written back by the kernel, committed at flush/release
    "mmap": ["--ioengine=mmap"],
    # an fsync every few writes: repeated commits that reuse the clean frames of the previous object
    "fsync": ["--fsync=6"],
}


@pytest.mark.parametrize("variant", RANDOM_VARIANTS)
def test_random_write_verify(kvfs, variant):
    """Random 4k..128k writes over 24 MiB per file, two jobs, every block verified."""
    size = 24 * MiB
    opts = ["--rw=randwrite", "--bsrange=4k-128k", f"--size={size}", *RANDOM_VARIANTS[variant]]
    write_verify_reread(kvfs, "rnd", opts, numjobs=2, size=size)


def test_unaligned_random_write_verify(kvfs):
    """Block sizes and offsets that are multiples of 3000 bytes: every write straddles pages, many straddle
    frames, and the file ends in a partial frame."""
    size = 3000 * 4567  # 13.07 MiB, not a multiple of 4 KiB or of the frame size
    opts = ["--rw=randwrite", "--bsrange=3000-72000", f"--size={size}"]
    write_verify_reread(kvfs, "odd", opts, numjobs=2, size=size)


def test_random_overwrite_of_committed_files(kvfs):
    """Random rewrites, with periodic fsync, of files that already have committed objects: each commit mixes
    dirty frames with frames copied from the previous object."""
    size = 16 * MiB
    run_fio(kvfs, "ow", "--rw=write", "--bs=1M", f"--size={size}", "--numjobs=2", "--do_verify=1")
    opts = ["--rw=randwrite", "--bsrange=4k-64k", f"--size={size}", "--fsync=16", "--overwrite=1"]
    write_verify_reread(kvfs, "ow", opts, numjobs=2, size=size)


def test_random_read_write_mix_verify(kvfs):
    """randrw with verify_backlog: reads of freshly written, not yet committed blocks interleave with writes."""
    size = 16 * MiB
    jobs = run_fio(kvfs, "mix", "--rw=randrw", "--bsrange=4k-128k", f"--size={size}", "--numjobs=2",
                   "--do_verify=1", "--verify_backlog=16")
    assert total(jobs, "write") > 0 and total(jobs, "read") > 0
    check_accounting(kvfs)
