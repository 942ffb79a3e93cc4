"""The chat as Markdown: messages under headings, each reply's stats and cache line under it."""

from __future__ import annotations

import time

from app.chat.export import chat_markdown
from app.history.store import Chat, Message


def test_chat_markdown_has_every_message_and_the_cache_lines():
    now = time.mktime((2026, 11, 30, 9, 5, 0, 0, 0, -1))
    chat = Chat(7, "Dogs", "Be brief.", now, now)
    stats = {"prefill_tokens_per_s": 812.0, "decode_tokens_per_s": 41.26, "ttft_ms": 35.0, "generated_tokens": 12,
             "mode": "paged", "reused_tokens": 30, "recomputed_tokens": 4, "first_divergence": 30}
    msgs = [Message(1, 7, 0, "user", "Tell me about dogs."), Message(2, 7, 1, "assistant", "Dogs bark.\n", stats),
            Message(3, 7, 2, "user", "More?"), Message(4, 7, 3, "assistant", "", {})]
    assert chat_markdown(chat, msgs, model="stories260K", now=now) == (
        "# Dogs\n\n_exported from KV Scope 2026-11-30 09:05 · model stories260K_\n\n"
        "## System\n\nBe brief.\n\n"
        "## You\n\nTell me about dogs.\n\n"
        "## Model\n\nDogs bark.\n\n"
        "> prefill 812 tok/s · decode 41.3 tok/s · TTFT 35 ms · 12 tokens · cache paged — "
        "reused 30 tokens, computed 4 (new)\n\n"
        "## You\n\nMore?\n\n"
        "## Model\n\n_(empty)_\n"
    )
