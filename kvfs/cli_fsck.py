"""What `kvfs fsck` does at the terminal: start the live job and poll it, or run the offline check; draw the
progress bar (on a terminal) and print the report. Returns the exit status (kvfs/fsck.py EXIT_*)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import click
from rich.console import Console
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn
from rich.table import Table

from .config import Config
from .console import table_console
from .fsck import EXIT_CORRECTED, EXIT_FAILED, KINDS
from .fsck_live import XA_FSCK

POLL_S = 0.2


def live(mountpoint: Path, repair: bool, as_json: bool) -> int:
    """Ask the mount's daemon to run the check while it serves; poll its status file until it is done."""
    control = mountpoint / ".kvfs"
    status_file = control / "fsck"
    try:
        previous = json.loads(status_file.read_bytes())["id"]
        os.setxattr(control, XA_FSCK, b"repair" if repair else b"check")
    except FileNotFoundError:
        return _fail(f"{mountpoint} is not a mounted kvfs (for an unmounted one: kvfs fsck --config FILE)")
    except OSError as e:
        reason = {errno.EBUSY: "an fsck is already running there",
                  errno.EACCES: "only the daemon's user or root may run it"}.get(e.errno, e.strerror)
        return _fail(f"{mountpoint}: {reason}")
    with _progress_bar(as_json) as show:
        while True:
            doc = json.loads(status_file.read_bytes())
            if doc["id"] != previous + 1:
                return _fail(f"{mountpoint}: another fsck replaced this one")
            show(doc)
            if doc["state"] != "running":
                break
            time.sleep(POLL_S)
    _print(doc, as_json)
    if doc["state"] == "failed":
        return _fail(f"{mountpoint}: the check did not finish: {doc['error']}")
    return doc["exit_status"]


def offline(config: Config, repair: bool, as_json: bool) -> int:
    from .fsck_offline import FsckError, run_offline

    with _progress_bar(as_json) as show:
        try:
            report = run_offline(config, repair, lambda r: show(r.to_dict()))
        except FsckError as e:
            return _fail(str(e))
    _print({"state": "done", **report.to_dict()}, as_json)
    return report.exit_status


def _fail(message: str) -> int:
    click.echo(f"kvfs fsck: {message}", err=True)
    return EXIT_FAILED


@contextlib.contextmanager
def _progress_bar(as_json: bool) -> Iterator:
    """A callable taking the status document: a progress bar over bytes on a terminal, nothing otherwise."""
    console = Console(stderr=True)
    if as_json or not console.is_terminal:
        yield lambda doc: None
        return
    with Progress(TextColumn("{task.description:<10}"), BarColumn(), TaskProgressColumn(),
                  TextColumn("{task.fields[objects]}"), TimeRemainingColumn(), console=console,
                  transient=True) as progress:
        task = progress.add_task("listing", total=None, objects="")

        def show(doc: dict) -> None:
            progress.update(task, description=doc.get("phase", ""), total=doc.get("bytes_total") or None,
                            completed=doc.get("bytes_checked", 0),
                            objects=f"{doc.get('objects_checked', 0)}/{doc.get('objects_total', 0)} objects")

        yield show


def _print(doc: dict, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(doc, indent=2))
        return
    console = table_console()
    unavailable = f", {doc['unavailable']} in a directory that is down" if doc.get("unavailable") else ""
    console.print(f"kvfs fsck ({doc['mode']}): {doc['objects_checked']} of {doc['objects_total']} objects "
                  f"({doc['bytes_checked']:,} bytes) checked, {doc['skipped']} busy files skipped{unavailable}")
    if doc.get("directories"):
        dirs = Table("tier", "directory", "state", "objects", "bytes", "not checked (down)", title="directories")
        for d in doc["directories"]:
            state = f"{d['state']} ({d['reason']})" if d.get("reason") else d["state"]
            dirs.add_row(d["tier"], d["path"], state, str(d["objects"]), f"{d['bytes']:,}", str(d["unavailable"]))
        console.print(dirs)
    findings = doc["findings"]
    if findings:
        table = Table("kind", "tier", "object", "inode", "path", "detail", "repair", title="findings")
        for f in findings:
            tier = f"{f['tier']} {f['directory']}" if f.get("directory") else f["tier"] or "-"
            table.add_row(f["kind"], tier, f["object_id"] or "-", str(f["ino"] or "-"),
                          f["path"] or "-", f["detail"], f["repair"] or "-")
        console.print(table)
    counts = Table("kind", "found", "repaired", title="summary")
    for kind in KINDS:
        repaired = sum(1 for f in findings if f["kind"] == kind and f["repair"])
        counts.add_row(kind, str(doc["counts"][kind]), str(repaired))
    console.print(counts)
    console.print(_verdict(doc))


def _verdict(doc: dict) -> str:
    found, repaired = len(doc["findings"]), doc["repaired"]
    if doc.get("state") == "failed":
        return "the check did not finish"
    down = [d["path"] for d in doc.get("directories", []) if d["state"] == "down"]
    if down or doc.get("unavailable"):
        why = f"{', '.join(down)} down" if down else "I/O errors"
        return (f"{found - repaired} of {found} findings left uncorrected; {doc.get('unavailable', 0)} files not "
                f"checked ({why})")
    if not found:
        return "clean"
    if doc["exit_status"] == EXIT_CORRECTED:
        return f"{found} findings, all repaired"
    hint = "" if doc["mode"] == "repair" else " (run with --repair to fix them)"
    return f"{found - repaired} of {found} findings left uncorrected{hint}"

