"""A fleet of three nodes (issue "kvfs in a fleet", part 5): each node its own network namespace, veth'd into
a hub bridge, with its own kvfs daemon, mount, L2 and L3; all three on one shared L4 prefix of one real Ceph
RGW, reached over the veths (tools/fleet.py forwards the hub's 10.77.0.1 to RGW's 127.0.0.1). The KV events of
all three reach one subscriber in the hub. The chunks are real: block 4 of three real prompts (tests/data/kv),
named and written as the connector does, each with its block record (the block's real token ids).

Node A stores chunks; B and C read them bit-exact. B is killed during a publish, its upload cut mid-body on
the wire: nothing of it is ever visible, A and C go on, and B's restart publishes what it had committed."""

from __future__ import annotations

import sys
import time
import uuid

import pytest
from conftest import REPO, s3_client
from kv_events import EventCollector
from test_l4 import settle
from test_tiers import tier_of, wait_for
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

from kvfs.events import blocks_of, parse_record
from kvfs_connector import files

sys.path.insert(0, str(REPO / "tools"))
import fleet as fleetlib  # noqa: E402

NODES = ["a", "b", "c"]
EVENTS_PORT = 5557


class HubSubscriber(EventCollector):
    """The collector, its ZMQ context made in the hub's namespace: ZMQ's I/O threads (which make the
    connections) inherit the namespace of the thread that starts them."""

    def __init__(self, net: fleetlib.Fleet, endpoints: list[str]) -> None:
        super().__init__(endpoints)
        self.net = net

    def _run(self) -> None:
        fleetlib.enter(self.net.hub)
        super()._run()


@pytest.fixture
def fleet(ceph):
    """Namespaces and the RGW forwarder, removed afterwards (after make_mount's daemons stopped, when the test
    asks for this fixture first)."""
    net = fleetlib.Fleet(NODES)
    try:
        net.up()
        fwd = fleetlib.Forwarder(net.hub, (net.hub_ip, ceph.port), ("127.0.0.1", ceph.port))
    except BaseException:
        net.down()
        raise
    yield net, fwd
    fwd.close()
    net.down()
    assert not net.exists()


def start_node(m, net: fleetlib.Fleet, node: str, ceph, prefix: str):
    m.launcher = net.launcher(node)
    env = {**ceph.env, "AWS_ENDPOINT_URL": f"http://{net.hub_ip}:{ceph.port}"}
    return m.start("--l3", f"{m.root / (node + '-l3')}:64M", "--l4", f"s3://kvfs-test/{prefix}", "--l4-shared",
                   "--l4-write", "through", "--events", endpoint(net, node), l2_size="64M", env=env)


def endpoint(net: fleetlib.Fleet, node: str) -> str:
    return f"tcp://{net.ip[node]}:{EVENTS_PORT}"


def published(ceph, prefix: str) -> dict[str, int]:
    """Published files under the prefix: path → size."""
    s3 = s3_client(ceph)
    out = s3.list_objects_v2(Bucket="kvfs-test", Prefix=f"{prefix}/files/")
    return {o["Key"].split("/files/", 1)[1]: o["Size"] for o in out.get("Contents", [])}


def store(m, chunk: fleetlib.Chunk) -> None:
    """As the connector saves a chunk: a temporary name, its xattrs, a rename (published ~1 s later)."""
    assert files.write_atomic(str(m.path(chunk.relpath)), [chunk.data], chunk.xattrs()) == "mount"


def wait_published(m, n: int) -> None:
    wait_for(lambda: m.stats()["published_through"] >= n, timeout=20, what=f"{n} files published")


def read_on(m, chunk: fleetlib.Chunk) -> None:
    """A first read on a node that does not have the chunk: found in the store, bit-exact, promoted."""
    assert m.path(chunk.relpath).read_bytes() == chunk.data
    wait_for(lambda: tier_of(m.path(chunk.relpath)) == "L2", what="promotion")


def check_local_tiers(m) -> None:
    """L2 and L3 hold exactly what the node's index says (the shared L4 is kvfs gc's to account for)."""
    stats = settle(m)
    m.check_accounting({"tiers": {t: v for t, v in stats["tiers"].items() if t in ("L2", "L3")}})


def held(sub: HubSubscriber, net: fleetlib.Fleet, node: str, n_events: int) -> set:
    """The subscriber's view of a node: (medium, hash) pairs, once it has received n_events from it."""
    return blocks_of(sub.wait(n_events, endpoint(net, node), timeout=20))


def test_three_nodes_share_chunks_and_survive_a_kill_mid_publish(fleet, make_mount, ceph):
    net, fwd = fleet
    prefix = f"fleet-{uuid.uuid4().hex[:8]}"
    prose, python, chat = fleetlib.prompt_chunks()
    with HubSubscriber(net, [endpoint(net, n) for n in NODES]) as sub:
        a, b, c = (start_node(make_mount(n), net, n, ceph, prefix) for n in NODES)
        for n in NODES:
            assert isinstance(sub.wait(1, endpoint(net, n))[0], AllBlocksCleared)

        # A stores a chunk of a real prompt; B and C read it bit-exact from the store, and say so
        store(a, prose)
        wait_published(a, 1)
        assert published(ceph, prefix) == {prose.relpath: a.stats()["tiers"]["L2"]["used_bytes"]}
        read_on(b, prose)
        read_on(c, prose)
        assert held(sub, net, "a", 2) == {("L2", prose.block_hash)}
        for n in ("b", "c"):  # adopted (L4), then promoted: vLLM's protocol has no move event
            events = sub.wait(4, endpoint(net, n))
            assert [(type(e), e.medium) for e in events[1:]] == [(BlockStored, "L4"), (BlockRemoved, "L4"),
                                                               (BlockStored, "L2")]
            assert events[1].token_ids == events[3].token_ids == parse_record(prose.record).token_ids  # it travelled
        assert fwd.connections > 0 and c.stats()["checksum_failures"] == 0

        # B is killed during a publish: its upload is cut on the wire, after the headers and 256 KiB of body
        hold = fwd.hold(net.ip["b"], f"PUT /kvfs-test/{prefix}/files/{chat.relpath}".encode())
        store(b, chat)
        assert hold.held.wait(20), "B's publish never started"
        assert chat.relpath not in published(ceph, prefix) and not c.path(chat.relpath).exists()
        b.kill9()
        assert hold.closed.wait(10)
        time.sleep(0.5)  # RGW has seen the connection end mid-body
        s3 = s3_client(ceph)
        assert chat.relpath not in published(ceph, prefix)
        assert not s3.list_multipart_uploads(Bucket="kvfs-test", Prefix=prefix).get("Uploads")
        assert not c.path(chat.relpath).exists() and not a.path(chat.relpath).exists()

        # A and C are unaffected: A publishes, C reads it at once, bit-exact
        store(a, python)
        wait_published(a, 2)
        read_on(c, python)
        assert held(sub, net, "a", 3) == {("L2", prose.block_hash), ("L2", python.block_hash)}
        assert held(sub, net, "c", 7) == {("L2", prose.block_hash), ("L2", python.block_hash)}

        # B's restart: its index and tiers agree, it publishes the chunk it had committed, every node reads it
        seen = len(sub.events(endpoint(net, "b")))
        start_node(b, net, "b", ceph, prefix)
        wait_published(b, 1)
        assert chat.relpath in published(ceph, prefix) and b.stats()["publish_conflicts"] == 0
        check_local_tiers(b)
        restarted = sub.wait(seen + 3, endpoint(net, "b"))[seen:]
        assert isinstance(restarted[0], AllBlocksCleared)
        assert blocks_of(restarted) == {("L2", prose.block_hash), ("L2", chat.block_hash)}
        read_on(a, chat)
        wait_for(lambda: c.path(chat.relpath).exists(), what="C finds B's chunk")  # a miss is remembered for 1 s
        read_on(c, chat)
        read_on(b, python)
        everything = {("L2", ch.block_hash) for ch in (prose, python, chat)}
        assert held(sub, net, "c", 10) == everything and held(sub, net, "a", 6) == everything
        for m in (a, b, c):
            check_local_tiers(m)
            assert m.stats()["checksum_failures"] == 0
