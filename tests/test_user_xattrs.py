"""Other tiers' metadata survives (issue "kvfs in a fleet", part 4): user.* xattrs set on a temporary file
before its rename, as vLLM's fs tier sets user.vllm.kv_crc32c (its opt-in CRC32C; the installed vLLM 0.32 has no
such option, so they are set here with setxattr, as setfattr would), survive the rename, every tier move, the
L4 round trip on a real Ceph RGW, and a restart."""

from __future__ import annotations

import os
import subprocess
import uuid
import zlib

import pytest

from test_l4 import settle, start_with_l4
from test_tiers import wait_for

XATTRS = {"user.vllm.kv_crc32c": None, "user.other.tag": b"\x00binary\xff value"}


def write_like_vllm(m, name: str, data: bytes) -> dict[str, bytes]:
    """Write a temp file, set its xattrs, rename it into place: vLLM's fs tier's order."""
    expected = {k: v if v is not None else b"%08x" % zlib.crc32(data) for k, v in XATTRS.items()}
    tmp = m.path(name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        for k, v in expected.items():
            os.setxattr(f.fileno(), k, v)
    os.rename(tmp, m.path(name))
    return expected


def xattrs_of(path) -> dict[str, bytes]:
    return {k: os.getxattr(path, k) for k in os.listxattr(path) if k.startswith("user.") and
            not k.startswith("user.kvfs.")}


def move(m, name: str, tier: str) -> None:
    os.setxattr(m.path(name), "user.kvfs.tier", tier.encode())
    assert os.getxattr(m.path(name), "user.kvfs.tier") == tier.encode()


def test_user_xattrs_survive_rename_moves_l4_and_restart(make_mount, ceph):
    prefix = f"xa-{uuid.uuid4().hex[:8]}"
    m = start_with_l4(make_mount(), ceph, prefix, "--promote", "never", l2="64M", l3="64M")
    data = os.urandom(3 << 20)
    expected = write_like_vllm(m, "chunk.kv", data)
    assert xattrs_of(m.path("chunk.kv")) == expected
    for tier in ("L3", "L4", "L2", "L4"):
        move(m, "chunk.kv", tier)
        settle(m)
        assert xattrs_of(m.path("chunk.kv")) == expected, tier
    m.stop()
    start_with_l4(m, ceph, prefix, "--promote", "never", l2="64M", l3="64M")
    assert xattrs_of(m.path("chunk.kv")) == expected
    assert m.path("chunk.kv").read_bytes() == data


def test_another_node_gets_a_published_files_user_xattrs(make_mount, ceph):
    """A shared prefix: what node A publishes carries its user.* attributes (S3 metadata), so node B's
    vLLM-style checksum check finds user.vllm.kv_crc32c on the file it reads."""
    prefix = f"xa-{uuid.uuid4().hex[:8]}"
    a = start_with_l4(make_mount("a"), ceph, prefix, "--l4-shared", "--promote", "never", l2="64M", l3="64M")
    b = start_with_l4(make_mount("b"), ceph, prefix, "--l4-shared", l2="64M", l3="64M")
    a.path("ns").mkdir()
    data = os.urandom(2 << 20)
    expected = write_like_vllm(a, "ns/c.kv", data)
    move(a, "ns/c.kv", "L4")
    assert xattrs_of(a.path("ns/c.kv")) == expected
    assert b.path("ns", "c.kv").read_bytes() == data
    assert xattrs_of(b.path("ns", "c.kv")) == expected
    assert xattrs_of(b.path("ns", "c.kv"))["user.vllm.kv_crc32c"] == b"%08x" % zlib.crc32(data)


def test_a_published_block_record_travels_and_is_announced_by_the_other_node(make_mount, ceph):
    """KV events across nodes: A publishes chunks with user.kvfs.blocks; B adopts them and announces their blocks
    in L4. A record too big for S3's metadata travels without its token ids (the hashes still name the blocks)."""
    from kvfs import events
    from kv_events import EventCollector

    prefix = f"xa-{uuid.uuid4().hex[:8]}"
    a = start_with_l4(make_mount("a"), ceph, prefix, "--l4-shared", "--promote", "never", l2="64M", l3="64M")
    endpoint = f"ipc://{a.root}/b.events"
    b = start_with_l4(make_mount("b"), ceph, prefix, "--l4-shared", "--promote", "never", "--events", endpoint,
                      l2="64M", l3="64M")
    small = events.BlockRecord(block_hashes=[os.urandom(8)[0] * 2**40 + i for i in range(4)], block_size=16,
                               token_ids=list(range(64)))
    big = events.BlockRecord(block_hashes=[os.urandom(32) for _ in range(16)], block_size=16,
                             token_ids=list(range(1000, 1256)))
    a.path("ns").mkdir()
    for name, rec in (("small.kv", small), ("big.kv", big)):
        a.path("ns", name).write_bytes(os.urandom(1 << 20))
        os.setxattr(a.path("ns", name), "user.kvfs.blocks", events.encode_record(rec))
        move(a, f"ns/{name}", "L4")
    with EventCollector([endpoint]) as sub:
        for name in ("small.kv", "big.kv"):
            assert b.path("ns", name).stat().st_size == 1 << 20  # B finds and adopts it
        wait_for(lambda: len(stored_events(sub)) == 2, what="B's two BlockStored")
        stored = stored_events(sub)
    got = {ev.block_hashes[-1]: ev for ev in stored}
    assert {ev.medium for ev in stored} == {"L4"}
    assert got[small.block_hashes[-1]].token_ids == small.token_ids  # whole
    assert got[big.block_hashes[-1]].block_hashes == big.block_hashes and got[big.block_hashes[-1]].token_ids == []


def stored_events(sub) -> list:
    return [ev for ev in sub.events() if type(ev).__name__ == "BlockStored"]


@pytest.mark.parametrize("tool", ["cp", "rsync"])
def test_a_copy_from_a_mount_with_l4_goes_into_one_without(make_mount, ceph, tmp_path, tool):
    """Backups and migrations (issue 40): files that lie in L4 copied out onto ext4 with cp -a / rsync -aX and on
    into a mount without L4: exit status 0, the bytes and the files' own xattrs (vLLM's checksum) travel,
    nothing moves. The copy carries no user.kvfs.tier: it used to, and `L4` was a move request the other mount
    refused (rsync exit 23: fsetxattr user.kvfs.tier failed: Invalid argument)."""
    prefix = f"xa-{uuid.uuid4().hex[:8]}"
    a = start_with_l4(make_mount("a"), ceph, prefix, "--promote", "never", l2="64M", l3="64M")
    a.path("ns").mkdir()
    data = {name: os.urandom(size) for name, size in (("c1.kv", 3 << 20), ("c2.kv", 1 << 20))}
    expected = {name: write_like_vllm(a, f"ns/{name}", d) for name, d in data.items()}
    move(a, "ns/c1.kv", "L4")
    move(a, "ns/c2.kv", "L3")
    settle(a)
    b = make_mount("b").start("--l3", f"{tmp_path / 'b-l3'}:64M", l2_size="64M")  # no L4
    out = tmp_path / "out"  # ext4

    def copy(src, dst) -> None:
        cmd = ["cp", "-a", str(src), str(dst)] if tool == "cp" else ["rsync", "-aX", f"{src}/", f"{dst}/"]
        res = subprocess.run(cmd, capture_output=True, text=True)
        assert res.returncode == 0 and res.stderr == "", res

    copy(a.path("ns"), out)
    for name in data:
        assert xattrs_of(out / name) == expected[name] and not any(k.startswith("user.kvfs.")
                                                                    for k in os.listxattr(out / name))
    copy(out, b.path("ns"))
    for name, d in data.items():
        assert b.path("ns", name).read_bytes() == d and xattrs_of(b.path("ns", name)) == expected[name]
        assert os.getxattr(b.path("ns", name), "user.kvfs.tier") == b"L2"  # where new files go
    assert b.stats()["requested_moves"] == 0
    assert [os.getxattr(a.path("ns", n), "user.kvfs.tier") for n in ("c1.kv", "c2.kv")] == [b"L4", b"L3"]
