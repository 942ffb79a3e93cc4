"""KV events that stay on this machine (#29 item 1): endpoints other machines reach are refused at start unless
``--kv-events-allow-remote``; the replay socket answers only well-formed requests, a few a second, a bounded
number of batches each, and a frame over ZMQ's size limit never reaches it; a publisher thread that dies says so
and stops being advertised; ``/metrics`` needs a key on a keyed server unless ``--metrics-public``.

Real ZMQ sockets on 127.0.0.1 (a publisher of its own where no model is needed), the real command line for what
a user types, a real server on the session's stories260K for what HTTP answers. No name here is looked up over
the network: "no such host" is refused by the resolver itself (no DNS query leaves for a name with spaces).
"""

from __future__ import annotations

import json
import re
import time
from types import SimpleNamespace

import httpx
import pytest
import zmq

from engine.config import CacheConfig
from engine.remote.wire import END_SEQ, Stored, seq_bytes, seq_of
from engine.server import KVServer, ServerOptions, ServerThread
from engine.server import kv_replay
from engine.server.kv_events import KVEventPublisher, KVEventsConfig, check_reach, reachable_from_elsewhere
from engine.server.metrics import parse as parse_metrics

P = 16
ARENA = SimpleNamespace(page_size=P, group="full")


def serve_says(capsys, stories_path, *argv: str) -> str:
    """``python -m engine serve`` with ``argv``: it must refuse with exit 2 and one stderr line, which is returned."""
    from engine.tools.cli import main

    assert main(["serve", "--model", str(stories_path), "--port", "0", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    return err


def events(**cfg) -> str:
    return json.dumps({"enable_kv_cache_events": True, **cfg})


def test_endpoints_other_machines_reach_are_refused_without_the_opt_in(capsys, stories_path):
    for cfg in ({"endpoint": "tcp://*:5557"}, {"endpoint": "tcp://0.0.0.0:5557"}, {"endpoint": "tcp://[::]:5557"},
                {"endpoint": "tcp://127.0.0.1:5557", "replay_endpoint": "tcp://*:5558"}):
        err = serve_says(capsys, stories_path, "--kv-events-config", events(**cfg))
        assert "reachable from other machines" in err and "--kv-events-allow-remote" in err
        assert list(cfg.values())[-1] in err  # the endpoint at fault, named
    err = serve_says(capsys, stories_path, "--kv-events-config", events(endpoint="tcp://no such host:5557"))
    assert "cannot resolve host 'no such host'" in err
    assert KVEventsConfig().endpoint == "tcp://127.0.0.1:5557"  # {"enable_kv_cache_events": true} alone: loopback
    for local in ("tcp://127.0.0.1:5557", "tcp://localhost:5557", "tcp://[::1]:5557", "ipc:///tmp/kv", "inproc://x"):
        assert not reachable_from_elsewhere(local)
    assert reachable_from_elsewhere("tcp://192.0.2.7:5557")  # a documentation address: no traffic is sent
    check_reach(KVEventsConfig(True, endpoint="tcp://*:5557"), allow_remote=True)  # the opt-in lets it through


def test_a_server_built_in_code_refuses_them_too(stories):
    with pytest.raises(ValueError, match="--kv-events-allow-remote"):
        KVServer(stories, CacheConfig(), ServerOptions(kv_events=KVEventsConfig(True, endpoint="tcp://*:5557")))
    assert stories.kv_arenas.listener is None  # nothing was started


def test_bad_events_config_values_are_one_line_each(capsys, stories_path):
    for key, value, says in [("buffer_steps", "x", "whole number"), ("buffer_steps", 0, "whole number"),
                             ("buffer_steps", 10 ** 9, "100,000"), ("hwm", 1e30, "whole number"),
                             ("hwm", True, "whole number"), ("topic", 5, "string"), ("topic", "t" * 300, "255 bytes"),
                             ("enable_kv_cache_events", "yes", "true or false"), ("endpoint", 5, "tcp://"),
                             ("endpoint", "tcp://127.0.0.1", "tcp://HOST:PORT"), ("publisher", "kafka", "'zmq'")]:
        err = serve_says(capsys, stories_path, "--kv-events-config", json.dumps({key: value}))
        assert key in err and says in err, (key, value, err)


def test_serve_host_names_are_resolved_or_refused(capsys, stories_path):
    err = serve_says(capsys, stories_path, "--host", "no such host")
    assert "cannot resolve host 'no such host'" in err and "reachable" not in err
    err = serve_says(capsys, stories_path, "--host", "127.0.0.1", "--api-key", "ключ")  # not latin-1: no header
    assert "--api-key" in err and "ASCII" in err


def test_help_says_what_the_switches_expose(capsys):
    from engine.tools.cli import main

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--kv-events-allow-remote" in text and "with no key, sees when blocks are cached" in text
    assert "--metrics-public" in text and "/health's status is always open" in text


@pytest.fixture()
def publisher(monkeypatch):
    """A publisher of its own on ports ZMQ picks, fed through the listener the model's arenas call; the replay
    socket answers 8 batches at most (the real limit is larger: fewer batches keep the test short)."""
    monkeypatch.setattr(kv_replay, "MAX_BATCHES", 8)
    pub = KVEventPublisher(KVEventsConfig(True, endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*",
                                          topic="t"), medium="CPU")
    heard = []
    pub.attach(SimpleNamespace(set_listener=heard.append))
    pub.store = lambda i: heard[0](ARENA, "stored", i, i.to_bytes(32, "big"), (None, tuple(range(P))))
    ctx = zmq.Context()
    yield pub, ctx
    ctx.destroy(linger=0)
    pub.close()


def publish(pub, n: int) -> None:
    """``n`` batches, one stored block each (each waits for the last to be sent, so none merge)."""
    for i in range(n):
        sent = pub.sent
        pub.store(1000 + i)
        end = time.monotonic() + 5
        while pub.sent == sent and time.monotonic() < end:
            time.sleep(0.002)


def ask(ctx, endpoint: str, *frames: bytes, wait_ms: int = 1000) -> list[int] | None:
    """Send one request from a new DEALER; the sequence numbers answered (END_SEQ last), None for no answer."""
    d = ctx.socket(zmq.DEALER)
    d.connect(endpoint)
    d.send_multipart(list(frames))
    got = []
    while d.poll(wait_ms):
        _, seq, _ = d.recv_multipart()
        got.append(seq_of(seq))
        if got[-1] == END_SEQ:
            break
    d.close(linger=0)
    return got or None


def test_replay_answers_well_formed_requests_with_a_bounded_number_of_batches(publisher):
    pub, ctx = publisher
    publish(pub, 20)
    where = pub.replay_endpoint
    assert re.fullmatch(r"tcp://127\.0\.0\.1:\d+", where)
    got = ask(ctx, where, b"", seq_bytes(0))
    newest = pub.sent - 1
    assert got == list(range(newest - 7, newest + 1)) + [END_SEQ]  # the newest 8 of 20+, then the end marker
    assert ask(ctx, where, b"", seq_bytes(newest)) == [newest, END_SEQ]
    for bad in [(b"x",), (b"", b"123"), (b"", seq_bytes(-5)), (b"", seq_bytes(0), b"more"), (b"no", seq_bytes(0))]:
        assert ask(ctx, where, *bad, wait_ms=300) is None
    assert pub.replay.counts == {"answered": 2, "malformed": 5, "limited": 0}


def test_a_replay_flood_is_answered_at_the_rate_limit_only(publisher):
    pub, ctx = publisher
    publish(pub, 2)
    d = ctx.socket(zmq.DEALER)
    d.connect(pub.replay_endpoint)
    for _ in range(40):
        d.send_multipart([b"", seq_bytes(0)])
    ends = 0
    while d.poll(500):
        ends += seq_of(d.recv_multipart()[1]) == END_SEQ
    d.close(linger=0)
    counts = pub.replay.counts
    assert 0 < ends == counts["answered"] < 40 and counts["limited"] == 40 - ends
    time.sleep(1.0 / kv_replay.RATE)  # the bucket refills: a view that asks later is answered again
    assert ask(ctx, pub.replay_endpoint, b"", seq_bytes(0))[-1] == END_SEQ


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS")).split()[1]) / 1024


def test_a_frame_over_the_size_limit_is_dropped_inside_zmq(publisher):
    """A 64 MiB frame to the replay socket: ZMQ disconnects its peer when the frame's header says its size, so
    the server never holds it (the process here is also the sender: its own copy is counted before)."""
    pub, ctx = publisher
    publish(pub, 1)
    big = b"\0" * (64 << 20)
    before = rss_mib()
    d = ctx.socket(zmq.DEALER)
    mon = d.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    d.connect(pub.replay_endpoint)
    d.send_multipart([b"", big], copy=False)
    assert mon.poll(10_000), "the server did not drop the connection that sent a 64 MiB frame"
    grown = rss_mib() - before
    d.close(linger=0)
    del big
    assert grown < 32, f"the process grew {grown:.0f} MiB while a 64 MiB frame was sent"
    assert pub.replay.counts["malformed"] == 0  # never reached the publisher thread
    assert ask(ctx, pub.replay_endpoint, b"", seq_bytes(0))[-1] == END_SEQ  # others are still answered


def test_the_startup_line_says_who_can_reach_the_events_and_what_they_carry(publisher):
    pub, _ = publisher
    line = pub.describe()
    assert re.fullmatch(r"KV events on tcp://127\.0\.0\.1:\d+ \(this machine only\), replay on tcp://127\.0\.0\.1:"
                        r"\d+ \(this machine only\); token ids of unsalted requests \(with cache_salt: block hashes "
                        r"only\)", line), line
    keyed = KVEventPublisher(KVEventsConfig(True, endpoint="ipc:///tmp/kvscope-test-events"), private=True)
    try:
        assert keyed.describe() == ("KV events on ipc:///tmp/kvscope-test-events (this machine only; the socket "
                                    "file's permissions decide who may read it); no token ids, block hashes only "
                                    "(the server has API keys)")
    finally:
        keyed.close()


@pytest.fixture()
def open_metrics_server(stories):
    """Keyed, ``--metrics-public``, events on."""
    cfg = KVEventsConfig(True, endpoint="tcp://127.0.0.1:*")
    server = KVServer(stories, CacheConfig(page_size=P), ServerOptions(api_key="k", metrics_public=True,
                                                                        kv_events=cfg))
    thread = ServerThread(server)
    url = thread.start()
    yield server, url
    thread.stop()


def test_metrics_public_and_a_publisher_that_dies_stops_being_advertised(open_metrics_server, capsys):
    server, url = open_metrics_server
    key = {"Authorization": "Bearer k"}
    m = parse_metrics(httpx.get(url + "/metrics").text)  # --metrics-public: no key needed
    assert m["kvscope_kv_events_up"] == 1
    assert httpx.get(url + "/health").json()["running"] == 0  # and /health's counts with it
    assert httpx.get(url + "/kv_event_sources", headers=key).json()["0"]["endpoint"] == server.kv_events.endpoint
    pub = server.kv_events
    pub._pending.append(Stored((object(),), None, (), P))  # a fault no config can cause now: its thread fails
    pub._wake.set()
    end = time.monotonic() + 5
    while pub.alive and time.monotonic() < end:
        time.sleep(0.02)
    assert not pub.alive and "TypeError" in pub.error
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "KV events stopped" in err and "/kv_event_sources now lists none" in err
    assert httpx.get(url + "/kv_event_sources", headers=key).json() == {}
    assert parse_metrics(httpx.get(url + "/metrics").text)["kvscope_kv_events_up"] == 0
