"""systemd's readiness protocol (sd_notify): tell the service manager when the mount is live and when it stops.

A unit with Type=notify sets $NOTIFY_SOCKET to a datagram socket; the daemon sends newline-separated
KEY=VALUE fields to it. Without the variable (run by hand, by mount(8), by tests) every call is a no-op.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger("kvfs")


def notify(*fields: str) -> bool:
    """Send fields such as "READY=1", "STOPPING=1", "STATUS=…" to $NOTIFY_SOCKET. True if sent; a failure
    is logged, never raised: the service manager being unreachable must not take the mount down."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):  # an abstract socket: no file, the name starts with a NUL byte
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.sendto("\n".join(fields).encode(), address)
    except OSError as e:
        log.warning("sd_notify to %s failed: %s", os.environ["NOTIFY_SOCKET"], e)
        return False
    return True
