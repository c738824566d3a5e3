"""The hot/cold API on real mounts: pin, unpin, move to a tier, prefetch, drop and the idle policy — through
xattrs, the CLI and kvfs.client — on files and directory trees, with the pin limit; cp -a and rsync -X in and
out of the mount."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvfs import client
from test_tiers import content, mover_idle, read_uncached, start_tiered, tier_of, wait_for

MiB = 1 << 20
KVFS = [sys.executable, "-m", "kvfs"]


def write_tree(m, files: dict[str, int]) -> dict[str, bytes]:
    data = {}
    for rel, size in files.items():
        p = m.path(rel)
        p.parent.mkdir(parents=True, exist_ok=True)
        data[rel] = content(rel, size)
        p.write_bytes(data[rel])
    return data


def pinned(path: Path) -> bool:
    return os.getxattr(path, "user.kvfs.pin") == b"1"


def kvfs_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*KVFS, *args], capture_output=True, text=True, timeout=120)


def settle(m) -> dict:
    wait_for(lambda: mover_idle(m), what="the mover to settle")
    return m.stats()


# -- xattrs ------------------------------------------------------------------------------------------------
def test_xattr_requests_on_files_and_trees(make_mount):
    m = start_tiered(make_mount(), "16M", "64M")
    data = write_tree(m, {"conv/a/f1": MiB, "conv/a/f2": MiB, "conv/b/f3": MiB, "other/g1": MiB})
    f1, f2, f3, g1 = (m.path(p) for p in ("conv/a/f1", "conv/a/f2", "conv/b/f3", "other/g1"))
    assert not pinned(f1)
    names = os.listxattr(f1)  # requests and where a file lies are readable by name, never listed
    assert not [n for n in names if n.startswith("user.kvfs.")], names

    os.setxattr(m.path("conv"), "user.kvfs.pin", b"1")  # a directory: its whole tree
    assert pinned(f1) and pinned(f2) and pinned(f3) and not pinned(g1)
    assert os.getxattr(m.path("conv"), "user.kvfs.pin") == b"1"
    with pytest.raises(OSError) as e:
        os.setxattr(f1, "user.kvfs.tier", b"L3")  # pinned: not demoted
    assert e.value.errno == errno.EBUSY
    os.setxattr(m.path("conv"), "user.kvfs.tier", b"L3")  # a tree skips its pinned files
    assert {tier_of(f) for f in (f1, f2, f3)} == {"L2"}
    with pytest.raises(OSError) as e:
        os.setxattr(f1, "user.kvfs.pin", b"maybe")
    assert e.value.errno == errno.EINVAL

    os.removexattr(f1, "user.kvfs.pin")  # removing the pin = unpin
    assert not pinned(f1) and os.getxattr(m.path("conv"), "user.kvfs.pin") == b"0"
    os.setxattr(f1, "user.kvfs.tier", b"L3")  # returns once it is there
    assert tier_of(f1) == "L3"
    os.setxattr(f1, "user.kvfs.tier", b"L3")  # its current value: nothing happens
    with pytest.raises(OSError) as e:
        os.setxattr(f1, "user.kvfs.tier", b"L7")
    assert e.value.errno == errno.EINVAL
    os.setxattr(f1, "user.kvfs.tier", b"L2")  # up works too
    assert tier_of(f1) == "L2"
    for name in ("user.kvfs.codec", "user.kvfs.stored_bytes", "user.kvfs.transform"):
        os.setxattr(f1, name, b"whatever")  # informational: ignored
    assert os.getxattr(f1, "user.kvfs.codec") != b"whatever"

    os.setxattr(g1, "user.kvfs.tier", b"L3")
    os.setxattr(g1, "user.kvfs.prefetch", b"1")  # in the background
    wait_for(lambda: tier_of(g1) == "L2", what="the prefetch")
    with pytest.raises(OSError) as e:
        os.getxattr(g1, "user.kvfs.prefetch")
    assert e.value.errno == errno.ENODATA

    stats = settle(m)
    assert stats["requested_moves"] == 3 and stats["prefetches"] == 1
    assert stats["tiers"]["L2"]["pinned_files"] == 2
    for rel, want in data.items():
        assert read_uncached(m.path(rel)) == want

    os.setxattr(g1, "user.kvfs.drop", b"1")  # out of every tier, name and all
    assert not g1.exists()
    os.setxattr(m.path("conv"), "user.kvfs.drop", b"1")  # a tree: pinned files too; directories stay
    assert not any(p.exists() for p in (f1, f2, f3)) and m.path("conv/a").is_dir()
    stats = m.stats()
    assert stats["tiers"]["L2"]["dropped_files"] == 4 and stats["tiers"]["L2"]["files"] == 0
    assert m.objects() == []
    m.check_accounting()


def test_pins_survive_pressure_and_restart(make_mount):
    """Pinned files stay in L2 while writers push everything else down, and are still pinned after a restart;
    a pinned file found in L3 is promoted."""
    m = start_tiered(make_mount(), "8M", "64M")
    hot = write_tree(m, {f"hot/{i}": MiB for i in range(3)})
    os.setxattr(m.path("hot/0"), "user.kvfs.tier", b"L3")
    subprocess.run(["setfattr", "-n", "user.kvfs.pin", "-v", "1", str(m.path("hot"))], check=True)
    wait_for(lambda: tier_of(m.path("hot/0")) == "L2", what="the pinned file's promotion")
    write_tree(m, {f"cold/{i}": MiB for i in range(24)})
    stats = settle(m)
    assert all(tier_of(m.path(f"hot/{i}")) == "L2" for i in range(3))
    assert stats["tiers"]["L2"]["demoted_files"] >= 18
    assert stats["tiers"]["L2"]["pinned_files"] == 3
    assert stats["tiers"]["L2"]["pinned_bytes"] >= 3 * MiB
    assert stats["tiers"]["L2"]["used_bytes"] <= stats["tiers"]["L2"]["capacity_bytes"]

    assert m.stop() == 0
    start_tiered(m, "8M", "64M")
    assert all(pinned(m.path(f"hot/{i}")) and tier_of(m.path(f"hot/{i}")) == "L2" for i in range(3))
    write_tree(m, {f"cold2/{i}": MiB for i in range(12)})
    settle(m)
    assert all(tier_of(m.path(f"hot/{i}")) == "L2" for i in range(3))
    for rel, want in hot.items():
        assert read_uncached(m.path(rel)) == want


def test_pin_past_the_limit_is_refused_whole(make_mount):
    """Pins may fill L2 up to its high watermark (90% of 10 MiB): a tree that would pass it is refused as a
    whole, with a clear message from the CLI and the client."""
    m = start_tiered(make_mount(), "10M", "64M")
    write_tree(m, {**{f"a/{i}": MiB for i in range(5)}, **{f"b/{i}": MiB for i in range(5)}})
    client.pin(m.path("a"), recursive=True)
    with pytest.raises(client.KvfsError) as e:
        client.pin(m.path("b"), recursive=True)
    assert e.value.errno == errno.ENOSPC and "pin refused" in str(e.value) and "9.0 MiB" in str(e.value)
    assert not any(pinned(m.path(f"b/{i}")) for i in range(5))  # nothing of the refused tree
    res = kvfs_cli("pin", "-r", str(m.path("b")))
    assert res.returncode == 1 and "pin refused" in res.stderr, res
    with pytest.raises(OSError) as e:  # the same request by xattr
        os.setxattr(m.path("b"), "user.kvfs.pin", b"1")
    assert e.value.errno == errno.ENOSPC
    client.pin([m.path(f"b/{i}") for i in range(3)])  # 8 of 9 MiB: granted
    pins = [m.path(f"a/{i}") for i in range(5)] + [m.path(f"b/{i}") for i in range(3)]
    # a promotion that found no room yet (unpinned files still being demoted) is queued again by the next
    # idle sweep: between the two the mover is idle with a pinned file still on L3
    wait_for(lambda: all(tier_of(p) == "L2" for p in pins), what="the pinned files' promotions")
    stats = settle(m)
    assert stats["pin_refusals"] == 3 and stats["mover"]["pin_limit_bytes"] == int(0.9 * 10 * MiB)
    assert stats["tiers"]["L2"]["pinned_files"] == 8  # all promoted to L2, some had been demoted
    assert stats["tiers"]["L2"]["used_bytes"] <= stats["tiers"]["L2"]["capacity_bytes"]


# -- the CLI and the client ------------------------------------------------------------------------------------
def test_cli_commands(make_mount):
    m = start_tiered(make_mount(), "16M", "64M")
    data = write_tree(m, {"s/x/1": MiB, "s/x/2": MiB, "s/3": MiB, "t": MiB})
    top = str(m.path("s"))
    res = kvfs_cli("demote", "--to", "L3", top)
    assert res.returncode == 1 and "is a directory" in res.stderr and "-r" in res.stderr
    res = kvfs_cli("demote", "--to", "L3", "-r", top)
    assert res.returncode == 0 and "3 paths" in res.stdout, res
    assert {tier_of(m.path(p)) for p in ("s/x/1", "s/x/2", "s/3")} == {"L3"} and tier_of(m.path("t")) == "L2"
    res = kvfs_cli("demote", "--to", "L9", str(m.path("t")))
    assert res.returncode == 1 and "no tier 'L9'" in res.stderr and "L2, L3" in res.stderr
    assert kvfs_cli("prefetch", "-r", top).returncode == 0
    wait_for(lambda: tier_of(m.path("s/x/1")) == "L2" and tier_of(m.path("s/3")) == "L2", what="prefetches")
    assert kvfs_cli("pin", "-r", top).returncode == 0
    assert pinned(m.path("s/x/2"))
    res = kvfs_cli("demote", "--to", "L3", str(m.path("s/3")))
    assert res.returncode == 1 and "is pinned" in res.stderr
    assert kvfs_cli("unpin", "-r", top).returncode == 0 and not pinned(m.path("s/x/2"))
    res = kvfs_cli("idle", "--after", "5m", "-r", top)
    assert res.returncode == 0 and os.getxattr(m.path("s/x/1"), "user.kvfs.idle") == b"300"
    res = kvfs_cli("idle", "--after", "soon", str(m.path("t")))
    assert res.returncode == 1 and "not an idle period" in res.stderr
    res = kvfs_cli("drop", "-r", top)
    assert res.returncode == 0 and "3 paths" in res.stdout
    assert not m.path("s/x/1").exists() and m.path("s/x").is_dir()
    outside = m.root / "outside"
    outside.write_bytes(b"x")
    res = kvfs_cli("pin", str(outside))
    assert res.returncode == 1 and "not in a kvfs mount" in res.stderr, res
    assert "user.kvfs.pin" not in os.listxattr(outside)
    assert read_uncached(m.path("t")) == data["t"]
    m.check_accounting()


def test_client_api(make_mount):
    m = start_tiered(make_mount(), "16M", "64M")
    write_tree(m, {"c/1": MiB, "c/2": 2 * MiB})
    progress = []
    assert client.demote(m.path("c"), to="L3", recursive=True, progress=lambda d, t: progress.append((d, t))) == 2
    assert progress == [(1, 2), (2, 2)]
    st = client.status(m.path("c/2"))
    assert (st.tier, st.pinned, st.size, st.idle_s) == ("L3", False, 2 * MiB, 0) and st.stored_bytes > 2 * MiB
    with pytest.raises(client.KvfsError) as e:
        client.pin(m.path("c"))
    assert e.value.errno == errno.EISDIR
    client.pin(m.path("c"), recursive=True)
    wait_for(lambda: client.status(m.path("c/1")).tier == "L2", what="pinned files promoted")
    with pytest.raises(client.KvfsError) as e:
        client.demote(m.path("c/1"), to="L3")
    assert e.value.errno == errno.EBUSY and "unpin" in str(e.value)
    client.unpin(m.path("c"), recursive=True)
    client.set_idle(m.path("c"), "2h", recursive=True)
    assert client.status(m.path("c/1")).idle_s == 7200
    client.set_idle(m.path("c/1"), None)  # back to the mount's default (off)
    assert client.status(m.path("c/1")).idle_s == 0
    assert client.prefetch([m.path("c/1"), m.path("c/2")]) == 2
    assert client.drop(m.path("c/2")) == 1 and not m.path("c/2").exists()


# -- the idle policy -------------------------------------------------------------------------------------------
def test_idle_policy_moves_files_down_a_tier_per_period(make_mount, tmp_path):
    """Per directory (inherited by new files): not read for 2 s → L3, for 4 s → L4; a file read meanwhile stays;
    the mount-wide --idle applies to files without their own policy."""
    m = make_mount()
    l4 = tmp_path / "l4"
    start_tiered(m, "32M", "64M", "--l4", str(l4), "--idle", "off")
    m.path("chat").mkdir()
    os.setxattr(m.path("chat"), "user.kvfs.idle", b"2s")
    data = write_tree(m, {"chat/old": MiB, "chat/busy": MiB, "plain": MiB})  # created after: they inherit
    assert os.getxattr(m.path("chat/old"), "user.kvfs.idle") == b"2"
    assert os.getxattr(m.path("plain"), "user.kvfs.idle") == b"0"
    started = time.monotonic()
    deadline = started + 7
    while time.monotonic() < deadline:
        read_uncached(m.path("chat/busy"))
        time.sleep(0.3)
    assert tier_of(m.path("chat/old")) == "L4"
    assert tier_of(m.path("chat/busy")) == "L2" and tier_of(m.path("plain")) == "L2"
    stats = m.stats()
    assert stats["tiers"]["L2"]["idle_demoted_files"] == 1 and stats["tiers"]["L3"]["idle_demoted_files"] == 1
    assert read_uncached(m.path("chat/old")) == data["chat/old"]  # a read brings it back: a local L4 is
    wait_for(lambda: tier_of(m.path("chat/old")) == "L2", what="promotion after a read")  # promoted by the mover
    assert m.stop() == 0

    start_tiered(m, "32M", "64M", "--l4", str(l4), "--idle", "2s")  # the mount's default
    # not read for over 4 s (two periods) by now: two tiers down
    wait_for(lambda: tier_of(m.path("plain")) == "L4", timeout=10, what="the mount-wide idle policy")
    assert "idle policy" in m.log_text()  # one line per batch


def test_drop_of_an_open_file(make_mount):
    """An open file keeps its data for its handle (as after unlink); the name goes at once; the object at close."""
    m = start_tiered(make_mount(), "16M", "64M")
    data = write_tree(m, {"d": 2 * MiB})
    with open(m.path("d"), "rb") as f:
        os.setxattr(m.path("d"), "user.kvfs.drop", b"1")
        assert not m.path("d").exists()
        assert f.read() == data["d"]
    wait_for(lambda: m.objects() == [], what="the object to go")
    m.check_accounting()


# -- copies in and out -------------------------------------------------------------------------------------------
OWN_XATTRS = {"user.owner": b"engine-7", "user.vllm.kv_crc32c": b"1c2d3e4f", "user.bin": b"\x00binary\xff"}


def own_xattrs(path: Path) -> dict[str, bytes]:
    return {k: os.getxattr(path, k) for k in os.listxattr(path) if not k.startswith("user.kvfs.")}


def kvfs_names(path: Path) -> list[str]:
    return sorted(k for k in os.listxattr(path) if k.startswith("user.kvfs."))


@pytest.mark.parametrize("tool", ["cp", "rsync"])
def test_copy_in_and_out_with_xattrs(make_mount, tmp_path, tool):
    """Backups and migrations (issue 40): cp -a and rsync -aX copy files out of a mount onto ext4, back into it
    and into another mount that has no L3, with exit status 0 and nothing on stderr. The data, the files' and
    directories' own xattrs and kvfs's encoding hints travel; where a file lies (tier), how it is stored (codec,
    stored bytes, transform), pins and quotas do not: they are readable by name, not listed. So the copies in
    move nothing. Before, user.kvfs.tier was listed: copied back in it was a move request (L3 moved the new
    copy), and into a mount without that tier it failed (rsync exit 23, fsetxattr: Invalid argument)."""
    m = start_tiered(make_mount(), "16M", "64M", "--promote", "never")
    other = make_mount("other").start("--l3", "none", l2_size="64M")
    data = write_tree(m, {"src/a": MiB, "src/sub/b": 300_000, "src/sub/c": 200_000})
    for rel in data:
        for k, v in OWN_XATTRS.items():
            os.setxattr(m.path(rel), k, v)
    os.setxattr(m.path("src/a"), "user.kvfs.dtype", b"bf16")
    os.setxattr(m.path("src/sub/b"), "user.kvfs.tier", b"L3")
    os.setxattr(m.path("src/sub"), "user.dir.tag", b"d")
    os.setxattr(m.path("src/sub"), "user.kvfs.quota", b"8M")  # the mount's policy, as pins are: not copied
    client.pin(m.path("src/a"))
    assert os.getxattr(m.path("src/sub"), "user.kvfs.quota") == b"L2=8388608"  # readable by name
    out = tmp_path / "out"  # ext4

    def copy(src: Path, dst: Path) -> None:
        cmd = ["cp", "-a", str(src), str(dst)] if tool == "cp" else ["rsync", "-aX", f"{src}/", f"{dst}/"]
        res = subprocess.run(cmd, capture_output=True, text=True)
        assert res.returncode == 0 and res.stderr == "", res

    def check_copy(top: Path) -> None:
        for rel in data:
            path = top / rel.removeprefix("src/")
            assert own_xattrs(path) == OWN_XATTRS, path
            assert kvfs_names(path) == (["user.kvfs.dtype"] if rel == "src/a" else []), path
        assert os.getxattr(top / "a", "user.kvfs.dtype") == b"bf16"
        assert own_xattrs(top / "sub") == {"user.dir.tag": b"d"} and kvfs_names(top / "sub") == []

    copy(m.path("src"), out)
    check_copy(out)
    assert (out / "a").read_bytes() == data["src/a"] and (out / "sub" / "b").read_bytes() == data["src/sub/b"]
    assert tier_of(m.path("src/sub/b")) == "L3"
    moved = m.stats()["requested_moves"]
    copy(out, m.path("back"))  # into the mount
    copy(out, other.path("copy"))  # into a mount without L3: L3 names no tier there
    for top in (m.path("back"), other.path("copy")):
        check_copy(top)
        for rel in data:
            path = top / rel.removeprefix("src/")
            assert read_uncached(path) == data[rel]
            assert tier_of(path) == "L2" and not pinned(path), path  # where new files go: nothing moved
        with pytest.raises(OSError) as e:
            os.getxattr(top / "sub", "user.kvfs.quota")
        assert e.value.errno == errno.ENODATA
    assert m.stats()["requested_moves"] == moved and other.stats()["requested_moves"] == 0
    copy(m.path("src"), m.path("again"))  # within the mount
    check_copy(m.path("again"))
    assert read_uncached(m.path("again/sub/b")) == data["src/sub/b"] and not pinned(m.path("again/a"))
    assert tier_of(m.path("again/sub/b")) == "L2" and tier_of(m.path("src/sub/b")) == "L3"
    shutil.rmtree(out)
    m.check_accounting()
    other.check_accounting()


def test_copy_that_carries_kvfs_info_goes_in(make_mount, tmp_path):
    """A copy made elsewhere may carry kvfs's informational attributes (a tool that copies by name, a copy made
    by an older kvfs that listed them): set by rsync -aX, the codec, stored size and transform of another mount,
    and a tier this file is in already, succeed and change nothing."""
    m = make_mount().start(l2_size="64M")
    out = tmp_path / "out"
    out.mkdir()
    data = content("x", 500_000)
    (out / "x").write_bytes(data)
    carried = {"user.kvfs.codec": b"qat", "user.kvfs.stored_bytes": b"12345", "user.kvfs.transform": b"xor-delta",
               "user.kvfs.tier": b"L2", "user.kvfs.object": b"L2 1 2 /nowhere", "user.kvfs.congested": b"1",
               "user.owner": b"engine-7"}
    for k, v in carried.items():
        os.setxattr(out / "x", k, v)
    res = subprocess.run(["rsync", "-aX", f"{out}/", f"{m.path('in')}/"], capture_output=True, text=True)
    assert res.returncode == 0 and res.stderr == "", res
    f = m.path("in", "x")
    assert read_uncached(f) == data and own_xattrs(f) == {"user.owner": b"engine-7"} and kvfs_names(f) == []
    assert os.getxattr(f, "user.kvfs.codec") != b"qat" and os.getxattr(f, "user.kvfs.tier") == b"L2"
    assert int(os.getxattr(f, "user.kvfs.stored_bytes")) > 400_000
    for k in carried:
        if k != "user.owner":
            os.removexattr(f, k)  # succeeds, changes nothing
    assert os.getxattr(f, "user.kvfs.tier") == b"L2" and m.stats()["requested_moves"] == 0


# -- the vLLM connector's options ----------------------------------------------------------------------------------
def test_connector_prefetches_scheduled_chunks_and_marks_finished_ones_idle(make_mount):
    """prefetch: a request's stored chunks go to L2 as soon as the scheduler looks it up; demote_after_idle_s:
    a finished request's chunks go down a tier once nobody read them for that long."""
    from connector_fakes import FakeRequest

    from kvfs_connector.mount import MountGuard
    from kvfs_connector.plan import Planner
    from kvfs_connector.settings import Settings

    settings = Settings.from_extra({"mount": "/x", "prefetch": True, "demote_after_idle_s": 2})
    with pytest.raises(ValueError):
        Settings.from_extra({"mount": "/x", "demote_after_idle_s": -1})
    m = start_tiered(make_mount(), "32M", "64M")
    planner = Planner(mount=str(m.mountpoint), namespaces=lambda: ["ns"], block_size=128, hash_block_size=128,
                      chunk_size=256, save_decode=True, guard=MountGuard(str(m.mountpoint), require_mount=True),
                      prefetch=settings.prefetch, demote_after_idle_s=settings.demote_after_idle_s)
    req = FakeRequest("r1", list(range(1100)), 1100)
    paths = [planner.chunk_paths(req, k)[0] for k in range(3)]
    for p in paths:  # stored earlier, since demoted
        os.makedirs(os.path.dirname(p), exist_ok=True)
        Path(p).write_bytes(content(p, 300_000))
        os.setxattr(p, "user.kvfs.tier", b"L3")
    assert planner.lookup(req, 0) == 768
    assert planner.stats["prefetched_chunks"] == 3
    wait_for(lambda: all(tier_of(Path(p)) == "L2" for p in paths), what="the prefetched chunks")
    planner.lookup(req, 0)  # looked up again while it waits for blocks: not prefetched twice
    assert planner.stats["prefetched_chunks"] == 3 and m.stats()["prefetches"] == 3

    planner.allocated(req, list(range(8)), 768)
    planner.finished("r1")
    assert planner.stats["idle_marked_chunks"] == 3
    assert all(os.getxattr(p, "user.kvfs.idle") == b"2" for p in paths)
    wait_for(lambda: all(tier_of(Path(p)) == "L3" for p in paths), timeout=10, what="idle chunks demoted")


def test_logs_say_what_happened_not_every_request(make_mount):
    """One line per significant event: a workload of hundreds of requests with demotions, promotions and
    requests by name logs a handful of lines — mount, demotion batches — and nothing per request."""
    m = start_tiered(make_mount(), "8M", "64M")
    data = write_tree(m, {f"w/{i}": 512 << 10 for i in range(40)})
    for rel, want in data.items():
        assert read_uncached(m.path(rel)) == want
    client.demote(m.path("w"), to="L3", recursive=True)
    client.prefetch(m.path("w"), recursive=True)
    settle(m)
    lines = [line for line in m.log_text().splitlines() if not line.startswith("===")]
    assert any("mounted" in line for line in lines)
    assert any("drained" in line and "demoted to L3" in line for line in lines), lines
    assert len(lines) <= 30, lines  # 40 files written, read, demoted and prefetched: thousands of requests
