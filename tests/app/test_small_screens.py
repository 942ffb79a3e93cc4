"""A 1024×768 screen, as a user saw it: the window takes the whole of a small screen's free area, and a timing panel
narrower than its bars and curves need gives the prefill bars' room to the curves (they were ~50 px wide, their
axis labels cut: "ms / toker", "token i"); wider again, the bars come back. The chat is the widest column there
(#31: it was the narrowest, 340-400 px against the panels' ~470)."""

from __future__ import annotations

from app_helpers import close_window, open_window, wait_reply
from PySide6.QtCore import QRect, QSize

from app.panels.timing import NARROW_PX, TimingPanel
from app.selftest.readouts import cut_captions
from engine.config import SamplingConfig
from engine.snapshot import TokenEvent


def test_a_narrow_timing_panel_keeps_its_curves_readable(qtbot):
    panel = TimingPanel()
    qtbot.addWidget(panel)
    panel.begin_reply(1, "cache paged")
    for i in range(40):
        panel.add_token(TokenEvent(1, i, 5, "x", "prefill" if i == 0 else "decode", 5.0 + i % 3, 1))
    panel.refresh()
    panel.show()
    panel.resize(NARROW_PX - 50, 300)
    qtbot.waitUntil(lambda: panel.narrow)
    qtbot.wait(50)
    assert not panel.prefill_plot.isVisible() and panel.latency_plot.width() > NARROW_PX - 100
    assert "TTFT" in panel.caption.text()  # the bars' figure is still said
    panel.resize(NARROW_PX + 200, 300)
    qtbot.waitUntil(lambda: not panel.narrow)
    qtbot.wait(50)
    assert panel.prefill_plot.isVisible() and panel.prefill_plot.width() > 100
    assert panel.latency_plot.width() > 200


def test_a_small_screen_gets_the_whole_window(qtbot, data_dir, stories_path, monkeypatch):
    from app.ground import docks

    class Screen:
        def availableGeometry(self):  # noqa: N802 - Qt name
            return QRect(0, 0, 1024, 740)

    real_size = docks.initial_size
    monkeypatch.setattr("app.shell.window.initial_size", lambda _w: QSize(1024, 740))  # as a 1024×768 screen gives
    w = open_window(qtbot, data_dir, str(stories_path), sampling=SamplingConfig(temperature=0.0, max_new_tokens=60))
    try:
        # shown at that size and never resized: fitted once shown (it never was: the chat kept its 356 px minimum)
        qtbot.waitUntil(lambda: w.layout_docks.settled, timeout=5000)
        assert w.chat.width() >= w.docks["controls"].width() and w.chat.width() > w.docks["occupancy"].width()
        monkeypatch.setattr(w, "screen", lambda: Screen())
        assert real_size(w) == QSize(1024, 740)  # not 92%: 942 px left the panels 200 px
        monkeypatch.setattr(Screen, "availableGeometry", lambda self: QRect(0, 0, 1920, 1040))
        assert real_size(w) == QSize(1766, 956)
        w.resize(1024, 740)
        w.send("Once upon a time")
        wait_reply(qtbot, w)
        qtbot.waitUntil(lambda: w.layout_docks.settled, timeout=5000)
        w.docks["timing"].raise_()
        qtbot.waitUntil(lambda: w.timing.latency_plot.width() > 200, timeout=5000)
        assert cut_captions(w) == []
        for size in (QSize(1024, 740), QSize(1177, 662)):  # the whole of 1024×768, 92% of 1280×720
            w.resize(size)
            qtbot.waitUntil(lambda: w.layout_docks.settled, timeout=5000)
            qtbot.wait(50)
            chat, left, panels = w.chat.width(), w.docks["controls"].width(), w.docks["occupancy"].width()
            assert chat >= left and chat > panels and chat >= 0.38 * size.width(), (size, chat, left, panels)
            assert w.timing.latency_plot.width() > 200 and cut_captions(w) == []
        w.docks["page_map"].raise_()  # its legends at 1024 px: the 'pages:' one lost its last line (85 of 94 px)
        w.resize(1024, 740)
        qtbot.waitUntil(lambda: w.layout_docks.settled, timeout=5000)
        qtbot.wait(50)
        assert w.page_map.legend.isVisible() and cut_captions(w) == []
    finally:
        close_window(w)


def test_a_short_latency_chart_says_ms_where_ms_per_token_would_be_cut(qtbot):
    """At 1280×720 a six-line timing caption left the latency chart ~45 px tall and its side read 'ms / toker'."""
    from PySide6.QtGui import QFontMetrics

    from app.panels.timing import LATENCY_LABEL

    panel = TimingPanel()
    qtbot.addWidget(panel)
    panel.show()
    axis = panel.latency_plot.getAxis("left")
    words = QFontMetrics(axis.label.font()).horizontalAdvance(LATENCY_LABEL)
    for height, said in ((180, "ms"), (600, LATENCY_LABEL)):
        panel.resize(NARROW_PX + 100, height)
        qtbot.waitUntil(lambda: panel.latency_label == said, timeout=3000)
        room = panel.latency_plot.getViewBox().height()
        assert (room < words + 6) == (said == "ms") and axis.labelText == said, (height, room, words)
