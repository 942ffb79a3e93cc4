"""Remote chats are saved in the history, marked with their server: a window opened later lists them (not connected),
shows their transcript, connects again from the chat's own notice (URL, events endpoint and model filled in, the key
asked for again) and goes on in the same chat; deleting one removes it from the file. A server serving several
models: the dialog's Model field picks one (a wrong name says which it serves), and the chat asks that model."""

from __future__ import annotations

import json
import sqlite3

import pytest
from app_helpers import close_window, open_window
from test_remote_app import Server, connect, send, shot

from engine.config import SamplingConfig

SHORT = SamplingConfig(temperature=0.0, max_new_tokens=20)


@pytest.fixture
def server(stories_path):
    srv = Server(stories_path)
    yield srv
    srv.kill()


def _rows(data_dir) -> list[tuple]:
    db = sqlite3.connect(str(data_dir / "history.sqlite3"))
    try:
        return db.execute("SELECT id, title, server FROM chats ORDER BY id").fetchall()
    finally:
        db.close()


def _messages(data_dir, chat_id: int) -> list[tuple]:
    db = sqlite3.connect(str(data_dir / "history.sqlite3"))
    try:
        return db.execute("SELECT role, content, stats FROM messages WHERE chat_id = ? ORDER BY position",
                          (chat_id,)).fetchall()
    finally:
        db.close()


def test_a_remote_chat_is_saved_reopened_and_continued(qtbot, data_dir, stories_path, server):
    w = open_window(qtbot, data_dir, str(stories_path), sampling=SHORT)
    try:
        local_chats = [c.id for c in w.history.chats()]
        rc = connect(qtbot, w, server.url)
        w.chat.system_prompt.setText("Be brief.")
        w.chat.system_prompt_changed.emit("Be brief.")
        assert send(qtbot, w, "Once upon a time") in ("max_tokens", "eos")
        first_reply = rc.messages[-1].content
        chat_id, label = rc.id, rc.label
        assert first_reply and label.endswith("— Once upon a time")
    finally:
        close_window(w)
        w.close()
    # the file: one remote row marked with its server (never a key), its messages with the reply's stats
    (row,) = [r for r in _rows(data_dir) if r[2]]
    assert row[0] == chat_id and row[1] == "Once upon a time"
    assert json.loads(row[2]) == {"url": server.url, "model": "stories260K", "events": ""}
    saved = _messages(data_dir, chat_id)
    assert [(r[0], r[1]) for r in saved] == [("user", "Once upon a time"), ("assistant", first_reply)]
    assert json.loads(saved[1][2])["stop_reason"] in ("max_tokens", "eos")

    w = open_window(qtbot, data_dir, str(stories_path), sampling=SHORT)
    try:
        remote = w.remote
        assert [c.id for c in w.history.chats()] == local_chats  # the local list has no remote chat in it
        assert remote.list.isVisible() and remote.list.chat_ids() == [chat_id]
        assert remote.list.item(0).text() == label and "not connected" in remote.list.item(0).toolTip()
        assert w.chat_id in local_chats and remote.current is None  # the last local chat opens, as before
        remote.list.setCurrentRow(0)
        rc = remote.current
        assert rc.id == chat_id and not rc.connected and w.chat_id is None
        assert [b.text for b in w.chat.bubbles] == ["Once upon a time", first_reply]
        assert w.chat.system_prompt.text() == "Be brief."
        assert not w.chat.send_button.isEnabled()  # nowhere to send it yet
        assert server.url in w.chat.notice.text and "never saved" in w.chat.notice.text
        assert w.chat.notice.property("tone") == "info"  # what the chat is, not a failure: not in red
        image = w.chat.notice.grab().toImage()
        fill = image.pixelColor(image.width() // 2, image.height() - 4)
        assert fill.blue() > fill.red(), fill.name()  # the info tone's blue, not the problem tone's #3a1f24
        assert "Not connected" in w.page_map.caption.text()
        port = server.url.rsplit(":", 1)[1]
        assert w.status.model.text() == f"⇄ stories260K @ 127.0.0.1:{port} · not connected"
        assert not w.status.context.isVisible()  # nothing of the local chat's context
        qtbot.wait(200)  # the transcript lays out on the event loop
        shot(w, "saved_offline")
        (connect_button,) = w.chat.notice.action_buttons
        connect_button.click()
        dialog = remote.dialog
        assert dialog.isVisible() and dialog.url.text() == server.url and dialog.key.text() == ""
        assert dialog.model.currentText() == "stories260K"
        with qtbot.waitSignal(remote.link_attached, timeout=30_000):
            dialog.connect_button.click()
        assert remote.current is rc and rc.connected and len(remote.chats) == 1  # the same chat, not a new one
        assert w.chat.send_button.isEnabled() and not w.chat.notice.text
        assert send(qtbot, w, "The dog") in ("max_tokens", "eos")
        sent = rc.reply.prompt_ids  # the server was sent the whole saved conversation
        assert rc.reply.usage["prompt_tokens"] == len(sent) > 20
    finally:
        close_window(w)
        w.close()
    assert [r[0] for r in _messages(data_dir, chat_id)] == ["user", "assistant", "user", "assistant"]

    w = open_window(qtbot, data_dir, str(stories_path), sampling=SHORT)
    try:
        w.remote.close_chat(chat_id)  # its menu's "Delete this chat"
        assert not w.remote.list.isVisible() and w.chat_id in local_chats
    finally:
        close_window(w)
        w.close()
    assert [r for r in _rows(data_dir) if r[2]] == [] and _messages(data_dir, chat_id) == []


def test_the_model_field_picks_a_served_model_and_says_which_are_served(qtbot, data_dir, stories_path, server):
    w = open_window(qtbot, data_dir, str(stories_path), sampling=SHORT)
    try:
        w.menu_actions["connect"].trigger()
        dialog = w.remote.dialog
        dialog.url.setText(server.url)
        dialog.model.setEditText("llama-70b")
        dialog.connect_button.click()
        qtbot.waitUntil(lambda: bool(dialog.error.text()), timeout=30_000)
        assert dialog.error.text().endswith("does not serve 'llama-70b'; it serves: stories260K")
        assert not w.remote.chats and dialog.isVisible()
        assert [dialog.model.itemText(i) for i in range(dialog.model.count())] == ["stories260K"]
        dialog.model.setCurrentIndex(0)
        with qtbot.waitSignal(w.remote.chat_added, timeout=30_000) as added:
            dialog.connect_button.click()
        rc = added.args[0]
        assert rc.model == "stories260K" and rc.link.engine.models == ["stories260K"]
        assert send(qtbot, w, "Once") in ("max_tokens", "eos") and rc.reply.text
    finally:
        close_window(w)
        w.close()


def test_a_cancelled_reconnect_leaves_the_next_connection_a_new_chat(qtbot, data_dir, stories_path, server):
    """The chat's notice opens the dialog for that chat; cancelling it leaves the next connection a new chat, and
    the saved chat, opened again, goes on over that open connection."""
    w = open_window(qtbot, data_dir, str(stories_path), sampling=SHORT)
    try:
        rc = connect(qtbot, w, server.url)
        assert send(qtbot, w, "Once") in ("max_tokens", "eos")
    finally:
        close_window(w)
        w.close()
    w = open_window(qtbot, data_dir, str(stories_path), sampling=SHORT)
    try:
        w.remote.list.setCurrentRow(0)
        w.chat.notice.action_buttons[0].click()  # Connect… for the saved chat, then Cancel
        w.remote.dialog.reject()
        added = connect(qtbot, w, server.url)  # File ▸ Connect: a new chat, the saved one stays as it was
        saved = w.remote.chats[rc.id]
        assert added.id != rc.id and len(w.remote.chats) == 2 and not saved.connected
        w.remote.open_chat(rc.id)  # its server is open now: it goes on over that link
        assert w.remote.current is saved and saved.link is added.link and w.chat.send_button.isEnabled()
        assert send(qtbot, w, "The cat") in ("max_tokens", "eos") and saved.reply.text
    finally:
        close_window(w)
        w.close()


def test_a_reply_cut_by_closing_the_window_is_kept_and_reopens_as_interrupted(qtbot, data_dir, stories_path, server):
    w = open_window(qtbot, data_dir, str(stories_path), sampling=SamplingConfig(temperature=0.0, max_new_tokens=300))
    try:
        rc = connect(qtbot, w, server.url)
        w.chat.input.setPlainText("Tell me a story")
        w.chat.submit()
        qtbot.waitUntil(lambda: rc.chunks > 5, timeout=30_000)
    finally:
        close_window(w)  # mid-reply: what streamed is in the file already (written as it came)
        w.close()
        streamed = rc.messages[-1].content
    (_, content, stats), = [r for r in _messages(data_dir, rc.id) if r[0] == "assistant"]
    assert streamed and content == streamed and "stop_reason" not in json.loads(stats)
    assert json.loads(stats)["streamed_tokens"] > 5
    w = open_window(qtbot, data_dir, str(stories_path), sampling=SHORT)
    try:
        w.remote.list.setCurrentRow(0)
        assert w.chat.bubbles[-1].text == streamed
        assert "stopped: the app closed before this reply finished" in w.chat.bubbles[-1].stats_label.text()
    finally:
        close_window(w)
        w.close()
    assert json.loads(_messages(data_dir, rc.id)[1][2])["stop_reason"] == "interrupted"
