"""The console the CLI prints tables on."""

from __future__ import annotations

from rich.console import Console

UNBOUNDED_WIDTH = 10_000  # wider than any table we print: off a terminal, tables take their natural width


def table_console() -> Console:
    """A console for stdout: on a terminal, its width; elsewhere (a pipe, a file) rich would assume 80 columns
    and cut or wrap cells such as tier paths, so the width is left unbounded and every cell prints whole."""
    console = Console()
    return console if console.is_terminal else Console(width=UNBOUNDED_WIDTH)
