"""Small widgets shared by the window's parts."""

from __future__ import annotations

from PySide6.QtCore import QSize, Qt
from PySide6.QtGui import QFontMetrics, QPainter
from PySide6.QtWidgets import QLabel, QSizePolicy, QWidget


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
