"""``Transcript``: the chat's bubbles in a scroll area, built only for the newest messages.

Opening a chat of 5,000 messages took 156 s and 1.8 GB here when every message got its bubble at once:
a bubble is ~15 widgets around a rich-text label, and each added bubble rescanned every bubble to update
its buttons (O(n²) widget calls). Now only the newest ``FIRST_PAGE`` messages get bubbles; the older ones
wait as plain records, and scrolling to the top builds the ``PAGE`` before the first bubble, keeping what
is on screen where it was. Adding a bubble touches only that bubble and the previous last reply.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

from PySide6.QtCore import Qt, QTimer
from PySide6.QtWidgets import QScrollArea, QVBoxLayout, QWidget

from app.message_view import MessageView

FIRST_PAGE = 40  # bubbles built when a chat opens: 40 × ≥55 px = 2,200 px, taller than the pane on any screen
PAGE = 40  # bubbles built each time the view reaches the top
TOP_PX = 40  # "the top": the scroll bar within 40 px of its minimum
BOTTOM_PX = 24  # the view follows new text while it is within 24 px of the bottom

Record = tuple[str, str, int, dict]  # role, text, position, stats of a message without a bubble yet


class Transcript(QScrollArea):
    """The bubbles (``bubbles``: the newest messages, oldest first) and the records older than them.

    ``make_bubble(role, text, position)`` builds a connected bubble; ``header`` widgets stay above the
    bubbles (the empty-chat hint). The transcript owns which bubble is the last reply, whether the
    bubbles' edit and regenerate buttons are enabled, and which messages say they are not saved.
    """

    def __init__(self, make_bubble: Callable[[str, str, int], MessageView], header: Iterable[QWidget],
                 parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self._make = make_bubble
        self.bubbles: list[MessageView] = []
        self._older: list[Record] = []  # oldest first; the last one comes just before ``bubbles[0]``
        self._last_reply: MessageView | None = None
        self._actions_enabled = True
        self._unsaved: set[int] = set()  # positions of messages that are not in the history file yet
        self._unsaved_text = ""
        self._stick_to_bottom = True
        self._anchor: tuple[MessageView, int] | None = None  # after building older bubbles: (bubble, its y
        # in the view) that stays in place while they lay out, until the user scrolls
        self._adjusting = False  # the scroll value is being set here, not by the user
        self._reveal_queued = False

        self.inner = QWidget()
        self.inner.setObjectName("transcript")
        self.column = QVBoxLayout(self.inner)
        self.column.setContentsMargins(12, 12, 12, 12)
        self.column.setSpacing(10)
        self._header = 0
        for widget in header:
            self.column.addWidget(widget)
            self._header += 1
        self.column.addStretch(1)
        self.setWidgetResizable(True)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setWidget(self.inner)
        self.setObjectName("transcriptScroll")
        self.verticalScrollBar().rangeChanged.connect(self._on_range)
        self.verticalScrollBar().valueChanged.connect(self._on_scroll)

    # what is shown ----------------------------------------------------------------------------------
    @property
    def older_count(self) -> int:
        """Messages older than the first bubble that have no bubble yet."""
        return len(self._older)

    @property
    def has_reply(self) -> bool:
        return self._last_reply is not None or any(r[0] == "assistant" for r in self._older)

    def text_at(self, position: int, role: str) -> str:
        """The text of the message at ``position`` if it has ``role`` ('' otherwise)."""
        for b in self.bubbles:
            if b.position == position:
                return b.text if b.role == role else ""
        return next((r[1] for r in self._older if r[2] == position and r[0] == role), "")

    def set_text_at(self, position: int, text: str) -> None:
        for b in self.bubbles:
            if b.position == position:
                b.set_text(text)
                return
        self._older = [(r[0], text, r[2], r[3]) if r[2] == position else r for r in self._older]

    # changes ----------------------------------------------------------------------------------------
    def clear(self) -> None:
        for b in self.bubbles:
            b.setParent(None)
            b.deleteLater()
        self.bubbles = []
        self._older = []
        self._last_reply = None

    def set_records(self, records: Iterable[Any]) -> None:
        """Show a chat: objects with role, content, position, stats (oldest first). Bubbles for the newest
        ``FIRST_PAGE``; the view goes to the bottom."""
        self.clear()
        self._older = [(r.role, r.content, r.position, dict(r.stats or {})) for r in records]
        self._stick_to_bottom, self._anchor = True, None
        self._build_older(FIRST_PAGE)

    def append(self, bubble: MessageView) -> None:
        """Add a new (newest) message's bubble."""
        self.column.insertWidget(self.column.count() - 1, bubble)
        self.bubbles.append(bubble)
        self._apply(bubble)
        if bubble.role == "assistant":
            self._set_last_reply(bubble)

    def truncate_after(self, position: int) -> None:
        """Drop every message after ``position``; bubbles are built again if fewer than a first page stay."""
        keep = [b for b in self.bubbles if b.position <= position]
        for b in self.bubbles[len(keep):]:  # bubbles are in position order
            b.setParent(None)
            b.deleteLater()
        self.bubbles = keep
        self._older = [r for r in self._older if r[2] <= position]
        self._last_reply = None
        self._set_last_reply(next((b for b in reversed(keep) if b.role == "assistant"), None))
        if len(self.bubbles) < FIRST_PAGE:
            self._build_older(FIRST_PAGE - len(self.bubbles))

    def scroll_to_bottom(self) -> None:
        self._stick_to_bottom, self._anchor = True, None
        self._set_value(self.verticalScrollBar().maximum())

    def reveal_older(self, count: int = PAGE) -> int:
        """Build up to ``count`` bubbles before the first one, keeping the view where it is (the bubble
        that was first stays where it is on screen while they lay out). Returns how many were built."""
        if self.bubbles:
            first = self.bubbles[0]
            self._stick_to_bottom = False
            self._anchor = (first, first.y() - self.verticalScrollBar().value())
        return self._build_older(count)

    def _build_older(self, count: int) -> int:
        page = self._older[-count:] if count > 0 else []
        if not page:
            return 0
        del self._older[-len(page):]
        built = []
        for i, (role, text, position, stats) in enumerate(page):
            b = self._make(role, text, position)
            if stats:
                b.set_stats(stats)
                b.set_pinned(bool(stats.get("pinned")))
            self.column.insertWidget(self._header + i, b)
            self._apply(b)
            built.append(b)
        self.bubbles[:0] = built
        if self._last_reply is None:
            self._set_last_reply(next((b for b in reversed(built) if b.role == "assistant"), None))
        return len(built)

    # per-bubble state -------------------------------------------------------------------------------
    def set_actions_enabled(self, enabled: bool) -> None:
        """Enable the bubbles' edit and regenerate buttons (a model is loaded, no reply is running)."""
        if enabled != self._actions_enabled:
            self._actions_enabled = enabled
            for b in self.bubbles:
                b.edit_button.setEnabled(enabled)
                b.regen_button.setEnabled(enabled)

    def set_unsaved(self, positions: set[int], text: str) -> None:
        """Mark the messages at ``positions`` with ``text`` ("not saved — retrying"); unmark the others."""
        changed = self._unsaved ^ set(positions)
        self._unsaved, self._unsaved_text = set(positions), text
        for b in self.bubbles:
            if b.position in changed or b.position in self._unsaved:
                b.set_unsaved(text if b.position in self._unsaved else "")

    def _apply(self, bubble: MessageView) -> None:
        bubble.edit_button.setEnabled(self._actions_enabled)
        bubble.regen_button.setEnabled(self._actions_enabled)
        if bubble.position in self._unsaved:
            bubble.set_unsaved(self._unsaved_text)

    def _set_last_reply(self, bubble: MessageView | None) -> None:
        if self._last_reply is not None and self._last_reply is not bubble:
            self._last_reply.set_last_reply(False)
        self._last_reply = bubble
        if bubble is not None:
            bubble.set_last_reply(True)

    # scrolling --------------------------------------------------------------------------------------
    def _set_value(self, value: int) -> None:
        self._adjusting = True
        try:
            self.verticalScrollBar().setValue(value)
        finally:
            self._adjusting = False

    def _on_range(self, _lo: int, hi: int) -> None:
        if self._stick_to_bottom:
            self._set_value(hi)
        elif self._anchor is not None:
            self.inner.layout().activate()  # the bubbles' positions after the change, not before it
            bubble, offset = self._anchor
            self._set_value(bubble.y() - offset)

    def _on_scroll(self, value: int) -> None:
        if self._adjusting:
            return
        bar = self.verticalScrollBar()
        self._anchor = None  # the user scrolled: the view stays where they put it
        self._stick_to_bottom = value >= bar.maximum() - BOTTOM_PX
        if value <= bar.minimum() + TOP_PX and self._older and not self._reveal_queued:
            self._reveal_queued = True  # built from the event loop, not inside the scroll bar's signal
            QTimer.singleShot(0, self._reveal_at_top)

    def _reveal_at_top(self) -> None:
        self._reveal_queued = False
        if self.verticalScrollBar().value() <= self.verticalScrollBar().minimum() + TOP_PX:
            self.reveal_older()
