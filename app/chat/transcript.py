"""``Transcript``: the chat's bubbles in a scroll area, built only for a window of the messages.

Opening a chat of 5,000 messages took 156 s and 1.8 GB here when every message got its bubble at once:
a bubble is ~15 widgets around a rich-text label, and each added bubble rescanned every bubble to update
its buttons (O(n²) widget calls). Now a chat opens with bubbles for its newest ``FIRST_PAGE`` messages;
the others wait as plain records. Reaching the top of the view builds the ``PAGE`` before the first
bubble, reaching the bottom the ``PAGE`` after the last, and at most ``MAX_BUILT`` bubbles exist: the
ones furthest from the view go back to records (laying out a page costs time in proportion to the
bubbles built — ~0.4 s with 200 here, ~2 s with 1,000 — so the window is what keeps scrolling smooth).
What is on screen stays in place while a page is built. Adding a bubble touches only that bubble and
the previous last reply.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

from PySide6.QtCore import Qt, QTimer
from PySide6.QtWidgets import QHBoxLayout, QScrollArea, QVBoxLayout, QWidget

from app.chat.message_view import MessageView

FIRST_PAGE = 40  # bubbles built when a chat opens: 40 × ≥55 px = 2,200 px, taller than the pane on any screen
PAGE = 40  # bubbles built each time the view reaches the top (or the bottom) of what is built
MAX_BUILT = FIRST_PAGE + 2 * PAGE  # bubbles alive at once: 120 × ≥55 px = 6,600 px around the view
EDGE_PX = 40  # "the top" / "the bottom": the scroll bar within 40 px of its end
STICK_PX = 24  # the view follows new text while it is within 24 px of the bottom
MAX_LINE_PX = 760  # the bubbles' column at its widest: long lines stay readable on wide screens

Record = tuple[str, str, int, dict]  # role, text, position, stats of a message without a bubble


class Transcript(QScrollArea):
    """The bubbles (``bubbles``: consecutive messages, oldest first) and the records around them.

    ``make_bubble(role, text, position)`` builds a connected bubble; ``header`` widgets stay above the
    bubbles (the empty-chat hint); ``live`` is the streaming reply, never turned back into a record. The
    transcript owns which bubble is the last reply, whether the bubbles' edit and regenerate buttons are
    enabled, and which messages say they are not saved.
    """

    def __init__(self, make_bubble: Callable[[str, str, int], MessageView], header: Iterable[QWidget],
                 parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self._make = make_bubble
        self.bubbles: list[MessageView] = []
        self._older: list[Record] = []  # oldest first; the last one comes just before ``bubbles[0]``
        self._newer: list[Record] = []  # oldest first; the first one comes just after ``bubbles[-1]``
        self.live: MessageView | None = None
        self._last_reply: MessageView | None = None
        self._actions_enabled = True
        self._unsaved: set[int] = set()  # positions of messages that are not in the history file yet
        self._unsaved_text = ""
        self._stick_to_bottom = True
        self._anchor: tuple[MessageView, int] | None = None  # (bubble, its y in the view) kept in place
        # while a page lays out, until the user scrolls
        self._adjusting = False  # the scroll value is being set here, not by the user
        self._queued = False  # a page is to be built from the event loop

        self.inner = QWidget()
        self.inner.setObjectName("transcript")
        self.column_widget = QWidget()  # the bubbles' column: centred, at most MAX_LINE_PX wide
        self.column_widget.setMaximumWidth(MAX_LINE_PX)
        centred = QHBoxLayout(self.inner)
        centred.setContentsMargins(0, 0, 0, 0)
        centred.addStretch(1)
        centred.addWidget(self.column_widget, 1000)
        centred.addStretch(1)
        self.column = QVBoxLayout(self.column_widget)
        self.column.setContentsMargins(12, 12, 12, 12)
        self.column.setSpacing(10)
        self._header = 0
        for widget in header:
            self.column.addWidget(widget)
            self._header += 1
        self.column.addStretch(1)
        self.setWidgetResizable(True)
        # As needed: the pane is never narrower than a bubble (ChatPane), so this never shows; if it did,
        # a bubble would scroll rather than be cut off.
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAsNeeded)
        self.setWidget(self.inner)
        self.setObjectName("transcriptScroll")
        self.verticalScrollBar().rangeChanged.connect(self._on_range)
        self.verticalScrollBar().valueChanged.connect(self._on_scroll)

    # what is shown ----------------------------------------------------------------------------------
    @property
    def older_count(self) -> int:
        """Messages before the first bubble that have no bubble."""
        return len(self._older)

    @property
    def newer_count(self) -> int:
        """Messages after the last bubble that have no bubble (the view was scrolled far up)."""
        return len(self._newer)

    @property
    def has_reply(self) -> bool:
        return self._last_reply is not None or any(r[0] == "assistant" for r in self._older + self._newer)

    def text_at(self, position: int, role: str) -> str:
        """The text of the message at ``position`` if it has ``role`` ('' otherwise)."""
        for b in self.bubbles:
            if b.position == position:
                return b.text if b.role == role else ""
        return next((r[1] for r in self._older + self._newer if r[2] == position and r[0] == role), "")

    def set_text_at(self, position: int, text: str) -> None:
        for b in self.bubbles:
            if b.position == position:
                b.set_text(text)
                return
        self._older = [(r[0], text, r[2], r[3]) if r[2] == position else r for r in self._older]
        self._newer = [(r[0], text, r[2], r[3]) if r[2] == position else r for r in self._newer]

    # changes ----------------------------------------------------------------------------------------
    def clear(self) -> None:
        self._remove(self.bubbles)
        self.bubbles, self._older, self._newer = [], [], []
        self.live = self._last_reply = None

    def set_records(self, records: Iterable[Any]) -> None:
        """Show a chat: objects with role, content, position, stats (oldest first). Bubbles for the newest
        ``FIRST_PAGE``; the view goes to the bottom."""
        self.clear()
        self._older = [(r.role, r.content, r.position, dict(r.stats or {})) for r in records]
        self._stick_to_bottom, self._anchor = True, None
        self._build_older(FIRST_PAGE)

    def append(self, bubble: MessageView) -> None:
        """Add a new (newest) message's bubble; a view scrolled far up comes back to the newest first."""
        if self._newer:
            self.show_newest()
        self.column.insertWidget(self.column.count() - 1, bubble)
        self.bubbles.append(bubble)
        self._apply(bubble)
        if bubble.role == "assistant":
            self._set_last_reply(bubble)

    def truncate_after(self, position: int) -> None:
        """Drop every message after ``position``; bubbles are built again if fewer than a first page stay."""
        keep = [b for b in self.bubbles if b.position <= position]
        self._remove(self.bubbles[len(keep):])  # bubbles are in position order
        self.bubbles = keep
        self._older = [r for r in self._older if r[2] <= position]
        self._newer = [r for r in self._newer if r[2] <= position]
        if self.live is not None and self.live not in keep:
            self.live = None
        if len(self.bubbles) < FIRST_PAGE:
            self._build_older(FIRST_PAGE - len(self.bubbles))
        self._refresh_last_reply()

    def show_newest(self) -> None:
        """Bubbles for the newest ``FIRST_PAGE`` messages, the view at the bottom (after scrolling far up)."""
        if self._newer:
            records = self._older + [self._record(b) for b in self.bubbles] + self._newer
            self._remove(self.bubbles)
            self.bubbles, self._newer, self._older, self._last_reply = [], [], records, None
            self._build_older(FIRST_PAGE)
        self._stick_to_bottom, self._anchor = True, None
        self._set_value(self.verticalScrollBar().maximum())

    def reveal_older(self, count: int = PAGE) -> int:
        """Build up to ``count`` bubbles before the first one and drop as many from the far end (beyond
        ``MAX_BUILT``); what is on screen stays in place. Returns how many were built."""
        self._anchor_on(self.bubbles[0] if self.bubbles else None)
        built = self._build_older(count)
        QTimer.singleShot(0, self._keep_anchor)  # queued after the new bubbles' show
        extra = len(self.bubbles) - MAX_BUILT
        if extra > 0 and self.live not in self.bubbles[-extra:]:  # the streaming reply stays built
            self._newer[:0] = [self._record(b) for b in self.bubbles[-extra:]]
            self._remove(self.bubbles[-extra:])
            del self.bubbles[-extra:]
            self._refresh_last_reply()
        return built

    def reveal_newer(self, count: int = PAGE) -> int:
        """Build up to ``count`` bubbles after the last one (the view was scrolled far up and comes back
        down) and drop as many from the top beyond ``MAX_BUILT``. Returns how many were built."""
        page = self._newer[:count]
        if not page:
            return 0
        self._anchor_on(self.bubbles[-1] if self.bubbles else None)
        del self._newer[:len(page)]
        for record in page:
            bubble = self._build(record)
            self.column.insertWidget(self.column.count() - 1, bubble)
            self.bubbles.append(bubble)
        QTimer.singleShot(0, self._keep_anchor)  # queued after the new bubbles' show
        extra = len(self.bubbles) - MAX_BUILT
        if extra > 0:
            self._older.extend(self._record(b) for b in self.bubbles[:extra])
            self._remove(self.bubbles[:extra])
            del self.bubbles[:extra]
        self._refresh_last_reply()
        return len(page)

    def _build_older(self, count: int) -> int:
        page = self._older[-count:] if count > 0 else []
        if not page:
            return 0
        del self._older[-len(page):]
        built = [self._build(record) for record in page]
        for i, bubble in enumerate(built):
            self.column.insertWidget(self._header + i, bubble)
        self.bubbles[:0] = built
        if self._last_reply is None and not any(r[0] == "assistant" for r in self._newer):
            self._set_last_reply(next((b for b in reversed(built) if b.role == "assistant"), None))
        return len(built)

    def _build(self, record: Record) -> MessageView:
        role, text, position, stats = record
        bubble = self._make(role, text, position)
        if stats:  # a reply's stats and versions; a pinned message's token count
            bubble.set_stats(stats)
        bubble.set_pinned(bool(stats.get("pinned")))
        self._apply(bubble)
        return bubble

    @staticmethod
    def _record(bubble: MessageView) -> Record:
        stats = {k: v for k, v in bubble.stats.items() if k != "pinned"}
        if bubble.pinned:
            stats["pinned"] = True
        return bubble.role, bubble.text, bubble.position, stats

    @staticmethod
    def _remove(bubbles: list[MessageView]) -> None:
        for b in bubbles:
            b.setParent(None)
            b.deleteLater()

    # per-bubble state -------------------------------------------------------------------------------
    def set_actions_enabled(self, enabled: bool) -> None:
        """Enable the bubbles' edit and regenerate buttons (a model is loaded, no reply is running)."""
        if enabled != self._actions_enabled:
            self._actions_enabled = enabled
            for b in self.bubbles:
                b.edit_button.setEnabled(enabled)
                b.regen_button.setEnabled(enabled)
                b.enable_versions(enabled)

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
        bubble.enable_versions(self._actions_enabled)
        if bubble.position in self._unsaved:
            bubble.set_unsaved(self._unsaved_text)

    def _refresh_last_reply(self) -> None:
        """The newest reply shows Regenerate; none does while the newest reply has no bubble."""
        newest_unbuilt = any(r[0] == "assistant" for r in self._newer)
        self._set_last_reply(None if newest_unbuilt else
                             next((b for b in reversed(self.bubbles) if b.role == "assistant"), None))

    def _set_last_reply(self, bubble: MessageView | None) -> None:
        if self._last_reply is not None and self._last_reply is not bubble:
            self._last_reply.set_last_reply(False)
        self._last_reply = bubble
        if bubble is not None:
            bubble.set_last_reply(True)

    # scrolling --------------------------------------------------------------------------------------
    def _anchor_on(self, bubble: MessageView | None) -> None:
        """Keep ``bubble`` where it is on screen while the page being built lays out: on every range
        change, and from the event loop once the new bubbles are shown (Qt shows a child added to a
        visible widget from the event loop) — a page built and one dropped can leave the range as it was."""
        if bubble is not None:
            self._stick_to_bottom = False
            self._anchor = (bubble, bubble.y() - self.verticalScrollBar().value())

    def _keep_anchor(self) -> None:
        if self._anchor is not None and not self._stick_to_bottom and self._anchor[0].parent() is not None:
            self.inner.layout().activate()  # the bubbles' positions after the change, not before it
            bubble, offset = self._anchor
            self._set_value(bubble.y() - offset)

    def _set_value(self, value: int) -> None:
        self._adjusting = True
        try:
            self.verticalScrollBar().setValue(value)
        finally:
            self._adjusting = False

    def _on_range(self, _lo: int, hi: int) -> None:
        if self._stick_to_bottom:
            self._set_value(hi)
        else:
            self._keep_anchor()

    def _on_scroll(self, value: int) -> None:
        if self._adjusting:
            return
        bar = self.verticalScrollBar()
        self._anchor = None  # the user scrolled: the view stays where they put it
        self._stick_to_bottom = value >= bar.maximum() - STICK_PX and not self._newer
        at_top, at_bottom = value <= bar.minimum() + EDGE_PX, value >= bar.maximum() - EDGE_PX
        if ((at_top and self._older) or (at_bottom and self._newer)) and not self._queued:
            self._queued = True  # built from the event loop, not inside the scroll bar's signal
            QTimer.singleShot(0, self._reveal_at_edge)

    def _reveal_at_edge(self) -> None:
        self._queued = False
        bar = self.verticalScrollBar()
        if bar.value() <= bar.minimum() + EDGE_PX:
            self.reveal_older()
        elif bar.value() >= bar.maximum() - EDGE_PX:
            self.reveal_newer()
