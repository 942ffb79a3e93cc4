"""A paste longer than the context, as a user makes it in the real window (#19 item 5)."""

from __future__ import annotations

import pytest
from app_helpers import close_window, open_window, wait_reply


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
        assert "the model reads the last 256" in said and w.history.messages(w.chat_id) == []
        assert [b.text() for b in w.chat.notice.action_buttons] == ["Send", "New chat"]
        w.chat.notice.action_buttons[0].click()
        assert wait_reply(qtbot, w)[1] in ("max_tokens", "eos")
        stats = w.history.messages(w.chat_id)[-1].stats
        assert f"{stats['dropped_tokens']:,} of them are dropped unread" in said  # what it said is what happened
    finally:
        close_window(w)
