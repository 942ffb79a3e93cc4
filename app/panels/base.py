"""What every panel shares: the ``show_snapshot`` contract, an update counter, PNG export, theme."""

from __future__ import annotations

import math
import re

import pyqtgraph as pg
from PySide6.QtCore import QSize, Qt, Signal
from PySide6.QtGui import QCursor, QFontMetrics
from PySide6.QtWidgets import (
    QGraphicsItem,
    QHBoxLayout,
    QLabel,
    QToolButton,
    QToolTip,
    QVBoxLayout,
    QWidget,
)

from app.ground.docks import on_screen
from app.ground.format import human_bytes

BACKGROUND = "#16191f"
FOREGROUND = "#c3c9d2"
GRID_ALPHA = 0.15

pg.setConfigOptions(antialias=False, background=BACKGROUND, foreground=FOREGROUND)


class Panel(QWidget):
    """Base for live panels: a caption (wrapped in full) with "paused", fit and help buttons on top, the plot below.

    Subclasses implement ``show_snapshot(snapshot)`` using only setters on items made in ``__init__``,
    call ``_count()`` so tests and the self-test can see the panel received data, list their
    ``StickyRange``s in ``ranges`` (the fit button resets them) and their plots in ``plots``. Charts never
    zoom or pan with the mouse: the wheel over a chart changes nothing, and their ranges follow the data.
    """

    title = "Panel"
    help_requested = Signal(object)  # this panel: its "?" was pressed (the window opens the help)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName(self.__class__.__name__)
        self.updates = 0
        self.ranges: list[StickyRange] = []
        self.last_snapshot = None
        self.caption = Caption(" ")
        self.paused_label = QLabel("paused")
        self.paused_label.setObjectName("pausedLabel")
        self.paused_label.setToolTip("Live panels are off (View ▸ Live panels): this shows an earlier moment")
        self.paused_label.setVisible(False)
        self.fit_button = self._tool_button("⟲", "Fit the chart to its data again")
        self.fit_button.clicked.connect(self.reset_view)
        self.help_button = self._tool_button("?", "What am I seeing? A short explanation and the colour legend")
        self.help_button.clicked.connect(self.show_help)
        head = QHBoxLayout()
        head.setContentsMargins(0, 0, 0, 0)
        head.addWidget(self.caption, 1)
        for w in (self.paused_label, self.fit_button, self.help_button):
            head.addWidget(w, 0, Qt.AlignmentFlag.AlignTop)
        self._layout = QVBoxLayout(self)
        self._layout.setContentsMargins(6, 4, 6, 6)
        self._layout.setSpacing(4)
        self._layout.addLayout(head)

    @staticmethod
    def _tool_button(text: str, tip: str) -> QToolButton:
        b = QToolButton()
        b.setText(text)
        b.setToolTip(tip)
        b.setAutoRaise(True)
        b.setObjectName("panelTool")
        policy = b.sizePolicy()
        policy.setRetainSizeWhenHidden(True)  # hidden for a PNG export without moving the caption
        b.setSizePolicy(policy)
        return b

    def sizeHint(self) -> QSize:  # noqa: N802 - Qt name
        """A chart reads well from about this size (a laptop's tab of panels is larger)."""
        return QSize(360, 260)

    def minimumSizeHint(self) -> QSize:  # noqa: N802 - Qt name
        """The layout's minimum, but for a panel behind another tab no more than its size hint's height: Qt shrinks
        a hidden tab's dock to its minimum width (136 px), where every wrapped caption and legend is many lines
        tall, and the tab group's minimum height — the tallest tab's — pushed a 720-pixel window off the screen
        (a hybrid model's page map: its checkpoints line). Brought forward, it takes the group's width again."""
        hint = super().minimumSizeHint()
        if on_screen(self) or self.window() is self:
            return hint
        return QSize(hint.width(), min(hint.height(), self.sizeHint().height()))

    def show_snapshot(self, snapshot) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def show_caption(self, snapshot) -> None:
        """The caption of ``snapshot`` alone (text only, cheap). The scheduler sets every panel's caption when it
        takes a frame, in the same call as the status bar's readouts, so all of them say the same moment; the chart
        follows at the panel's turn (``show_snapshot``, which writes the same caption)."""

    def clear(self) -> None:
        """Forget data (new model, or a chat with nothing cached yet)."""

    def set_paused(self, paused: bool) -> None:
        """Say that the panel shows an earlier moment (live panels off)."""
        self.paused_label.setVisible(paused)

    def reset_view(self) -> None:
        """Fit every axis to the data shown (the one-click way back from any stale range)."""
        for rng in self.ranges:
            rng.reset()
        if self.last_snapshot is not None:
            self.show_snapshot(self.last_snapshot)

    def show_help(self) -> None:
        """The "?" button: ask whoever shows help (the main window connects ``help_requested`` to ``app.shell.help``,
        whose texts import the panels' colours: the panels never import it)."""
        self.help_requested.emit(self)

    def view_ranges(self) -> list:
        """Each chart's [[x0, x1], [y0, y1]] (for tests: the wheel must not change them)."""
        return [box.viewRange() for box in self.view_boxes()]

    def view_boxes(self) -> list:
        boxes = []
        for view in self.findChildren(pg.GraphicsView):
            boxes += [item for item in view.scene().items() if isinstance(item, pg.ViewBox)]
        return boxes

    def _count(self) -> None:
        self.updates += 1

    def export_png(self, path: str) -> bool:
        """Save the panel as it looks now, without its ⟲ / ? buttons (they do nothing in a picture; their room
        is kept, so nothing moves)."""
        tools = [b for b in (self.fit_button, self.help_button) if b.isVisible()]
        for b in tools:
            b.hide()
        try:
            return self.grab().save(str(path), "PNG")
        finally:
            for b in tools:
                b.show()


# a number and its unit, "CPU threads" and "page size 16" stay on one line when a caption wraps: at 1024×768 the
# dock's captions broke as "KV 360.0 | KiB", "1 CPU | thread" and "page size | 16"
_TAG = re.compile(r"(<[^>]*>)")
_GLUE = re.compile(r"(?<=\d) (?=(?:[KMGT]i)?B\b|CPU\b|tok/s|tokens?\b|ms\b|s\b)|(?<=CPU) (?=threads?\b)"
                   r"|(?<=page) (?=size)|(?<=size) (?=\d)")


def glued(text: str) -> str:
    """``text`` with no-break spaces between a number and its unit, outside tags (a tag's attributes untouched)."""
    return "".join(part if part.startswith("<") else _GLUE.sub("\u00a0", part) for part in _TAG.split(text))


class Caption(QLabel):
    """A panel's caption: wrapped in full, never cut. Its height is fixed to what the text needs (at least two
    lines) and changes only when the number of lines does, so a number that changes every token does not
    re-lay out the plot below on every token, and a long caption (a narrow dock, a reply with a previous one)
    is never cut off after two lines."""

    def __init__(self, text: str = "", parent: QWidget | None = None, min_lines: int = 2) -> None:
        super().__init__(glued(text), parent)
        self._source = text  # ``text()``: what was set, the display's no-break spaces aside
        self.min_lines = min_lines
        self.setObjectName("panelCaption")
        self.setWordWrap(True)
        self.setAlignment(Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignTop)
        # A hidden twin measures the text: a label's own heightForWidth is clamped to its fixed height.
        self._probe = QLabel(glued(text), self)
        self._probe.setWordWrap(True)
        self._probe.hide()
        self._fit(self.width())

    def setText(self, text: str) -> None:  # noqa: N802 - Qt name
        if text != self._source:
            self._source = text
            shown = glued(text)
            super().setText(shown)
            self._probe.setText(shown)
            self._fit(self.width())

    def text(self) -> str:
        return self._source

    def needed_height(self, width: int | None = None) -> int:
        """Pixels the whole text takes at ``width`` (the caption's own by default): more than ``height()``
        would mean lines are cut off."""
        return self._probe.heightForWidth(self.width() if width is None else width)

    def resizeEvent(self, event) -> None:  # noqa: N802 - Qt name
        super().resizeEvent(event)
        if event.size().width() != event.oldSize().width():
            self._fit(event.size().width())

    def _fit(self, width: int) -> None:
        floor = self.min_lines * self.fontMetrics().lineSpacing() + 4
        needed = max(floor, self.needed_height(width) if width > 0 else floor)
        if self.minimumHeight() != needed or self.maximumHeight() != needed:
            self.setFixedHeight(needed)


class StickyRange:
    """An axis range that only grows in steps (and shrinks on ``reset``), so axes are not re-laid out on
    every frame: re-drawing tick labels is the most expensive part of a live pyqtgraph plot."""

    def __init__(self, setter, minimum: float = 1.0, grow: float = 1.5) -> None:
        self._set = setter
        self.minimum = minimum
        self.grow = grow
        self.top = 0.0

    def fit(self, needed: float) -> bool:
        """Make sure ``needed`` is inside the range. Returns True if the range changed."""
        needed = max(float(needed), self.minimum)
        if self.top and needed <= self.top and needed >= self.top / (self.grow * self.grow * 2):
            return False
        self.top = needed * self.grow
        self._set(self.top)
        return True

    def reset(self) -> None:
        self.top = 0.0


def cache_axes(plot: pg.PlotItem) -> None:
    """Let Qt keep each axis (tick labels and grid lines) as a pixmap, repainted only when its ticks change.

    Without this every data update repaints the axes' text, which is most of a live plot's paint time.
    """
    for side in ("left", "bottom", "right", "top"):
        plot.getAxis(side).setCacheMode(QGraphicsItem.CacheMode.DeviceCoordinateCache)


class SpacedAxis(pg.AxisItem):
    """A horizontal axis whose labelled ticks are never closer than their labels are wide: pyqtgraph keeps at
    least two intervals whatever the width, so a narrow chart ran "100200300" together."""

    GAP_PX = 10  # between two labels

    def tickSpacing(self, minVal: float, maxVal: float, size: float):  # noqa: N802,N803 - pyqtgraph's names
        levels = super().tickSpacing(minVal, maxVal, size)
        span = abs(maxVal - minVal)
        if not levels or size <= 0 or span <= 0:
            return levels
        widest = max(f"{minVal:g}", f"{maxVal:g}", key=len)
        font = self.style.get("tickFont") or self.font()
        need = (QFontMetrics(font).horizontalAdvance(widest) + self.GAP_PX) * span / size  # in axis units
        major, offset = levels[0]
        if major >= need:
            return levels
        for factor in (2, 2.5, 5, 10, 20, 25, 50, 100):  # the next round spacing with room for each label
            if major * factor >= need:
                return [(major * factor, offset), (major, offset)]  # the old majors stay as unlabelled ticks
        return [(need, offset)]


def decade_ticks(low: int, high: int) -> list:
    """Explicit ticks of a log10 axis from 10**low to 10**high: a label at each decade only, the 2..9 steps as
    unlabelled minor ticks (labelled, they overlapped: "1 0.9 0.8 0.7…")."""
    majors = [(d, f"{10.0 ** d:g}") for d in range(low, high + 1)]
    minors = [(d + math.log10(k), "") for d in range(low, high) for k in range(2, 10)]
    return [majors, minors]


def hover_tip(view: pg.GraphicsView, charts: list) -> pg.SignalProxy:
    """The value under the mouse as a tooltip of ``view`` (a tooltip never resizes anything). ``charts``: (plot,
    describe) pairs of the view's plots; ``describe(x)`` gives the text at data coordinate ``x`` ("" for none).
    Keep the returned proxy: it holds the connection."""

    def moved(event) -> None:
        pos = event[0]
        text = next((describe(plot.getViewBox().mapSceneToView(pos).x()) for plot, describe in charts
                     if plot.getViewBox().sceneBoundingRect().contains(pos)), "")
        view.setToolTip(text)
        if text:
            QToolTip.showText(QCursor.pos(), text, view)

    return pg.SignalProxy(view.scene().sigMouseMoved, rateLimit=30, slot=moved)


def styled_plot(plot: pg.PlotItem, left: str = "", bottom: str = "") -> pg.PlotItem:
    plot.setAxisItems({"bottom": SpacedAxis("bottom")})
    plot.showGrid(x=True, y=True, alpha=GRID_ALPHA)
    if left:
        plot.setLabel("left", left)
    if bottom:
        plot.setLabel("bottom", bottom)
    plot.setMenuEnabled(False)
    plot.hideButtons()
    # No zoom or pan by wheel or drag: a chart that stays zoomed hides the next reply, and ranges follow
    # the data anyway (the panel's fit button resets them).
    plot.getViewBox().setMouseEnabled(x=False, y=False)
    for side in ("left", "bottom"):
        plot.getAxis(side).enableAutoSIPrefix(False)
    cache_axes(plot)
    return plot


def kv_held(snap) -> int:
    """The bytes of a chat's KV cache: on the device, or in host memory while it is swapped out."""
    return int(sum(int(x) for x in snap.bytes_per_layer)) if getattr(snap, "offloaded", False) else int(snap.kv_bytes)


def kv_words(snap, bold: bool = False) -> str:
    """'KV 272 KiB', or where a chat's cache waits in host memory (swapped out while another chat ran) 'KV 272 KiB
    in host memory': its bytes are no longer the device's (``kv_bytes`` 0) but its tokens are still cached."""
    b, nb = ("<b>", "</b>") if bold else ("", "")
    where = " in host memory (swapped out)" if getattr(snap, "offloaded", False) else ""
    return f"KV {b}{human_bytes(kv_held(snap))}{nb}{where}"


def legend_html(chips: list[tuple[str, str]], prefix: str = "") -> str:
    """The rich text of one line of colour chips (``legend_row``'s, or a label's new legend)."""
    # each chip on one line where it fits (at 1024×768 the page map's legend broke "verified | (frame)")
    return (prefix + " &nbsp; " if prefix else "") + " &nbsp; ".join(
        f'<span style="white-space:nowrap"><span style="color:{c}; font-size:13px">■</span>&nbsp;{t}</span>'
        for c, t in chips
    )


def legend_row(chips: list[tuple[str, str]], prefix: str = "") -> QLabel:
    """One line of colour chips: [(colour, text), ...], after an optional plain ``prefix``; wrapped in full, never
    cut (a ``Caption`` of one line or more): a plain wrapped label in a short dock was squeezed under its text's
    height (the page map's legend at 1024×768 lost its last line, 'verified (frame) · restored from disk')."""
    label = Caption(legend_html(chips, prefix), min_lines=1)
    label.setObjectName("legendChip")
    return label
