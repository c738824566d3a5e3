"""Prometheus metrics (--metrics-port) and `kvfs top` on real mounts: what they show equals .kvfs/stats."""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from conftest import kv_samples
from kvfs import format as fmt
from kvfs import metrics
from kvfs.config import ConfigError, build_config
from kvfs.tiers.breaker import Breaker
from kvfs.top import human_bytes
from test_tiers import mover_idle, read_uncached, wait_for

KVFS = [sys.executable, "-m", "kvfs"]
TIER_FIGURES = ("used_bytes", "capacity_bytes", "files", "logical_bytes", "read_bytes", "hits", "demoted_files",
                "demoted_bytes", "promoted_files", "promoted_bytes", "evicted_files", "evicted_bytes")
GLOBAL_FIGURES = ("bytes_written", "bytes_read", "write_requests", "read_requests", "commits", "checksum_failures",
                  "errors", "lookup_misses")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


class Scrape:
    """One scrape, parsed: values by (sample name, labels) and family types by name."""

    def __init__(self, text: str) -> None:
        self.values: dict[tuple[str, tuple], float] = {}
        self.types: dict[str, str] = {}
        for family in text_string_to_metric_families(text):
            self.types[family.name] = family.type
            for s in family.samples:
                self.values[(s.name, tuple(sorted(s.labels.items())))] = s.value

    @classmethod
    def of(cls, port: int) -> "Scrape":
        status, body = get(f"http://127.0.0.1:{port}/metrics")
        assert status == 200, body
        return cls(body)

    def value(self, name: str, **labels: str) -> float:
        return self.values[(name, tuple(sorted(labels.items())))]

    def has(self, name: str, **labels: str) -> bool:
        return (name, tuple(sorted(labels.items()))) in self.values


def figures(doc: dict) -> dict:
    """The stats figures the metrics must equal."""
    out = {(tier, key): t[key] for tier, t in doc["tiers"].items() for key in TIER_FIGURES}
    return {**out, **{key: doc[key] for key in GLOBAL_FIGURES}}


def scraped_figures(scrape: Scrape, doc: dict) -> dict:
    out = {}
    for tier in doc["tiers"]:
        for key in TIER_FIGURES:
            name = f"kvfs_tier_{metrics.metric_name(key)}"
            counter = key in metrics.TIER_COUNTERS
            out[(tier, key)] = scrape.value(name + ("_total" if counter else ""), tier=tier)
    for key in GLOBAL_FIGURES:
        out[key] = scrape.value(f"kvfs_{metrics.metric_name(key)}_total")
    return out


def quiet_scrape(m, port: int) -> tuple[dict, Scrape]:
    """Stats and a scrape taken while nothing changed (the same figures before and after the scrape)."""
    for _ in range(20):
        before = m.stats()
        scrape = Scrape.of(port)
        after = m.stats()
        if figures(before) == figures(after):
            return after, scrape
        time.sleep(0.2)
    raise AssertionError("the mount never settled")


def write_samples(m, copies: int = 2) -> dict[str, bytes]:
    files = {}
    for i in range(copies):
        for sample in kv_samples("bf16") + kv_samples("fp16"):
            name = f"{i}-{sample.name}"
            files[name] = sample.read_bytes()
            m.path(name).write_bytes(files[name])
    return files


def test_scrape_matches_stats(make_mount):
    """Six real KV files (about 12 MiB stored) through a 4 MiB L2: demotions, hits in both tiers; every
    figure of the scrape equals .kvfs/stats, the types are right, the histograms count every request."""
    m = make_mount()
    port = free_port()
    m.start("--l3", f"{m.root / 'l3'}:64M", "--metrics-port", str(port), l2_size="4M")
    files = write_samples(m)
    for name, data in files.items():
        assert read_uncached(m.path(name)) == data
    assert not m.path("absent.kv").exists()
    wait_for(lambda: mover_idle(m), what="the mover to settle")
    doc, scrape = quiet_scrape(m, port)

    assert scraped_figures(scrape, doc) == figures(doc)
    assert doc["tiers"]["L2"]["demoted_files"] > 0 and doc["tiers"]["L3"]["hits"] > 0, doc["tiers"]
    assert doc["lookup_misses"] >= len(files) + 1  # each create looked the name up first; and absent.kv
    assert scrape.value("kvfs_tier_misses_total", tier="L2") == doc["lookup_misses"] + doc["tiers"]["L3"]["hits"]
    assert scrape.value("kvfs_tier_misses_total", tier="L3") == doc["lookup_misses"]
    assert scrape.value("kvfs_compression_ratio") == doc["compression_ratio"]
    assert scrape.value("kvfs_codec_info", codec=doc["codec"], dtype=doc["dtype"], qat_mode="not loaded") == 1
    assert not scrape.has("kvfs_tier_breaker_open", tier="L2")  # only remote tiers have a breaker

    reads = scrape.value("kvfs_request_duration_seconds_count", op="read")
    writes = scrape.value("kvfs_request_duration_seconds_count", op="write")
    assert reads == doc["read_requests"] >= len(files)
    assert writes == doc["write_requests"] >= len(files)
    assert scrape.value("kvfs_request_duration_seconds_bucket", op="read", le="+Inf") == reads
    assert 0 < scrape.value("kvfs_request_duration_seconds_sum", op="write") < 60

    assert scrape.types["kvfs_tier_hits"] == "counter" and scrape.types["kvfs_tier_used_bytes"] == "gauge"
    assert scrape.types["kvfs_tier_pinned_bytes"] == "gauge"  # a state, not a count
    assert scrape.types["kvfs_written_bytes"] == "counter" and scrape.types["kvfs_open_files"] == "gauge"
    assert scrape.types["kvfs_request_duration_seconds"] == "histogram"
    assert all(name.startswith(("kvfs_", "process_")) for name in scrape.types), sorted(scrape.types)


def test_checksum_failure_is_counted(make_mount):
    m = make_mount()
    port = free_port()
    m.start("--metrics-port", str(port))
    m.expect_log(r"corrupt object for inode")
    sample = kv_samples("bf16")[0]
    m.path("victim.kv").write_bytes(sample.read_bytes())
    m.path("bystander").write_bytes(b"b" * 10_000)
    victim = max(m.objects("L2"), key=lambda p: p.stat().st_size)
    raw = bytearray(victim.read_bytes())
    raw[fmt.parse_header(raw).data_offset + 1000] ^= 0x10
    victim.write_bytes(bytes(raw))
    with pytest.raises(OSError) as e:
        read_uncached(m.path("victim.kv"))
    assert e.value.errno == errno.EIO
    doc, scrape = quiet_scrape(m, port)
    assert doc["checksum_failures"] == 1
    assert scrape.value("kvfs_checksum_failures_total") == 1
    assert scraped_figures(scrape, doc) == figures(doc)


def test_metrics_listen_on_localhost_only(make_mount):
    m = make_mount()
    port = free_port()
    m.start("--metrics-port", str(port))
    listening = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if int(hex_port, 16) == port and state == "0A":  # LISTEN
                listening.append((table, address))
    assert listening == [("/proc/net/tcp", "0100007F")]  # 127.0.0.1, nothing else
    assert m.log_text().count(f"metrics on http://127.0.0.1:{port}/metrics") == 1


def test_port_in_use_fails_the_mount(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        res = subprocess.run([*KVFS, "mount", "--foreground", str(mnt), "--l2", f"{tmp_path / 'l2'}:64M",
                              "--state-dir", str(tmp_path / "state"), "--metrics-port", str(port)],
                             capture_output=True, text=True, timeout=60)
    assert res.returncode != 0 and not os.path.ismount(mnt)
    assert "Traceback" not in res.stderr
    assert res.stderr.strip().splitlines()[-1] == (f"kvfs: metrics port 127.0.0.1:{port} is already in use "
                                                   "(choose another --metrics-port)")


def test_metrics_port_is_validated(tmp_path):
    with pytest.raises(ConfigError, match="1..65535"):
        build_config(tmp_path, metrics_port=0)
    toml = tmp_path / "kvfs.toml"
    toml.write_text('[mount]\nmetrics_port = "9100"\n')
    with pytest.raises(ConfigError, match="metrics_port"):
        build_config(tmp_path, config_file=toml)
    toml.write_text("[mount]\nmetrics_port = 9100\n")
    cfg = build_config(tmp_path, config_file=toml)
    assert (cfg.metrics_port, cfg.metrics_address) == (9100, "127.0.0.1")
    assert build_config(tmp_path, config_file=toml, metrics_port=9200).metrics_port == 9200
    assert build_config(tmp_path).metrics_port is None
    res = subprocess.run([*KVFS, "mount", str(tmp_path), "--metrics-port", "70000"], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 2 and "--metrics-port" in res.stderr


def _breaker_open(doc: dict) -> dict[str, float]:
    return {s.labels["tier"]: s.value for f in metrics.families(doc) for s in f.samples
            if s.name == "kvfs_tier_breaker_open"}


def test_breaker_state_mapping():
    """A real breaker's stats as a remote tier reports them: open → 1, closed → 0; tiers without one: absent."""
    breaker = Breaker("L4", failures=3, probe_s=60)

    def doc() -> dict:
        return {"tiers": {"L3": {"hits": 2}, "L4": {"hits": 1, "failures": 3, **breaker.stats()}}}

    assert _breaker_open(doc()) == {"L4": 0}
    for _ in range(3):
        breaker.failure("timed out")
    assert _breaker_open(doc()) == {"L4": 1}
    samples = {s.name: s for f in metrics.families(doc()) for s in f.samples if s.labels.get("tier") == "L4"}
    assert samples["kvfs_tier_breaker_opened_total"].value == 1
    assert samples["kvfs_tier_consecutive_failures"].value == 3
    breaker.success()
    assert _breaker_open(doc()) == {"L4": 0}


def test_scrape_fails_cleanly_when_the_daemon_cannot_answer():
    """Starting (no trio run yet), a trio loop too busy to answer, a finished run: 503 with the reason."""
    exporter = metrics.Exporter(lambda: {"tiers": {}, "errors": 7}, metrics.RequestLatency(), "127.0.0.1", 0,
                                timeout_s=0.3)
    try:
        status, body = get(exporter.url)
        assert status == 503 and "starting" in body

        async def serve() -> None:
            exporter.attach(trio.lowlevel.current_trio_token())
            status, body = await trio.to_thread.run_sync(get, exporter.url)
            assert status == 200 and "kvfs_errors_total 7.0" in body
            busy: dict = {}
            scraper = threading.Thread(target=lambda: busy.update(answer=get(exporter.url)))
            scraper.start()
            time.sleep(1.0)  # the trio thread is blocked: the snapshot cannot run
            scraper.join()
            assert busy["answer"][0] == 503 and "did not answer" in busy["answer"][1]

        trio.run(serve)
        status, body = get(exporter.url)
        assert status == 503 and "stopped" in body
    finally:
        exporter.close()


def test_top_shows_the_stats(make_mount):
    m = make_mount()
    m.start("--l3", f"{m.root / 'l3'}:64M", l2_size="4M")
    files = write_samples(m, copies=1)
    for name in files:
        read_uncached(m.path(name))
    wait_for(lambda: mover_idle(m), what="the mover to settle")
    for _ in range(10):
        before = m.stats()
        res = subprocess.run([*KVFS, "top", str(m.mountpoint), "--count", "2", "--interval", "0.2"],
                             capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "80"})
        doc = m.stats()
        if figures(before) == figures(doc):
            break
    else:
        raise AssertionError("the mount never settled")
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("kvfs top:") == 2  # printed twice: not a terminal
    last = res.stdout[res.stdout.rindex("kvfs top:"):].splitlines()
    header = next(line for line in last if line.startswith("┃"))
    assert [c.strip() for c in header.strip("┃").split("┃")][1:] == list(doc["tiers"])
    rows = {cells[0]: cells[1:] for line in last if line.startswith("│")
            for cells in [[c.strip() for c in line.strip("│").split("│")]]}
    tiers = doc["tiers"].values()
    assert rows["files"] == [str(t["files"]) for t in tiers]
    assert rows["hits"] == [str(t["hits"]) for t in tiers]
    assert [c.split(" (")[0] for c in rows["used"]] == [human_bytes(t["used_bytes"]) for t in tiers]
    assert [c.split(" (")[0] for c in rows["demoted"]] == [str(t["demoted_files"]) for t in tiers]
    assert [c.split(" (")[0] for c in rows["promoted"]] == [str(t["promoted_files"]) for t in tiers]
    misses = metrics.tier_misses(doc)
    assert rows["hit rate"] == [f"{100 * t['hits'] / (t['hits'] + misses[n]):.1f}%" for n, t in doc["tiers"].items()]
    assert rows["state"] == ["ok", "ok"]
    text = "\n".join(last)
    assert f"checksum failures {doc['checksum_failures']}" in " ".join(text.split())
    assert f"errors {doc['errors']}" in " ".join(text.split())
    assert f"ratio {doc['compression_ratio']:.3f}" in " ".join(text.split())
