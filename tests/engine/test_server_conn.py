"""Slowloris (#20 item 6): connections that send half a request head, or a body byte by byte, are closed at their
deadline; past the connection limit a new connection gets 503 at once; normal requests go on meanwhile. Real
server on 127.0.0.1 (stories260K), raw sockets; every wait is bounded and nothing is timed.
"""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from engine.config import CacheConfig
from engine.server import KVServer, ServerOptions, ServerThread
from engine.server.limits import ConnLimits
from engine.server.metrics import parse as parse_metrics

MODEL = "m"
DEADLINE_S = 120.0
HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"


@pytest.fixture()
def serve(stories):
    threads = []

    def start(**conn):
        server = KVServer(stories, CacheConfig(page_size=16), ServerOptions(conn=ConnLimits(**conn)), source=MODEL)
        thread = ServerThread(server)
        threads.append(thread)
        url = thread.start()
        host, port = url.rsplit("//", 1)[1].split(":")
        return server, thread, url, (host, int(port))

    yield start
    for t in threads:
        t.stop()


def closed_by_server(s: socket.socket) -> bytes:
    """What the server sent before closing ``s`` (waits for the close, bounded)."""
    s.settimeout(DEADLINE_S)
    data = b""
    while chunk := s.recv(4096):
        data += chunk
    return data


def ok(url: str) -> bool:
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2},
                   timeout=DEADLINE_S)
    return r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_half_heads_and_slow_bodies_are_closed_and_others_are_served(serve):
    _, _, url, addr = serve(header_timeout_s=1.0, body_timeout_s=1.0)
    heads = [socket.create_connection(addr) for _ in range(20)]
    for s in heads:
        s.sendall(HEAD)  # a head that never ends
    body = socket.create_connection(addr)
    body.sendall(HEAD + b"Content-Length: 100\r\n\r\n{\"model\": ")  # 10 of 100 bytes
    silent = socket.create_connection(addr)  # connects, sends nothing
    assert ok(url)  # served while they hang
    for s in heads + [body, silent]:
        assert closed_by_server(s) == b""  # closed, no reply
        s.close()
    m = parse_metrics(httpx.get(url + "/metrics", timeout=DEADLINE_S).text)
    assert m['kvscope_connections_closed_total{reason="header_timeout"}'] == 21
    assert m['kvscope_connections_closed_total{reason="body_timeout"}'] == 1
    assert ok(url)


def test_keep_alive_connections_get_a_new_deadline_per_request(serve):
    _, _, url, addr = serve(header_timeout_s=1.0, body_timeout_s=1.0)
    with httpx.Client(timeout=DEADLINE_S) as c:
        for _ in range(3):  # the same connection, one request after another
            r = c.post(url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
            assert r.status_code == 200


def wait_for(cond, what: str) -> None:
    end = time.monotonic() + DEADLINE_S
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.01)


def closed_metric(url: str, reason: str) -> float:
    m = parse_metrics(httpx.get(url + "/metrics", timeout=DEADLINE_S).text)
    return m[f'kvscope_connections_closed_total{{reason="{reason}"}}']


def test_at_the_limit_a_new_connection_takes_the_place_of_the_oldest_idle_one(serve):
    """Eight connections that never send a head fill the limit: a normal client is still served, and the oldest
    silent connection is the one closed for it."""
    _, thread, url, addr = serve(header_timeout_s=600.0, max_connections=8)
    held = []
    for _ in range(8):
        held.append(socket.create_connection(addr))
        wait_for(lambda: thread.open_connections == len(held), "the server to take the connection")
    assert ok(url)  # a ninth connection: served
    assert closed_by_server_or_reset(held[0])  # the oldest silent one made room
    assert closed_metric(url, "evicted") >= 1 and closed_metric(url, "over_limit") == 0
    for s in held:
        s.close()


def test_at_the_limit_with_every_connection_busy_a_new_one_gets_503(serve):
    server, thread, url, addr = serve(header_timeout_s=600.0, max_connections=4)
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "stream": True}
    server.scheduler.pause()  # four streams in flight, held where they are
    try:
        with httpx.Client(timeout=DEADLINE_S, limits=httpx.Limits(max_connections=8)) as c:
            streams = [c.stream("POST", url + "/v1/completions", json=body) for _ in range(4)]
            responses = [st.__enter__() for st in streams]
            assert [r.status_code for r in responses] == [200] * 4
            wait_for(lambda: server.scheduler.waiting == 4, "the four requests to queue")
            extra = socket.create_connection(addr)
            reply = closed_by_server(extra)
            assert reply.startswith(b"HTTP/1.1 503") and b"too_many_connections" in reply
            server.scheduler.resume()
            for st, r in zip(streams, responses):
                assert any(line == "data: [DONE]" for line in r.iter_lines())
                st.__exit__(None, None, None)
    finally:
        server.scheduler.resume()
    assert closed_metric(url, "over_limit") == 1


def closed_by_server_or_reset(s: socket.socket) -> bool:
    try:
        return closed_by_server(s) == b""
    except ConnectionResetError:
        return True


@pytest.mark.parametrize("flag", ["--header-timeout", "--body-timeout", "--max-connections"])
def test_serve_refuses_bad_limits(stories_path, capsys, flag):
    from engine.tools.cli import main

    assert main(["serve", "--model", str(stories_path), flag, "0"]) == 2
    assert flag in capsys.readouterr().err
