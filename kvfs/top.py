"""`kvfs top MOUNT`: a live terminal view of a mount's .kvfs/stats, refreshed every few seconds.

Per tier: fill, files, hits and hit rate, moves with their rates since the last refresh, the remote tiers'
circuit state; for the mount: read/write throughput, misses, checksum failures, errors, codec and ratio.
On a terminal the view redraws in place (rich.live); elsewhere (a pipe, a log) it is printed each time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from pathlib import Path

from rich.console import Console, Group
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table

from .metrics import tier_misses
from .stats import human_bytes

UNLIMITED = 1 << 60
MOVES = ("demoted", "promoted", "evicted")


class NotAMount(Exception):
    """MOUNT has no readable .kvfs/stats."""


@dataclasses.dataclass(frozen=True)
class Sample:
    doc: dict
    at: float  # time.monotonic() when read


def read_sample(mountpoint: Path) -> Sample:
    try:
        raw = (mountpoint / ".kvfs" / "stats").read_bytes()
    except OSError as e:
        raise NotAMount(f"{mountpoint} does not look like a kvfs mount: {e.strerror}") from None
    return Sample(json.loads(raw), time.monotonic())


def per_second(now: Sample, before: Sample | None, *path: str) -> float | None:
    """The rate of a counter (doc[path[0]][path[1]]…) since the previous sample, or for the first one since
    the mount started (the daemon's counters start at zero)."""
    if before is None:
        elapsed, base = now.doc.get("uptime_s", 0), 0
    else:
        elapsed, base = now.at - before.at, _get(before.doc, path)
    if elapsed <= 0:
        return None
    return max(0.0, (_get(now.doc, path) - base) / elapsed)


def _get(doc: dict, path: tuple[str, ...]) -> float:
    for key in path:
        doc = doc.get(key, {}) if isinstance(doc, dict) else {}
    return doc if isinstance(doc, (int, float)) else 0


def _rate(value: float | None, unit: str = "/s") -> str:
    if value is None:
        return "-"
    return f"{human_bytes(value)}/s" if unit == "B/s" else f"{value:.1f}{unit}"


def _with_rate(count: int, rate: float | None) -> str:
    return f"{count} ({_rate(rate)})"


def tier_table(now: Sample, before: Sample | None) -> Table:
    """One column per tier (fastest first), one row per figure: fits 80 columns with three tiers."""
    doc = now.doc
    tiers = doc["tiers"]
    misses = tier_misses(doc)
    draining = set(doc.get("mover", {}).get("draining", []))
    table = Table(title=f"kvfs top: {doc['mountpoint']} (pid {doc['pid']}, up {doc['uptime_s']:.0f} s)")
    table.add_column("", no_wrap=True)
    for name in tiers:
        table.add_column(name, justify="right", no_wrap=True)

    def row(label: str, cell) -> None:
        table.add_row(label, *(cell(name, t) for name, t in tiers.items()))

    row("fill", lambda _, t: ProgressBar(total=t["capacity_bytes"] or 1, completed=t["used_bytes"], width=12))
    row("used", lambda _, t: f"{human_bytes(t['used_bytes'])} ({_percent(t['used_bytes'], t['capacity_bytes'])})")
    row("capacity", lambda _, t: "unlimited" if t["capacity_bytes"] >= UNLIMITED else human_bytes(t["capacity_bytes"]))
    row("files", lambda _, t: str(t["files"]))
    row("hits", lambda _, t: str(t["hits"]))
    row("hit rate", lambda name, t: _percent(t["hits"], t["hits"] + misses[name]))
    row("read", lambda name, _: _rate(per_second(now, before, "tiers", name, "read_bytes"), "B/s"))
    for move in MOVES:
        row(move, lambda name, t, m=move: _with_rate(t[f"{m}_files"],
                                                     per_second(now, before, "tiers", name, f"{m}_files")))
    row("state", lambda name, t: _state(t, name in draining))
    return table


def _percent(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


def _state(tier: dict, draining: bool) -> str:
    """"ok", "draining", or a remote tier's circuit: "closed" / "OPEN" and its failures."""
    parts = []
    if "breaker" in tier:
        parts.append(f"{'OPEN' if tier['breaker'] == 'open' else tier['breaker']}, {tier.get('failures', 0)} fail")
    if draining:
        parts.append("draining")
    return ", ".join(parts) or "ok"


def mount_table(now: Sample, before: Sample | None) -> Table:
    doc = now.doc
    grid = Table(show_header=False, box=None, padding=(0, 2))
    for _ in range(2):
        grid.add_column(justify="left", no_wrap=True)
        grid.add_column(justify="right", no_wrap=True)
    ratio = doc.get("compression_ratio")
    codec = doc["codec"] + (f" ({doc['qat']['mode']})" if doc.get("qat", {}).get("mode") != "not loaded" else "")
    cells = [
        ("read", _rate(per_second(now, before, "bytes_read"), "B/s")),
        ("write", _rate(per_second(now, before, "bytes_written"), "B/s")),
        ("read requests", _rate(per_second(now, before, "read_requests"))),
        ("write requests", _rate(per_second(now, before, "write_requests"))),
        ("lookup misses", _with_rate(doc.get("lookup_misses", 0), per_second(now, before, "lookup_misses"))),
        ("commits", _with_rate(doc["commits"], per_second(now, before, "commits"))),
        ("checksum failures", str(doc["checksum_failures"])),
        ("errors", str(doc["errors"])),
        ("codec", codec),
        ("ratio", "-" if ratio is None else f"{ratio:.3f}"),
        ("open files", str(doc["open_files"])),
        ("dirty", human_bytes(doc["dirty_bytes"])),
        ("mover backlog", human_bytes(doc.get("mover", {}).get("backlog_bytes", 0))),
        ("failed moves", str(doc.get("move_failures", 0))),
    ]
    for left, right in zip(cells[::2], cells[1::2]):
        grid.add_row(*left, *right)
    return grid


def view(now: Sample, before: Sample | None) -> Group:
    return Group(tier_table(now, before), mount_table(now, before))


def run(mountpoint: Path, interval: float, count: int | None, plain: bool) -> None:
    """Refresh every `interval` seconds, `count` times (None: until interrupted). Raises NotAMount."""
    console = Console()
    live = console.is_terminal and not plain
    before: Sample | None = None
    shown = 0
    with Live(console=console, auto_refresh=False) if live else contextlib.nullcontext() as screen:
        while count is None or shown < count:
            if shown:
                time.sleep(interval)
            now = read_sample(mountpoint)
            if screen is None:
                console.print(view(now, before))
            else:
                screen.update(view(now, before), refresh=True)
            before, shown = now, shown + 1
