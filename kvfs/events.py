"""KV events: which blocks of vLLM's prefix cache the mount holds, and in which tier, in vLLM's own wire format.

A router that consumes vLLM's KV events (llm-d's kv-cache manager, Dynamo's KV router) consumes kvfs's
unchanged: ZMQ PUB frames (topic, 8-byte big-endian sequence number, msgpack `KVEventBatch`), a ROUTER socket
that replays buffered batches from a sequence number on, and the event classes of vllm/distributed/kv_events.py
(mirrored here, field for field, so kvfs needs no vLLM).

Which blocks a file holds is the writer's to say: `user.kvfs.blocks` (`BlockRecord`, msgpack) on the file,
set by the connector on every chunk it saves. A file with that record is *announced* in tier T while its
object is committed in T and it has a name. Changes of that state are logged by SQLite triggers in the
transaction that makes them (Index.enable_event_log), so a rolled-back change never gives an event, and
`EventSource` turns the log into events:

- committed (write, direct write, adoption of a published file) → BlockStored(medium T);
- moved from T to U (demotion, promotion, upload) → BlockRemoved(T), BlockStored(U): vLLM has no move event;
- dropped, evicted, unlinked, or its record removed → BlockRemoved(T).

Two files with the same blocks in one tier (a chunk rewritten through a temporary name and renamed over the
old one) are counted: the blocks are removed only when the last such file leaves the tier.
At start the source sends AllBlocksCleared and announces every file again: a subscriber that saw an earlier
run learns that its view is stale (sequence numbers restart at 0, as vLLM's do).
"""

from __future__ import annotations

import collections
import logging
import queue
import socket
import threading
import time
from collections.abc import Iterable
from typing import Any

import msgspec
import trio
import xxhash

log = logging.getLogger(__name__)

XA_BLOCKS = b"user.kvfs.blocks"
RECORD_MAX = 64 << 10  # a record is an xattr value: the kernel's limit
MAX_GROUPS = 1024  # KV-cache groups one file can announce
DRAIN_INTERVAL_S = 0.02  # the trigger log is read this often: the events' latency
START_GRACE_S = 1.0  # before the start's announcement: subscribers of the last run reconnect (ZMQ retries
# every 100 ms) and PUB drops what no subscriber asked for; a later one replays it
ANNOUNCE_BATCH = 256  # files per batch when announcing everything at start
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # ends a replay (vLLM's marker)


# -- vLLM's wire format (vllm/distributed/kv_events.py), mirrored -------------------------------------------
class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the events: msgpack maps tagged with the class name."""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


# -- what a file holds --------------------------------------------------------------------------------------
class BlockRecord(msgspec.Struct, forbid_unknown_fields=False, gc=False):
    """The value of user.kvfs.blocks: the vLLM blocks whose KV a file holds, as vLLM's own BlockStored
    describes them (hashes in vLLM's external form: bytes, or ints under VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)."""
    block_hashes: list[bytes | int]
    block_size: int
    parent_block_hash: bytes | int | None = None
    token_ids: list[int] = []
    lora_name: str | None = None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    # a file of several KV-cache groups (a hybrid model's part: kvfs_connector/model.py): the blocks are
    # announced once per group, as vLLM announces each group's; group_idx is then the first of them
    group_ids: list[int] | None = None


_record_decoder = msgspec.msgpack.Decoder(BlockRecord)
_encoder = msgspec.msgpack.Encoder()


def encode_record(record: BlockRecord) -> bytes:
    return _encoder.encode(record)


def parse_record(value: bytes) -> BlockRecord:
    """Decode and check a user.kvfs.blocks value; ValueError says what is wrong."""
    if len(value) > RECORD_MAX:
        raise ValueError("larger than 64 KiB")
    try:
        rec = _record_decoder.decode(value)
    except msgspec.DecodeError as e:
        raise ValueError(f"not a msgpack block record: {e}") from None
    if not rec.block_hashes:
        raise ValueError("no block hashes")
    if rec.block_size < 1:
        raise ValueError(f"block_size {rec.block_size} < 1")
    if rec.token_ids and len(rec.token_ids) != len(rec.block_hashes) * rec.block_size:
        raise ValueError(f"{len(rec.token_ids)} token ids for {len(rec.block_hashes)} blocks of {rec.block_size}")
    if rec.group_ids is not None and not 0 < len(rec.group_ids) <= MAX_GROUPS:
        raise ValueError(f"{len(rec.group_ids)} group ids (1 to {MAX_GROUPS})")
    return rec


def record_groups(rec: BlockRecord) -> list[int | None]:
    """The groups a record's blocks are announced under: its group_ids, else its one group_idx."""
    return list(rec.group_ids) if rec.group_ids else [rec.group_idx]


def without_tokens(value: bytes) -> bytes:
    """The record with its hashes only (what fits S3's metadata where the whole one does not: kvfs/mover.py);
    routers that key on hashes still find the blocks. An unreadable record is returned as it is."""
    try:
        rec = parse_record(value)
    except ValueError:
        return value
    return encode_record(BlockRecord(block_hashes=rec.block_hashes, block_size=rec.block_size,
                                     parent_block_hash=rec.parent_block_hash, lora_name=rec.lora_name,
                                     group_idx=rec.group_idx, group_ids=rec.group_ids))


# -- the source: trigger log → events -----------------------------------------------------------------------
class EventSource:
    """Reads the index's event log on the trio thread and hands batches to a Publisher."""

    def __init__(self, index, publisher: "Publisher", media: dict[str, str] | None = None) -> None:
        self.index = index
        self.publisher = publisher
        self.media = dict(media or {})
        self._held: collections.Counter[tuple[int, str]] = collections.Counter()  # (record digest, tier) → files
        self.published = 0  # events, for stats
        self.bad_records = 0
        index.enable_event_log()

    def medium(self, tier: str) -> str:
        return self.media.get(tier, tier)

    def announce_all(self) -> None:
        """AllBlocksCleared, then every announced file: what a subscriber must know after a (re)start."""
        self.index.drain_event_log()  # all of it is in the scan below
        self._held.clear()
        events: list = [AllBlocksCleared()]
        for tier, value in self.index.announced_blocks():
            events.extend(self._change(None, tier, value))
            if len(events) >= ANNOUNCE_BATCH:
                self._send(events)
                events = []
        self._send(events)

    def drain(self) -> int:
        """Events for the changes committed since the last drain; returns how many were sent."""
        events: list = []
        for old, new, value in self.index.drain_event_log():
            events.extend(self._change(old, new, value))
        self._send(events)
        return len(events)

    async def run(self) -> None:
        await trio.sleep(START_GRACE_S)
        self.announce_all()
        while True:
            await trio.sleep(DRAIN_INTERVAL_S)
            self.drain()

    def _change(self, old: str | None, new: str | None, value: bytes) -> list:
        if old == new:
            return []
        try:
            rec = parse_record(value)
        except ValueError:
            self.bad_records += 1  # set before validation existed, or by another implementation
            return []
        key = xxhash.xxh3_64_intdigest(value)
        out = []
        if old is not None:
            self._held[(key, old)] -= 1
            if self._held[(key, old)] <= 0:
                del self._held[(key, old)]
                out.extend(BlockRemoved(block_hashes=rec.block_hashes, medium=self.medium(old), group_idx=g)
                           for g in record_groups(rec))
        if new is not None:
            self._held[(key, new)] += 1
            if self._held[(key, new)] == 1:
                out.extend(BlockStored(
                    block_hashes=rec.block_hashes, parent_block_hash=rec.parent_block_hash, token_ids=rec.token_ids,
                    block_size=rec.block_size, lora_id=None, medium=self.medium(new), lora_name=rec.lora_name,
                    extra_keys=rec.extra_keys, group_idx=g) for g in record_groups(rec))
        return out

    def _send(self, events: list) -> None:
        if events:
            self.published += len(events)
            self.publisher.publish(KVEventBatch(ts=time.time(), events=events))

    def stats(self) -> dict[str, int]:
        return {"endpoint": self.publisher.endpoint, "replay_endpoint": self.publisher.replay_endpoint,
                "events_published": self.published, "batches_dropped": self.publisher.dropped,
                "bad_block_records": self.bad_records, "announced_files": sum(self._held.values())}


# -- the publisher: a thread that owns the ZMQ sockets ------------------------------------------------------
class Publisher:
    """vLLM's ZmqEventPublisher protocol: PUB of (topic, seq, payload); a ROUTER that answers a replay request
    (an 8-byte big-endian start sequence) with every buffered batch from there on, then END_SEQ. Bind or
    connect as _bind_or_connect says."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
                 buffer_steps: int = 10_000, buffer_bytes: int = 256 << 20, hwm: int = 100_000,
                 max_queue: int = 100_000) -> None:
        import zmq  # imported here: mounts without events do not load libzmq

        self._zmq = zmq
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        _bind_or_connect(self._pub, endpoint)
        self._replay = None
        if replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(replay_endpoint)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT) or endpoint
        self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT) if self._replay else None
        self.topic = topic.encode()
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(maxsize=max_queue)
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=buffer_steps)
        self._buffer_bytes, self._buffer_limit = 0, buffer_bytes  # records carry token ids: bound the memory
        self._seq = 0
        self.dropped = 0
        self._thread = threading.Thread(target=self._loop, name="kvfs-events", daemon=True)
        self._thread.start()

    def publish(self, batch: KVEventBatch) -> None:
        """Never blocks the trio thread: a full queue (no thread progress for max_queue batches) drops."""
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.dropped += 1

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued (for up to `timeout`), then close the sockets."""
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            pass  # the thread is stuck or gone: what is queued is lost with the process anyway
        self._thread.join(timeout)
        self._ctx.destroy(linger=0)

    def _loop(self) -> None:
        zmq = self._zmq
        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while True:
            if self._replay is not None and poller.poll(0):
                self._serve_replay()
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if batch is None:
                return
            try:
                payload = _encoder.encode(batch)
            except Exception:  # noqa: BLE001 - one bad batch must not end the thread
                log.exception("a KV event batch could not be encoded; dropped")
                self.dropped += 1
                continue
            seq = self._seq
            self._seq += 1
            try:
                self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
            except zmq.ZMQError as e:
                log.warning("publishing KV events failed: %s", e)
            if len(self._buffer) == self._buffer.maxlen:
                self._buffer_bytes -= len(self._buffer[0][1])
            self._buffer.append((seq, payload))
            self._buffer_bytes += len(payload)
            while self._buffer_bytes > self._buffer_limit and len(self._buffer) > 1:
                self._buffer_bytes -= len(self._buffer.popleft()[1])

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", self.topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))


def _bind_or_connect(sock, endpoint: str) -> None:
    """Bind as vLLM does ('*', '::', ipc://, inproc://), and also to an address of this host (tcp://127.0.0.1:N
    binds: vLLM would connect there); connect to any other host (a collector that binds, as llm-d's does)."""
    if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")) or _is_local(endpoint):
        sock.bind(endpoint)
    else:
        sock.connect(endpoint)


def _is_local(endpoint: str) -> bool:
    host = endpoint.removeprefix("tcp://").rpartition(":")[0].strip("[]")
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
        return True
    except (OSError, ValueError):
        return False


# -- a subscriber (kvfs events, tests) ----------------------------------------------------------------------
_batch_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def decode_batch(payload: bytes) -> KVEventBatch:
    return _batch_decoder.decode(payload)


def replay(endpoint: str, start_seq: int = 0, timeout_s: float = 5.0) -> list[tuple[int, KVEventBatch]]:
    """Ask a publisher's ROUTER for every buffered batch from start_seq on."""
    import zmq

    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)  # the answer is many messages: a REQ socket takes one
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
        sock.connect(endpoint)
        sock.send_multipart((b"", start_seq.to_bytes(8, "big")))
        out = []
        while True:
            frames = sock.recv_multipart()
            seq_bytes, payload = frames[-2], frames[-1]
            if seq_bytes == END_SEQ:
                return out
            out.append((int.from_bytes(seq_bytes, "big"), decode_batch(payload)))
    finally:
        ctx.destroy(linger=0)


def describe(event) -> str:
    """One line per event, for people (kvfs events)."""
    name = type(event).__name__
    if isinstance(event, AllBlocksCleared):
        return name
    hashes = event.block_hashes
    first = _short(hashes[0]) if hashes else "-"
    last = _short(hashes[-1]) if len(hashes) > 1 else ""
    span = f"{first}…{last}" if last else first
    return f"{name:<13} {event.medium or '-':<8} {len(hashes):>4} blocks {span}"


def _short(h: bytes | int) -> str:
    return h.hex()[:12] if isinstance(h, bytes) else f"{h:016x}"


def blocks_of(events: Iterable) -> set[tuple[str, bytes | int]]:
    """(medium, hash) pairs a sequence of events leaves held: a subscriber's view. Takes vLLM's event classes
    as well as these (by name)."""
    held: set[tuple[str, bytes | int]] = set()
    for ev in events:
        kind = type(ev).__name__
        if kind == "AllBlocksCleared":
            held.clear()
        elif kind == "BlockStored":
            held.update((ev.medium, h) for h in ev.block_hashes)
        elif kind == "BlockRemoved":
            held.difference_update((ev.medium, h) for h in ev.block_hashes)
    return held
