"""Which CPUs the connector's reader and writer threads run on.

vLLM on CPU binds each worker process to its compute cores (one OpenMP thread per core) and leaves the rest
of the machine (VLLM_CPU_NUM_OF_RESERVED_CPU) to the engine core and the frontend. Threads the connector
starts inherit that binding, so loads and saves — reading, checksums, decoding, copies in and out of the
paged cache — share the forward pass's cores. "auto" lets them run on the CPUs of the process that started
the worker, within the worker's NUMA nodes, where vLLM bound the worker to fewer; GPU workers, which vLLM does
not bind that way, are left as they are. "worker" (the default) keeps the binding: the reserved cores are
not idle either (the engine core polls for each step's results), and on 2 cores only "auto"'s gain for
concurrent loads was clear of the noise (docs/connector.md).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger("vllm.kvfs_connector")
NODES = Path("/sys/devices/system/node")


def parse_cpu_list(text: str) -> frozenset[int]:
    """'0-3,8' → {0, 1, 2, 3, 8} (the kernel's cpulist format); ValueError for anything else."""
    cpus: set[int] = set()
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ValueError(f"not a CPU list: {text!r} (expected e.g. 0-3,8)")
        lo, hi = int(first), int(last) if dash else int(first)
        if hi < lo:
            raise ValueError(f"not a CPU list: {text!r} ({part} runs backwards)")
        cpus.update(range(lo, hi + 1))
    return frozenset(cpus)


def format_cpu_list(cpus: frozenset[int]) -> str:
    """{0, 1, 2, 3, 8} → '0-3,8'."""
    runs: list[list[int]] = []
    for c in sorted(cpus):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)


def check(setting: str) -> None:
    """ValueError unless `setting` is "auto", "worker" or a CPU list."""
    if setting not in ("auto", "worker"):
        parse_cpu_list(setting)


def io_cpus(setting: str) -> frozenset[int] | None:
    """The CPUs for the connector's threads, or None to leave them on the worker's own. Call it in the worker
    after vLLM has bound it (its binding is what "auto" compares with)."""
    if setting == "worker":
        return None
    if setting != "auto":
        return parse_cpu_list(setting)
    mine = frozenset(os.sched_getaffinity(0))
    try:
        starter = frozenset(os.sched_getaffinity(os.getppid()))
    except OSError:  # the parent is gone or not ours to inspect
        return None
    wider = starter & numa_cpus(mine)  # tensor-parallel CPU workers each own a node: stay on ours
    return wider if wider > mine else None


def numa_cpus(cpus: frozenset[int], nodes: Path = NODES) -> frozenset[int]:
    """The CPUs of the NUMA nodes that hold any of `cpus` (all CPUs where the kernel shows no nodes)."""
    found: set[int] = set()
    for cpulist in nodes.glob("node[0-9]*/cpulist"):
        node = parse_cpu_list(cpulist.read_text().strip())
        if node & cpus:
            found |= node
    return frozenset(found) if found else frozenset(range(os.cpu_count() or 1)) | cpus


def pin_current_thread(cpus: frozenset[int] | None) -> None:
    """Move the calling thread (Linux: affinity is per thread) onto `cpus`; a thread pool's initializer."""
    if cpus is None:
        return
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as e:  # a CPU this process may not use: the thread stays where it was
        log.warning("kvfs connector: cannot move I/O threads to CPUs %s: %s", format_cpu_list(cpus), e)
