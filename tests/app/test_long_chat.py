"""A chat of 5,000 messages in the real window: it opens with its last message on screen, with bubbles
for the newest messages only, and scrolling to the top builds the earlier ones in place.

The time to open is printed, never asserted (``-s`` shows it); what is asserted is the structure that
makes it fast. Before bubbles were built on demand it took 156 s and 1.8 GB here; see ``app.chat.transcript``.
"""

from __future__ import annotations

import time

from app_helpers import ScriptedSession, close_window, make_info, wait_reply
from history_files import stored_messages, write_history

from app.history.store import HistoryStore
from app.shell.window import MainWindow
from app.settings.store import Settings
from app.chat.transcript import FIRST_PAGE, MAX_BUILT, PAGE
from app.link.worker import EngineBackend

N = 5000


def _window(qtbot, data_dir) -> tuple[MainWindow, float]:
    """The window on the data dir, shown; returns it and the seconds until its last message is on screen."""
    backend = EngineBackend(load=lambda spec, progress, cancel: type("L", (), {"info": make_info()})(),
                            make_session=lambda loaded, cache: ScriptedSession(chunks=1, tokens=3))
    t0 = time.perf_counter()
    w = MainWindow(Settings.from_data_dir(data_dir), HistoryStore.in_data_dir(data_dir), model="demo",
                   backend=backend)
    qtbot.addWidget(w)
    w.show()
    qtbot.waitUntil(lambda: _on_screen(w, w.chat.bubbles[-1]), timeout=120_000)
    return w, time.perf_counter() - t0


def _on_screen(w, bubble) -> bool:
    viewport = w.chat.scroll.viewport()
    top = bubble.mapTo(viewport, bubble.rect().topLeft()).y()
    return bubble.isVisible() and 0 <= top < viewport.height()


def _scroll_to_top_and_wait(qtbot, w) -> None:
    first, bar = w.chat.bubbles[0].position, w.chat.scroll.verticalScrollBar()
    bar.setValue(0)  # as a wheel or a drag to the top does
    # built, laid out, and the view kept on what it showed: no longer at the top
    qtbot.waitUntil(lambda: w.chat.bubbles[0].position < first and bar.value() > 0, timeout=10_000)


def test_a_5000_message_chat_opens_with_the_newest_bubbles_and_builds_older_ones_on_scroll(qtbot, data_dir):
    write_history(data_dir / "history.sqlite3", N)
    w, seconds = _window(qtbot, data_dir)
    try:
        print(f"\n{N} messages: last message on screen {seconds:.2f} s after the window was made")
        bubbles = w.chat.bubbles
        assert len(bubbles) == FIRST_PAGE <= 100  # not one per message
        assert [b.position for b in bubbles] == list(range(N - FIRST_PAGE, N))
        assert bubbles[-1].text.startswith(f"message {N - 1} of chat 1")
        assert "cache paged" in bubbles[-1].stats_label.text() and bubbles[-1].cache_label.text()
        bar = w.chat.scroll.verticalScrollBar()
        assert bar.value() == bar.maximum() > 0
        assert sum(b.regen_button.isVisibleTo(w) for b in bubbles) == 1 and bubbles[-1].regen_button.isVisibleTo(w)

        first = bubbles[0]
        bar.setValue(0)
        top_before = first.mapTo(w.chat.scroll.viewport(), first.rect().topLeft()).y()
        _scroll_to_top_and_wait(qtbot, w)
        assert [b.position for b in w.chat.bubbles] == list(range(N - FIRST_PAGE - PAGE, N))
        qtbot.wait(50)  # the new bubbles lay out; the one that was at the top stays where it was
        top_after = first.mapTo(w.chat.scroll.viewport(), first.rect().topLeft()).y()
        assert abs(top_after - top_before) < 30, (top_before, top_after)
        assert bar.value() > 0
        for _ in range(3):
            _scroll_to_top_and_wait(qtbot, w)
        assert w.chat.bubbles[0].position == N - FIRST_PAGE - 4 * PAGE and len(w.chat.bubbles) == MAX_BUILT
        last = w.chat.bubbles[-1].position
        assert last == N - FIRST_PAGE - 4 * PAGE + MAX_BUILT - 1

        def down() -> bool:  # back down, as a drag to the end does: the newer ones are built again
            if w.chat.bubbles[-1].position == last:  # (again while the page built last is laid out and its
                bar.setValue(bar.maximum())          # height moves the end, as a user's drag goes on)
            return w.chat.bubbles[-1].position == last + PAGE  # one page, not more
        qtbot.waitUntil(down, timeout=10_000)
    finally:
        close_window(w)


def test_a_long_chat_regenerates_edits_and_pins_like_a_short_one(qtbot, data_dir):
    write_history(data_dir / "history.sqlite3", 300)
    w, _ = _window(qtbot, data_dir)
    try:
        with qtbot.waitSignal(w.model_loaded, timeout=30_000):
            w.start()
        w.chat.bubbles[-2].pin_button.click()  # the last user message
        assert w.history.messages(w.chat_id)[298].stats.get("pinned") is True
        w.chat.regen_button.click()
        assert wait_reply(qtbot, w)[1] == "max_tokens"
        assert w.chat.bubbles[-1].text == "xxx" and len(w.chat.bubbles) <= FIRST_PAGE + 1
        while w.chat.scroll.older_count:  # everything can be reached by scrolling up...
            _scroll_to_top_and_wait(qtbot, w)
            assert len(w.chat.bubbles) <= MAX_BUILT  # ...while the bubbles furthest down go back to records
        assert [b.position for b in w.chat.bubbles] == list(range(MAX_BUILT))
        w.chat.bubbles[10].begin_edit()
        w.chat.bubbles[10].editor.setPlainText("edited far up")
        w.chat.bubbles[10].save_button.click()
        assert wait_reply(qtbot, w)[1] == "max_tokens"
        assert [b.text for b in w.chat.bubbles[10:]] == ["edited far up", "xxx"]
        assert [m[2] for m in stored_messages(data_dir / "history.sqlite3")][10:] == ["edited far up", "xxx"]
    finally:
        close_window(w)
