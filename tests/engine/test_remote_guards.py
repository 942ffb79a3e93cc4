"""The remote client's rules as tables: where a subscriber's socket goes for each endpoint a server may advertise
(no socket is opened for the non-loopback addresses below — they are refused or only spelled), what every
malformed event field becomes, the pool's caps, and a remote engine whose server names an address we will not
listen on (the chat works, the note says why the map stays empty)."""

from __future__ import annotations

import msgpack
import pytest

from engine.remote import view as view_module
from engine.remote.attach import RemoteEngine
from engine.remote.client import RemoteError
from engine.remote.metrics import label_int, metrics_of
from engine.remote.subscriber import EndpointRefused, local_endpoint, replay_address
from engine.remote.view import RemoteView, check_shape
from engine.remote.wire import Batch, Stored, decode_batch
from tests.engine.hostile_remote import HostileServer

LOCAL, FAR = "http://127.0.0.1:8000", "http://192.0.2.5:8000"  # 192.0.2.0/24: documentation, never routed


@pytest.mark.parametrize("endpoint,server,given,want", [
    ("tcp://*:5557", FAR, False, ("tcp://192.0.2.5:5557", False)),  # vLLM binds every interface: connect
    ("tcp://[::]:5557", "http://[::1]:8000", False, ("tcp://[::1]:5557", False)),
    ("tcp://0.0.0.0:5557", LOCAL, False, ("tcp://127.0.0.1:5557", True)),  # vLLM connects to itself: us, here
    ("tcp://0.0.0.0:5557", FAR, False, ("tcp://192.0.2.5:5557", False)),  # never listen on every interface
    ("tcp://127.0.0.1:5557", "http://localhost:8000", False, ("tcp://127.0.0.1:5557", True)),
    ("tcp://192.0.2.5:5557", FAR, False, ("tcp://192.0.2.5:5557", False)),  # the server's own address
    ("tcp://192.0.2.9:5557", FAR, True, ("tcp://192.0.2.9:5557", True)),  # the user said so (--events)
    ("ipc:///tmp/kv.sock", LOCAL, False, ("ipc:///tmp/kv.sock", False)),
])
def test_where_the_subscriber_goes(endpoint, server, given, want):
    assert local_endpoint(endpoint, server, given) == want


@pytest.mark.parametrize("endpoint,server,says", [
    ("tcp://192.0.2.9:5557", FAR, "KV Scope listens only on loopback for a server's say-so"),
    ("tcp://10.1.2.3:5557", LOCAL, "KV Scope listens only on loopback for a server's say-so"),
    ("tcp://127.0.0.1:5557", FAR, "publishes its KV events on its own loopback (tcp://127.0.0.1:5557)"),
    ("inproc://kv", LOCAL, "lives inside the server's process"),
    ("tcp://127.0.0.1:99999", LOCAL, "is not tcp://HOST:PORT with a port 1-65535"),
    ("udp://127.0.0.1:5557", LOCAL, "is not a tcp:// or ipc:// address"),
])
def test_endpoints_we_will_not_use_are_one_line(endpoint, server, says):
    with pytest.raises(EndpointRefused) as e:
        local_endpoint(endpoint, server)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_replay_goes_only_where_we_can_reach():
    assert replay_address("tcp://*:5558", FAR) == "tcp://192.0.2.5:5558"
    assert replay_address("tcp://0.0.0.0:5558", LOCAL) == "tcp://127.0.0.1:5558"
    assert replay_address("tcp://127.0.0.1:5558", FAR) is None  # the server's own loopback
    assert replay_address("tcp://192.0.2.9:5558", FAR) is None  # someone else's machine
    assert replay_address(None, LOCAL) is None


def _one(event) -> Batch:
    return decode_batch(msgpack.packb([1.0, [event], 0]))


STORED = {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None, "token_ids": list(range(8)),
          "block_size": 4}


@pytest.mark.parametrize("change,says", [
    ({"block_hashes": "x"}, "block_hashes 'x' is not a list of at most 65,536 hashes"),
    ({"block_hashes": [1.5]}, "block hash 1.5 is not a block hash"),
    ({"block_hashes": [b"x" * 65]}, "is not a block hash (an integer, or up to 64 bytes)"),
    ({"block_hashes": list(range(65_537))}, "is not a list of at most 65,536 hashes"),
    ({"parent_block_hash": [1]}, "parent_block_hash [1] is not a block hash"),
    ({"token_ids": "abc"}, "token_ids 'abc' is not a list"),
    ({"token_ids": [1, -1]}, "holds something other than token ids"),
    ({"token_ids": [1, "a"]}, "holds something other than token ids"),
    ({"token_ids": list(range(9))}, "BlockStored has 9 token ids for 2 blocks of 4"),
    ({"block_size": "4"}, "block_size '4' is not an integer from 0 to 65,536"),
    ({"block_size": True}, "block_size True is not an integer"),
    ({"block_size": 10 ** 9}, "block_size 1000000000 is not an integer from 0 to 65,536"),
    ({"medium": 5}, "medium 5 is not a short name"),
    ({"medium": "GPU\x1b[31m"}, "is not a short name"),
    ({"group_idx": -1}, "group_idx -1 is not an integer from 0 to 1,024"),
    ({"type": 5}, "event type 5 is not a name"),
])
def test_a_bad_field_skips_its_event_and_says_which(change, says):
    batch = _one({**STORED, **change})
    assert batch.events == [] and batch.skipped == 1 and says in batch.problem


def test_good_events_and_unknown_kinds_pass():
    assert _one(STORED).events == [Stored((1, 2), None, tuple(range(8)), 4, None, None, None)]
    assert _one({"type": "SomethingNewer", "x": 1}).events == [] and _one({"type": "SomethingNewer"}).skipped == 0
    removed = _one({"type": "BlockRemoved", "block_hashes": [b"h" * 32], "medium": "GPU"})
    assert removed.skipped == 0 and removed.events[0].hashes == (b"h" * 32,)


@pytest.mark.parametrize("payload,says", [
    (b"\xc1", "not msgpack"),
    (msgpack.packb({1: 2}), "not msgpack"),  # a map key that is not text
    (msgpack.packb([1.0, "events", 0]), "not a KV event batch"),
    (msgpack.packb([float("nan"), [], 0]), "batch time nan is not a finite number"),
    (msgpack.packb(["yesterday", [], 0]), "batch time 'yesterday' is not a finite number"),
    (msgpack.packb([1.0, [], 5000]), "data_parallel_rank 5000 is not an integer from 0 to 63"),
    (b"\x91" * 100_000, "not msgpack"),  # 100,000 nested arrays
    (msgpack.packb([1.0, [0] * ((1 << 20) + 1), 0]), "not msgpack"),  # an array past msgpack's cap here
])
def test_a_payload_that_is_not_a_batch_is_one_error(payload, says):
    with pytest.raises(ValueError) as e:
        decode_batch(payload)
    assert says in str(e.value)


def test_the_pool_stops_at_its_cap_and_counts_the_rest(monkeypatch):
    monkeypatch.setattr(view_module, "MAX_POOL_BLOCKS", 8)
    view = RemoteView(4, 0)
    for first in (1, 5, 9):  # 4 + 4 fit; the third event would make 12
        view.apply(Batch(1.0, [Stored(tuple(range(first, first + 4)), None, (), 4)], rank=first % 2))
    assert sum(s.cached_blocks for s in view.snapshots()) == 8
    assert view.malformed == 1 and view.problem.startswith("BlockStored past 8 cached blocks")


@pytest.mark.parametrize("shape,says", [
    ((16, 300_000_000, 1), "has 300,000,000 blocks: more than the 1,048,576 a remote view follows"),
    ((10 ** 6, 64, 1), "blocks hold 1,000,000 tokens: more than 65,536"),
    ((16, 64, 2000), "reports 2,000 engines (data-parallel ranks): more than the 64"),
])
def test_pool_shapes_no_server_has_are_refused(shape, says):
    with pytest.raises(ValueError) as e:
        check_shape(*shape)
    assert says in str(e.value)
    view = RemoteView(16, 64)
    with pytest.raises(ValueError):
        view.set_shape(*shape)
    assert (view.block_size, view.num_blocks) == (16, 64)  # kept what it had


def test_metrics_junk_reads_as_zero_and_huge_stays_huge():
    assert [label_int(v) for v in ("32", "abc", None, "", "-5", "١٢", "9" * 5000)] == [32, 0, 0, 0, 0, 0, 10 ** 18]
    m = metrics_of('vllm:kv_cache_usage_perc 7\nvllm:prefix_cache_hits_total inf\nvllm:prefix_cache_hits_total 1e308\n'
                   'vllm:prefix_cache_hits_total 1e308\nvllm:cache_config_info{block_size="x",num_gpu_blocks="8"} 1\n'
                   'vllm:cache_config_info{block_size="16",num_gpu_blocks="8"} 1\nother_metric 1\n')
    assert (m.kv_usage, m.prefix_hits, m.block_size, m.num_blocks, m.engines) == (1.0, 1e15, 16, 16, 2)


def test_a_server_naming_an_address_we_will_not_listen_on_still_chats():
    sources = {"0": {"enable_kv_cache_events": True, "endpoint": "tcp://192.0.2.9:5557"}}
    with HostileServer(sources=sources) as server:
        eng = RemoteEngine(server.url)
        try:
            assert eng.subscribers == []
            assert "KV Scope listens only on loopback" in eng.note
            assert eng.chat([{"role": "user", "content": "hi"}], 4).text == "Once upon"
        finally:
            eng.close()
        with pytest.raises(RemoteError) as e:  # one the user gave: an error at once, not a note
            RemoteEngine(server.url, events="inproc://kv")
        assert "lives inside the server's process" in str(e.value)
