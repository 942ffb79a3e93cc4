"""What a chat switch keeps and what it must not carry over (issue #19 items 8 and 13), and Tab stops that
always show where the focus is (item 8). Real window, real stories260K."""

from __future__ import annotations

from app_helpers import close_window, open_window, wait_reply
from PySide6.QtCore import Qt
from PySide6.QtTest import QTest
from PySide6.QtWidgets import QApplication, QTabBar

from app.ground.docks import on_screen
from app.ground.format import human_bytes


def test_a_new_chat_starts_clean_and_the_memory_history_stays(qtbot, data_dir, stories_path):
    w = open_window(qtbot, data_dir, str(stories_path))
    try:
        weights = human_bytes(w.info.weights_bytes)
        # before the first message: every layer of the model on the occupancy axis, the weights in Memory
        assert w.info.num_layers == 5
        assert len(w.occupancy.bar_heights()["full"]) == 5
        lo, hi = w.occupancy.plot.viewRange()[0]
        assert lo < 0 and 4 < hi < 5
        assert w.memory.split.weights == w.info.weights_bytes and f"weights <b>{weights}</b>" in \
            w.memory.caption.text()

        w.send("Once upon a time")
        wait_reply(qtbot, w)
        qtbot.waitUntil(lambda: w.memory.n > 0 and w.status.speed.text().endswith("tokens/s"))
        first, points = w.chat_id, w.memory.n
        speed = w.status.speed.text()
        w.chat.input.setPlainText("a draft for the first chat")

        w.new_chat()
        # nothing of the other chat: no tok/s, no draft, no cache — but the model's weights and memory history
        assert w.status.speed.text() == ""
        assert w.chat.input.toPlainText() == ""
        assert w.memory.n == points and w.memory.series()["kv_mib"][-1] > 0  # the chart goes on
        assert w.memory.split.weights == w.info.weights_bytes and w.memory.split.kv == 0
        assert "weights <b>0 B</b>" not in w.memory.caption.text() and weights in w.memory.caption.text()
        assert len(w.occupancy.bar_heights()["full"]) == 5 and not w.occupancy.bar_heights()["full"].any()
        w.chat.input.setPlainText("the second chat's draft")

        w.open_chat(first)
        assert w.chat.input.toPlainText() == "a draft for the first chat"
        assert w.status.speed.text() == speed  # this chat's last reply's
        qtbot.waitUntil(lambda: w.memory.n > points, timeout=30_000)  # its cache, added to the same series
        assert w.memory.split.kv > 0
        w.new_chat()
        assert w.chat.input.toPlainText() == ""
    finally:
        close_window(w)


def focus_shows(widget) -> bool:
    """The widget looks different with the focus than without it."""
    with_focus = widget.grab().toImage()
    widget.clearFocus()
    QApplication.processEvents()
    without = widget.grab().toImage()
    widget.setFocus(Qt.FocusReason.TabFocusReason)
    QApplication.processEvents()
    return with_focus != without


def tab_through(w, presses: int, key=Qt.Key.Key_Tab) -> list[str]:
    """Press Tab ``presses`` times; each stop must be a widget on screen (not in a dock behind a tab), enabled,
    not an empty tab bar, and drawn differently with the focus. Returns the stops, as 'Type:objectName'."""
    seen = []
    for _ in range(presses):
        f = QApplication.focusWidget()
        assert f is not None and f.isEnabled() and on_screen(f), (f, seen)
        assert not (isinstance(f, QTabBar) and f.count() == 0), seen
        name = f"{type(f).__name__}:{f.objectName()}"
        assert focus_shows(f), f"no focus to be seen on {name} after {seen}"
        seen.append(name)
        QTest.keyClick(f, key)
    return seen


def test_every_tab_stop_shows_the_focus(qtbot, data_dir, stories_path):
    """45 Tab presses from the message box (through the chats, the cache controls, the panels' buttons, the dock
    tabs and a reply's buttons): each lands on a widget on screen that draws its focus — no stop on a scroll
    area, a chart, an empty tab bar, or the fields of a dock behind a tab (Tab went through Speculation's and
    Sampling's ten fields unseen after 'When the context is full'). A dock brought forward from its tab bar
    with the arrow keys is tabbed into."""
    w = open_window(qtbot, data_dir, str(stories_path))
    try:
        w.send("Once upon a time")
        wait_reply(qtbot, w)
        w.activateWindow()
        w.chat.input.setFocus()
        qtbot.wait(50)
        seen = tab_through(w, 45)
        assert {"QComboBox:", "QToolButton:panelTool", "QPushButton:flatButton", "ChatList:ChatList",
                "QTabBar:", "QLineEdit:systemPrompt"} <= set(seen)
        assert "QDoubleSpinBox:temperature" not in seen  # Sampling is behind Cache policy's tab
        assert tab_through(w, 20, Qt.Key.Key_Backtab)  # and backwards
        bar = next(b for b in w.findChildren(QTabBar) if "Sampling" in [b.tabText(i) for i in range(b.count())])
        bar.setFocus(Qt.FocusReason.TabFocusReason)
        while bar.tabText(bar.currentIndex()) != "Sampling":
            QTest.keyClick(bar, Qt.Key.Key_Right)
        qtbot.wait(50)
        assert on_screen(w.sampling)
        QTest.keyClick(bar, Qt.Key.Key_Tab)
        assert "QDoubleSpinBox:temperature" in tab_through(w, 45)
    finally:
        close_window(w)


def test_memory_counts_bytes_per_token_as_the_model_card_does(qtbot):
    """#19 item 12: Memory said 1.3 KiB per token beside the model card's 1.2 KiB: it divided by the tokens held,
    so the last page's empty slots counted. Per token slot, as the card counts, the two agree."""
    from app_helpers import make_snapshot

    from app.panels import MemoryPanel

    panel = MemoryPanel()
    qtbot.addWidget(panel)
    # 10 tokens in 3 pages of 4 per layer, 3 layers at 1920 bytes: 160 bytes per token slot (not 192)
    panel.show_snapshot(make_snapshot(kv_bytes=1920), now=1.0)
    assert "· 160 B per token" in panel.caption.text()
