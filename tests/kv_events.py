"""A KV-event subscriber for tests, as a router runs one: ZMQ SUB on one or more publishers (kvfs mounts, vLLM
engines), each batch decoded with vLLM's own classes (vllm.distributed.kv_events): what a router decodes with."""

from __future__ import annotations

import threading
import time

import msgspec
import zmq
from vllm.distributed.kv_events import KVEventBatch

from kvfs.events import replay

decoder = msgspec.msgpack.Decoder(KVEventBatch)


class EventCollector:
    """Collects (seq, batch) per endpoint in a thread, from the moment it is entered; a replay from
    `from_seq` first where a replay endpoint is given (what came before the subscription)."""

    def __init__(self, endpoints: list[str], replays: dict[str, str] | None = None, from_seq: int = 0) -> None:
        self.endpoints = endpoints
        self.replays = replays or {}
        self.from_seq = from_seq
        self.batches: dict[str, list[tuple[int, KVEventBatch]]] = {e: [] for e in endpoints}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "EventCollector":
        self._thread.start()
        self._ready.wait(10)
        time.sleep(0.3)  # subscriptions reach the publishers before anything is asked of them
        for endpoint, rep in self.replays.items():
            got = [(seq, decoder.decode(msgspec.msgpack.encode(b))) for seq, b in replay(rep, self.from_seq)]
            with self._lock:
                live = self.batches[endpoint]
                first_live = live[0][0] if live else None
                self.batches[endpoint] = [b for b in got if first_live is None or b[0] < first_live] + live
        return self

    def __exit__(self, *exc) -> None:
        time.sleep(0.2)
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        ctx = zmq.Context()
        socks = {}
        poller = zmq.Poller()
        for e in self.endpoints:
            s = ctx.socket(zmq.SUB)
            s.setsockopt(zmq.SUBSCRIBE, b"")
            s.connect(e)
            socks[s] = e
            poller.register(s, zmq.POLLIN)
        self._ready.set()
        try:
            while not self._stop.is_set():
                for s, _ in poller.poll(50):
                    _, seq, payload = s.recv_multipart()
                    with self._lock:
                        self.batches[socks[s]].append((int.from_bytes(seq, "big"), decoder.decode(payload)))
        finally:
            ctx.destroy(linger=0)

    def events(self, endpoint: str | None = None) -> list:
        with self._lock:
            batches = list(self.batches[endpoint or self.endpoints[0]])
        return [ev for _, b in batches for ev in b.events]

    def seqs(self, endpoint: str | None = None) -> list[int]:
        with self._lock:
            return [s for s, _ in self.batches[endpoint or self.endpoints[0]]]

    def wait(self, n: int, endpoint: str | None = None, timeout: float = 10.0) -> list:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            evs = self.events(endpoint)
            if len(evs) >= n:
                return evs
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {n} events, got {len(self.events(endpoint))}")
