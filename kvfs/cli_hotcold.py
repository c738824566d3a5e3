"""`kvfs pin|unpin|demote|prefetch|drop|idle PATH… [-r]`: the hot/cold API (kvfs.client) on the command line."""

from __future__ import annotations

import sys
from collections.abc import Callable

import click

from . import client

RECURSIVE = click.option("-r", "--recursive", is_flag=True, help="directories: every file of the tree")
PATHS = click.argument("paths", nargs=-1, required=True, type=click.Path(exists=True))


def _run(action: Callable[[], int], what: str) -> None:
    try:
        n = action()
    except client.KvfsError as e:
        raise click.ClickException(e.strerror) from None
    click.echo(f"{what} {n} {'path' if n == 1 else 'paths'}")


def _with_progress(label: str, call: Callable[[client.Progress | None], int]) -> int:
    """A progress bar on a terminal (large trees take a while: each file is a move); none otherwise."""
    if not sys.stderr.isatty():
        return call(None)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    with Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(), transient=True,
                  console=_stderr_console()) as bar:
        task = bar.add_task(label, total=None)
        return call(lambda done, total: bar.update(task, completed=done, total=total))


def _stderr_console():
    from rich.console import Console

    return Console(stderr=True)


@click.command()
@RECURSIVE
@PATHS
def pin(paths, recursive):
    """Keep files hot: in L2, never demoted or evicted (all pins may fill L2 up to its high watermark)."""
    _run(lambda: client.pin(paths, recursive=recursive), "pinned")


@click.command()
@RECURSIVE
@PATHS
def unpin(paths, recursive):
    """Let the mover demote and evict files again."""
    _run(lambda: client.unpin(paths, recursive=recursive), "unpinned")


@click.command()
@click.option("--to", "tier", required=True, metavar="TIER", help="the tier to move to: L3, L4 (or L2)")
@RECURSIVE
@PATHS
def demote(paths, tier, recursive):
    """Move files to TIER now (pinned files in a tree are skipped)."""
    _run(lambda: _with_progress(f"to {tier}", lambda p: client.demote(paths, tier, recursive=recursive,
                                                                      progress=p)), f"moved to {tier}:")


@click.command()
@RECURSIVE
@PATHS
def prefetch(paths, recursive):
    """Promote files to the fastest tier in the background."""
    _run(lambda: _with_progress("prefetch", lambda p: client.prefetch(paths, recursive=recursive, progress=p)),
         "prefetching")


@click.command()
@RECURSIVE
@PATHS
def drop(paths, recursive):
    """Remove files from every tier now (their names too; directories stay)."""
    _run(lambda: _with_progress("drop", lambda p: client.drop(paths, recursive=recursive, progress=p)),
         "dropped")


@click.command()
@click.option("--after", required=True, metavar="DURATION",
              help="not read for DURATION (90s, 10m, 2h), a file goes down a tier; off = never; default = the mount's")
@RECURSIVE
@PATHS
def idle(paths, after, recursive):
    """Set the idle policy of files or directory trees (new entries of a directory inherit it)."""
    value = None if after == "default" else after
    _run(lambda: client.set_idle(paths, value, recursive=recursive), f"idle policy {after} on")


COMMANDS = (pin, unpin, demote, prefetch, drop, idle)
