"""The window on a laptop screen and a wide one, as a user sees it: sizes, wrapping, charts that do not zoom,
tooltips, help, keyboard focus."""

from __future__ import annotations

import dataclasses

import pytest
from app_helpers import close_window, make_snapshot, open_window, wait_reply
from PySide6.QtCore import QPoint, QPointF, Qt
from PySide6.QtGui import QWheelEvent
from PySide6.QtWidgets import (
    QAbstractSpinBox,
    QApplication,
    QCheckBox,
    QComboBox,
    QLineEdit,
    QPushButton,
    QWidget,
)

from app.selftest.readouts import cut_captions
from engine.config import CacheConfig, SamplingConfig
from engine.policies.base import config_from_flags

LONG_WORDS = "Supercalifragilisticexpialidocious-and-then-some-more-" * 2 + " "  # no place to break: 108 chars
LONG_TEXT = "A sentence that goes on and on about a fox in a forest, " * 5  # stories260K's context is 512


def _settle(qtbot, w, size: tuple[int, int]) -> None:
    """Resize, then wait until the docks have refitted (150 ms after the size settles) and the window's geometry
    (docks, transcript, wrapped bubbles) is the same at three checks in a row: a condition, not a clock."""
    w.resize(*size)
    seen: list = []

    def stable() -> bool:
        shape = (w.layout_docks.settled, w.centralWidget().size().toTuple(),
                 tuple((b.width(), b.body.height()) for b in w.chat.bubbles),
                 tuple(d.size().toTuple() for d in w.docks.values()))
        seen.append(shape)
        return shape[0] and len(seen) >= 3 and seen[-1] == seen[-2] == seen[-3]
    qtbot.waitUntil(stable, timeout=5000)


def _shown(widget: QWidget) -> bool:
    from app.ground.docks import on_screen

    return on_screen(widget)


def _squashed(w) -> list[str]:
    """Every dock's widget and every input in it that is smaller than its size hint (shown ones only)."""
    out = []
    for name, dock in w.docks.items():
        body = dock.widget()
        if not _shown(body):
            continue  # a tab behind another
        hint = body.sizeHint()
        if body.width() < hint.width() or body.height() < hint.height():
            out.append(f"{name} {body.width()}x{body.height()} < hint {hint.width()}x{hint.height()}")
        for child in body.findChildren(QWidget):
            if isinstance(child, (QAbstractSpinBox, QComboBox, QCheckBox, QPushButton)) and _shown(child):
                if child.width() < child.sizeHint().width():
                    out.append(f"{name}/{child.objectName() or type(child).__name__} {child.width()} < "
                               f"{child.sizeHint().width()}")
    return out


def _clipped_bubbles(w) -> list[str]:
    viewport = w.chat.scroll.viewport()
    out = []
    if w.chat.scroll.horizontalScrollBar().maximum() > 0:
        out.append("the transcript scrolls sideways")
    for b in w.chat.bubbles:
        right = b.mapTo(viewport, QPoint(b.width(), 0)).x()
        if right > viewport.width() or b.body.width() > b.width() or b.body.minimumSizeHint().width() > b.body.width():
            out.append(f"bubble {b.position}: right edge {right} > {viewport.width()} or body {b.body.width()}")
    return out


@pytest.mark.parametrize("size", [(1280, 720), (1366, 768)])
def test_laptop_screens_fit_and_bubbles_wrap(qtbot, data_dir, stories_path, size):
    w = open_window(qtbot, data_dir, str(stories_path),
                    sampling=SamplingConfig(temperature=0.0, max_new_tokens=60, ignore_eos=True))
    try:
        assert w.minimumSizeHint().height() <= 700 and w.minimumSize().height() <= 700
        w.controls.set_config(CacheConfig(policy="priority"))  # its fields were squashed, digits cut off
        w.send(LONG_WORDS + LONG_TEXT)
        wait_reply(qtbot, w)
        _settle(qtbot, w, size)
        assert (w.width(), w.height()) == size
        assert _squashed(w) == []
        assert _clipped_bubbles(w) == []
        assert w.chat.bubbles[0].body.height() > 5 * w.chat.bubbles[0].body.fontMetrics().lineSpacing()  # wrapped
        for tab in ("page_map", "memory", "sampling", "model"):  # the tabs behind: shown one at a time
            w.docks[tab].raise_()
            qtbot.wait(50)
            assert _squashed(w) == [], tab
    finally:
        close_window(w)


def test_wide_screen_keeps_lines_short_and_docks_come_back_after_a_small_window(qtbot, data_dir, stories_path):
    from app.chat.transcript import MAX_LINE_PX

    w = open_window(qtbot, data_dir, str(stories_path))
    try:
        w.send(LONG_TEXT)
        wait_reply(qtbot, w)
        _settle(qtbot, w, (1024, 700))
        _settle(qtbot, w, (1920, 1080))
        assert w.layout_docks.arrangement == "wide"
        panels = ("occupancy", "page_map", "timing", "memory")
        assert [k for k in panels if not _shown(w.docks[k].widget())] == []  # 2×2 panels, none behind a tab
        assert _squashed(w) == []
        assert max(b.width() for b in w.chat.bubbles) <= MAX_LINE_PX
        _settle(qtbot, w, (2560, 1440))
        assert w.chat.width() > MAX_LINE_PX + 100 and max(b.width() for b in w.chat.bubbles) <= MAX_LINE_PX
        column = w.chat.scroll.column_widget.geometry()  # centred in the wider pane
        assert abs(column.left() - (w.chat.scroll.inner.width() - column.right())) <= 4
        _settle(qtbot, w, (1280, 720))
        assert w.layout_docks.arrangement == "compact" and _squashed(w) == []
    finally:
        close_window(w)


def test_no_panel_text_is_cut_at_common_screen_sizes(qtbot, data_dir, stories_path):
    """The longest captions (a second reply with the first as 'previous', evictions, int8 keys) are shown in full
    at four window sizes, each panel brought to the front in turn (at the smaller sizes some share a tab)."""
    streaming = config_from_flags(policy="streaming", flags={"sinks": 4, "window": 40}, mode="paged",
                                       page_size=16)
    w = open_window(qtbot, data_dir, str(stories_path),
                    sampling=SamplingConfig(temperature=0.0, max_new_tokens=80, ignore_eos=True))
    try:
        with qtbot.waitSignal(w.engine.worker.applied, timeout=30_000):
            w.apply_cache_config(dataclasses.replace(streaming, k_dtype="int8"))
        for text in ("Once upon a time", "Tell me more"):
            w.send(text)
            wait_reply(qtbot, w)
        assert "evicted" in w.occupancy.caption.text() and "previous" in w.timing.caption.text()
        for size in ((1280, 720), (1366, 768), (1472, 920), (1920, 1080)):
            _settle(qtbot, w, size)
            for name in ("occupancy", "page_map", "timing", "memory", "model"):
                w.docks[name].raise_()
                qtbot.waitUntil(lambda n=name: _shown(w.docks[n].widget()))
                qtbot.waitUntil(lambda: w.layout_docks.settled)
                assert cut_captions(w) == [], (size, name)  # the self-test checks the same
    finally:
        close_window(w)


def _wheel(view, steps: int = 5) -> None:
    viewport = view.viewport()
    centre = QPointF(viewport.width() / 2, viewport.height() / 2)
    for _ in range(steps):
        event = QWheelEvent(centre, QPointF(viewport.mapToGlobal(centre.toPoint())), QPoint(0, 0), QPoint(0, 120),
                            Qt.MouseButton.NoButton, Qt.KeyboardModifier.NoModifier, Qt.ScrollPhase.NoScrollPhase,
                            False)
        QApplication.sendEvent(viewport, event)


def _settled_ranges(qtbot, panel) -> list:
    """The panel's view ranges once its layout has settled: x-linked plots align their ranges in pixels, so the
    timing panel's tok/s range moves until both plots' axes are laid out (later than 20 ms on a busy machine)."""
    ranges = None
    for _ in range(100):
        qtbot.wait(20)
        now = panel.view_ranges()
        if now == ranges:
            break
        ranges = now
    return ranges


def test_the_wheel_over_a_chart_never_zooms_and_fit_resets(qtbot):
    import pyqtgraph as pg

    from app.panels import MemoryPanel, ModelCardPanel, OccupancyPanel, PageMapPanel, TimingPanel
    from engine.snapshot import TokenEvent

    for cls in (OccupancyPanel, PageMapPanel, TimingPanel, MemoryPanel, ModelCardPanel):
        panel = cls()
        qtbot.addWidget(panel)
        panel.resize(500, 400)
        panel.show()
        if isinstance(panel, TimingPanel):
            panel.begin_reply(1, "cache paged")
            for i in range(5):
                panel.add_token(TokenEvent(1, i, 5, "x", "prefill" if i == 0 else "decode", 10.0 + i, 1))
        panel.show_snapshot(make_snapshot())
        before = _settled_ranges(qtbot, panel)
        assert before, cls.__name__
        for view in panel.findChildren(pg.GraphicsView):
            _wheel(view)
        qtbot.wait(20)
        assert panel.view_ranges() == before, cls.__name__
        panel.fit_button.click()
        assert panel.view_ranges() == before, cls.__name__  # fitting the same data gives the same view


def test_every_control_says_what_it_does(qtbot):
    from app.ground import glossary
    from app.controls.cache_controls import CacheControls
    from app.controls.sampling_form import SamplingForm

    for policy in ("none", "streaming", "h2o", "priority"):
        c = CacheControls(CacheConfig(policy=policy, overflow="rolling"))
        qtbot.addWidget(c)
        controls = [x for x in c.findChildren(QWidget) if isinstance(x, (QComboBox, QAbstractSpinBox, QCheckBox,
                                                                          QLineEdit))]
        assert len(controls) >= 7
        unexplained = [x.objectName() or type(x).__name__ for x in controls
                       if not x.toolTip().strip() and not x.objectName().startswith("qt_")]  # a spin box's own line
        assert unexplained == []
        for box in c.findChildren(QComboBox):
            assert all(box.itemData(i, Qt.ItemDataRole.ToolTipRole) for i in range(box.count()))
    names = [c.policy.itemText(i) for i in range(c.policy.count())]
    assert names == ["Keep everything", "Attention sinks + recent window (StreamingLLM)", "Heavy hitters (H2O)",
                     "Expected attention", "Priority pinning"]
    assert "Memory" in c.policy.toolTip() and "Quality" in c.policy.toolTip()
    for term in (*glossary.MODES.values(), *glossary.KV_DTYPES.values(), *glossary.POLICIES.values()):
        assert "Memory" in term.tip and "Quality" in term.tip, term.name
    form = SamplingForm()
    qtbot.addWidget(form)
    assert all(x.toolTip() for x in form.findChildren(QAbstractSpinBox))


def test_tab_leaves_the_message_box_and_help_lists_the_shortcuts(qtbot, data_dir, stories_path):
    from app.shell.help import PANEL_HELP

    w = open_window(qtbot, data_dir, str(stories_path))
    try:
        w.activateWindow()
        w.chat.input.setFocus()
        qtbot.waitUntil(w.chat.input.hasFocus, timeout=2000)
        qtbot.keyClicks(w.chat.input, "hello")
        qtbot.keyClick(w.chat.input, Qt.Key.Key_Tab)
        assert not w.chat.input.hasFocus() and w.chat.input.toPlainText() == "hello"
        focused = QApplication.focusWidget()
        assert focused is not None and focused is not w.chat.input
        w.show_shortcuts()
        dialog = next(d for d in w.findChildren(QWidget) if d.objectName() == "shortcutsHelp")
        assert "Tab" in dialog.findChild(QWidget, "helpText").text()
        dialog.close()
        for panel in w.panels:
            panel.help_button.click()
            qtbot.wait(10)
            texts = [d.findChild(QWidget, "helpText").text() for d in w.findChildren(QWidget)
                     if d.objectName() == "panelHelp" and d.isVisible()]
            assert texts and PANEL_HELP[panel.objectName()].text[:40] in texts[-1]
    finally:
        close_window(w)


def test_the_wheel_over_a_scrolled_panels_field_scrolls_the_panel_and_changes_nothing(qtbot):
    """Scrolling the Cache panel with the wheel: the pointer passing over a spin box or a combo box changes neither
    (it changed "First tokens kept (sinks)" from 4 to 0); the panel scrolls instead. A field the user clicked into
    (it has the focus) still takes the wheel."""
    from PySide6.QtWidgets import QFormLayout, QGroupBox, QSpinBox, QVBoxLayout

    from app.ground.docks import scrolled

    form = QWidget()
    rows = QFormLayout(form)
    spins = [QSpinBox() for _ in range(30)]
    for spin in spins:
        spin.setRange(0, 100)
        spin.setValue(4)
        rows.addRow("a field", spin)
    combo = QComboBox()
    combo.addItems(["one", "two", "three"])
    rows.addRow("a choice", combo)
    area = scrolled(form)
    qtbot.addWidget(area)
    area.resize(300, 200)
    area.show()
    qtbot.waitExposed(area)
    box = QGroupBox("a policy's parameters")  # added once the panel is up, nested (a policy chosen later)
    late = QSpinBox(box)
    late.setValue(4)
    QVBoxLayout(box).addWidget(late)
    rows.insertRow(0, box)
    qtbot.wait(10)
    bar = area.verticalScrollBar()
    assert bar.maximum() > 0 and bar.value() == 0
    for field in (spins[1], combo, late):
        _wheel_field(field)
    assert [s.value() for s in spins] == [4] * 30 and combo.currentIndex() == 0 and late.value() == 4
    assert bar.value() > 0  # the panel moved
    spins[1].setFocus()
    qtbot.waitUntil(spins[1].hasFocus)
    _wheel_field(spins[1])
    assert spins[1].value() != 4


def _wheel_field(field, steps: int = 3) -> None:
    """The wheel turned down over ``field``'s middle, as it reaches the field (a spin box's line edit passes a real
    one up to it; a sent event is not passed up)."""
    at = QPointF(field.width() / 2, field.height() / 2)
    for _ in range(steps):
        event = QWheelEvent(at, QPointF(field.mapToGlobal(at.toPoint())), QPoint(0, 0), QPoint(0, -120),
                            Qt.MouseButton.NoButton, Qt.KeyboardModifier.NoModifier, Qt.ScrollPhase.NoScrollPhase,
                            False)
        QApplication.sendEvent(field, event)
