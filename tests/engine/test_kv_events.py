"""KV Scope's server speaks vLLM's KV events protocol, and the remote view reads it: a real server on 127.0.0.1
(stories260K, pages of 16; two API keys, so two tenants), a real ZMQ subscriber, the real HTTP client and
``python -m engine attach``. A keyed server's events carry no token ids: the view finds a chat's blocks by hash."""

from __future__ import annotations

import http.server
import json
import socket
import threading
import time

import msgpack
import pytest
import zmq

from engine.config import CacheConfig
from engine.remote.attach import RemoteEngine
from engine.remote.client import RemoteError, metrics_of
from engine.remote.view import SLOT_CHAT, SLOT_EVICTED, SLOT_OTHER, RemotePool
from engine.remote.wire import Batch, Cleared, Removed, Stored, decode_batch, encode_batch
from engine.server import KVServer, ServerOptions, ServerThread
from engine.server.kv_events import KVEventsConfig

P = 16
STORY = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park with her dog."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def events_server(stories_path):
    from engine.model.loader import load_model

    cfg = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:*", topic="kv-events",
                         replay_endpoint="tcp://127.0.0.1:*")  # ports ZMQ picks: /kv_event_sources says them
    lm = load_model(str(stories_path))
    server = KVServer(lm, CacheConfig(page_size=P), ServerOptions(kv_events=cfg, api_key="sekret",
                                                                  api_keys=("other",)))
    thread = ServerThread(server)
    url = thread.start()
    yield server, url
    thread.stop()


def test_wire_round_trip_and_vllm_forms():
    b = Batch(12.5, [Stored((1, 2), None, tuple(range(2 * P)), P, "GPU", 0, "full_attention"), Removed((1,)),
                     Cleared()], 3)
    back = decode_batch(encode_batch(b))
    assert back.ts == 12.5 and back.rank == 3 and back.events == b.events
    raw = msgpack.unpackb(encode_batch(b), raw=False)  # vLLM 0.32's shape: an array batch of tagged maps
    assert raw[1][0]["type"] == "BlockStored" and raw[1][0]["block_size"] == P and raw[1][2] == {"type": "AllBlocksCleared"}
    arr = msgpack.packb([1.0, [["BlockStored", [b"h"], None, list(range(P)), P, None, "GPU", None]], None])
    assert decode_batch(arr).events == [Stored((b"h",), None, tuple(range(P)), P, "GPU", None, None)]


def test_pool_matches_a_chain_by_tokens_and_draws_evictions():
    pool = RemotePool(0, 4, 8)
    pool.apply(Batch(1.0, [Stored((10, 11), None, (1, 2, 3, 4, 5, 6, 7, 8), 4), Stored((20,), None, (9, 9, 9, 9), 4)]))
    assert pool.chain_of([1, 2, 3, 4, 5, 6, 7, 8, 0]) == [10, 11]
    assert pool.chain_of([1, 2, 3, 4, 0, 0, 0, 0]) == [10]
    pool.apply(Batch(2.0, [Stored((11,), 10, (5, 6, 7, 8), 4)]))  # vLLM recomputed a block it had cached
    snap = pool.snapshot([1, 2, 3, 4, 5, 6, 7, 8])
    assert snap.cached_blocks == 4 and snap.chat_blocks == 2 and snap.slots.count(SLOT_OTHER) == 2
    assert snap.slots[3] == SLOT_CHAT  # the newer copy of block 11
    pool.apply(Batch(3.0, [Removed((20,))]))
    snap = pool.snapshot([1, 2, 3, 4, 5, 6, 7, 8])
    assert snap.slots[2] == SLOT_EVICTED and snap.slots.count(SLOT_CHAT) == 2 and snap.removed == 1


def test_prometheus_facts_of_several_engines():
    text = ('vllm:kv_cache_usage_perc{engine="0"} 0.5\nvllm:kv_cache_usage_perc{engine="1"} 0.25\n'
            'vllm:prefix_cache_hits_total{engine="0"} 3\nvllm:prefix_cache_hits_total{engine="1"} 4\n'
            'vllm:cache_config_info{block_size="32",engine="0",num_gpu_blocks="100"} 1.0\n'
            'vllm:cache_config_info{block_size="32",engine="1",num_gpu_blocks="100"} 1.0\n')
    m = metrics_of(text)
    assert m.kv_usage == 0.375 and m.prefix_hits == 7 and m.block_size == 32 and m.num_blocks == 200


def test_a_chats_blocks_are_the_full_blocks_of_prompt_and_reply(events_server):
    server, url = events_server
    eng = RemoteEngine(url, "sekret")
    try:
        assert eng.note == "" and len(eng.subscribers) == 1
        msgs = [{"role": "user", "content": STORY}]
        first = eng.chat(msgs, max_tokens=40)
        assert first.error is None and len(first.token_ids) == 40 and first.prompt_ids
        ids = first.prompt_ids + first.token_ids
        time.sleep(0.3)
        expect = (len(ids) - 1) // P  # the last token is sampled, never written to the cache
        assert eng.view.chat_blocks(ids) == expect > 2
        second = eng.chat(msgs, max_tokens=40)
        assert second.token_ids == first.token_ids  # greedy
        assert second.cached_tokens >= (len(first.prompt_ids) - 1) // P * P > 0
        eng.refresh()
        assert eng.metrics.prefix_hits >= second.cached_tokens and eng.metrics.block_size == P
        assert 0 < eng.metrics.kv_usage <= 1 and eng.metrics.num_blocks > 0
        assert eng.view.chat_blocks(ids) == expect  # the hits: the same blocks, found again
        assert sorted(eng.view.latencies)[len(eng.view.latencies) // 2] < 1.0
    finally:
        eng.close()


def test_a_late_subscriber_gets_the_missed_batches_from_replay(events_server):
    server, url = events_server
    eng = RemoteEngine(url, "sekret")
    eng.chat([{"role": "user", "content": "The dog ran to the park. " * 4}], max_tokens=20)
    eng.close()
    late = RemoteEngine(url, "sekret")  # joins after those batches: replayed from the server's buffer
    try:
        assert late.wait_events(3.0)
        snap = late.view.snapshots()[0]
        assert snap.gaps > 0 and snap.resyncs == 0 and snap.stored > 0 and late.subscribers[0].replayed > 0
    finally:
        late.close()


def test_a_server_that_came_back_starts_a_new_stream_read_from_replay(events_server):
    """After the server failed to answer and answered again (the app's /metrics backoff), its numbers may have
    begun anew with the first batches lost before ZMQ reconnected: the next batch starts over — the view is
    cleared and everything before it comes from the replay endpoint, so the blocks of a reply sent right after
    are drawn even when its first batches were missed live."""
    server, url = events_server
    eng = RemoteEngine(url, "sekret")
    try:
        first = eng.chat([{"role": "user", "content": "A cat sat on the mat. " * 4}], max_tokens=20)
        time.sleep(0.3)
        sub = eng.subscribers[0]
        replayed = sub.replayed
        time.sleep(1.5)  # the replay endpoint answers 2 requests a second (kv_replay.RATE): the earlier tests' are spent
        eng.came_back()
        # a prompt no earlier test sent: its blocks are new, so they are drawn only from batches after came_back
        # (STORY's were already in the view, and a check could pass before the next batch had arrived)
        second = eng.chat([{"role": "user", "content": "Once upon a time a small fox found a red ball. " * 5}],
                          max_tokens=40)
        ids = second.prompt_ids + second.token_ids
        deadline = time.monotonic() + 10
        while ((eng.view.chat_blocks(ids) < (len(ids) - 1) // P or sub.replayed <= replayed)
               and time.monotonic() < deadline):
            time.sleep(0.05)
        assert eng.view.chat_blocks(ids) == (len(ids) - 1) // P > 2
        assert sub.replayed > replayed  # started over: everything before the next batch read from replay
        earlier = first.prompt_ids + first.token_ids
        assert eng.view.chat_blocks(earlier) == (len(earlier) - 1) // P  # the batches before: back from replay
    finally:
        eng.close()


def test_sources_metrics_and_token_ids_over_http(events_server):
    import httpx

    server, url = events_server
    h = {"Authorization": "Bearer sekret"}
    src = httpx.get(url + "/kv_event_sources", headers=h).json()
    assert src["0"]["enable_kv_cache_events"] is True and src["0"]["topic"] == "kv-events"
    assert src["0"]["endpoint"] == server.kv_events.endpoint and src["0"]["endpoint"].startswith("tcp://127.0.0.1:")
    assert src["0"]["endpoint"][-1].isdigit() and src["0"]["replay_endpoint"][-1].isdigit()  # the bound ports
    assert httpx.get(url + "/metrics").status_code == 401  # counts of a shared server: a key holder's only
    assert httpx.get(url + "/health").json() == {"status": "ok"}  # open, and says no more without a key
    text = httpx.get(url + "/metrics", headers=h).text
    assert 'vllm:cache_config_info{block_size="16"' in text and "vllm:prefix_cache_hits_total" in text
    r = httpx.post(url + "/v1/chat/completions", headers=h, timeout=60, json={
        "model": server.model_id, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5,
        "return_token_ids": True}).json()
    assert r["prompt_token_ids"] and len(r["choices"][0]["token_ids"]) == r["usage"]["completion_tokens"]


def test_our_events_reach_a_plain_zmq_subscriber(events_server):
    """What any tool written for vLLM does: SUB, topic, [topic, seq, msgpack batch]."""
    server, url = events_server
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(server.kv_events.endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
    try:
        time.sleep(0.3)
        eng = RemoteEngine(url, "sekret")
        eng.chat([{"role": "user", "content": "A cat sat on a mat and looked at the sky for a long time."}], 30)
        eng.close()
        stored = []
        end = time.monotonic() + 5
        while time.monotonic() < end and not stored:
            if sub.poll(200):
                topic, seq, payload = sub.recv_multipart()
                assert topic == b"kv-events" and len(seq) == 8
                stored += [e for e in msgpack.unpackb(payload, raw=False)[1] if e["type"] == "BlockStored"]
        assert stored and all(e["token_ids"] == [] for e in stored)  # a keyed server: block hashes only
    finally:
        ctx.destroy(linger=0)


def test_attach_cli_reports_json_and_refuses_bad_servers(events_server, capsys):
    from engine.tools.cli import main as cli_main

    server, url = events_server
    rc = cli_main(["attach", url, "--api-key", "sekret", "--prompt", STORY, "--max-new-tokens", "20", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["block_size"] == P and out["usage"]["completion_tokens"] == 20
    assert out["chat_blocks"] == (out["chat_tokens"] - 1) // P and out["ttft_ms"] > 0
    assert set(out["events"]) >= {"stored", "removed", "cleared", "gaps"} and "hits" in out["prefix_cache"]
    c = out["cache"]  # why the prompt was recomputed, from the server's events: as the API's account
    assert c["prompt"] == out["usage"]["prompt_tokens"] and c["reused"] + c["recomputed"] + c["dropped"] == c["prompt"]
    # the module's server may hold the story from an earlier test: then only its last partial block is computed
    assert c["misses"] and c["misses"][-1]["end"] == c["prompt"]
    assert {m["reason"] for m in c["misses"]} <= {"new", "partial_page"}
    for argv, says in [([url, "--api-key", "wrong"], "refused the API key (401)"),
                       ([f"http://127.0.0.1:{free_port()}"], "refused the connection"),
                       (["ftp://x"], "not a server address")]:
        assert cli_main(["attach", *argv, "--prompt", "hi"]) == 2
        err = capsys.readouterr().err
        assert says in err and len(err.strip().splitlines()) == 1


def test_attach_refuses_a_server_that_is_not_openai_and_silent_events(events_server, capsys):
    from engine.tools.cli import main as cli_main

    class NotOpenAI(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"<html>hello</html>")

        def log_message(self, *a):
            pass

    httpd = http.server.HTTPServer(("127.0.0.1", 0), NotOpenAI)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        assert cli_main(["attach", f"http://127.0.0.1:{httpd.server_port}", "--prompt", "hi"]) == 2
        assert "not an OpenAI-compatible server" in capsys.readouterr().err
    finally:
        httpd.shutdown()
    server, url = events_server  # events asked for at an endpoint nobody publishes to
    rc = cli_main(["attach", url, "--api-key", "sekret", "--events", f"tcp://127.0.0.1:{free_port()}", "--prompt",
                   STORY, "--max-new-tokens", "40", "--events-timeout", "1"])
    assert rc == 2 and "no KV events arrived" in capsys.readouterr().err


def test_a_server_gone_mid_reply_keeps_the_text(stories_path):
    from engine.model.loader import load_model

    lm = load_model(str(stories_path))
    server = KVServer(lm, CacheConfig(page_size=P), ServerOptions())
    thread = ServerThread(server)
    url = thread.start()
    eng = RemoteEngine(url)
    assert "publishes no KV events" in eng.note
    got = []

    stopper = threading.Thread(target=thread.stop, daemon=True)

    def on_delta(text, ids):
        got.append(text)
        if len(got) == 5:
            stopper.start()

    reply = eng.chat([{"role": "user", "content": STORY}], max_tokens=400, on_delta=on_delta)
    assert reply.error and reply.text.startswith("".join(got[:5])) and len(reply.token_ids) < 400
    stopper.join(30)
    with pytest.raises(RemoteError, match="refused the connection|closed the connection"):
        eng.chat([{"role": "user", "content": "again"}], max_tokens=4)
    eng.close()


def test_events_config_refusals():
    with pytest.raises(ValueError, match="unknown key 'endpont'"):
        KVEventsConfig.parse('{"endpont": "tcp://*:1"}')
    with pytest.raises(ValueError, match="not JSON"):
        KVEventsConfig.parse("{")
    with pytest.raises(ValueError, match="not a tcp://"):
        KVEventsConfig.parse('{"endpoint": "http://x"}')


@pytest.fixture(scope="module")
def plain_server(stories_path):
    """No API key: a small pool (32 pages) and one idle conversation kept, so new prompts evict cached pages."""
    from engine.model.loader import load_model

    cfg = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:*")
    lm = load_model(str(stories_path))
    server = KVServer(lm, CacheConfig(page_size=P, max_pages=32), ServerOptions(kv_events=cfg, max_idle=1))
    thread = ServerThread(server)
    url = thread.start()
    yield server, url
    thread.stop()


def test_the_events_tell_the_pools_truth_through_evictions(plain_server):
    """After every request the view rebuilt from the events holds exactly the names the server's pools hold."""
    import httpx

    from engine.server.kv_events import block_hash

    server, url = plain_server
    lm = server.lm
    eng = RemoteEngine(url)
    try:
        removed = 0
        for i, animal in enumerate(["cat", "dog", "bird", "fish", "frog", "bear", "cat"]):
            eng.chat([{"role": "user", "content": f"{i}. The {animal} " + STORY * 2}], max_tokens=30)
            truth = server.scheduler.call(lambda: sorted(
                block_hash(d) for a in lm.kv_arenas for d in a.pool.hash if d is not None)).result(10)
            end = time.monotonic() + 5
            while time.monotonic() < end:
                with eng.view.lock:
                    seen = sorted(eng.view.pool(0).names())
                if seen == truth:
                    break
                time.sleep(0.05)
            assert seen == truth, f"request {i}: the view holds {len(seen)} names, the pools {len(truth)}"
            removed = eng.view.snapshots()[0].removed
        assert removed > 0  # the pool was small enough that names were dropped
        assert "vllm:num_preemptions_total" in httpx.get(url + "/metrics").text  # no key: /metrics is open
    finally:
        eng.close()


def stored_events(sub, until) -> list[dict]:
    """Every ``BlockStored`` (decoded as any vLLM tool decodes it) until ``until()`` says enough, or 5 s."""
    out: list[dict] = []
    end = time.monotonic() + 5
    while time.monotonic() < end and not until(out):
        if sub.poll(100):
            _, _, payload = sub.recv_multipart()
            out += [e for e in msgpack.unpackb(payload, raw=False)[1] if e["type"] == "BlockStored"]
    return out


def plain_sub(ctx, endpoint: str, topic: bytes = b""):
    sub = ctx.socket(zmq.SUB)  # no key, no HTTP: what anyone on this machine can open
    sub.connect(endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    time.sleep(0.3)  # ZMQ's slow joiner: batches before the connection is up are not seen
    return sub


def test_an_unkeyed_server_publishes_token_ids_except_for_a_salted_request(plain_server, stories):
    """vLLM's behaviour for an unkeyed, unsalted request (the token ids of each page); none for one with
    ``cache_salt``, whose pages are named from the salt's own root."""
    import httpx

    from engine.kv.paged.tenants import block_hashes

    server, url = plain_server
    ctx = zmq.Context()
    try:
        sub = plain_sub(ctx, server.kv_events.endpoint)
        ids = {}
        for salt, text in [(None, "A red fox ran far. " * 6), ("s3cret-salt", "A blue owl sat still. " * 6)]:
            body = {"model": server.model_id, "prompt": text, "max_tokens": 1, "return_token_ids": True}
            r = httpx.post(url + "/v1/completions", timeout=60, json=body | ({"cache_salt": salt} if salt else {}))
            ids[salt] = r.json()["prompt_token_ids"]
        want = {s: block_hashes(v, P, cache_salt=s) for s, v in ids.items()}
        stored = stored_events(sub, lambda got: {h for e in got for h in e["block_hashes"]} >= set(sum(want.values(), [])))
        tokens = {h: e["token_ids"][i * P:(i + 1) * P] for e in stored for i, h in enumerate(e["block_hashes"])}
        n = len(want[None])
        assert n > 1 and [t for h in want[None] for t in tokens[h]] == ids[None][:n * P]  # readable by anyone
        assert want["s3cret-salt"] and all(tokens[h] == [] for h in want["s3cret-salt"])
        assert not set(want["s3cret-salt"]) & set(block_hashes(ids["s3cret-salt"], P))  # unsalted names differ
    finally:
        ctx.destroy(linger=0)


def test_a_keyless_subscriber_reads_no_tenants_text(events_server):
    """Two tenants (keys "sekret" and "other", one request with a salt) on the keyed server: a SUB with no key
    receives their blocks' events, and nothing in them is a token id; the hashes are those the tenant's own key
    computes, not those any key-less guess of the text gives."""
    import httpx

    from engine.kv.paged.tenants import block_hashes

    server, url = events_server
    ctx = zmq.Context()
    try:
        sub = plain_sub(ctx, server.kv_events.endpoint, b"kv-events")
        sent = []
        for key, salt, text in [("sekret", None, "Tenant A's secret plan is to sail at dawn. " * 3),
                                ("other", "b-salt", "Tenant B's password is hunter2 and blue. " * 3)]:
            body = {"model": server.model_id, "prompt": text, "max_tokens": 8, "return_token_ids": True}
            r = httpx.post(url + "/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=60,
                           json=body | ({"cache_salt": salt} if salt else {})).json()
            sent.append((key, salt, r["prompt_token_ids"]))
        want = {h for key, salt, ids in sent for h in block_hashes(ids, P, key, salt)}
        stored = stored_events(sub, lambda got: {h for e in got for h in e["block_hashes"]} >= want)
        seen = {h for e in stored for h in e["block_hashes"]}
        assert want and want <= seen  # the subscriber did receive both tenants' blocks
        assert all(e["token_ids"] == [] for e in stored)  # and not one token id of either
        guesses = {h for _, _, ids in sent for k in (None, "") for h in block_hashes(ids, P, k)}
        assert not guesses & seen  # knowing the text is not enough to recognise its blocks: the key is needed
    finally:
        ctx.destroy(linger=0)


def test_data_parallel_ranks_are_one_pool_each():
    """Two engines (ranks 0 and 1) publish on the endpoint's port and port + 1, as vLLM's data-parallel ranks do:
    the view subscribes to each and draws one pool per rank."""
    from engine.remote.subscriber import EventSubscriber
    from engine.remote.view import RemoteView
    from engine.remote.wire import seq_bytes

    base = free_port()
    while True:  # two free ports in a row
        try:
            ctx = zmq.Context()
            pubs = [ctx.socket(zmq.PUB) for _ in range(2)]
            for r, pub in enumerate(pubs):
                pub.bind(f"tcp://127.0.0.1:{base + r}")
            break
        except zmq.ZMQError:
            ctx.destroy(linger=0)
            base = free_port()
    view = RemoteView(P, 64)
    subs = [EventSubscriber(view, f"tcp://*:{base}", "http://127.0.0.1:8000", "kv", rank=r) for r in (0, 1)]
    try:
        for s in subs:
            s.start()
        assert [s.endpoint for s in subs] == [f"tcp://127.0.0.1:{base}", f"tcp://127.0.0.1:{base + 1}"]
        time.sleep(0.3)
        for r, pub in enumerate(pubs):
            batch = Batch(time.time(), [Stored(tuple(range(10 * r, 10 * r + 2 + r)), None, tuple(range((2 + r) * P)),
                                               P)], r)
            pub.send_multipart([b"kv", seq_bytes(0), encode_batch(batch)])
        end = time.monotonic() + 5
        while time.monotonic() < end and view.batches < 2:
            time.sleep(0.05)
        snaps = view.snapshots()
        assert [(s.rank, s.cached_blocks, s.num_blocks) for s in snaps] == [(0, 2, 64), (1, 3, 64)]
    finally:
        for s in subs:
            s.stop()
        ctx.destroy(linger=0)
