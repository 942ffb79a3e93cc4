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
        assert wait_reply(qtbot, w)[1] in ("max_tokens", "eos")
        stats = w.history.messages(w.chat_id)[-1].stats
        read = w.info.context_length // 2
        assert stats["recomputed_tokens"] == read and stats["reused_tokens"] == 0
        assert stats["dropped_tokens"] == stats["prompt_tokens"] - read > 2_000
        bubble = w.chat.bubbles[-1]
        assert bubble.cache_label.text() == (f"reused 0 tokens, recomputed {read}, dropped {stats['dropped_tokens']:,} "
                                             "unread to fit the context, nothing cached before")
        assert f"prefill {stats['prefill_tokens_per_s']:.0f} tok/s" in bubble.stats_label.text()
        assert stats["prefill_tokens_per_s"] == pytest.approx(read / (stats["prefill_ms"] / 1000.0))
        assert any("were dropped to fit the context of 512 tokens, unread" in n for n in stats["notes"])
        # the panels refresh on their own timer after the reply's last step
        qtbot.waitUntil(lambda: f"({read} prompt tokens)" in w.timing.caption.text(), timeout=10_000)
    finally:
        close_window(w)
