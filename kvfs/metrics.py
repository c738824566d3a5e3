"""Prometheus metrics of a mount (`--metrics-port`): the .kvfs/stats document as metrics, plus request latency.

At each scrape the collector takes one snapshot of the stats document on the trio thread (the index and the
daemon's dicts belong to it) and maps it generically: a tier field becomes `kvfs_tier_<field>{tier=…}`, a
global one `kvfs_<field>`; fields kept in stats.TierCounters / stats.Counters (and the remote tiers' request
counts) are counters, every other number is a gauge. New stats fields thus appear without code changes.
docs/metrics.md lists every metric.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import errno
import logging
import re
import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from wsgiref.simple_server import WSGIRequestHandler, make_server

import trio
from prometheus_client import CollectorRegistry, Histogram, ProcessCollector, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.registry import Collector

from . import stats

log = logging.getLogger(__name__)

SNAPSHOT_TIMEOUT_S = 5.0  # a scrape that cannot get the daemon's attention fails (Prometheus: up == 0)
LATENCY_BUCKETS = (50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3, 250e-3,
                   500e-3, 1.0, 2.5, 5.0, 10.0)

# cumulative fields: counters; every other number in the document is a gauge (a state: sizes, files, ratios)
TIER_COUNTERS = {f.name for f in dataclasses.fields(stats.TierCounters)} | {
    "read_bytes", "requests", "bytes_downloaded", "bytes_uploaded", "failures", "timeouts", "quarantined",
    "breaker_opened"}
GLOBAL_COUNTERS = {f.name for f in dataclasses.fields(stats.Counters)} - {"tiers"}
GAUGES = {"pinned_files", "pinned_bytes"}  # states, wherever they are kept
# a tier spread over several directories (L3 on several SSDs): kvfs_directory_<field>{tier=…, directory=…}
DIRECTORY_COUNTERS = {"written_files", "written_bytes", "read_bytes", "failures", "breaker_opened"}
DIRECTORY_STATES = ("up", "full", "down")
RENAMED = {"frame_size": "frame_size_bytes"}  # a unit the field name leaves implicit
SKIPPED = {"version", "pid", "tiers", "mover", "qat", "quotas", "events"}  # identity, or mapped on their own below
HELP = {
    "capacity_bytes": "configured capacity of the tier",
    "used_bytes": "stored bytes the tier holds",
    "files": "objects the tier holds",
    "logical_bytes": "logical (uncompressed) bytes of the files the tier holds",
    "compression_ratio": "stored / logical bytes (smaller is better)",
    "read_bytes": "stored bytes read from the tier for file reads (not moves)",
    "hits": "file reads served by the tier (counted once per open handle, at its first read)",
    "misses": "file reads the tier could not serve: hits of slower tiers plus lookups of absent names",
    "demoted_files": "files moved from the tier to the next slower one",
    "promoted_files": "files moved into the tier from a slower one",
    "evicted_files": "files dropped from the last tier (they became misses)",
    "requests": "requests sent to the remote store, by kind",
    "bytes_downloaded": "bytes downloaded from the remote store",
    "bytes_uploaded": "bytes uploaded to the remote store",
    "failures": "remote requests that failed",
    "timeouts": "remote requests that timed out",
    "breaker_open": "1 while the tier's circuit breaker is open (down: calls fail fast), else 0",
    "breaker_opened": "times the tier's circuit breaker opened",
    "consecutive_failures": "remote failures in a row (the breaker opens at its threshold)",
    "bytes_written": "logical bytes accepted by write()",
    "bytes_read": "logical bytes returned by read()",
    "checksum_failures": "corrupt objects detected (each dropped from the index)",
    "key_unavailable": "reads refused because the object is sealed with a key this mount does not hold",
    "quota_limit_bytes": "a directory's quota in a tier (stored bytes)",
    "quota_used_bytes": "stored bytes below a directory with a quota, per tier",
    "errors": "unexpected exceptions answered with EIO",
    "expired_files": "files dropped at the end of their retention time (user.kvfs.ttl)",
    "saves_shed": "saves skipped while the mover was congested: sheddable adoptions refused, and writers' reports",
    "published": "KV events published (BlockStored, BlockRemoved, AllBlocksCleared)",
    "batches_dropped": "KV event batches dropped because the publisher thread fell behind",
    "announced_files": "files whose blocks the KV events announce now",
    "lookup_misses": "lookups of a name that does not exist",
    "uptime_s": "seconds since the mount started",
    "directory_state": "1 for the state a directory of a spread tier is in (up, full: ENOSPC, down: failed)",
}
DIRECTORY_HELP = {
    "capacity_bytes": "configured capacity of the directory",
    "used_bytes": "stored bytes the directory holds",
    "files": "objects the directory holds",
    "written_files": "objects written into the directory",
    "written_bytes": "stored bytes written into the directory",
    "read_bytes": "stored bytes read from the directory (reads and moves)",
    "failures": "I/O errors of the directory",
    "breaker_opened": "times the directory was taken down",
    "pending_deletions": "deletions waiting for the directory to answer again",
}


class Unavailable(Exception):
    """The daemon cannot answer a snapshot now (starting, stopped, or busy past the timeout)."""


class RequestLatency:
    """Durations of successful read and write requests. Created unregistered: the exporter registers it."""

    def __init__(self) -> None:
        self.histogram = Histogram("kvfs_request_duration_seconds", "duration of FUSE read/write requests",
                                   ["op"], buckets=LATENCY_BUCKETS, registry=None)
        self.read = self.histogram.labels(op="read")
        self.write = self.histogram.labels(op="write")

    def add_reads(self, per_bucket, total_s: float) -> None:
        """Reads timed elsewhere (the native front end's, kvfs/frontend/_loop.c), counted per bucket of
        LATENCY_BUCKETS (the last: above them all) with their total duration."""
        self._add(self.read, per_bucket, total_s)

    def add_writes(self, per_bucket, total_s: float) -> None:
        """Writes timed elsewhere (the native front end's writers), as add_reads."""
        self._add(self.write, per_bucket, total_s)

    @staticmethod
    def _add(child, per_bucket, total_s: float) -> None:
        buckets, total = getattr(child, "_buckets", None), getattr(child, "_sum", None)
        if buckets is None or total is None or len(buckets) != len(per_bucket):  # another prometheus_client
            bounds = (*LATENCY_BUCKETS, LATENCY_BUCKETS[-1] * 2)
            for bound, n in zip(bounds, per_bucket):
                for _ in range(n):
                    child.observe(bound)
            return
        for bucket, n in zip(buckets, per_bucket):
            if n:
                bucket.inc(n)
        total.inc(total_s)


def metric_name(field: str) -> str:
    """A stats field as a metric name with its unit last: bytes_written → written_bytes, uptime_s → uptime_seconds."""
    name = RENAMED.get(field) or re.sub(r"[^a-zA-Z0-9_]", "_", field)
    if name.startswith("bytes_"):
        name = name.removeprefix("bytes_") + "_bytes"
    if name.endswith("_s"):
        name = name.removesuffix("_s") + "_seconds"
    return name


def _help(field: str) -> str:
    return HELP.get(field, f"{field} of .kvfs/stats")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class _Families:
    """Metric families by name, created on first use with the type the field calls for."""

    def __init__(self) -> None:
        self.by_name: dict[str, Metric] = {}

    def add(self, prefix: str, field: str, counter: bool, labels: dict[str, str], value: float,
            help_text: str | None = None) -> None:
        name = prefix + metric_name(field)
        family = self.by_name.get(name)
        if family is None:
            kind = CounterMetricFamily if counter and field not in GAUGES else GaugeMetricFamily
            family = self.by_name[name] = kind(name, help_text or _help(field), labels=list(labels))
        family.add_metric(list(labels.values()), value)


def families(doc: dict) -> list[Metric]:
    """The metrics of one stats document (see the module docstring and docs/metrics.md)."""
    out = _Families()
    tiers = doc.get("tiers", {})
    for tier, fields in tiers.items():
        _tier_metrics(out, tier, fields)
    for tier, misses in tier_misses(doc).items():
        out.add("kvfs_tier_", "misses", True, {"tier": tier}, misses)
    for field, value in doc.items():
        if field not in SKIPPED and _is_number(value):
            out.add("kvfs_", field, field in GLOBAL_COUNTERS, {}, value)
    _mover_metrics(out, doc.get("mover", {}), tiers)
    for q in doc.get("quotas", []):
        for tier, limit in q["limits"].items():
            labels = {"directory": q["path"], "tier": tier}
            out.add("kvfs_", "quota_limit_bytes", False, labels, limit)
            out.add("kvfs_", "quota_used_bytes", False, labels, q["used"].get(tier, 0))
    events = doc.get("events") or {}
    for field in ("events_published", "batches_dropped", "bad_block_records"):
        if field in events:
            out.add("kvfs_events_", field.removeprefix("events_"), True, {}, events[field])
    if "announced_files" in events:
        out.add("kvfs_events_", "announced_files", False, {}, events["announced_files"])
    return [*out.by_name.values(), *_info(doc)]


def _tier_metrics(out: _Families, tier: str, fields: dict) -> None:
    for d in fields.get("directories", []):
        _directory_metrics(out, tier, d)
    for field, value in fields.items():
        counter = field in TIER_COUNTERS
        if _is_number(value):
            out.add("kvfs_tier_", field, counter, {"tier": tier}, value)
        elif isinstance(value, dict):  # e.g. requests by kind
            for kind, n in value.items():
                if _is_number(n):
                    out.add("kvfs_tier_", field, counter, {"tier": tier, "kind": str(kind)}, n)
    if "breaker" in fields:
        out.add("kvfs_tier_", "breaker_open", False, {"tier": tier}, 1 if fields["breaker"] == "open" else 0)


def _directory_metrics(out: _Families, tier: str, d: dict) -> None:
    labels = {"tier": tier, "directory": d["path"]}
    for field, value in d.items():
        if _is_number(value):
            out.add("kvfs_directory_", field, field in DIRECTORY_COUNTERS, labels, value, DIRECTORY_HELP.get(field))
    for state in DIRECTORY_STATES:
        out.add("kvfs_", "directory_state", False, {**labels, "state": state}, 1 if d["state"] == state else 0)


def tier_misses(doc: dict) -> dict[str, int]:
    """Misses per tier: a read served by tier N missed every faster tier; a lookup of an absent name missed
    them all. So hits / (hits + misses) of a tier is its hit rate among the reads that reached it."""
    tiers = doc.get("tiers", {})
    names = list(tiers)  # fastest first
    return {tier: doc.get("lookup_misses", 0) + sum(tiers[t].get("hits", 0) for t in names[i + 1:])
            for i, tier in enumerate(names)}


def _mover_metrics(out: _Families, mover: dict, tiers: dict) -> None:
    for field, value in mover.items():
        if _is_number(value):
            out.add("kvfs_mover_", field, False, {}, value)
    draining = set(mover.get("draining", []))
    for tier in tiers:
        out.add("kvfs_tier_", "draining", False, {"tier": tier}, 1 if tier in draining else 0)
    for tier, marks in mover.get("watermarks", {}).items():
        for level, ratio in marks.items():
            out.add("kvfs_tier_", "watermark_ratio", False, {"tier": tier, "level": level}, ratio)


def _info(doc: dict) -> Iterator[Metric]:
    qat = doc.get("qat", {})
    codec = InfoMetricFamily("kvfs_codec", "codec configuration and QAT mode")
    codec.add_metric([], {"codec": str(doc.get("codec")), "dtype": str(doc.get("dtype")),
                          "qat_mode": str(qat.get("mode", "not loaded"))})
    yield codec
    mount = InfoMetricFamily("kvfs_mount", "the mount this daemon serves")
    mount.add_metric([], {"mountpoint": str(doc.get("mountpoint")),
                          "promotion": str(doc.get("mover", {}).get("promotion"))})
    yield mount
    tier_info = InfoMetricFamily("kvfs_tier", "where each tier lives", labels=["tier"])
    for tier, fields in doc.get("tiers", {}).items():
        tier_info.add_metric([tier], {k: str(v).lower() if isinstance(v, bool) else str(v)
                                      for k, v in fields.items() if k in ("path", "persistent", "endpoint")})
    yield tier_info
    if _is_number(qat.get("software_calls")):
        calls = CounterMetricFamily("kvfs_qat_software_calls", "QATzip calls run in its software fallback")
        calls.add_metric([], qat["software_calls"])
        yield calls


class StatsCollector(Collector):
    """Turns one snapshot of the stats document per scrape into metrics."""

    def __init__(self, snapshot: Callable[[], dict]) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterable[Metric]:
        return families(self.snapshot())


class Exporter:
    """The HTTP endpoint: prometheus_client's threaded WSGI server in a daemon thread."""

    def __init__(self, stats_doc: Callable[[], dict], latency: RequestLatency, address: str, port: int,
                 timeout_s: float = SNAPSHOT_TIMEOUT_S) -> None:
        self.stats_doc = stats_doc
        self.timeout_s = timeout_s
        self.token: trio.lowlevel.TrioToken | None = None
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(StatsCollector(self.snapshot))
        self.registry.register(latency.histogram)
        ProcessCollector(registry=self.registry)
        self._failing = False
        self.httpd = _bind(address, port, self._app(make_wsgi_app(self.registry)))
        self.url = f"http://{_host(address)}:{self.httpd.server_port}/metrics"
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="kvfs-metrics", daemon=True)
        self._thread.start()

    def attach(self, token: trio.lowlevel.TrioToken) -> None:
        """Scrapes get answers from now on, from the trio run that `token` belongs to."""
        self.token = token

    def snapshot(self) -> dict:
        """The stats document, taken on the trio thread. trio.from_thread.run_sync has no timeout: a busy
        or finished loop must fail the scrape, not hang it."""
        if self.token is None:
            raise Unavailable("the daemon is starting")
        answer: concurrent.futures.Future = concurrent.futures.Future()

        def take() -> None:
            try:
                answer.set_result(self.stats_doc())
            except BaseException as e:  # noqa: BLE001 - raising here would crash the trio run
                answer.set_exception(e)

        try:
            self.token.run_sync_soon(take)
        except trio.RunFinishedError:
            raise Unavailable("the daemon has stopped") from None
        try:
            return answer.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            raise Unavailable(f"the daemon did not answer within {self.timeout_s:g} s") from None

    def _app(self, metrics_app):
        """metrics_app, answering 503 with the reason when no snapshot can be had (logged once per outage)."""

        def app(environ, start_response):
            response = []
            try:
                body = b"".join(metrics_app(environ, lambda status, headers: response.append((status, headers))))
            except Exception as e:  # noqa: BLE001 - a failed scrape must not reach the server's traceback printer
                if not self._failing:
                    log.warning("metrics scrape failed: %s (answered 503 until a scrape succeeds)", _reason(e))
                self._failing = True
                start_response("503 Service Unavailable", [("Content-Type", "text/plain; charset=utf-8")])
                return [f"kvfs metrics unavailable: {_reason(e)}\n".encode()]
            if self._failing:
                log.info("metrics scrapes succeed again")
            self._failing = False
            start_response(*response[0])
            return [body]

        return app

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(timeout=5)


def _reason(e: Exception) -> str:
    return str(e) if isinstance(e, Unavailable) else f"{type(e).__name__}: {e}"


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args) -> None:  # noqa: A002 - the base class's signature
        """One line per request is not an event worth logging."""


def _bind(address: str, port: int, app) -> ThreadingWSGIServer:
    """A server listening on address:port; OSError (e.g. the port is taken) with a clear message."""
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM,
                                                       flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise OSError(f"metrics address {address!r}: {e.strerror}") from None

    class Server(ThreadingWSGIServer):
        address_family = family

    try:
        return make_server(sockaddr[0], port, app, Server, handler_class=_QuietHandler)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise OSError(e.errno, f"metrics port {_host(address)}:{port} is already in use "
                                   "(choose another --metrics-port)") from None
        raise OSError(e.errno, f"metrics port {_host(address)}:{port}: {e.strerror}") from None


def _host(address: str) -> str:
    return f"[{address}]" if ":" in address else address


def start(stats_doc: Callable[[], dict], latency: RequestLatency, address: str, port: int) -> Exporter:
    """Serve metrics on address:port (SystemExit with one clear line when it cannot be bound)."""
    try:
        exporter = Exporter(stats_doc, latency, address, port)
    except OSError as e:
        raise SystemExit(f"kvfs: {e.strerror or e}") from None
    log.info("metrics on %s", exporter.url)
    return exporter
