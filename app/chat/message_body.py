"""A bubble's text on screen: its pieces (``app.chat.pieces``) as labels, laid out a frame's budget at a time,
and a long text collapsed to its first piece until the user presses "Show all".

A 100 KB paste in one label froze the window 2–6 s here and kept re-laying out beside the reply
(decode 36.5 tok/s with it on screen against 556 without). Now each call lays out at most
``FRAME_CHARS`` characters: a label whose piece did not change is left alone, the rest waits for the next
turn of the event loop (``_more``), so a streaming reply re-renders only its last piece and a long text
is built a few pieces a turn. ``laid_out_chars`` counts the characters put into labels, for the tests.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Sequence

from PySide6.QtCore import QEvent, Qt, QTimer
from PySide6.QtWidgets import QLabel, QPushButton, QVBoxLayout, QWidget

from app.chat.draft_tint import TINT, tinted_html
from app.chat.markdown import to_html
from app.chat.pieces import Piece, Pieces

FRAME_CHARS = 4000  # characters laid out per call at most: two pieces, 2–6 ms here (100 KB at once: seconds)


class PieceLabel(QLabel):
    """One piece's rich text. Remembers its height for each width until its text changes: a box layout
    measures every label in it again whenever one is added (Qt drops its items' size caches when the
    layout activates), which made "Show all" on 100 KB take 9.5 s here, 0.75 s a turn at the end."""

    def __init__(self) -> None:
        super().__init__()
        self._heights: dict[int, int] = {}

    def setText(self, text: str) -> None:  # noqa: N802 - Qt name
        self._heights.clear()
        super().setText(text)

    def changeEvent(self, event: QEvent) -> None:  # noqa: N802 - Qt name
        if event.type() in (QEvent.Type.FontChange, QEvent.Type.StyleChange):  # the same text, other heights
            self._heights.clear()
        super().changeEvent(event)

    def heightForWidth(self, width: int) -> int:  # noqa: N802 - Qt name
        height = self._heights.get(width)
        if height is None:
            if len(self._heights) > 8:  # a window being resized: keep the few widths asked for now
                self._heights.clear()
            height = self._heights[width] = super().heightForWidth(width)
        return height


class MessageBody(QWidget):
    """The labels of a message's text. ``show_text`` sets what to show; ``expanded`` whether a long text
    shows all of it; ``live`` (a reply being written) never collapses, and shows no toggle."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.labels: list[QLabel] = []
        self._keys: list[tuple] = []  # what each label shows: (piece, tint, its draft spans, placeholder)
        self.pieces = Pieces()
        self.expanded = False
        self.live = False
        self.laid_out_chars = 0  # characters put into labels so far (each one laid out again by Qt)
        self._spans: list[tuple[int, int]] = []
        self._ends: list[int] = []
        self._tint = False
        self._colour = TINT
        self._placeholder = ""
        self._layout = QVBoxLayout(self)
        self._layout.setContentsMargins(0, 0, 0, 0)
        self._layout.setSpacing(0)
        self.toggle = QPushButton("Show all")
        self.toggle.setObjectName("flatButton")
        self.toggle.setCursor(Qt.CursorShape.PointingHandCursor)
        self.toggle.setVisible(False)
        self.toggle.clicked.connect(self._on_toggle)
        self._layout.addWidget(self.toggle, 0, Qt.AlignmentFlag.AlignLeft)
        self._more = QTimer(self)  # the pieces left over by the budget: next turn of the event loop
        self._more.setSingleShot(True)
        self._more.setInterval(0)
        self._more.timeout.connect(self._build)

    def show_text(self, text: str, spans: Sequence[Sequence[int]] = (), tint: bool = False,
                  placeholder: str = "", colour: str = TINT) -> None:
        """Show Markdown ``text`` (``placeholder``, rich text, while it is empty); with ``tint``, the
        characters in ``spans`` on the draft tint (or ``colour``)."""
        self.pieces.update(text)
        self._tint, self._placeholder, self._colour = tint, placeholder, colour
        self._spans = [(int(s), int(e)) for s, e in spans] if tint else []
        self._ends = [e for _, e in self._spans]
        self._build()

    def text(self) -> str:
        """The rich text shown (all labels')."""
        return "".join(label.text() for label in self.labels)

    @property
    def pending(self) -> bool:
        """Pieces wait for the next turn of the event loop (the budget ran out)."""
        return self._more.isActive()

    @property
    def hidden_chars(self) -> int:
        """Characters a collapsed text does not show (0 when all of it is shown)."""
        wanted = self._wanted()
        last = self.pieces.all[-1]
        return last.end - wanted[-1].end

    def set_expanded(self, on: bool) -> None:
        """Show all of a long text (or only its first piece)."""
        if on != self.expanded:
            self.expanded = on
            self._build()

    def _on_toggle(self) -> None:
        self.set_expanded(not self.expanded)

    def _wanted(self) -> list[Piece]:
        pieces = self.pieces.all
        return pieces if self.live or self.expanded or not self.pieces.collapsible else pieces[:1]

    def _piece_spans(self, piece: Piece) -> tuple[tuple[int, int], ...]:
        """The draft spans inside ``piece``, as offsets of its ``source()``."""
        if not self._spans:
            return ()
        shift = len(piece.source()) - len(piece.body) - piece.start  # the reopened fence line, if any
        out = []
        for s, e in self._spans[bisect_right(self._ends, piece.start):]:
            if s >= piece.end:
                break
            out.append((max(s, piece.start) + shift, min(e, piece.end) + shift))
        return tuple(out)

    def _build(self) -> None:
        """Bring the labels up to date, at most ``FRAME_CHARS`` characters of them now."""
        wanted, budget = self._wanted(), FRAME_CHARS
        for i, piece in enumerate(wanted):
            key = (piece, self._tint, self._piece_spans(piece), "" if piece.body else self._placeholder, self._colour)
            if i < len(self._keys) and self._keys[i] == key:
                continue
            if budget < len(piece.body) and budget < FRAME_CHARS:  # one piece a call at least
                self._more.start()
                break
            self._draw(i, piece, key)
            budget -= len(piece.body)
        else:
            for label in self.labels[len(wanted):]:  # a text collapsed or cut shorter
                label.setParent(None)
                label.deleteLater()
            del self.labels[len(wanted):], self._keys[len(wanted):]
        self._show_toggle()

    def _draw(self, i: int, piece: Piece, key: tuple) -> None:
        if i == len(self.labels):
            label = PieceLabel()
            label.setObjectName("messageBody")
            label.setTextFormat(Qt.TextFormat.RichText)
            label.setWordWrap(True)
            label.setMinimumWidth(1)  # never wider than the column: what cannot wrap is cut, not the bubble
            label.setTextInteractionFlags(Qt.TextInteractionFlag.TextBrowserInteraction)
            label.setOpenExternalLinks(False)
            self._layout.insertWidget(i, label)
            self.labels.append(label)
            self._keys.append(key)
        if not piece.body and i == 0:
            html = self._placeholder
        else:
            source, spans = piece.source(), key[2]
            html = tinted_html(source, [list(s) for s in spans], key[4]) if spans else to_html(source)
        self.labels[i].setText(html)
        self._keys[i] = key
        self.laid_out_chars += len(piece.body)

    def _show_toggle(self) -> None:
        show = self.pieces.collapsible and not self.live
        self.toggle.setVisible(show)
        if show:
            hidden = self.hidden_chars
            self.toggle.setText(f"Show all · {hidden:,} more characters" if hidden else "Show less")
