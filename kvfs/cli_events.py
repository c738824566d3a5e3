"""`kvfs events`: print a mount's KV events as a subscriber sees them (kvfs/events.py, docs/events.md)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import click

from . import events


def endpoints(target: str, replay: str | None) -> tuple[str, str | None]:
    """A mountpoint's endpoints from its .kvfs/stats (wildcard binds read as 127.0.0.1), or TARGET itself."""
    stats_file = Path(target) / ".kvfs" / "stats"
    if "://" in target:
        return target, replay
    try:
        doc = json.loads(stats_file.read_bytes())
    except (OSError, ValueError):
        raise click.ClickException(f"{target} is neither a ZMQ endpoint nor a mounted kvfs") from None
    ev = doc.get("events")
    if not ev:
        raise click.ClickException(f"{target} publishes no KV events (mount it with --events ENDPOINT)")
    return _local(ev["endpoint"]), replay or (_local(ev["replay_endpoint"]) if ev.get("replay_endpoint") else None)


def _local(endpoint: str) -> str:
    return endpoint.replace("://*:", "://127.0.0.1:").replace("://0.0.0.0:", "://127.0.0.1:")


def run(target: str, replay: str | None, start: int | None, count: int | None, as_json: bool, topic: str) -> None:
    import zmq

    endpoint, replay = endpoints(target, replay)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt_string(zmq.SUBSCRIBE, topic)
    sub.connect(endpoint)
    shown = 0
    last_seq = -1
    try:
        if start is not None:
            if replay is None:
                raise click.ClickException("--from needs the publisher's replay endpoint (--replay)")
            time.sleep(0.2)  # the subscription reaches the publisher first: nothing falls between replay and live
            for seq, batch in events.replay(replay, start):
                shown += _show(seq, batch, as_json, count, shown)
                last_seq = seq
                if count is not None and shown >= count:
                    return
        while count is None or shown < count:
            _, seq_bytes, payload = sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            if seq <= last_seq:
                continue  # already replayed
            if last_seq >= 0 and seq > last_seq + 1:
                click.echo(f"# missed batches {last_seq + 1}..{seq - 1} (replay them with --from)", err=True)
            last_seq = seq
            shown += _show(seq, events.decode_batch(payload), as_json, count, shown)
    finally:
        ctx.destroy(linger=0)


def _show(seq: int, batch: events.KVEventBatch, as_json: bool, count: int | None, shown: int) -> int:
    n = 0
    for ev in batch.events:
        if count is not None and shown + n >= count:
            break
        if as_json:
            doc = {"seq": seq, "ts": batch.ts, "type": type(ev).__name__, **_fields(ev)}
            click.echo(json.dumps(doc, default=lambda b: b.hex()))
        else:
            click.echo(f"{seq:>8} {time.strftime('%H:%M:%S', time.localtime(batch.ts))} {events.describe(ev)}")
        n += 1
    return n


def _fields(ev) -> dict:
    return {f: getattr(ev, f) for f in ev.__struct_fields__ if getattr(ev, f) is not None}
