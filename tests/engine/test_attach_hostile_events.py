"""KV events from a hostile publisher (a real ZMQ XPUB / ROUTER written here, on 127.0.0.1), read by
``python -m engine attach`` (the CLI surface) and by an ``EventSubscriber`` in this process (the thread itself):
events of the wrong type, frames that are not batches, a million hashes in one event, a pool filled past its
cap, a replay that never sends the end marker, an endpoint of ``tcp://0.0.0.0``. Bad events are counted and
skipped, the subscriber thread stays alive, and what a user sees says how many were skipped."""

from __future__ import annotations

import json
import time

import msgpack
import pytest

from engine.remote import view as view_module
from engine.remote.subscriber import EventSubscriber
from engine.remote.view import RemoteView
from engine.remote.wire import Batch, Stored, encode_batch
from tests.engine.hostile_remote import BLOCK, HostileServer, Publisher, attach, free_port, listening

MEMORY_MB = 500
GUARD_S = 20.0  # how long a test waits for something that takes milliseconds (a hang guard, not a measure)
PROMPT = list(range(1, 2 * BLOCK + 2))  # the hostile server's reply: 33 prompt ids + 2 tokens -> 2 full blocks


def good(first_hash: int = 1, blocks: int = 2) -> bytes:
    """A proper batch: the reply's first ``blocks`` blocks (chained, with their tokens)."""
    hashes = tuple(range(first_hash, first_hash + blocks))
    return encode_batch(Batch(time.time(), [Stored(hashes, None, tuple(PROMPT[:blocks * BLOCK]), BLOCK)]))


def bad_event_batch() -> bytes:
    """One event of the wrong type (its hashes a string) beside a proper one."""
    ok = {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None,
          "token_ids": PROMPT[:2 * BLOCK], "block_size": BLOCK}
    return msgpack.packb([time.time(), [{"type": "BlockStored", "block_hashes": "x"}, ok], 0])


def wait_for(cond, timeout: float = GUARD_S) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def _sources(pub: Publisher, **extra) -> dict:
    return {"0": {"enable_kv_cache_events": True, "endpoint": pub.endpoint, "topic": "", **extra}}


def test_attach_counts_and_skips_bad_events_and_keeps_reading():
    """One bad event, a payload that is not msgpack, a message of two frames and a sequence number of 3 bytes,
    then a proper batch: the CLI reports the proper blocks and '4 malformed events skipped'."""
    pub = Publisher()

    def script():
        assert pub.wait_subscriber()
        pub.send(0, bad_event_batch())
        pub.send(1, b"\xc1 not msgpack")
        pub.pub.send_multipart([b"", b"\x00" * 8])
        pub.pub.send_multipart([b"", b"\x00\x00\x02", good()])
        pub.send(2, good(10, 2))

    try:
        with HostileServer(sources=_sources(pub), on_chat=script) as server:
            run = attach(server.url, "--prompt", "hi", "--max-new-tokens", "4", "--watch", "1", "--json")
    finally:
        pub.close()
    assert run.rc == 0, run.err
    out = json.loads(run.out)
    assert out["events"]["malformed"] == 4 and out["events"]["batches"] == 2
    assert out["cached_blocks"] == 4 and out["chat_blocks"] == 2
    assert out["note"] == ("4 malformed events skipped (first: block_hashes 'x' is not a list of at most 65,536 "
                           "hashes)")
    assert run.peak_mb < MEMORY_MB


def test_a_million_hashes_disconnect_the_publisher_and_65537_are_one_malformed_event():
    """A 9 MB frame (10^6 hashes) is over ZMQ_MAXMSGSIZE: ZMQ drops the connection before allocating it and
    reconnects; the lost batch is a gap (the view starts over). An event of 65,537 hashes fits a frame but not
    an event: skipped, counted. The proper batch after them is drawn."""
    pub = Publisher()
    huge = msgpack.packb([time.time(), [{"type": "BlockStored", "block_hashes": list(range(2 ** 40, 2 ** 40 + 10 ** 6)),
                                         "token_ids": [], "block_size": BLOCK}], 0])
    wide = msgpack.packb([time.time(), [{"type": "BlockStored", "block_hashes": list(range(65_537)),
                                         "block_size": BLOCK}], 0])

    def script():
        assert pub.wait_subscriber()
        pub.send(0, huge)
        assert pub.wait_subscriber()  # ZMQ reconnected after dropping it
        pub.send(1, wide)
        pub.send(2, good())

    try:
        with HostileServer(sources=_sources(pub), on_chat=script) as server:
            run = attach(server.url, "--prompt", "hi", "--max-new-tokens", "4", "--watch", "1", "--json")
    finally:
        pub.close()
    assert run.rc == 0, run.err
    out = json.loads(run.out)
    assert (out["events"]["gaps"], out["events"]["resyncs"], out["events"]["malformed"]) == (1, 1, 1)
    assert out["cached_blocks"] == 2 and out["chat_blocks"] == 2
    assert "1 malformed event skipped (first: block_hashes" in out["note"]
    assert run.peak_mb < MEMORY_MB


def test_a_pool_filled_past_its_cap_stops_there():
    """2^20 + 65,536 distinct blocks, never removed: the view holds 2^20 (~250 MB) and skips the rest (--watch 10:
    time to apply them on a busy machine; ~1 s alone)."""
    pub = Publisher()
    per_event = 65_536

    def batch(i: int) -> bytes:
        ev = {"type": "BlockStored", "block_hashes": list(range(i * per_event + 1, (i + 1) * per_event + 1)),
              "block_size": BLOCK}
        return msgpack.packb([time.time(), [ev], 0])

    def script():
        assert pub.wait_subscriber()
        for i in range((view_module.MAX_POOL_BLOCKS // per_event) + 1):
            pub.send(i, batch(i))

    try:
        with HostileServer(sources=_sources(pub), on_chat=script) as server:
            run = attach(server.url, "--prompt", "hi", "--max-new-tokens", "4", "--watch", "10", "--json")
    finally:
        pub.close()
    assert run.rc == 0, run.err
    out = json.loads(run.out)
    assert out["cached_blocks"] == view_module.MAX_POOL_BLOCKS == 1_048_576
    assert out["events"]["malformed"] == 1 and "BlockStored past 1,048,576 cached blocks" in out["note"]
    assert run.peak_mb < MEMORY_MB


def _flood(pub: Publisher, ident: bytes, first: int) -> None:
    """A replay that never says -1: frames outside the range asked, then the same one again and again."""
    n = 0
    while not pub.stopped and n < 200_000:
        seq = 10 ** 6 + n if n % 2 else first
        pub.router.send_multipart([ident, b"", seq.to_bytes(8, "big", signed=True), good(100 + n % 7, 1)])
        n += 1
        if n % 1000 == 0:
            time.sleep(0.01)


def test_a_replay_that_never_ends_is_cut_and_the_view_goes_on():
    pub = Publisher(replay_fn=_flood)

    def script():
        assert pub.wait_subscriber()
        pub.send(5, good())  # batches 0-4 never sent: a gap the subscriber asks the replay socket for

    try:
        sources = _sources(pub, replay_endpoint=pub.replay_endpoint)
        with HostileServer(sources=sources, on_chat=script) as server:
            run = attach(server.url, "--prompt", "hi", "--max-new-tokens", "4", "--watch", "1", "--json")
        assert pub.requests == [0]
    finally:
        pub.close()
    assert run.rc == 0, run.err
    out = json.loads(run.out)
    assert (out["events"]["gaps"], out["events"]["resyncs"]) == (5, 1)  # 1 of 5 replayed: not enough
    assert out["chat_blocks"] == 2
    assert out["note"].startswith("5 event batches were missed")


def test_an_advertised_0000_endpoint_is_listened_for_on_loopback_only():
    """vLLM given ``tcp://0.0.0.0:P`` connects there (to its own machine): the subscriber must listen, and does,
    on 127.0.0.1 only — never on every interface because a server said so."""
    port = free_port()
    where: dict = {}

    def during(_pid):
        wait_for(lambda: listening(port))
        where["listening"] = listening(port)

    pub: list = []

    def script():  # a connecting publisher learns of the subscriber only once it sends: it sends a few
        pub.append(Publisher(connect_to=f"tcp://0.0.0.0:{port}"))
        for seq in range(20):
            pub[0].send(seq, good(1 + 2 * seq))
            time.sleep(0.05)

    try:
        sources = {"0": {"enable_kv_cache_events": True, "endpoint": f"tcp://0.0.0.0:{port}"}}
        with HostileServer(sources=sources, on_chat=script) as server:
            run = attach(server.url, "--prompt", "hi", "--max-new-tokens", "4", "--watch", "1", "--json",
                         during=during)
    finally:
        for p in pub:
            p.close()
    assert where["listening"] == {"127.0.0.1"}
    assert run.rc == 0, run.err
    assert json.loads(run.out)["chat_blocks"] == 2


# -- the thread itself --------------------------------------------------------------------------------------

@pytest.fixture
def subscribed():
    """An ``EventSubscriber`` in this process on a real publisher; yields (publisher, subscriber, view)."""
    pub = Publisher(replay_fn=_flood)
    view = RemoteView(BLOCK, 64)
    sub = EventSubscriber(view, pub.endpoint, "http://127.0.0.1:1", "", pub.replay_endpoint)
    sub.start()
    try:
        assert pub.wait_subscriber()
        yield pub, sub, view
    finally:
        sub.stop()
        pub.close()


def test_the_subscriber_thread_outlives_anything_it_receives(subscribed, monkeypatch):
    pub, sub, view = subscribed
    pub.send(0, bad_event_batch())
    pub.send(1, msgpack.packb({"ts": "yesterday", "events": []}))
    pub.send(2, msgpack.packb([1.0, [], 5000]))  # a data-parallel rank no server has: no pool 5000
    pub.pub.send_multipart([b"only one frame"])
    assert wait_for(lambda: view.malformed == 4)
    calls = []

    def broken(batch, live=True):  # a bug in the view: the thread must not die of it either
        calls.append(batch)
        raise RuntimeError("the view broke")

    monkeypatch.setattr(view, "apply", broken)
    pub.send(3, good())
    assert wait_for(lambda: view.malformed == 5)
    monkeypatch.undo()
    pub.send(4, good(10))
    assert wait_for(lambda: view.batches == 2)
    assert sub.alive and len(calls) == 1 and 5000 not in view.pools
    assert view.problem == "block_hashes 'x' is not a list of at most 65,536 hashes"
    assert view.snapshots()[0].cached_blocks == 4


def test_the_subscriber_replay_is_bounded_in_frames(subscribed):
    pub, sub, view = subscribed
    pub.send(0, good())
    assert wait_for(lambda: view.batches == 1)
    pub.send(50, good(20))  # 49 missing: the flood answers one of them, then junk, never -1
    assert wait_for(lambda: view.batches >= 2)
    snap = view.snapshots()[0]
    assert (snap.gaps, snap.resyncs, sub.replayed, sub.dropped) == (49, 1, 1, 48)
    assert pub.requests == [1] and sub.alive
