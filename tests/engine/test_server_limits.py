"""No client holds the server (#20 item 4): ``max_tokens`` capped by a server setting; a stream whose client stops
reading is held once its unsent events pass the bound (no more tokens), taken up again when the client reads,
cancelled when it does not (its slot goes to the next request); both counted in /metrics. Real server on
127.0.0.1 (stories260K under StreamingLLM, so a reply is not bounded by the context), raw sockets and httpx.
"""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from engine.config import CacheConfig
from engine.server import KVServer, ServerOptions, ServerThread
from engine.server.limits import StreamLimits
from engine.server.metrics import parse as parse_metrics

MODEL = "m"
CAP = 5000
BUFFER = 16
DEADLINE_S = 120.0
STREAMING = CacheConfig(page_size=16, policy="streaming", policy_params={"sinks": 4, "window": 64})


def serve(stories_path, stall_s: float, max_running: int = 8, cap: int = CAP):
    from engine.model.loader import load_model

    lm = load_model(str(stories_path))
    server = KVServer(lm, STREAMING, ServerOptions(max_running=max_running, limits=StreamLimits(
        max_tokens=cap, stream_buffer=BUFFER, stall_s=stall_s)), source=MODEL)
    thread = ServerThread(server)
    return server, thread, thread.start()


def wait_for(cond, what: str):
    end = time.monotonic() + DEADLINE_S
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.01)


def silent_stream(url: str, max_tokens: int) -> socket.socket:
    """A streamed request from a client that then reads nothing (a small receive buffer, as a stuck client's)."""
    host, port = url.rsplit("//", 1)[1].split(":")
    body = json.dumps({"model": MODEL, "prompt": "Once upon a time", "max_tokens": max_tokens, "stream": True,
                       "temperature": 0}).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect((host, int(port)))
    s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    return s


def read_sse(s: socket.socket) -> list[dict]:
    """Everything the socket holds until ``[DONE]``: the JSON events."""
    s.settimeout(DEADLINE_S)
    data = b""
    while b"data: [DONE]" not in data:
        chunk = s.recv(1 << 16)
        assert chunk, "the server closed the stream before [DONE]"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    return [json.loads(line[6:]) for line in body.decode().splitlines() if line.startswith("data: {")]


def test_max_tokens_is_capped_by_the_server(stories_path):
    server, thread, url = serve(stories_path, 600.0, cap=100)
    try:
        r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 10**12},
                       timeout=DEADLINE_S)
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
        assert "100" in r.json()["error"]["message"]
        # none asked under an eviction policy (no context bound): the context's length (512), at most the cap
        r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "temperature": 0},
                       timeout=DEADLINE_S).json()
        assert r["usage"]["completion_tokens"] == 100 and r["choices"][0]["finish_reason"] == "length"
    finally:
        thread.stop()


def test_a_stream_not_read_is_held_then_taken_up_when_read(stories_path):
    """One running slot: the held stream takes no steps, so another request is served beside it meanwhile."""
    server, thread, url = serve(stories_path, 600.0, max_running=1)
    try:
        m = server.metrics
        s = silent_stream(url, 3000)
        wait_for(lambda: m.stalls["paused"] == 1, "the stream to be held")
        jobs = server.scheduler.call(lambda: list(server.scheduler._running)).result(DEADLINE_S)
        (job,) = jobs
        made = m.generation_tokens
        assert job.backlog.pending <= BUFFER + 2  # the bound, and the event of the step that passed it
        for _ in range(20):  # rounds of the engine: the held request is not stepped
            server.scheduler.call(lambda: None).result(DEADLINE_S)
        assert m.generation_tokens == made < 3000
        r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 5},
                       timeout=DEADLINE_S)  # before: it waited for the slot until the held stream was cancelled
        assert r.status_code == 200 and m.stalls == {"paused": 1, "cancelled": 0}
        events = read_sse(s)  # the client reads again: taken up, to the end
        s.close()
        assert sum(1 for e in events if e["choices"] and e["choices"][0]["finish_reason"] is None) == 3000
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        assert m.stalls == {"paused": 1, "cancelled": 0}
    finally:
        thread.stop()


def test_a_stream_never_read_is_cancelled_and_others_go_on_meanwhile(stories_path):
    server, thread, url = serve(stories_path, 3.0, max_running=1)
    try:
        m = server.metrics
        s = silent_stream(url, CAP)
        wait_for(lambda: m.stalls["paused"] == 1, "the stream to be held")
        made = m.generation_tokens
        r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 5},
                       timeout=DEADLINE_S)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        assert m.generation_tokens == made + 5  # nothing generated for the held stream meanwhile
        wait_for(lambda: m.stalls["cancelled"] == 1, "the held stream to be cancelled")
        wait_for(lambda: server.scheduler.running == 0, "its slot to be given back")
        assert m.stalls == {"paused": 1, "cancelled": 1}
        text = httpx.get(url + "/metrics", timeout=DEADLINE_S).text
        d = parse_metrics(text)
        assert d['kvscope_streams_stalled_total{action="cancelled"}'] == 1
        assert d['kvscope_requests_total{outcome="cancelled"}'] == 1
        s.close()
    finally:
        thread.stop()


@pytest.mark.parametrize("value", [0, -1])
def test_serve_refuses_a_bad_max_tokens(stories_path, capsys, value):
    from engine.tools.cli import main

    assert main(["serve", "--model", str(stories_path), "--max-tokens", str(value)]) == 2
    assert "--max-tokens" in capsys.readouterr().err
