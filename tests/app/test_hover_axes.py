"""Hover text that never moves the layout, values under the mouse, axis labels that never run together (#19 item
8). Real window, real stories260K, the mouse moved by QTest over the charts."""

from __future__ import annotations

import pytest
from app_helpers import close_window, open_window, wait_reply
from PySide6.QtCore import QEvent, QPointF, Qt
from PySide6.QtGui import QImage, QMouseEvent, QPainter
from PySide6.QtWidgets import QApplication
from test_layout import _settle, _shown

from engine.config import SamplingConfig

SIZES = ((1024, 752), (1280, 720), (1920, 1080), (2560, 1440))


@pytest.fixture
def window(qtbot, data_dir, stories_path):
    w = open_window(qtbot, data_dir, str(stories_path),
                    sampling=SamplingConfig(temperature=0.0, max_new_tokens=300, ignore_eos=True))
    w.send("Once upon a time")
    wait_reply(qtbot, w)
    yield w
    close_window(w)


def _front(qtbot, w, name: str) -> None:
    """Bring a dock to the front and wait until its charts are laid out (their scene the same three checks running)."""
    w.docks[name].raise_()
    qtbot.waitUntil(lambda: _shown(w.docks[name].widget()) and w.layout_docks.settled)
    view = w.docks[name].widget().view
    seen: list = []

    def steady() -> bool:
        seen.append((view.size().toTuple(), tuple(i.sceneBoundingRect().getRect() for i in view.scene().items()
                                                  if i.isVisible())))
        return len(seen) >= 3 and seen[-1] == seen[-2] == seen[-3]
    qtbot.waitUntil(steady)


def _hover(view, scene_point: QPointF) -> None:
    """Move the mouse over ``scene_point`` of a chart's scene (``view``: its GraphicsView), as the platform would:
    a move event to the viewport (QTest.mouseMove sends none on the offscreen platform)."""
    local = QPointF(view.mapFromScene(scene_point))
    viewport = view.viewport()
    event = QMouseEvent(QEvent.Type.MouseMove, local, QPointF(viewport.mapToGlobal(local.toPoint())),
                        Qt.MouseButton.NoButton, Qt.MouseButton.NoButton, Qt.KeyboardModifier.NoModifier)
    QApplication.sendEvent(viewport, event)


def _in_box(plot, x: float) -> QPointF:
    """The scene point of data ``x`` halfway up the plot (well inside its box, whatever the y range)."""
    box = plot.getViewBox()
    low, high = box.viewRange()[1]
    return box.mapViewToScene(QPointF(x, (low + high) / 2))


def test_hovering_the_page_map_and_its_token_strip_says_what_is_there_without_moving_the_layout(qtbot, window):
    w = window
    for size in ((1024, 752), (1920, 1080)):  # at 1024x752 the page's text widened the dock from 291 to 426 px
        _settle(qtbot, w, size)
        _front(qtbot, w, "page_map")
        pm = w.page_map
        qtbot.waitUntil(lambda: pm.snapshot is not None and pm.grid_box.width() > 0)
        before = (w.docks["page_map"].width(), w.chat.width())
        px = pm.px
        _hover(pm.view, pm.image.mapToScene(QPointF(px / 2, px / 2)))  # page 0, the first turn's
        qtbot.waitUntil(lambda: pm.hover.text().startswith("page 0 · "))
        assert pm.hover.text() == pm.describe_page(0) and "owner turn" in pm.hover.text()
        qtbot.waitUntil(lambda: w.layout_docks.settled)
        assert (w.docks["page_map"].width(), w.chat.width()) == before, size  # the dock did not widen
        assert pm.hover.shown_text() == pm.hover.text() or pm.hover.toolTip() == pm.hover.text()
        _hover(pm.view, pm.strip.mapToScene(QPointF(2.5, 0.5)))  # the strip's third token
        n = len(pm.snapshot.token_state)
        qtbot.waitUntil(lambda: pm.hover.text().startswith("token 2 of "))
        assert pm.hover.text() == f"token 2 of {n} · kept"
        assert (w.docks["page_map"].width(), w.chat.width()) == before, size


def _hover_at(view, plot, x: float) -> float:
    """Move the mouse to data ``x`` of ``plot`` (halfway up); the data x of the whole pixel it landed on."""
    _hover(view, _in_box(plot, x))
    pixel = view.mapFromScene(_in_box(plot, x))
    return plot.getViewBox().mapSceneToView(view.mapToScene(pixel)).x()


def test_charts_say_their_values_under_the_mouse(qtbot, window):
    w = window
    _settle(qtbot, w, (1920, 1080))
    occ, timing, memory = w.occupancy, w.timing, w.memory
    qtbot.waitUntil(lambda: occ.stack and timing.current.n == 299 and memory.n > 2)
    _hover_at(occ.view, occ.plot, 2)
    qtbot.waitUntil(lambda: occ.view.toolTip().startswith("layer 2: "))
    held = int(occ.stack["full"][2])
    assert occ.view.toolTip() == f"layer 2: {held} tokens ({held} full) of 512"
    x = _hover_at(timing.view, timing.latency_plot, 100)
    i = int(round(x))
    qtbot.waitUntil(lambda: timing.view.toolTip().startswith(f"token {i} · this reply: "))
    assert f"this reply: {timing.current.decode_ms[i - 1]:.1f} ms, " in timing.view.toolTip()
    _hover_at(timing.view, timing.prefill_plot, 1)
    qtbot.waitUntil(lambda: timing.view.toolTip().startswith("this reply: prefill "))
    assert f"for {timing.current.prefill_tokens} prompt tokens" in timing.view.toolTip()
    t = _hover_at(memory.view, memory.plot, float(memory.t[memory.n - 1]))
    qtbot.waitUntil(lambda: " s: weights " in memory.view.toolTip())
    assert memory.view.toolTip() == memory.value_at(t)


def _labels(axis) -> list:
    """The tick labels the axis draws now: (rectangle, text), from pyqtgraph's own drawing specs."""
    image = QImage(8, 8, QImage.Format.Format_ARGB32)
    painter = QPainter(image)
    try:
        specs = axis.generateDrawSpecs(painter)
    finally:
        painter.end()
    return [(rect, text) for rect, _flags, text in (specs[2] if specs else [])]


def _overlaps(axis) -> list[str]:
    labels = _labels(axis)
    return [f"{a[1]!r} and {b[1]!r}" for i, a in enumerate(labels) for b in labels[i + 1:]
            if a[0].intersects(b[0])]


def test_axis_labels_never_run_together(qtbot, window):
    w = window
    axes = {"timing latency x": w.timing.latency_plot.getAxis("bottom"),
            "timing tok/s x": w.timing.tps_plot.getAxis("bottom"),
            "memory y (log)": w.memory.plot.getAxis("left"), "memory x": w.memory.plot.getAxis("bottom"),
            "occupancy x": w.occupancy.plot.getAxis("bottom")}
    for size in SIZES:
        _settle(qtbot, w, size)
        for dock in ("timing", "memory", "occupancy"):
            _front(qtbot, w, dock)
            qtbot.waitUntil(lambda: w.layout_docks.settled)
            for name, axis in axes.items():
                if dock in name:
                    assert _overlaps(axis) == [], (size, name)
    memory_labels = [text for _rect, text in _labels(axes["memory y (log)"])]
    assert memory_labels and all(text in ("0.001", "0.01", "0.1", "1", "10", "100") for text in memory_labels)
