"""The chat pane on its own: keys, copy, edit; streaming text is buffered and rendered on refresh."""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtGui import QGuiApplication

from app.chat.pane import ChatPane
from app.history.store import Message
from app.chat.transcript import FIRST_PAGE, MAX_BUILT, PAGE


def _pane(qtbot) -> ChatPane:
    pane = ChatPane()
    qtbot.addWidget(pane)
    pane.show()
    pane.set_ready(True, "ready")
    return pane


def test_enter_sends_shift_enter_is_a_new_line(qtbot):
    pane = _pane(qtbot)
    qtbot.keyClicks(pane.input, "line one")
    qtbot.keyClick(pane.input, Qt.Key.Key_Return, Qt.KeyboardModifier.ShiftModifier)
    qtbot.keyClicks(pane.input, "line two")
    assert pane.input.toPlainText() == "line one\nline two"
    with qtbot.waitSignal(pane.send_requested, timeout=1000) as blocker:
        qtbot.keyClick(pane.input, Qt.Key.Key_Return)
    assert blocker.args == ["line one\nline two"] and pane.input.toPlainText() == ""


def test_escape_stops_only_while_generating(qtbot):
    pane = _pane(qtbot)
    with qtbot.assertNotEmitted(pane.stop_requested):
        qtbot.keyClick(pane.input, Qt.Key.Key_Escape)
    pane.set_generating(True)
    assert not pane.send_button.isEnabled() and pane.stop_button.isEnabled()
    with qtbot.waitSignal(pane.stop_requested, timeout=1000):
        qtbot.keyClick(pane.input, Qt.Key.Key_Escape)


def test_streaming_copy_and_edit(qtbot):
    pane = _pane(qtbot)
    pane.add_message("user", "hi", 0)
    bubble = pane.begin_reply(1)
    pane.append_delta("Hello ")
    pane.append_delta("**world**")
    assert "world" not in bubble.body.text()  # buffered until the refresh timer renders it
    pane.render()
    assert "<b>world</b>" in bubble.body.text()
    pane.finish_reply("Hello **world**", {"generated_tokens": 2, "decode_tokens_per_s": 12.5, "ttft_ms": 40,
                                           "reused_tokens": 3, "recomputed_tokens": 4, "first_divergence": 3})
    assert bubble.cache_label.text() == "reused 3 tokens, computed 4 (new)"  # a reply saved without its account
    assert "decode 12.5 tok/s" in bubble.stats_label.text() and "TTFT 40 ms" in bubble.stats_label.text()
    qtbot.mouseClick(bubble.copy_button, Qt.MouseButton.LeftButton)
    assert QGuiApplication.clipboard().text() == "Hello **world**"
    user = pane.bubbles[0]
    qtbot.mouseClick(user.edit_button, Qt.MouseButton.LeftButton)
    user.editor.setPlainText("hello again")
    with qtbot.waitSignal(pane.edit_requested, timeout=1000) as blocker:
        qtbot.mouseClick(user.save_button, Qt.MouseButton.LeftButton)
    assert blocker.args == [0, "hello again"]
    pane.truncate_after(0)
    assert [b.role for b in pane.bubbles] == ["user"]


def test_suggestions_on_an_empty_chat(qtbot):
    pane = _pane(qtbot)
    qtbot.waitUntil(lambda: pane.suggestions.isVisible(), timeout=1000)
    button = pane.suggestions.findChildren(type(pane.send_button))[0]
    with qtbot.waitSignal(pane.send_requested, timeout=1000) as blocker:
        qtbot.mouseClick(button, Qt.MouseButton.LeftButton)
    assert blocker.args == [button.text()]
    pane.add_message("user", button.text(), 0)
    assert not pane.suggestions.isVisible()
    pane.set_ready(False, "loading")
    pane.clear()
    assert not pane.suggestions.isVisible()


def _records(n: int) -> list[Message]:
    return [Message(i + 1, 1, i, "user" if i % 2 == 0 else "assistant", f"m{i}",
                    {"pinned": True} if i == 3 else {"generated_tokens": 4} if i % 2 else {}) for i in range(n)]


def test_a_long_chat_gets_bubbles_for_its_newest_messages_and_the_rest_on_demand(qtbot):
    """(``isHidden``: new bubbles are shown by the event loop, their labels' own state is what is set.)"""
    pane = _pane(qtbot)
    pane.set_messages(_records(300))
    assert [b.position for b in pane.bubbles] == list(range(300 - FIRST_PAGE, 300))
    assert pane.scroll.older_count == 300 - FIRST_PAGE
    assert [not b.regen_button.isHidden() for b in pane.bubbles].count(True) == 1
    assert not pane.bubbles[-1].regen_button.isHidden() and pane.regen_button.isEnabled()
    assert pane.user_text_at(2) == "m2" and pane.user_text_at(3) == ""  # no bubble yet; 3 is a reply
    pane.set_text_at(2, "edited")
    assert pane.scroll.reveal_older() == PAGE and pane.bubbles[0].position == 300 - FIRST_PAGE - PAGE
    pane.set_generating(True)  # the buttons of every bubble follow, built or not
    assert not any(b.edit_button.isEnabled() for b in pane.bubbles)
    pane.truncate_after(10)  # fewer than a first page left: the older ones get bubbles again
    pane.set_generating(False)
    assert [b.position for b in pane.bubbles] == list(range(11)) and pane.scroll.older_count == 0
    assert pane.bubbles[2].text == "edited" and pane.bubbles[3].pinned
    assert all(b.edit_button.isEnabled() for b in pane.bubbles)
    assert not pane.bubbles[9].regen_button.isHidden() and pane.bubbles[7].regen_button.isHidden()


def test_unsaved_messages_say_so_until_they_are_saved(qtbot):
    pane = _pane(qtbot)
    pane.set_messages(_records(4))
    pane.set_unsaved({3, 4})  # 4 has no bubble yet: it is marked when it comes
    reply = pane.add_message("assistant", "new", 4)
    assert [not b.save_label.isHidden() for b in pane.bubbles] == [False, False, False, True, True]
    assert reply.save_label.text() == "not saved — retrying"
    pane.set_unsaved(set())
    assert all(b.save_label.isHidden() for b in pane.bubbles)


def test_scrolling_far_keeps_a_bounded_window_of_bubbles(qtbot):
    pane = _pane(qtbot)
    pane.set_messages(_records(400))
    pane.bubbles[-2].pin_button.click()  # a state the bubble holds, kept when it goes back to a record
    while pane.scroll.older_count:
        pane.scroll.reveal_older()
        assert len(pane.bubbles) <= MAX_BUILT
        positions = [b.position for b in pane.bubbles]
        assert positions == list(range(positions[0], positions[0] + len(positions)))  # consecutive
    assert pane.bubbles[0].position == 0 and pane.scroll.newer_count == 400 - MAX_BUILT
    assert not any(not b.regen_button.isHidden() for b in pane.bubbles)  # the last reply is not built
    assert pane.regen_button.isEnabled() and pane.user_text_at(398) == "m398"
    while pane.scroll.newer_count:
        pane.scroll.reveal_newer()
        assert len(pane.bubbles) <= MAX_BUILT
    assert pane.bubbles[-1].position == 399 and not pane.bubbles[-1].regen_button.isHidden()
    assert pane.bubbles[-2].pinned
    pane.scroll.reveal_older()  # far up again, then a new message: the newest come back first
    pane.scroll.reveal_older()
    assert pane.scroll.newer_count
    pane.begin_reply(400)
    assert pane.scroll.newer_count == 0 and [b.position for b in pane.bubbles][-2:] == [399, 400]
    assert pane.streaming is pane.bubbles[-1] and not pane.bubbles[-1].regen_button.isHidden()
    while pane.scroll.older_count:  # the streaming reply is never turned back into a record
        pane.scroll.reveal_older()
    assert pane.streaming is pane.bubbles[-1] and pane.streaming.parent() is not None
