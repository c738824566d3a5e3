"""Round trips of real KV bytes and random data through the mount with every codec and transform choice."""

from __future__ import annotations

import os

import pytest

from conftest import KvfsMount, kv_samples


@pytest.mark.parametrize("codec", ["zstd", "none"])
def test_real_kv_and_random_round_trip(make_mount, codec):
    m = make_mount().start("--codec", codec)
    ns = m.path("smollm2-bf16-abc123", "ab")
    ns.mkdir(parents=True)
    originals = {}
    for src in kv_samples("bf16") + kv_samples("fp16"):
        originals[src.name] = src.read_bytes()
        (ns / src.name).write_bytes(originals[src.name])
    originals["random.bin"] = os.urandom(2_500_001)
    (ns / "random.bin").write_bytes(originals["random.bin"])
    m.stop()
    m.start()  # read back cold, from the objects
    for name, data in originals.items():
        assert (ns / name).read_bytes() == data, name
        assert os.getxattr(ns / name, "user.kvfs.codec") == (b"zstd" if codec == "zstd" and name != "random.bin"
                                                             else b"none")
    if codec == "none":
        stats = m.stats()
        assert stats["stored_bytes"] >= stats["logical_bytes"]


@pytest.mark.parametrize("dtype,limit", [("bf16", 0.67), ("fp16", 0.86)])
def test_real_kv_ratio_in_vllm_block_order(make_mount, dtype, limit):
    """Ratio targets, measured through the mount on real KV in vLLM's block order, no hints, headers included:
    the default codec picks the entropy coder from a sample."""
    m = make_mount().start()
    raw = stored = 0
    for src in kv_samples(dtype):
        dst = m.path(src.name)
        dst.write_bytes(src.read_bytes())
        raw += dst.stat().st_size
        stored += int(os.getxattr(dst, "user.kvfs.stored_bytes"))
        assert os.getxattr(dst, "user.kvfs.codec") == b"entropy"  # chosen from a sample
    assert stored / raw <= limit, f"{dtype}: {stored / raw:.4f}"


def test_dtype_xattr_forces_the_transform(kvfs: KvfsMount):
    text = b"plain text is not float data " * 40_000
    auto, forced = kvfs.path("auto.txt"), kvfs.path("forced.txt")
    auto.write_bytes(text)
    forced.touch()
    os.setxattr(forced, "user.kvfs.dtype", b"bf16")
    forced.write_bytes(text)
    assert os.getxattr(auto, "user.kvfs.transform") == b"identity"
    assert os.getxattr(forced, "user.kvfs.transform") == b"byteplane2"
    assert forced.read_bytes() == text and auto.read_bytes() == text


def test_mount_dtype_option(make_mount):
    m = make_mount().start("--dtype", "none")
    src = kv_samples("bf16")[0]
    m.path("k").write_bytes(src.read_bytes())
    assert os.getxattr(m.path("k"), "user.kvfs.transform") == b"identity"
    assert m.path("k").read_bytes() == src.read_bytes()


def test_concurrent_readers_and_writers(kvfs: KvfsMount):
    import threading
    samples = [p.read_bytes() for p in kv_samples("bf16")]
    errors = []

    def work(k: int) -> None:
        try:
            for i in range(6):
                data = samples[(k + i) % len(samples)]
                p = kvfs.path(f"c{k}-{i}.kv")
                p.write_bytes(data)
                assert p.read_bytes() == data
                if i:
                    assert kvfs.path(f"c{k}-{i - 1}.kv").read_bytes() == samples[(k + i - 1) % len(samples)]
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
