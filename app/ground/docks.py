"""The window's docks: which exist, where they go, how big they start, and how they come back.

Two default arrangements, chosen by the window's width when it is laid out (View ▸ Reset layout):

* **compact** (laptops, under ``WIDE_PX``): chats above a tab group of cache policy / speculation / sampling / model on
  the left, the chat in the middle — the widest column — and two tab groups of panels on the right (occupancy / page
  map above, timing / memory / why recomputed below). Nothing is squeezed below its size hint at 1280×720.
* **wide**: the same left column, and the four panels in a 2×2 grid on the right (none behind a tab; the "Why
  recomputed?" readout is a tab behind the timing panel, brought forward by a reply footer's "Why?").

Sizes are fractions of the window. When the window's size changes a lot (moved to another screen,
maximised, restored) the fractions are applied again, so docks never keep the crushed sizes of a smaller
window; a default arrangement whose width crosses ``WIDE_PX`` is rearranged for the new width.
"""

from __future__ import annotations

from PySide6.QtCore import QByteArray, QEvent, QObject, QPoint, QRect, QSize, Qt, QTimer
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import (
    QAbstractSlider,
    QAbstractSpinBox,
    QApplication,
    QComboBox,
    QDockWidget,
    QMainWindow,
    QScrollArea,
    QScrollBar,
    QTabBar,
    QTabWidget,
    QWidget,
)

DOCKS = (  # key, title
    ("chats", "Chats"), ("controls", "Cache policy"), ("speculation", "Speculation"), ("sampling", "Sampling"),
    ("model", "Model"),
    ("occupancy", "Layer occupancy"), ("page_map", "Page map"), ("timing", "Token timing"), ("memory", "Memory"),
    ("why", "Why recomputed?"),
)
SHORT_TITLES = {"occupancy": "Occupancy", "timing": "Timing", "why": "Why?", "controls": "Cache"}
SHORT_TITLES_BELOW_PX = 1200  # a window narrower than this names its docks in short (their tabs are not cut)
SCROLLED = ("controls", "speculation", "sampling")  # forms that scroll rather than force the window's height
WIDE_PX = 1700  # from this width on, the panels sit side by side in a 2×2 grid
REFIT_CHANGE = 1.15  # re-apply the default sizes when the window's size changed by this factor since then
DEFAULT_SIZE = QSize(1600, 960)
SMALL_SCREEN_PX = 1280  # a screen narrower than this gets the whole of its free area
# Compact: the chat takes 40% of the window and never less than the left column (at 1024 px: chat 381, panels 262;
# at 1280×720's 1177 px: chat 471, panels 325 — the panels took 37% and left the chat 340-400 px, the narrowest part)
CHAT_SHARE = 0.40
PANELS_MIN_PX = 240


def initial_size(window: QWidget) -> QSize:
    """The first size of the window: 92% of the screen's free area (at most 2200×1300), all of it on a screen
    under ``SMALL_SCREEN_PX`` wide (at 1024×768, 92% left the panels a column too narrow for their charts).
    Screens under 1000 pixels wide are offscreen or virtual ones (tests, the self-test: 800×600): 1600×960."""
    screen = window.screen() or QGuiApplication.primaryScreen()
    free = screen.availableGeometry().size() if screen is not None else QSize(0, 0)
    if free.width() < 1000:
        return DEFAULT_SIZE
    share = 1.0 if free.width() < SMALL_SCREEN_PX else 0.92
    return QSize(min(int(free.width() * share), 2200), min(int(free.height() * share), 1300))


class _WheelGuard(QObject):
    """The wheel over a spin box, combo box or slider of a scrolled panel (``scrolled``) scrolls the panel unless that
    field has the keyboard focus: turning the wheel to scroll the Cache panel changed "First tokens kept (sinks)"
    from 4 to 0 as the pointer passed over it, with no click. It watches the panel's widgets only, and the ones added
    later (a policy's parameters appear when it is chosen): a filter on the whole application saw every event of the
    window, ~1.5 us more each."""

    FIELDS = (QAbstractSpinBox, QComboBox, QAbstractSlider)

    def watch(self, widget: QWidget) -> None:
        """Filter ``widget`` and everything under it (a filter installed twice is there once)."""
        widget.installEventFilter(self)
        for child in widget.findChildren(QWidget):
            child.installEventFilter(self)

    def eventFilter(self, obj, event) -> bool:  # noqa: N802 - Qt name
        kind = event.type()
        if kind == QEvent.Type.ChildAdded:
            if event.child().isWidgetType():
                self.watch(event.child())
            return False
        if (kind != QEvent.Type.Wheel or not isinstance(obj, self.FIELDS) or isinstance(obj, QScrollBar)
                or obj.hasFocus()):  # (a scroll bar takes the wheel: the panel's own is where it is sent)
            return False
        area = obj.parentWidget()
        while area is not None and not isinstance(area, QScrollArea):
            area = area.parentWidget()
        if area is None:
            return False
        QApplication.sendEvent(area.verticalScrollBar(), event)  # the panel scrolls; the field keeps its value
        return True


def scrolled(widget: QWidget) -> QScrollArea:
    """``widget`` in a scroll area that scrolls vertically and gives it its full width; the wheel over its fields
    scrolls it unless a field has the focus (``_WheelGuard``)."""
    area = QScrollArea()
    guard = _WheelGuard(area)
    guard.watch(widget)
    area.setWidgetResizable(True)
    area.setFrameShape(QScrollArea.Shape.NoFrame)
    area.setFocusPolicy(Qt.FocusPolicy.NoFocus)  # a Tab stop on the area itself would show nothing: its form's fields are the stops
    area.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
    area.setWidget(widget)
    area.setMinimumWidth(widget.minimumSizeHint().width() + area.verticalScrollBar().sizeHint().width())
    hint = widget.sizeHint()  # a form: wider than its minimum helps nothing, so that is its preferred width
    area.sizeHint = lambda: QSize(area.minimumWidth(), hint.height())  # type: ignore[method-assign]
    return area


def focus_unseen() -> bool:
    """The focus is where nobody sees it: in a dock behind another tab (Qt keeps its page "visible", outside
    the window: Tab went through Speculation's and Sampling's ten fields unseen), or on a tab bar with no tabs
    (QMainWindow keeps the bar of a tab group that was taken apart; it draws nothing). A keyboard user brings
    a dock forward from its tab bar (arrow keys), then tabs into it."""
    widget = QApplication.focusWidget()
    if widget is None:
        return False
    return (isinstance(widget, QTabBar) and widget.count() == 0) or not on_screen(widget)


def on_screen(widget: QWidget) -> bool:
    """Shown and not behind another tab (Qt keeps a tabbed dock's hidden page "visible", moved outside the
    window)."""
    if not widget.isVisible():
        return False
    window = widget.window()
    return window.rect().intersects(QRect(widget.mapTo(window, QPoint(0, 0)), widget.size()))


class _Shown(QObject):
    """Calls ``then()`` each time ``window`` is shown (a window arranged before it was shown is fitted then)."""

    def __init__(self, window: QWidget, then) -> None:
        super().__init__(window)
        self.then = then
        window.installEventFilter(self)

    def eventFilter(self, obj, event) -> bool:  # noqa: N802 - Qt name
        if event.type() == QEvent.Type.Show:
            self.then()
        return False


class DockLayout:
    """Creates the docks of ``window`` around ``widgets`` (keyed as in ``DOCKS``) and lays them out."""

    def __init__(self, window: QMainWindow, widgets: dict[str, QWidget]) -> None:
        self.window = window
        window.setDockNestingEnabled(True)
        window.setTabPosition(Qt.DockWidgetArea.AllDockWidgetAreas, QTabWidget.TabPosition.North)
        self.docks: dict[str, QDockWidget] = {}
        for key, title in DOCKS:
            dock = QDockWidget(title, window)
            dock.setObjectName(f"dock_{key}")
            dock.setWidget(scrolled(widgets[key]) if key in SCROLLED else widgets[key])
            dock.setFeatures(QDockWidget.DockWidgetFeature.DockWidgetMovable
                             | QDockWidget.DockWidgetFeature.DockWidgetFloatable
                             | QDockWidget.DockWidgetFeature.DockWidgetClosable)
            self.docks[key] = dock
        self.restored = False
        self.arrangement = ""  # "compact" or "wide" (a default one), "restored" (the user's saved one)
        self._fitted = QSize(0, 0)  # the window size the default sizes were applied for
        self._planned: dict[str, int] = {}  # the widths the last fit asked of the docks
        self._checks = 0  # looks still to take at whether they took
        self._refit = QTimer(window)
        self._refit.setSingleShot(True)
        self._refit.setInterval(150)
        self._refit.timeout.connect(self._settled)
        self._shown = _Shown(window, self.window_resized)

    @property
    def wide(self) -> bool:
        return self.window.width() >= WIDE_PX

    def arrange(self) -> None:
        """The default arrangement for the window's width (View ▸ Reset layout)."""
        for dock in self.docks.values():
            self.window.removeDockWidget(dock)
            dock.setFloating(False)
        self._wide() if self.wide else self._compact()
        self.arrangement = "wide" if self.wide else "compact"
        for dock in self.docks.values():
            dock.show()
        for key in ("controls", "occupancy", "timing"):
            self.docks[key].raise_()  # the first tab of each group
        self._fitted = QSize(0, 0)
        self._refit.start()  # once shown and laid out (a window arranged before it is shown was never fitted: at
        # 1024×768 the docks kept Qt's sizes, the chat its 356 px minimum against panels of 291 px)

    def _left_column(self) -> None:
        d, w = self.docks, self.window
        w.addDockWidget(Qt.DockWidgetArea.LeftDockWidgetArea, d["chats"])
        w.splitDockWidget(d["chats"], d["controls"], Qt.Orientation.Vertical)
        w.tabifyDockWidget(d["controls"], d["speculation"])
        w.tabifyDockWidget(d["speculation"], d["sampling"])
        w.tabifyDockWidget(d["sampling"], d["model"])

    def _compact(self) -> None:
        d, w = self.docks, self.window
        self._left_column()
        w.addDockWidget(Qt.DockWidgetArea.RightDockWidgetArea, d["occupancy"])
        w.splitDockWidget(d["occupancy"], d["timing"], Qt.Orientation.Vertical)
        w.tabifyDockWidget(d["occupancy"], d["page_map"])
        w.tabifyDockWidget(d["timing"], d["memory"])
        w.tabifyDockWidget(d["memory"], d["why"])

    def _wide(self) -> None:
        d, w = self.docks, self.window
        self._left_column()
        w.addDockWidget(Qt.DockWidgetArea.RightDockWidgetArea, d["occupancy"])
        w.splitDockWidget(d["occupancy"], d["page_map"], Qt.Orientation.Horizontal)
        w.splitDockWidget(d["occupancy"], d["timing"], Qt.Orientation.Vertical)
        w.splitDockWidget(d["page_map"], d["memory"], Qt.Orientation.Vertical)
        w.tabifyDockWidget(d["timing"], d["why"])  # next to the timing panel, behind it

    def fit(self) -> None:
        """Default sizes as fractions of the window; the chat in the middle gets what is left. Looked at again
        twice after a layout pass: Qt may not apply them before its first one (a loaded host kept Qt's own sizes
        at 1024×768: the chat at its 356 px minimum, the left column 369 px)."""
        self._apply()
        self._checks = 2
        self._refit.start()

    def _took(self) -> bool:
        return all(abs(self.docks[key].width() - px) <= 16 for key, px in self._planned.items())

    def _apply(self) -> None:
        d, w = self.docks, self.window
        W, Hh = max(w.width(), 800), max(w.height(), 500)
        H, V = Qt.Orientation.Horizontal, Qt.Orientation.Vertical
        left = max(int(W * (0.19 if self.wide else 0.2)), self.docks["controls"].widget().minimumWidth() + 12)
        w.resizeDocks([d["chats"], d["controls"]], [int(Hh * 0.28), int(Hh * 0.72)], V)
        if self.wide:
            w.resizeDocks([d["chats"], d["occupancy"], d["page_map"]], [left, int(W * 0.21), int(W * 0.21)], H)
            self._planned = {"chats": left}  # the panels share what the chat leaves by their hints
            w.resizeDocks([d["occupancy"], d["timing"]], [int(Hh * 0.5), int(Hh * 0.5)], V)
            w.resizeDocks([d["page_map"], d["memory"]], [int(Hh * 0.5), int(Hh * 0.5)], V)
        else:  # the chat is what a laptop's screen is for: at least 40% and wider than the left column
            chat = max(left + 12, int(W * CHAT_SHARE))
            panels = max(PANELS_MIN_PX, W - left - chat - 12)
            w.resizeDocks([d["chats"], d["occupancy"]], [left, panels], H)
            self._planned = {"chats": left, "occupancy": panels}
            w.resizeDocks([d["occupancy"], d["timing"]], [int(Hh * 0.5), int(Hh * 0.5)], V)
        self.name_docks(short=not self.wide and W < SHORT_TITLES_BELOW_PX)
        self._fitted = w.size()

    def name_docks(self, short: bool) -> None:
        """Dock titles (their tabs' words) in full, or short where three tabs share a narrow column: at 1024×768
        "Token timing · Memory · Why recomputed?" read "Token … · Me… · Why recom…"."""
        for key, title in DOCKS:
            name = SHORT_TITLES.get(key, title) if short else title
            dock = self.docks[key]
            if dock.windowTitle() != name:
                dock.setWindowTitle(name)
                dock.setToolTip(title if short else "")

    def window_resized(self) -> None:
        """Call from the window's resize event: a much larger or smaller window gets the default sizes
        again (after the size settles)."""
        if self._needs_refit():
            self._refit.start()

    def _needs_refit(self) -> bool:
        size, fitted = self.window.size(), self._fitted
        return fitted.isEmpty() or any(
            new > old * REFIT_CHANGE or new * REFIT_CHANGE < old
            for new, old in ((size.width(), fitted.width()), (size.height(), fitted.height())))

    @property
    def settled(self) -> bool:
        """No refit pending: the sizes fit the window as it is now (tests wait on this, not on a clock)."""
        return not self._refit.isActive() and not self._needs_refit()

    def _settled(self) -> None:
        if not self.window.isVisible():
            return  # fitted when it is shown (``_Shown``)
        if self.arrangement in ("compact", "wide") and self.arrangement != ("wide" if self.wide else "compact"):
            self.arrange()
        elif self._checks and not self._needs_refit():  # a fit being looked at after a layout pass
            self._checks -= 1
            if self._took():
                self._checks = 0
            else:
                self._apply()
                if self._checks:
                    self._refit.start()
        else:
            self.fit()

    def restore(self, geometry: bytes, state: bytes) -> None:
        """The saved geometry and dock state, or the default arrangement if there is none (or it is bad)."""
        self.restored = False
        try:
            if geometry:
                self.window.restoreGeometry(QByteArray(geometry))
            if state:
                self.restored = bool(self.window.restoreState(QByteArray(state)))
        except Exception:  # noqa: BLE001 - a bad saved layout must never stop the app
            self.restored = False
        if self.restored:
            self.arrangement = "restored"
            for key, dock in self.docks.items():  # one a saved layout does not know (added since): beside the
                # controls, a panel beside the timing panel
                if self.window.dockWidgetArea(dock) == Qt.DockWidgetArea.NoDockWidgetArea:
                    self.window.tabifyDockWidget(self.docks["timing" if key == "why" else "controls"], dock)
            self._fitted = self.window.size()  # the user's sizes stand until the window changes a lot
        else:
            self.arrange()

    def save(self) -> tuple[bytes, bytes]:
        return bytes(self.window.saveGeometry().data()), bytes(self.window.saveState().data())
