"""#31 item 1: at default settings a chat goes on past the model's context (the oldest tokens dropped, and said so),
and a message that would not fit under "Stop the reply" gets a one-click way on that follows the setting at once.

All on the real window with the built-in stories260K (512-token context), as a user types and clicks."""

from __future__ import annotations

from app_helpers import close_window, open_window, wait_reply

from app.controls.cache_parts import TOOLTIP_ROLE
from engine.config import SamplingConfig

MESSAGES = ("Once upon a time there was a little dog.", "What did the dog do next?",
            "Tell me about the cat in the garden.", "Where did they go after lunch?", "How did the story end?")
DROPS = ("Drop the oldest turns: drops the oldest whole messages to make room; the system prompt, pinned messages "
         "and the latest message stay")


def _type_and_send(qtbot, w, text: str):
    """Type ``text`` and press Send; the reply's (generation id, stop reason), or None when nothing was sent."""
    before = len(w.history.messages(w.chat_id)) if w.chat_id else 0
    w.chat.input.setPlainText(text)
    w.chat.submit()
    qtbot.waitUntil(lambda: w.chat.notice.isVisible() or len(w.history.messages(w.chat_id)) > before, timeout=10_000)
    return None if w.chat.notice.isVisible() else wait_reply(qtbot, w, timeout_ms=120_000)


def test_five_messages_at_default_settings_are_all_answered(qtbot, data_dir, stories_path):
    """The measure: five messages in one chat at default settings (sampling too: Max new tokens 256) — all answered
    (before: 2 of 5, message 3 refused as more than the context), the tokens dropped shown."""
    w = open_window(qtbot, data_dir, str(stories_path), sampling=None)
    try:
        assert w.controls.overflow.currentText() == "Drop the oldest turns"
        assert w.sampling.sampling().max_new_tokens == 256
        for text in MESSAGES:
            result = _type_and_send(qtbot, w, text)
            assert result is not None, w.chat.notice.text  # sent, not held back by a "Not sent yet" notice
            assert result[1] in ("eos", "max_tokens"), result
        replies = [b for b in w.chat.bubbles if b.role == "assistant"]
        assert len(replies) == 5 and all(b.text.strip() for b in replies)
        assert not any("context full" in b.stats_label.text() for b in replies)
        # the chat went past the 512-token context: what was dropped is said, under the reply and in the status bar
        assert any(DROPS in b.notes_label.text() for b in replies), [b.notes_label.text() for b in replies]
        assert "dropped)" in w.status.context.text()
        notes = " ".join(b.notes_label.text() for b in replies)
        assert "smaller than the protected prompt" not in notes and "overflow setting" not in notes
        # a chat past the context cannot go on with the cache off (every step would read all of it): not offered
        c = w.controls
        off = c.mode.model().item(c.mode.findData("off"))
        assert not off.isEnabled() and c.mode.itemData(c.mode.findData("off"), TOOLTIP_ROLE).startswith("This chat (")
        w.new_chat()
        qtbot.waitUntil(lambda: off.isEnabled(), timeout=10_000)  # an empty chat can
    finally:
        close_window(w)


def _choose_overflow(qtbot, w, name: str) -> None:
    w.controls.overflow.setCurrentIndex(w.controls.overflow.findData(name))  # as the user does
    qtbot.waitUntil(lambda: w.cache.applied.overflow == name, timeout=10_000)


def _buttons(w) -> list[str]:
    return [b.text() for b in w.chat.notice.action_buttons]


def test_a_message_that_does_not_fit_offers_drop_the_oldest_and_the_notice_follows_the_setting(qtbot, data_dir,
                                                                                              stories_path):
    w = open_window(qtbot, data_dir, str(stories_path),
                    sampling=SamplingConfig(temperature=0.0, max_new_tokens=20, ignore_eos=True))
    try:
        _choose_overflow(qtbot, w, "stop")
        text = "the cat sat on the mat and " * 56  # ~580 of stories260K's 512 tokens
        assert _type_and_send(qtbot, w, text) is None
        assert "more than the model's context of 512" in w.chat.notice.text
        assert "nothing set here drops tokens" in w.chat.notice.text
        assert _buttons(w) == ["Drop the oldest turns and send", "New chat"]

        _choose_overflow(qtbot, w, "truncate_middle")  # a setting that drops tokens: the notice says so at once
        qtbot.waitUntil(lambda: "it can be sent" in w.chat.notice.text, timeout=5_000)
        assert "nothing set here drops tokens" not in w.chat.notice.text and _buttons(w) == ["Send", "New chat"]
        _choose_overflow(qtbot, w, "stop")  # and back
        qtbot.waitUntil(lambda: "nothing set here drops tokens" in w.chat.notice.text, timeout=5_000)
        assert _buttons(w) == ["Drop the oldest turns and send", "New chat"]
        w.controls.mode.setCurrentIndex(w.controls.mode.findData("off"))  # nothing to drop from: not offered
        qtbot.waitUntil(lambda: w.cache.applied.mode == "off" and _buttons(w) == ["New chat"], timeout=5_000)
        assert 'choose an overflow policy that drops tokens (Paged under Cache, then' in w.chat.notice.text
        w.controls.mode.setCurrentIndex(w.controls.mode.findData("paged"))
        qtbot.waitUntil(lambda: _buttons(w) == ["Drop the oldest turns and send", "New chat"], timeout=5_000)

        w.chat.notice.action_buttons[0].click()  # the one click: the setting changes, the message goes out
        gen, reason = wait_reply(qtbot, w)
        assert reason == "max_tokens" and w.chat.bubbles[-1].text.strip()
        assert w.cache.applied.overflow == "turns"
        assert w.controls.overflow.currentText() == "Drop the oldest turns"
        assert [m.role for m in w.history.messages(w.chat_id)] == ["user", "assistant"]
        assert not w.chat.notice.isVisible() and w.chat.input.toPlainText() == ""
    finally:
        close_window(w)


def test_a_message_sent_right_after_a_change_is_checked_against_that_change(qtbot, data_dir, stories_path):
    """The worker applies a change and a message in the order sent: a message typed a moment after choosing "Stop
    the reply" is checked under it (asked first), not sent under the setting still in force to fail at the start."""
    w = open_window(qtbot, data_dir, str(stories_path),
                    sampling=SamplingConfig(temperature=0.0, max_new_tokens=20, ignore_eos=True))
    try:
        w.controls.overflow.setCurrentIndex(w.controls.overflow.findData("stop"))  # no wait: sent straight after
        assert _type_and_send(qtbot, w, "the cat sat on the mat and " * 56) is None
        assert "nothing set here drops tokens" in w.chat.notice.text and w.history.messages(w.chat_id) == []
        w.controls.overflow.setCurrentIndex(w.controls.overflow.findData("rolling"))
        w.chat.input.setPlainText("Once upon a time")
        w.chat.submit()  # sent under "Drop the oldest" a moment after it was chosen: its footer and reply agree
        assert wait_reply(qtbot, w)[1] == "max_tokens"
        assert "cache paged" in w.chat.bubbles[-1].stats_label.text() and w.cache.applied.overflow == "rolling"
    finally:
        close_window(w)
