"""Small widgets shared by the window's parts."""

from __future__ import annotations

from PySide6.QtCore import QSize, Qt, QTimer
from PySide6.QtGui import QFontMetrics, QPainter
from PySide6.QtWidgets import QLabel, QSizePolicy, QWidget


DEBOUNCE_MS = 150  # a spin box's arrow held down: one change is sent once it stops, not one per step


class DebouncedForm:
    """A controls form (mixed into a ``QWidget``) whose changes go out through ``_emit``: ``_later`` after
    ``DEBOUNCE_MS`` of quiet (spin boxes), ``_now`` at once (combo boxes, check boxes); neither while
    ``_building`` (the form is being filled from a config: no change of the user's)."""

    _building = False

    def _init_debounce(self) -> None:
        self._debounce = QTimer(self)
        self._debounce.setSingleShot(True)
        self._debounce.setInterval(DEBOUNCE_MS)
        self._debounce.timeout.connect(self._emit)

    def _emit(self) -> None:
        raise NotImplementedError

    def _later(self) -> None:
        if not self._building:
            self._debounce.start()

    def _now(self) -> None:
        if not self._building:
            self._debounce.stop()
            self._emit()


def elide_words(text: str, metrics: QFontMetrics, width: int) -> str:
    """``text`` if it fits in ``width`` pixels, else as many whole words as fit followed by "…"."""
    if metrics.horizontalAdvance(text) <= width:
        return text
    words = text.split(" ")
    while len(words) > 1:
        words.pop()
        candidate = " ".join(words).rstrip(" ·,;:") + "…"
        if metrics.horizontalAdvance(candidate) <= width:
            return candidate
    return "…"


class WordLabel(QLabel):
    """A plain-text label that shortens itself at word boundaries instead of clipping; ``text()`` stays the
    full text and the tooltip shows it whenever it is shortened (unless a tooltip was set on purpose)."""

    def __init__(self, text: str = "", parent: QWidget | None = None) -> None:
        super().__init__(text, parent)
        self.setTextFormat(Qt.TextFormat.PlainText)
        self.setSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Preferred)
        self.explicit_tip = ""

    def minimumSizeHint(self) -> QSize:  # noqa: N802 - Qt name
        hint = super().minimumSizeHint()
        return QSize(min(hint.width(), self.fontMetrics().horizontalAdvance("M…") + 8), hint.height())

    def shown_text(self) -> str:
        """What is painted at the current width."""
        return elide_words(self.text(), self.fontMetrics(), self.contentsRect().width())

    def set_tip(self, tip: str) -> None:
        self.explicit_tip = tip
        self.setToolTip(tip)

    def paintEvent(self, _event) -> None:  # noqa: N802 - Qt name
        shown = self.shown_text()
        if not self.explicit_tip:
            self.setToolTip(self.text() if shown != self.text() else "")
        p = QPainter(self)
        self.style().drawItemText(p, self.contentsRect(), int(self.alignment() | Qt.AlignmentFlag.AlignVCenter),
                                  self.palette(), self.isEnabled(), shown, self.foregroundRole())
        p.end()
