"""A paste longer than the context, as a user makes it in the real window (#19 item 5)."""

from __future__ import annotations

import numpy as np
import pytest
from app_helpers import close_window, open_window, wait_reply

from transformers import AutoTokenizer

from engine.model.chat import message_spans
from engine.snapshot import TOKEN_EVICTED


def test_a_paste_longer_than_the_context_says_what_was_dropped(qtbot, data_dir):
    """"Drop the middle" on a prompt six times the context: the reply's lines count the tokens the model read,
    and say how many were dropped unread (#19 item 5)."""
    w = open_window(qtbot, data_dir, "stories260K")
    try:
        w.controls.overflow.setCurrentIndex(w.controls.overflow.findData("truncate_middle"))  # as the user does
        qtbot.waitUntil(lambda: w.cache.applied.overflow == "truncate_middle", timeout=10_000)
        w.send("The little dog ran to the park and played with a big red ball. " * 200)  # ~3,000 tokens
        qtbot.waitUntil(lambda: "dropped unread" in w.chat.notice.text, timeout=20_000)  # said first (#49 item 3)
        w.chat.notice.action_buttons[0].click()  # Send
        assert wait_reply(qtbot, w)[1] in ("max_tokens", "eos")
        stats = w.history.messages(w.chat_id)[-1].stats
        read = w.info.context_length // 2
        assert stats["recomputed_tokens"] == read and stats["reused_tokens"] == 0
        assert stats["dropped_tokens"] == stats["prompt_tokens"] - read > 2_000
        bubble = w.chat.bubbles[-1]
        assert bubble.cache_label.text() == (f"reused 0 tokens, computed {read} (new), dropped {stats['dropped_tokens']:,} "
                                             "unread to fit the context")
        assert f"prefill {stats['prefill_tokens_per_s']:.0f} tok/s" in bubble.stats_label.text()
        assert stats["prefill_tokens_per_s"] == pytest.approx(read / (stats["prefill_ms"] / 1000.0))
        assert any("were dropped to fit the context of 512 tokens, unread" in n for n in stats["notes"])
        # the panels refresh on their own timer after the reply's last step
        qtbot.waitUntil(lambda: f"({read} of {stats['prompt_tokens']:,} prompt tokens computed)" in w.timing.caption.text(),
                        timeout=10_000)
    finally:
        close_window(w)


def test_a_paste_longer_than_the_context_says_what_it_drops_before_it_is_sent(qtbot, data_dir):
    """At the default "Drop the oldest turns" a 100 KB paste went out with no word and 43,951 tokens were dropped
    unread, said only afterwards (#49 item 3): it now waits, saying how many will be dropped, and goes on one click."""
    w = open_window(qtbot, data_dir, "stories260K")
    try:
        assert w.cache.applied.overflow == "turns"
        w.chat.input.setPlainText("The little dog ran to the park and played with a big red ball. " * 200)
        w.chat.submit()
        qtbot.waitUntil(lambda: "dropped unread" in w.chat.notice.text, timeout=20_000)
        said = w.chat.notice.text
        assert "tokens of this message), the model reads" in said  # no system prompt in this chat: none named
        assert w.history.messages(w.chat_id) == []
        assert [b.text() for b in w.chat.notice.action_buttons] == ["Send", "New chat"]
        w.chat.notice.action_buttons[0].click()
        assert wait_reply(qtbot, w)[1] in ("max_tokens", "eos")
        stats = w.history.messages(w.chat_id)[-1].stats
        assert f"{stats['dropped_tokens']:,} of them are dropped unread (the oldest {stats['dropped_tokens']:,} tokens" in said
        read = stats["recomputed_tokens"] + stats["reused_tokens"]
        assert f"the model reads {read:,}" in said and read == stats["prompt_tokens"] - stats["dropped_tokens"]
        assert read <= 448  # all but an eighth of the context: the reply has room before anything else goes
    finally:
        close_window(w)


def test_a_paste_longer_than_the_context_keeps_the_system_prompt(qtbot, data_dir, stories_path):
    """"Drop the oldest turns" on a paste six times the context in a chat with a system prompt: the system prompt is
    read and kept (it was dropped with the paste's oldest tokens), the paste's oldest part passed over unread, said
    before it is sent and in the reply's notes; the page map counts the paste's unread tokens as evicted."""
    w = open_window(qtbot, data_dir, "stories260K")
    try:
        w.on_screen.set_system_prompt("You are a storyteller who writes about dogs and cats.")  # as the pane does
        w.chat.input.setPlainText("The little dog ran to the park and played with a big red ball. " * 200)
        w.chat.submit()
        qtbot.waitUntil(lambda: "dropped unread" in w.chat.notice.text, timeout=20_000)
        assert "of this message; the system prompt is kept), the model reads" in w.chat.notice.text
        w.chat.notice.action_buttons[0].click()
        assert wait_reply(qtbot, w)[1] in ("max_tokens", "eos")
        stats = w.history.messages(w.chat_id)[-1].stats
        assert stats["dropped_tokens"] > 2_000
        assert any("the system prompt and pinned messages were kept" in n and "the oldest" in n for n in stats["notes"])
        assert stats["recomputed_tokens"] + stats["reused_tokens"] + stats["dropped_tokens"] == stats["prompt_tokens"]
        state = np.asarray(w.on_screen.latest.token_state)  # what the page map and the token strip draw
        system = message_spans(AutoTokenizer.from_pretrained(stories_path), w.conversation.engine_messages())[0]
        assert system[1] > 10 and not np.any(state[:system[1]] == TOKEN_EVICTED)  # the system prompt: read, kept
        assert int(np.count_nonzero(state == TOKEN_EVICTED)) == stats["dropped_tokens"]
    finally:
        close_window(w)
