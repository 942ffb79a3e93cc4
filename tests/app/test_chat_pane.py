"""The chat pane on its own: keys, copy, edit; streaming text is buffered and rendered on refresh."""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtGui import QGuiApplication

from app.chat_pane import ChatPane


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
    assert bubble.cache_label.text() == "reused 3 tokens, recomputed 4, diverged at 3"
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
