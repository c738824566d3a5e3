"""Route what native libraries write to file descriptor 2 into the log.

QATzip prints lines such as "[Error] ... Error no hardware, switch to SW if permitted" to stderr for every
session and call on a machine without a QAT device. Raw, they look like kvfs errors in the daemon's log;
routed through logging they are attributed ("kvfs.native: …"): the known software-fallback notices once at
INFO and then at DEBUG (they repeat with every request), anything else at WARNING. Python's own logging
keeps writing to the original stderr.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading

log = logging.getLogger("kvfs.native")

# QATzip's notices on a host without a device (expected in software-fallback mode)
KNOWN_NOTICES = re.compile(r"no hardware|qz_init_status|Cannot open /dev/vfio|Pipe to stdout was broken|"
                           r"switch to SW")
_installed = False


def capture() -> None:
    """Replace fd 2 by a pipe whose lines are logged; idempotent."""
    global _installed
    if _installed:
        return
    _installed = True
    original = os.fdopen(os.dup(2), "w", buffering=1, errors="replace")
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream in (sys.stderr, sys.__stderr__):
            handler.setStream(original)
    sys.stderr = original
    read_fd, write_fd = os.pipe()
    os.dup2(write_fd, 2)
    os.close(write_fd)
    threading.Thread(target=_forward, args=(read_fd,), name="native-stderr", daemon=True).start()


def _forward(read_fd: int) -> None:
    notices = 0
    with os.fdopen(read_fd, "r", errors="replace") as pipe:
        for line in pipe:
            line = line.rstrip()
            if not line:
                continue
            if not KNOWN_NOTICES.search(line):
                log.warning("%s", line)
                continue
            notices += 1
            if notices == 1:
                log.info("%s (QATzip's notices repeat with every request: further ones at DEBUG)", line)
            else:
                log.debug("%s", line)
