"""What every panel shares: the ``show_snapshot`` contract, an update counter, PNG export, theme."""

from __future__ import annotations

import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QGraphicsItem, QLabel, QVBoxLayout, QWidget

BACKGROUND = "#16191f"
FOREGROUND = "#c3c9d2"
GRID_ALPHA = 0.15

pg.setConfigOptions(antialias=False, background=BACKGROUND, foreground=FOREGROUND)


class Panel(QWidget):
    """Base for live panels: a caption line on top, the plot below.

    Subclasses implement ``show_snapshot(snapshot)`` using only setters on items made in ``__init__``,
    and call ``_count()`` so tests and the self-test can see the panel received data.
    """

    title = "Panel"

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName(self.__class__.__name__)
        self.updates = 0
        self.caption = QLabel(" ")
        self.caption.setObjectName("panelCaption")
        self.caption.setWordWrap(True)
        # A fixed two-line caption: text that changes every token must never re-lay out the plot below.
        self.caption.setFixedHeight(2 * self.caption.fontMetrics().lineSpacing() + 4)
        self.caption.setAlignment(Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignTop)
        self._layout = QVBoxLayout(self)
        self._layout.setContentsMargins(6, 4, 6, 6)
        self._layout.setSpacing(4)
        self._layout.addWidget(self.caption)

    def show_snapshot(self, snapshot) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def clear(self) -> None:
        """Forget data (new model or new chat)."""

    def _count(self) -> None:
        self.updates += 1

    def export_png(self, path: str) -> bool:
        """Save the panel as it looks now."""
        return self.grab().save(str(path), "PNG")


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


def styled_plot(plot: pg.PlotItem, left: str = "", bottom: str = "") -> pg.PlotItem:
    plot.showGrid(x=True, y=True, alpha=GRID_ALPHA)
    if left:
        plot.setLabel("left", left)
    if bottom:
        plot.setLabel("bottom", bottom)
    plot.setMenuEnabled(False)
    plot.hideButtons()
    for side in ("left", "bottom"):
        plot.getAxis(side).enableAutoSIPrefix(False)
    cache_axes(plot)
    return plot


def legend_row(chips: list[tuple[str, str]], prefix: str = "") -> QLabel:
    """One line of colour chips: [(colour, text), ...], after an optional plain ``prefix``."""
    html = (prefix + " &nbsp; " if prefix else "") + " &nbsp; ".join(
        f'<span style="color:{c}; font-size:13px">■</span>&nbsp;{t}' for c, t in chips
    )
    label = QLabel(html)
    label.setObjectName("legendChip")
    label.setWordWrap(True)
    return label
