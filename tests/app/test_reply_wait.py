"""A reply that waits before its first step says what for and for how long, in its bubble and the status bar,
with Stop as the way out; the wait is never in TTFT (#19 item 4). Real window, real stories260K."""

from __future__ import annotations

import re

from app_helpers import close_window, open_window, wait_reply

from app.chat.reply_wait import GENERIC, wait_text


def test_wait_text_names_the_cause_the_seconds_and_the_way_out():
    assert wait_text("a model load", 3.4) == "waiting for a model load · 3 s · Stop (Esc) cancels"
    assert GENERIC in wait_text(GENERIC, 1)


def test_a_swapped_out_chat_says_its_cache_comes_back_then_streams(qtbot, data_dir, stories_path):
    w = open_window(qtbot, data_dir, str(stories_path))
    try:
        w.send("Once upon a time")
        wait_reply(qtbot, w)
        first = w.chat_id
        w.new_chat()
        w.send("A cat sat")
        wait_reply(qtbot, w)  # activating the new chat swapped the first one's cache to host memory
        assert w.engine.worker._pool.get(first).offloaded  # read while the worker is idle
        w.open_chat(first)
        qtbot.waitUntil(lambda: w.chat_id == first and not w.generation_id)
        seen = []  # what the user saw each time the wait's text changed

        def saw(_gen: int, text: str) -> None:
            bubble = w.chat.streaming.body.text() if w.chat.streaming else ""
            status = w.status.wait.text() if w.status.wait.isVisible() else ""
            seen.append((text, bubble, status, w.chat.stop_button.isEnabled()))
        w.reply_wait.shown.connect(saw)
        w.send("Tell me more")
        gen, reason = wait_reply(qtbot, w)
        assert reason != "error"
        cause = "waiting for this chat's cache to come back from host memory · "
        assert seen and seen[0][0].startswith(cause) and seen[0][0].endswith(" s · Stop (Esc) cancels")
        text, bubble, status, stop_enabled = seen[0]
        assert cause in bubble and status == text and stop_enabled  # bubble, status bar, and the way out
        assert seen[-1][0] == ""  # the first step ended the wait: cleared from both
        assert not w.status.wait.isVisible()
        reply = w.chat.bubbles[-1]
        assert reply.text and "waiting for" not in reply.body.text()
        # the timing panel's TTFT is the engine's (the footer's): the wait is in neither
        footer = re.search(r"TTFT (\d+) ms", reply.stats_label.text()).group(1)
        # the panel draws the reply's last frame on its own refresh, which may come after reply_finished
        qtbot.waitUntil(lambda: f"TTFT {footer} ms" in w.timing.caption.text(), timeout=5000)
    finally:
        close_window(w)
