"""Prompts tokenized off the engine thread (#20 item 5): a prompt too long for the context is refused before any
tokenizing; a long prompt that is tokenized (no context bound under an eviction policy) never delays a short
request. Real server on 127.0.0.1 (stories260K), httpx; orders and counts, no timings.
"""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from engine.config import CacheConfig
from engine.server import KVServer, ServerOptions, ServerThread

MODEL = "m"
DEADLINE_S = 300.0
BIG = "Once upon a time there was a dog. " * 115_000  # 3.9 MB: under the 4 MiB body limit


@pytest.fixture()
def serve(stories_path):
    threads = []

    def start(cache: CacheConfig):
        from engine.model.loader import load_model

        server = KVServer(load_model(str(stories_path)), cache, ServerOptions(), source=MODEL)
        thread = ServerThread(server)
        threads.append(thread)
        return server, thread.start()

    yield start
    for t in threads:
        t.stop()


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": BIG}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": BIG}]}, "messages")])
def test_a_prompt_too_long_for_the_context_is_refused_before_tokenizing(serve, path, body, param):
    assert 3_800_000 < len(BIG) < 4 << 20
    server, url = serve(CacheConfig(page_size=16))
    r = httpx.post(url + path, json={"model": MODEL, "max_tokens": 2, **body}, timeout=DEADLINE_S)
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == "context_length_exceeded" and "characters" in err["message"]
    assert server.scheduler.tokenizing.started == {"small": 0, "large": 0}  # refused before any tokenizing
    hi = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}, timeout=DEADLINE_S)
    assert hi.status_code == 200 and server.scheduler.tokenizing.started == {"small": 1, "large": 0}


def test_a_short_request_passes_a_long_prompt_being_tokenized(serve):
    """Under StreamingLLM a prompt is not bounded by the context, so the 3.9 MB one is tokenized (seconds); a
    "Hi" sent meanwhile is answered while it still is. Then the long one's client leaves (its ~1M-token prefill
    is not this test's business) and the server is idle again."""
    server, url = serve(CacheConfig(page_size=16, policy="streaming", policy_params={"sinks": 4, "window": 64}))
    sched, tok = server.scheduler, server.scheduler.tokenizing
    host, port = url.rsplit("//", 1)[1].split(":")
    body = json.dumps({"model": MODEL, "prompt": BIG, "max_tokens": 1}).encode()
    with socket.create_connection((host, int(port))) as s:
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        wait_for(lambda: tok.large_busy == 1, "the long prompt to be tokenized")
        hi = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2},
                        timeout=DEADLINE_S)
        assert hi.status_code == 200 and hi.json()["usage"]["completion_tokens"] == 2
        assert tok.large_busy == 1  # answered while the long prompt was still being tokenized
    wait_for(lambda: tok.large_busy == 0 and sched.running == 0 and sched.waiting == 0, "the long one to end")
    assert tok.started == {"small": 1, "large": 1}


def wait_for(cond, what: str) -> None:
    end = time.monotonic() + DEADLINE_S
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.01)
