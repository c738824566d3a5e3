"""A kvfs fleet on one host: one network namespace per node, all reaching one Ceph RGW (tests/test_fleet.py,
tools/bench_fleet.py; docs/fleet.md). Also the chunks of real prompts that the fleet's nodes exchange.

    hub namespace:   bridge 10.77.0.1/24, the RGW forwarder's listening socket, the event subscriber
    node namespaces: 10.77.0.11, .12, … each on a veth whose other end is in the hub's bridge

RGW listens on 127.0.0.1 of the root namespace, which no node namespace can reach, and it must not listen
anywhere else. So a forwarder in this process listens inside the hub (its socket was created by a thread that
entered the hub: a socket keeps the namespace it was made in) and connects to RGW from the root namespace.
Nodes use AWS_ENDPOINT_URL=http://10.77.0.1:PORT. Nothing is ever bound outside namespaces made here, and the
namespace names carry a random tag, so two runs on one host do not meet.

Node processes run under `nsenter --net=/var/run/netns/NAME`: only the network namespace changes, so a FUSE
mount made there is visible from the host (`ip netns exec` would make it in a private mount namespace).
Requires root, iproute2 and nsenter (util-linux).
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import json
import os
import secrets
import socket
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)
T = TypeVar("T")


def enter(netns: str) -> None:
    """Move the calling thread (only it: namespaces are per thread) into a named network namespace."""
    fd = os.open(f"/var/run/netns/{netns}", os.O_RDONLY)
    try:
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {netns}: {os.strerror(err)}")
    finally:
        os.close(fd)


def run_in(netns: str, fn: Callable[[], T]) -> T:
    """fn() on a fresh thread inside `netns`; what it creates (sockets) stays in that namespace."""
    out: list = []

    def body() -> None:
        try:
            enter(netns)
            out.append((True, fn()))
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            out.append((False, e))

    t = threading.Thread(target=body)
    t.start()
    t.join()
    ok, value = out[0]
    if not ok:
        raise value
    return value


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class Fleet:
    """A hub namespace with a bridge, and one namespace per node veth'd into it. `up()`, then `down()`
    (always: it removes whatever exists of it)."""

    def __init__(self, nodes: list[str], subnet: str = "10.77.0") -> None:
        tag = secrets.token_hex(3)
        self.hub = f"kvfs-{tag}-hub"
        self.netns = {n: f"kvfs-{tag}-{n}" for n in nodes}
        self.hub_ip = f"{subnet}.1"
        self.ip = {n: f"{subnet}.{11 + i}" for i, n in enumerate(nodes)}

    def up(self) -> "Fleet":
        _ip("netns", "add", self.hub)
        _ip("-n", self.hub, "link", "set", "lo", "up")
        _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.hub, "addr", "add", f"{self.hub_ip}/24", "dev", "br0")
        _ip("-n", self.hub, "link", "set", "br0", "up")
        for i, (node, ns) in enumerate(self.netns.items()):
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")  # the daemon's own loopback (metrics, local clients)
            # both ends created inside the namespaces: no interface ever appears in the root namespace
            _ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", f"port{i}", "netns", self.hub)
            _ip("-n", self.hub, "link", "set", f"port{i}", "master", "br0")
            _ip("-n", self.hub, "link", "set", f"port{i}", "up")
            _ip("-n", ns, "addr", "add", f"{self.ip[node]}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
        return self

    def down(self) -> None:
        for ns in [*self.netns.values(), self.hub]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)

    def launcher(self, node: str) -> list[str]:
        """The command prefix that runs a program in a node's network namespace (and nothing else changed)."""
        return ["nsenter", f"--net=/var/run/netns/{self.netns[node]}"]

    def exists(self) -> list[str]:
        """The namespaces of this fleet that exist (empty after down())."""
        names = set(os.listdir("/var/run/netns")) if os.path.isdir("/var/run/netns") else set()
        return sorted(n for n in [*self.netns.values(), self.hub] if n in names)


class Hold:
    """Cut one upload short: the first request from `peer` whose bytes contain `marker` is forwarded up to its
    headers and `body_bytes` of its body; the rest of that connection is swallowed (the store waits for a body
    that never comes) until the client goes away, which closes the store's side mid-request."""

    def __init__(self, peer: str, marker: bytes, body_bytes: int) -> None:
        self.peer, self.marker, self.body_bytes = peer, marker, body_bytes
        self.held = threading.Event()  # set once the cut is in place
        self.closed = threading.Event()  # set once the store's side of that connection is closed
        self._taken = False
        self._lock = threading.Lock()

    def claim(self, peer: str, data: bytes) -> int | None:
        """Where the held request starts in `data`, if this connection is the one to cut."""
        if peer != self.peer:
            return None
        idx = data.find(self.marker)
        with self._lock:
            if idx < 0 or self._taken:
                return None
            self._taken = True
        return idx


class Forwarder:
    """TCP from `listen` (inside namespace `netns`) to `target` (the root namespace's loopback), a thread pair
    per connection. `hold()` arms a Hold for the next matching upload."""

    def __init__(self, netns: str, listen: tuple[str, int], target: tuple[str, int]) -> None:
        self.target = target
        self._server = run_in(netns, lambda: self._listen(listen))
        self._hold: Hold | None = None
        self._socks: set[socket.socket] = set()
        self._lock = threading.Lock()
        self.connections = 0
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    @staticmethod
    def _listen(addr: tuple[str, int]) -> socket.socket:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(addr)
        s.listen(128)
        return s

    def hold(self, peer: str, marker: bytes, body_bytes: int = 256 << 10) -> Hold:
        self._hold = Hold(peer, marker, body_bytes)
        return self._hold

    def close(self) -> None:
        self._server.close()
        with self._lock:
            socks, self._socks = list(self._socks), set()
        for s in socks:
            _close(s)
        self._thread.join(5)

    def _accept(self) -> None:
        while True:
            try:
                client, (peer, _) = self._server.accept()
            except OSError:
                return  # closed
            try:
                upstream = socket.create_connection(self.target, timeout=10)
            except OSError:
                _close(client)
                continue
            upstream.settimeout(None)
            for s in (client, upstream):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._socks |= {client, upstream}
                self.connections += 1
            threading.Thread(target=self._up, args=(client, upstream, peer), daemon=True).start()
            threading.Thread(target=self._down, args=(upstream, client), daemon=True).start()

    def _down(self, upstream: socket.socket, client: socket.socket) -> None:
        _pump(upstream, client)
        self._drop(upstream, client)

    def _up(self, client: socket.socket, upstream: socket.socket, peer: str) -> None:
        hold, left = None, None  # the Hold this connection serves, and the bytes it may still forward
        head = b""  # the held request, until its headers are complete
        while True:
            data = _recv(client)
            if not data:
                break
            if hold is None and self._hold is not None and (idx := self._hold.claim(peer, data)) is not None:
                hold = self._hold
                if not _send(upstream, data[:idx]):
                    break
                head, data = data[idx:], b""
            if hold is None:
                if not _send(upstream, data):
                    break
                continue
            if hold.held.is_set():
                continue  # swallowed: the store never gets the rest of the body
            if left is None:
                head += data
                end = head.find(b"\r\n\r\n")
                if end < 0:
                    continue
                left = end + 4 + hold.body_bytes
                data, head = head, b""
            part = data[:left]
            left -= len(part)
            if not _send(upstream, part):
                break
            if left <= 0:
                hold.held.set()
        self._drop(client, upstream)
        if hold is not None:
            hold.closed.set()

    def _drop(self, *socks: socket.socket) -> None:
        with self._lock:
            self._socks -= set(socks)
        for s in socks:
            _close(s)


def _recv(s: socket.socket) -> bytes:
    try:
        return s.recv(1 << 16)
    except OSError:
        return b""


def _send(s: socket.socket, data: bytes) -> bool:
    try:
        s.sendall(data)
        return True
    except OSError:
        return False


def _pump(src: socket.socket, dst: socket.socket) -> None:
    while (data := _recv(src)) and _send(dst, data):
        pass


def _close(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    s.close()


# -- chunks of real prompts -------------------------------------------------------------------------------
REPO = Path(__file__).resolve().parent.parent
KV_DATA = REPO / "tests" / "data" / "kv"
MODEL = Path(os.environ.get("KVFS_TEST_MODEL", REPO / ".venv/opt/models/SmolLM2-135M-Instruct"))
NAMESPACE = "SmolLM2-135M-Instruct-fleet"  # the connector's per-model directory (kvfs_connector.naming)


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One block of a real prompt as the connector saves it: its file (relative to the mount), the block's real
    KV bytes (tests/data/kv), its dtype and its block record (user.kvfs.blocks: the block's real token ids)."""

    prompt: str
    relpath: str
    data: bytes
    dtype: str
    record: bytes
    block_hash: bytes

    def xattrs(self) -> dict[str, bytes]:
        return {"user.kvfs.dtype": self.dtype.encode(), "user.kvfs.blocks": self.record}


def prompt_tokens(name: str, manifest: dict) -> list[int]:
    """The token ids of a prompt of tests/data/kv, checked against its manifest (the text's sha256 and token
    count): the texts come from files of this Debian 12 image (tools/dump_kv.py)."""
    from tokenizers import Tokenizer

    info = manifest["prompts"][name]
    text = _prompt_text(name)
    if hashlib.sha256(text.encode()).hexdigest() != info["text_sha256"]:
        raise RuntimeError(f"the {name} prompt's text differs from the one tests/data/kv was made from")
    ids = Tokenizer.from_file(str(MODEL / "tokenizer.json")).encode(text).ids
    if len(ids) != info["text_tokens"] or ids[:8] != info["first_token_ids"]:
        raise RuntimeError(f"the {name} prompt tokenizes differently from tools/dump_kv.py")
    return ids


def _prompt_text(name: str) -> str:
    read = lambda p: Path(p).read_text(errors="replace")  # noqa: E731 - dump_kv.py's reading
    if name == "prose":
        return read("/usr/share/common-licenses/GPL-3")
    if name == "python":
        return read("/usr/lib/python3.11/argparse.py")
    if name == "chat":  # dump_kv.py's conversation, in SmolLM2's chat template (chat_template.jinja)
        messages = [
            ("system", "You are a careful assistant who answers questions about software licenses and source code. "
             "Quote the relevant passage before you explain it."),
            ("user", "Here is a license I found in a package:\n\n" + read("/usr/share/common-licenses/Apache-2.0")
             + "\n\nWhat does section 4 require when I redistribute a modified version?"),
            ("assistant", "Section 4 (Redistribution) lets you distribute copies in any medium, with or without "
             "modifications, provided that you (a) give recipients a copy of the License, (b) make modified files "
             "carry prominent notices stating that you changed them, (c) retain all copyright, patent, trademark "
             "and attribution notices of the Source form, and (d) include a readable copy of any NOTICE file. You "
             "may add your own copyright statement and license terms for your modifications."),
            ("user", "Thanks. Now explain what this Python module does, function by function, and point out "
             "anything surprising:\n\n```python\n" + read("/usr/lib/python3.11/textwrap.py") + "```"),
        ]
        return "".join(f"<|im_start|>{role}\n{text}<|im_end|>\n" for role, text in messages) + "<|im_start|>assistant\n"
    raise ValueError(name)


def block_hashes(tokens: list[int], block_size: int) -> list[bytes]:
    """Chained block hashes, as vLLM's prefix cache makes them: each block's sha256 covers its parent's hash
    and its own tokens, so a block names its whole prefix."""
    out, parent = [], b""
    for i in range(len(tokens) // block_size):
        block = tokens[i * block_size:(i + 1) * block_size]
        parent = hashlib.sha256(parent + json.dumps(block).encode()).digest()
        out.append(parent)
    return out


def prompt_chunks() -> list[Chunk]:
    """One chunk per real KV sample of tests/data/kv (block 4 of each prompt: tokens 512-639)."""
    from kvfs.events import BlockRecord, encode_record
    from kvfs_connector.naming import chunk_relpath

    manifest = json.loads((KV_DATA / "manifest.json").read_text())
    size = manifest["block_size"]
    chunks = []
    for path in sorted(KV_DATA.glob("*.kv")):
        dtype, prompt, block = path.stem.split("-")
        n = int(block)
        tokens = prompt_tokens(prompt, manifest)
        hashes = block_hashes(tokens[:(n + 1) * size], size)
        record = BlockRecord(block_hashes=[hashes[n]], block_size=size, parent_block_hash=hashes[n - 1] if n else None,
                             token_ids=tokens[n * size:(n + 1) * size])
        chunks.append(Chunk(prompt, chunk_relpath(NAMESPACE, hashes[n]), path.read_bytes(), dtype,
                            encode_record(record), hashes[n]))
    return chunks
