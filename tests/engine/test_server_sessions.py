"""Unrelated requests do not take over a conversation kept idle (#19 item 11: three requests shown as one 'API #21'
entry, and the first conversation's follow-up got 8 of 111 tokens cached). Real server, real HTTP client."""

from __future__ import annotations

import httpx
import pytest

from engine.config import CacheConfig
from engine.server import KVServer, ServerOptions, ServerThread

STORY = "Once upon a time there was a little girl named Lily. She loved to play outside."


@pytest.mark.parametrize("cache", [CacheConfig(page_size=4), CacheConfig(page_size=4, k_dtype="int8")],
                         ids=["prefix-cache", "no-prefix-cache"])
def test_unrelated_requests_get_sessions_of_their_own(stories_path, cache):
    from engine.model.loader import load_model

    lm = load_model(str(stories_path))
    server = KVServer(lm, cache, ServerOptions())
    thread = ServerThread(server)
    url = thread.start()
    try:
        with httpx.Client(base_url=url, timeout=60) as c:
            def chat(msgs):
                r = c.post("/v1/chat/completions", json={"model": server.model_id, "messages": msgs,
                                                         "max_tokens": 40, "temperature": 0})
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["message"]["content"], r.json()["usage"]

            first = [{"role": "user", "content": STORY}]
            reply, _ = chat(first)
            for other in ("The dog ran fast.", "A bird sang a song.", "The sun was hot."):
                chat([{"role": "user", "content": other}])  # share the template's start only
            _, usage = chat(first + [{"role": "assistant", "content": reply}, {"role": "user", "content": "And?"}])
        records = list(server.scheduler.records)
        assert len({r.session_id for r in records[:4]}) == 4  # four conversations, four sessions
        assert records[4].session_id == records[0].session_id  # the follow-up went on with its own
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        assert cached >= records[0].prompt_tokens + 30  # its prompt and most of its reply, to the token
    finally:
        thread.stop()
