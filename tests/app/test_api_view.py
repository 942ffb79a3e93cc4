"""An API conversation on screen (issue #19 item 11): selecting it switches the transcript, title, list
highlight and panels together; clicking the chat brings all of them back; Stop serving leaves no notice and a
Send that can be used; a grey Send always says why. Real window, real stories260K, real HTTP client."""

from __future__ import annotations

import httpx
from app_helpers import close_window, open_window, wait_reply
from PySide6.QtCore import Qt
from test_server_menu import DEADLINE_MS, free_port, start_serving

from app.server.api_view import READ_ONLY
from app.chat.pane import SEND_TIP


def click_chat(qtbot, w, row: int) -> None:
    """A real click on a chat row (as the user does), not a setCurrentRow."""
    rect = w.chat_list.visualItemRect(w.chat_list.item(row))
    qtbot.mouseClick(w.chat_list.viewport(), Qt.MouseButton.LeftButton, pos=rect.center())


def chat_on_screen(w, title: str, bubbles: int) -> bool:
    return (w.chat.title.text() == title and len(w.chat.bubbles) == bubbles
            and all(b.role in ("user", "assistant") for b in w.chat.bubbles))


def test_an_api_conversation_takes_the_chats_place_and_gives_it_back(qtbot, data_dir, stories_path):
    w = open_window(qtbot, data_dir, str(stories_path))
    w.settings.set("server/port", free_port())
    try:
        w.send("Once upon a time")
        wait_reply(qtbot, w)
        title, chat_id = w.chat.title.text(), w.chat_id
        qtbot.wait(100)  # the panels' last frame: the reply's final snapshot
        chat_tokens = w.scheduler.frame.seq_len
        url = start_serving(qtbot, w)
        assert w.chat.send_button.isEnabled() and w.chat.send_button.toolTip() == SEND_TIP  # chats go on
        r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "model": "stories260K", "messages": [{"role": "user", "content": "Ben found a shiny rock."}],
            "temperature": 0, "max_tokens": 20})
        assert r.status_code == 200, r.text
        qtbot.waitUntil(lambda: w.api_list.count() == 1, timeout=DEADLINE_MS)
        sid = w.api_list.session_ids()[0]

        with qtbot.waitSignal(w.api_snapshot_shown, timeout=DEADLINE_MS) as shown:
            w.api_list.setCurrentRow(0)
        api_tokens = shown.args[1].seq_len
        assert api_tokens != chat_tokens
        # one conversation on screen: its transcript, its title, no chat highlighted, its panels
        qtbot.waitUntil(lambda: len(w.chat.bubbles) == 1 and w.chat.bubbles[0].role == "api", timeout=DEADLINE_MS)
        assert w.chat.title.text() == "API #1"  # numbered from 1, not by the engine's session ids (it read "#55")
        assert "Ben found a shiny rock" in w.chat.bubbles[0].text
        assert w.chat.bubbles[0].stats_label.text().startswith(f"{api_tokens:,} tokens, as the model saw them")
        assert w.status.speed.text() == ""  # the chat's tok/s left with it
        assert w.chat_list.currentRow() == -1 and not w.chat_list.selectedItems()
        assert w.chat_id is None
        qtbot.waitUntil(lambda: w.scheduler.frame is not None and w.scheduler.frame.seq_len == api_tokens,
                        timeout=DEADLINE_MS)
        # nothing is typed into it, and the grey Send says why
        assert not w.chat.send_button.isEnabled() and w.chat.send_button.toolTip() == READ_ONLY
        assert w.chat.input.isReadOnly() and w.chat.input.placeholderText() == READ_ONLY
        assert not w.chat.system_prompt.isVisible()
        assert not w.chat.scroll.horizontalScrollBar().isVisible()  # the bubble fits the column

        click_chat(qtbot, w, 0)  # the chat that was on screen
        assert w.chat_id == chat_id and chat_on_screen(w, title, 2)
        assert w.api_list.selected == 0 and w.chat_list.currentRow() == 0
        assert w.chat.send_button.isEnabled() and not w.chat.input.isReadOnly() and w.chat.system_prompt.isVisible()
        assert w.status.speed.text().endswith("tokens/s")  # its last reply's speed is back
        qtbot.waitUntil(lambda: w.scheduler.frame is not None and w.scheduler.frame.seq_len == chat_tokens,
                        timeout=DEADLINE_MS)  # its panels are back
        qtbot.wait(1200)  # two polls: the API's snapshots no longer reach the panels
        assert w.scheduler.frame.seq_len == chat_tokens and chat_on_screen(w, title, 2)

        w.api_list.setCurrentRow(0)
        qtbot.waitUntil(lambda: w.chat.title.text() == f"API #{w.api_list.number(sid)}", timeout=DEADLINE_MS)
        with qtbot.waitSignal(w.server.serving, timeout=DEADLINE_MS):
            w.menu_actions["serve_stop"].trigger()
        # Stop serving: the chat is back, nothing left in the message area, Send usable and saying so
        assert w.chat_id == chat_id and chat_on_screen(w, title, 2) and w.chat_list.currentRow() == 0
        assert not w.chat.notice.isVisible()
        assert w.chat.send_button.isEnabled() and w.chat.send_button.toolTip() == SEND_TIP
        with qtbot.waitSignal(w.reply_finished, timeout=DEADLINE_MS):
            w.send("The end")
        assert len(w.chat.bubbles) == 4
    finally:
        close_window(w)


def test_a_grey_send_says_why(qtbot, data_dir, stories_path):
    """While the model loads and while a reply is written, Send's tooltip gives the reason it is grey."""
    from app.history.store import HistoryStore
    from app.shell.window import MainWindow
    from app.settings.store import Settings

    w = MainWindow(Settings.from_data_dir(data_dir), HistoryStore.in_data_dir(data_dir), model=str(stories_path))
    qtbot.addWidget(w)
    w.show()
    try:
        assert not w.chat.send_button.isEnabled() and w.chat.send_button.toolTip() == "Starting the engine…"
        with qtbot.waitSignal(w.model_loaded, timeout=120_000):
            w.start()
            assert w.chat.send_button.toolTip().startswith("Loading ")
        assert w.chat.send_button.isEnabled() and w.chat.send_button.toolTip() == SEND_TIP
        w.send("Once upon a time")
        assert not w.chat.send_button.isEnabled() and "Stop (Esc)" in w.chat.send_button.toolTip()
        wait_reply(qtbot, w)
        assert w.chat.send_button.isEnabled() and w.chat.send_button.toolTip() == SEND_TIP
    finally:
        close_window(w)
