"""Server ▸ Start / Stop serving on the real window and engine (stories260K), with a real HTTP client."""

from __future__ import annotations

import dataclasses
import os
import socket
import threading

import httpx
from app_helpers import close_window, open_window

from engine.config import CacheConfig, SamplingConfig
from slow_forward import SlowForward

MESSAGES = [{"role": "user", "content": "Once upon a time"}]
MAX_TOKENS = 24
DEADLINE_MS = 60_000


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def reference(stories_path) -> tuple[str, int]:
    """The engine's own greedy reply and its conversation's length (prompt + reply tokens)."""
    from engine.model.loader import load_model
    from engine.core.session import ChatSession

    lm = load_model(str(stories_path))
    s = ChatSession(lm, CacheConfig())
    s.start(MESSAGES, SamplingConfig(temperature=0.0, max_new_tokens=MAX_TOKENS))
    while not (r := s.step()).done:
        pass
    out = r.text, len(s.seq)
    s.close()
    return out


def start_serving(qtbot, w) -> str:
    with qtbot.waitSignal(w.server.serving, timeout=DEADLINE_MS) as blocker:
        w.menu_actions["serve_start"].trigger()
    url = blocker.args[0]
    assert url
    return url


def test_serve_from_the_menu_chat_completion_list_and_panels(qtbot, data_dir, stories_path):
    expected_text, expected_len = reference(stories_path)
    w = open_window(qtbot, data_dir, str(stories_path))
    port = free_port()
    w.settings.set("server/port", port)
    try:
        assert not w.api_list.isVisible()
        chats = [w.chat_list.item(i).text() for i in range(w.chat_list.count())]
        url = start_serving(qtbot, w)
        assert url == f"http://127.0.0.1:{port}"
        assert w.status.server.text() == f"Serving at {url}/v1" and w.status.server.isVisible()
        assert w.api_list.isVisible()
        assert w.conversation.ready  # the chat goes on while the model serves
        assert not w.menu_actions["serve_start"].isEnabled() and w.menu_actions["serve_stop"].isEnabled()
        # cache settings change while serving (they apply to the chats; the API keeps the server's setting)
        wanted = dataclasses.replace(w.cache.applied, page_size=w.cache.applied.page_size * 2)
        with qtbot.waitSignal(w.engine.worker.applied, timeout=DEADLINE_MS) as applied:
            w.apply_cache_config(wanted)
        assert applied.args[0] == wanted

        r = httpx.post(url + "/v1/chat/completions", timeout=60,
                       json={"model": "stories260K", "messages": MESSAGES, "temperature": 0,
                             "max_tokens": MAX_TOKENS})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["message"]["content"] == expected_text  # greedy: the engine's own reply
        usage = body["usage"]
        assert usage["prompt_tokens"] + usage["completion_tokens"] >= expected_len - 1

        qtbot.waitUntil(lambda: w.api_list.count() == 1, timeout=DEADLINE_MS)
        # the user's chats are apart: the API's conversation is not one of them
        assert [w.chat_list.item(i).text() for i in range(w.chat_list.count())] == chats
        assert "API #" in w.api_list.item(0).text()
        cached = usage["prompt_tokens_details"]["cached_tokens"]  # the conversation's requests, step by step
        step = f"step 1: {cached:,} reused, {usage['prompt_tokens'] - cached:,} recomputed"
        qtbot.waitUntil(lambda: step in w.api_list.item(0).text(), timeout=DEADLINE_MS)
        assert step in w.api_list.item(0).toolTip()
        sid = w.api_list.session_ids()[0]
        with qtbot.waitSignal(w.api_snapshot_shown, timeout=DEADLINE_MS) as shown:
            w.api_list.setCurrentRow(0)
        got_sid, snap = shown.args
        assert got_sid == sid
        assert snap.seq_len == expected_len  # that conversation's tokens: the prompt and the reply
        # the panels draw it (a later poll may bring a newer snapshot of the same conversation)
        qtbot.waitUntil(lambda: w.scheduler.frame is not None and w.scheduler.frame.seq_len == expected_len,
                        timeout=DEADLINE_MS)
        assert sum(int(v.sum()) for v in w.occupancy.stack.values()) > 0

        with qtbot.waitSignal(w.server.serving, timeout=DEADLINE_MS) as stopped:
            w.menu_actions["serve_stop"].trigger()
        assert stopped.args[0] == ""
        assert not w.status.server.isVisible() and w.api_list.count() == 0
        assert w.conversation.ready
        with socket.socket() as s:  # the port is free again
            s.bind(("127.0.0.1", port))

        url2 = start_serving(qtbot, w)  # a second start works on the same port
        assert url2 == url
        r2 = httpx.post(url + "/v1/chat/completions", timeout=60,
                        json={"model": "stories260K", "messages": MESSAGES, "temperature": 0,
                              "max_tokens": MAX_TOKENS})
        assert r2.json()["choices"][0]["message"]["content"] == expected_text
    finally:
        close_window(w)
    assert w.server.thread is None  # quitting stopped it
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_the_app_chats_while_an_api_request_streams(qtbot, data_dir, stories_path):
    """No lending: a message typed while an API request decodes gets its reply from the same engine core, and
    both replies are the engine's own greedy text; the chat's page map shows the API's pages in the pool."""
    expected_text, _ = reference(stories_path)
    w = open_window(qtbot, data_dir, str(stories_path))
    w.settings.set("server/port", free_port())
    slow = None
    got: dict[str, str] = {}

    def ask() -> None:
        r = httpx.post(url + "/v1/chat/completions", timeout=120,
                       json={"model": "stories260K", "messages": MESSAGES, "temperature": 0, "max_tokens": 150})
        got["api"] = r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else r.text

    try:
        url = start_serving(qtbot, w)
        slow = SlowForward(w.server.thread.server.lm.model, 0.05)  # the API reply lasts seconds
        t = threading.Thread(target=ask)
        t.start()
        qtbot.waitUntil(lambda: w.api_list.count() == 1, timeout=DEADLINE_MS)
        snaps = []
        w.engine.worker.snapshot.connect(snaps.append)
        with qtbot.waitSignal(w.reply_finished, timeout=DEADLINE_MS) as done:
            w.send(MESSAGES[0]["content"])
        assert done.args[1] in ("max_tokens", "eos") and w.chat.bubbles[-1].text
        assert max(sn.batch_size for sn in snaps) == 2  # the chat's tokens decoded in the API's forwards
        held = [sn for sn in snaps if sn.page_mine is not None and (sn.page_state[:len(sn.page_mine)] != 0).any()]
        assert any(((sn.page_state != 0) & ~sn.page_mine).any() for sn in held)  # the API's pages, same pool
        assert t.is_alive()  # the API's reply was still streaming while the chat got its whole reply
        t.join(120)
        assert got["api"].startswith(expected_text[:20])
    finally:
        if slow is not None:
            slow.undo()
        close_window(w)


def test_busy_port_is_told_and_the_chat_goes_on(qtbot, data_dir, stories_path):
    w = open_window(qtbot, data_dir, str(stories_path))
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    w.settings.set("server/port", port)
    try:
        with qtbot.waitSignal(w.error_shown, timeout=DEADLINE_MS) as err:
            w.menu_actions["serve_start"].trigger()
        assert err.args[0] == f"The server did not start: port {port} is in use by another program."
        assert [b.text() for b in w.chat.notice.action_buttons] == ["Choose another port…"]
        assert w.chat.notice.isVisible()
        assert w.server.thread is None and w.menu_actions["serve_start"].isEnabled()
        # the worker has its model back: a chat reply still works
        with qtbot.waitSignal(w.reply_finished, timeout=DEADLINE_MS):
            w.send("Hello")
        assert w.chat.bubbles[-1].text
    finally:
        holder.close()
        close_window(w)


def test_loading_another_model_stops_the_server(qtbot, data_dir, stories_path):
    w = open_window(qtbot, data_dir, str(stories_path))
    port = free_port()
    w.settings.set("server/port", port)
    try:
        start_serving(qtbot, w)
        with qtbot.waitSignal(w.model_loaded, timeout=120_000):
            with qtbot.waitSignal(w.server.serving, timeout=DEADLINE_MS) as stopped:
                w.start()  # loads the same model again
            assert stopped.args[0] == ""
        assert w.server.thread is None
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
        with qtbot.waitSignal(w.reply_finished, timeout=DEADLINE_MS):
            w.send("Hello")
    finally:
        close_window(w)


def test_four_api_requests_decode_together_and_the_page_map_shows_it(qtbot, data_dir, stories_path):
    w = open_window(qtbot, data_dir, str(stories_path))
    w.settings.set("server/port", free_port())
    prompts = ["Once upon a time", "Ben found a shiny rock.", "The cat sat on the mat.", "Mia baked a cake."]
    replies: dict[int, int] = {}
    slow = None

    def ask(i: int) -> None:
        r = httpx.post(url + "/v1/chat/completions", timeout=120,
                       json={"model": "stories260K", "messages": [{"role": "user", "content": prompts[i]}],
                             "temperature": 0, "max_tokens": 150})
        replies[i] = r.status_code

    try:
        url = start_serving(qtbot, w)
        server = w.server.thread.server
        slow = SlowForward(server.lm.model, 0.03)  # ~5 s per reply: the panels poll twice a second
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        qtbot.waitUntil(lambda: w.api_list.count() == 4, timeout=DEADLINE_MS)
        w.api_list.setCurrentRow(0)
        qtbot.waitUntil(lambda: (w.page_map.snapshot is not None and w.page_map.snapshot.batch_size >= 2
                                 and len(w.page_map.snapshot.written_pages) >= 2), timeout=DEADLINE_MS)
        snap = w.page_map.snapshot
        assert f"{len(snap.written_pages)} written this step ({snap.batch_size} chats decoded together)" in \
            w.page_map.caption.text()
        if os.environ.get("KVSCOPE_SCREENSHOTS"):
            from PySide6.QtWidgets import QDockWidget

            dock = w.page_map.parent()
            while dock is not None and not isinstance(dock, QDockWidget):
                dock = dock.parent()
            if dock is not None:
                dock.raise_()
            qtbot.wait(700)  # a poll or two more: the map redrawn on its tab
            w.grab().save(os.path.join(os.environ["KVSCOPE_SCREENSHOTS"], "api-batched.png"))
        for t in threads:
            t.join(120)
        assert replies == {0: 200, 1: 200, 2: 200, 3: 200}
        assert server.scheduler.metrics.batched_forwards >= 50
    finally:
        if slow is not None:
            slow.undo()
        close_window(w)
