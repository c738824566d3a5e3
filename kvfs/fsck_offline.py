"""kvfs fsck on an unmounted state directory (`kvfs fsck --config FILE`): the check of kvfs/fsck.py with nothing
else running. It takes the daemon's own lock on STATE_DIR/lock, so it never runs beside a mount of that state
(which is checked live instead: `kvfs fsck MOUNTPOINT`). A check reads a private L4 without claiming it; a repair
claims it first, as a mount does (kvfs/owner.py), and is refused while another mount owns it."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable

import trio

from . import owner
from .config import Config
from .daemon import open_tiers
from .fsck import Checker, Host, Report
from .index import Index
from .store import Store


class FsckError(Exception):
    """The check cannot run: the message says why (mounted, no state, a tier unreachable)."""


def run_offline(config: Config, repair: bool, on_progress: Callable[[Report], None] | None = None) -> Report:
    lock_fd = _lock_state_dir(config)
    try:
        if not config.index_path.is_file():
            raise FsckError(f"no kvfs index in {config.state_dir}")
        index = Index(config.index_path)
        try:
            try:
                tiers = open_tiers(config)
                claim = owner.claim_l4(tiers, config.state_dir, config.l4_lease_s, None) if repair else None
            except SystemExit as e:  # a remote tier does not answer, or another mount owns L4: the reason
                raise FsckError(str(e.code).removeprefix("kvfs: ")) from None
            store = Store(tiers)
            checker = Checker(index, store, Host(index, store), repair, on_progress)
            try:
                return trio.run(checker.run)
            except OSError as e:
                raise FsckError(f"the check could not finish: {e}") from None
            finally:
                if claim is not None:
                    claim.release()
        finally:
            index.close()
    finally:
        os.close(lock_fd)


def _lock_state_dir(config: Config) -> int:
    """The lock a mounted daemon holds on its state directory (daemon._lock_state_dir), taken or refused."""
    if not config.state_dir.is_dir():
        raise FsckError(f"no kvfs state directory {config.state_dir}")
    fd = os.open(config.state_dir / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise FsckError(f"{config.state_dir} is mounted: run kvfs fsck {config.mountpoint or 'MOUNTPOINT'} "
                        "instead") from None
    return fd
