"""mount.fuse.kvfs: the helper util-linux mount(8) runs for `mount -t fuse.kvfs` and fuse.kvfs lines in /etc/fstab.

mount(8) calls `mount.fuse.kvfs SOURCE MOUNTPOINT [-sfnv] [-N NS] [-o OPTIONS] [-t TYPE]`. Each kvfs option in
OPTIONS becomes a `kvfs mount` option (`l2=/dev/shm/a:1G` → `--l2 /dev/shm/a:1G`, `allow_other` →
`--allow-other`); generic mount options (rw, noauto, nofail, x-systemd.*, …) are mount(8)'s business and
ignored. The kvfs options are read from the `kvfs mount` click command, so a new one works here unchanged.
SOURCE is free text (conventionally "kvfs").
"""

from __future__ import annotations

import getopt
import os
import subprocess
import sys
from dataclasses import dataclass, field

import click

from .cli import mount as mount_command

PROG = "mount.fuse.kvfs"
# options mount(8) handles, adds (rw, and noexec,nosuid,nodev for `user`), or that mean nothing to kvfs
GENERIC_OPTIONS = frozenset({
    "defaults", "rw", "auto", "noauto", "user", "nouser", "users", "owner", "group", "nofail", "_netdev",
    "dev", "nodev", "suid", "nosuid", "exec", "noexec", "async", "atime", "noatime", "relatime", "norelatime",
    "strictatime", "nostrictatime", "lazytime", "nolazytime", "diratime", "nodiratime", "loud", "silent",
})
GENERIC_PREFIXES = ("x-", "X-", "comment=")
# `kvfs mount` options that make no sense here: the helper must return once mounted
EXCLUDED = frozenset({"foreground"})
# mount(8) runs helpers with an empty environment; kvfs and libfuse may need to find programs
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# mount(8)'s exit statuses
EX_USAGE, EX_FAIL = 1, 32


class HelperError(Exception):
    """A bad invocation: the message is shown by mount(8) as is."""


@dataclass
class Invocation:
    mountpoint: str
    kvfs_args: list[str] = field(default_factory=list)
    fake: bool = False  # -f: do everything but mount
    verbose: bool = False


def kvfs_options() -> dict[str, tuple[str, bool]]:
    """Mount option name (underscores) → (`kvfs mount` option, whether it takes a value)."""
    table = {}
    for param in mount_command.params:
        if not isinstance(param, click.Option) or param.name in EXCLUDED:
            continue
        for opt in [*param.opts, *param.secondary_opts]:
            if opt.startswith("--"):
                table[opt[2:].replace("-", "_")] = (opt, not param.is_flag)
    return table


def split_options(text: str) -> list[str]:
    """'a=1,b="x,y",c' → ['a=1', 'b=x,y', 'c']: commas inside double quotes (libmount's quoting) do not split."""
    items, current, quoted = [], [], False
    for ch in text:
        if ch == '"':
            quoted = not quoted
        elif ch == "," and not quoted:
            items.append("".join(current))
            current = []
        else:
            current.append(ch)
    if quoted:
        raise HelperError(f"unbalanced quote in options: {text}")
    items.append("".join(current))
    return [item for item in items if item]


def translate(options: list[str], sloppy: bool = False) -> list[str]:
    """Mount options → `kvfs mount` arguments; HelperError on one kvfs does not know (ignored with -s)."""
    known = kvfs_options()
    args: list[str] = []
    for item in options:
        key, has_value, value = item.partition("=")
        if key == "ro":  # refused even with -s: silently mounting writable would be worse
            raise HelperError("option ro: kvfs has no read-only mode; mount it rw")
        if key in GENERIC_OPTIONS or item.startswith(GENERIC_PREFIXES):
            continue
        name = key.replace("-", "_")
        if name not in known:
            if sloppy:
                print(f"{PROG}: ignoring unknown option {key}", file=sys.stderr)
                continue
            raise HelperError(f"unknown option {key} (kvfs options: {', '.join(sorted(known))})")
        flag, takes_value = known[name]
        if takes_value and not has_value:
            raise HelperError(f"option {key} needs a value: {key}=…")
        if not takes_value and has_value:
            raise HelperError(f"option {key} is a flag and takes no value")
        args += [flag, value] if takes_value else [flag]
    return args


def parse(argv: list[str]) -> Invocation:
    """mount(8)'s helper command line → what to run."""
    try:
        opts, positional = getopt.gnu_getopt(argv, "sfnvo:N:t:")
    except getopt.GetoptError as e:
        raise HelperError(str(e)) from None
    if len(positional) != 2:
        raise HelperError(f"usage: {PROG} SOURCE MOUNTPOINT [-sfnv] [-o OPTIONS]")
    flags = {flag for flag, _ in opts}
    if "-N" in flags:
        raise HelperError("mounting in another mount namespace (-N) is not supported")
    options = [item for flag, text in opts if flag == "-o" for item in split_options(text)]
    return Invocation(mountpoint=positional[1], kvfs_args=translate(options, sloppy="-s" in flags),
                      fake="-f" in flags, verbose="-v" in flags)


def main(argv: list[str] | None = None) -> int:
    try:
        call = parse(sys.argv[1:] if argv is None else argv)
    except HelperError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return EX_USAGE
    cmd = [sys.executable, "-m", "kvfs", "mount", call.mountpoint, *call.kvfs_args]
    if call.verbose or call.fake:
        print(f"{PROG}: {' '.join(cmd)}", file=sys.stderr)
    if call.fake:
        return 0
    env = {**os.environ, "PATH": os.environ.get("PATH") or DEFAULT_PATH}
    res = subprocess.run(cmd, env=env, stdin=subprocess.DEVNULL, stdout=None if call.verbose else subprocess.DEVNULL)
    if res.returncode == 0:
        return 0
    return EX_USAGE if res.returncode == click.UsageError.exit_code else EX_FAIL


if __name__ == "__main__":
    sys.exit(main())
