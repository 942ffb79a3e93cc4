"""Big text in the real window (#31 item 3): a 100 KB message collapses with "Show all", an unbroken run
wraps inside the column, and a reply streaming beside a 100 KB message lays out only its own new text.

What is asserted is what a user sees (labels shown, buttons inside the view) and the structure that keeps
rendering off the reply's time (characters laid out per frame), never a time: the measured effect
(decode tok/s with and without the message, the longest stall) is in the issue's closing note.
"""

from __future__ import annotations

from app_helpers import close_window, open_window, wait_reply
from history_files import write_history
from PySide6.QtCore import Qt

from app.chat.message_body import FRAME_CHARS
from app.chat.pieces import PIECE_CHARS, Pieces
from engine.config import SamplingConfig

PROSE = "The little dog ran to the park and played with a big red ball. "
BIG = PROSE * 1560 + "The very last words."  # 99,860 characters


def _send_big(qtbot, w, text: str):
    """Send ``text`` under "Drop the middle" (the model reads half its context of it): its bubble."""
    w.controls.overflow.setCurrentIndex(w.controls.overflow.findData("truncate_middle"))  # as the user does
    qtbot.waitUntil(lambda: w.cache.applied.overflow == "truncate_middle", timeout=10_000)
    w.send(text)
    # longer than the context: it says first how much it drops unread, and goes on with one click
    qtbot.waitUntil(lambda: "dropped unread" in w.chat.notice.text, timeout=30_000)
    w.chat.notice.action_buttons[0].click()  # Send
    return next(b for b in w.chat.bubbles if b.role == "user" and b.text == text)


def test_a_100kb_message_shows_its_start_and_a_show_all_that_expands_it(qtbot, data_dir, stories_path):
    w = open_window(qtbot, data_dir, str(stories_path))
    try:
        w.resize(1024, 768)  # the narrowest chat column (~300 px): the collapsed start still fits in view
        bubble = _send_big(qtbot, w, BIG)
        assert wait_reply(qtbot, w)[1] in ("max_tokens", "eos", "context_full")
        body, pieces = bubble.body, Pieces()
        pieces.update(BIG)
        shown = len(pieces.all[0].body)
        assert len(body.labels) == 1 and PROSE.strip() in body.text() and "The very last words." not in body.text()
        assert body.toggle.isVisibleTo(w) and body.toggle.text() == f"Show all · {len(BIG) - shown:,} more characters"
        qtbot.wait(100)  # laid out at that width
        collapsed = bubble.height()
        assert collapsed < w.chat.scroll.viewport().height() / 2  # the reply under it is in view too

        qtbot.mouseClick(body.toggle, Qt.MouseButton.LeftButton)
        qtbot.waitUntil(lambda: not body.pending, timeout=10_000)  # built a few pieces a turn of the event loop
        assert len(body.labels) == len(pieces.all) >= len(BIG) // PIECE_CHARS
        assert "The very last words." in body.text() and body.toggle.text() == "Show less"
        qtbot.waitUntil(lambda: bubble.height() > 10 * collapsed, timeout=10_000)

        qtbot.mouseClick(body.toggle, Qt.MouseButton.LeftButton)
        assert len(body.labels) == 1 and body.toggle.text().startswith("Show all")
        qtbot.waitUntil(lambda: bubble.height() == collapsed, timeout=10_000)
        assert bubble.regen_button.isHidden() and w.chat.bubbles[-1].regen_button.isVisibleTo(w)
    finally:
        close_window(w)


def _right_edges(w) -> dict[str, int]:
    """The right edge, in the transcript's viewport, of each bubble's visible buttons and footer lines."""
    viewport = w.chat.scroll.viewport()
    out = {}
    for b in w.chat.bubbles:
        for name in ("copy_button", "pin_button", "edit_button", "regen_button", "stats_label", "cache_label",
                     "notes_label"):
            widget = getattr(b, name)
            if widget.isVisibleTo(w):
                out[f"{b.position}:{name}"] = widget.mapTo(viewport, widget.rect().topRight()).x()
        out[f"{b.position}:bubble"] = b.mapTo(viewport, b.rect().topRight()).x()
    return out


def test_unbroken_runs_wrap_inside_the_column(qtbot, data_dir, stories_path):
    """A stored reply with a 5,000-character run in inline code, then a message with one in a code block and
    a URL: every bubble, its Edit / Regenerate buttons and its footer stay inside the view (a run of
    "PfPf…" made the bubble as wide as the column's 760 px, its buttons cut off)."""
    write_history(data_dir / "history.sqlite3", 2, words="`" + "Pf" * 2500 + "` ")
    w = open_window(qtbot, data_dir, str(stories_path), sampling=SamplingConfig(temperature=0.0, max_new_tokens=30))
    try:
        w.resize(1024, 768)
        qtbot.waitUntil(lambda: len(w.chat.bubbles) == 2, timeout=10_000)
        _send_big(qtbot, w, "```\n" + "Pf" * 2500 + "\n```\nand https://example.com/" + "a/b?c=d&" * 300)
        assert wait_reply(qtbot, w)[1] in ("max_tokens", "eos")
        qtbot.wait(100)  # laid out
        width = w.chat.scroll.viewport().width()
        assert width < 700  # narrower than the column's widest: a run could widen it
        edges = _right_edges(w)
        assert "3:regen_button" in edges and "2:edit_button" in edges and "3:stats_label" in edges
        assert max(edges.values()) <= width, (width, edges)
        assert not w.chat.scroll.horizontalScrollBar().isVisible()
    finally:
        close_window(w)


def test_a_reply_beside_a_100kb_message_lays_out_only_its_own_text(qtbot, data_dir, stories_path):
    """Per refresh frame while the reply streams: the 100 KB message is not laid out again, and no frame lays
    out more than ``FRAME_CHARS`` characters in the whole transcript."""
    w = open_window(qtbot, data_dir, str(stories_path),
                    sampling=SamplingConfig(temperature=0.0, max_new_tokens=200, ignore_eos=True))
    try:
        frames: list[tuple[int, int, int]] = []  # (chars laid out in all bubbles, in the big one, reply length)

        def frame() -> None:  # after the window's own refresh (connected after it)
            bubbles = w.chat.bubbles
            frames.append((sum(b.body.laid_out_chars for b in bubbles), big.body.laid_out_chars,
                           len(w.chat.streaming.text) if w.chat.streaming else -1))

        big = _send_big(qtbot, w, BIG.replace(" ", "\n", 40))  # its first 40 lines as one piece
        w._refresh.timeout.connect(frame)
        assert wait_reply(qtbot, w)[1] in ("max_tokens", "context_full")
        w._refresh.timeout.disconnect(frame)
        streaming = [(a, b) for (a, b, n) in frames if n >= 0]
        steps = [(a2 - a1, b2 - b1) for (a1, b1), (a2, b2) in zip(streaming, streaming[1:])]
        assert sum(1 for total, _ in steps if total) >= 3  # the reply was drawn over several frames
        assert all(on_big == 0 for _, on_big in steps)  # the 100 KB message was not laid out again
        assert max(total for total, _ in steps) <= FRAME_CHARS
        assert len(big.body.labels) == 1 and len(w.chat.bubbles[-1].text) > 200
    finally:
        close_window(w)


def test_a_long_reply_streams_a_bounded_amount_a_frame_and_ends_whole(qtbot):
    """A 60 KB reply arriving 600 characters a frame, then a 20 KB burst (a remote server's): each render lays
    out at most ``FRAME_CHARS`` characters, the rest follows on later turns of the event loop, the live reply
    never collapses, and once it ended all of it is shown with "Show less"."""
    from app.chat.pane import ChatPane

    pane = ChatPane()
    qtbot.addWidget(pane)
    pane.show()
    pane.set_ready(True, "ready")
    pane.add_message("user", "write a lot", 0)
    bubble = pane.begin_reply(1)
    text = ("Pf" * 300 + "\n") * 100 + PROSE * 310 + "THE END"
    steps, sent = [], 0
    for end in list(range(600, 60_000, 600)) + [len(text)]:
        pane.append_delta(text[sent:end])
        sent = end
        before = bubble.body.laid_out_chars
        pane.render()
        steps.append(bubble.body.laid_out_chars - before)
        assert not bubble.body.toggle.isVisible()
    assert max(steps) <= FRAME_CHARS and sum(1 for s in steps if s) >= 90
    pane.finish_reply(text, {"generated_tokens": 9000, "stop_reason": "max_tokens"})
    qtbot.waitUntil(lambda: not bubble.body.pending, timeout=10_000)
    assert bubble.body.text().rstrip().endswith("THE END</p>") or "THE END" in bubble.body.labels[-1].text()
    assert len(bubble.body.labels) == len(bubble.body.pieces.all)
    assert bubble.body.toggle.isVisible() and bubble.body.toggle.text() == "Show less"
