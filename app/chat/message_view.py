"""One message in the chat transcript: role, Markdown body, per-reply stats and cache line, actions."""

from __future__ import annotations

import html
from typing import Any

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import (
    QFrame,
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from app.chat.bubble_lines import cache_line, error_line, note_lines, pin_line, stats_line  # noqa: F401 - and
# re-exported: app.chat.export and the tests take them from here
from app.chat.draft_tint import add_span
from app.chat.markdown import breakable
from app.chat.message_body import MessageBody
from app.chat.tool_messages import tool_title
from app.ground.reuse_words import footer_line

COPIED_MS = 1500  # how long "Copied" shows on the button
FIDELITY_TINT = "#7a2f2f"  # a dark red the bubble's light text stays readable on: the fidelity check's worst tokens


def shown_is_stored(versions: list, shown: int) -> bool:
    """The version on screen is one of the stored ones (not a reply still being written)."""
    return 0 <= shown < len(versions)


class MessageView(QFrame):
    """A chat bubble. Assistant bubbles stream: ``append`` buffers text, ``render`` draws it."""

    copy_requested = Signal()
    edit_submitted = Signal(int, str)  # position, new text
    regenerate_requested = Signal()
    pin_toggled = Signal(int, bool)  # position, pinned
    version_requested = Signal(int, int)  # position, version index
    why_requested = Signal()  # its footer's "Why?" link: show the "Why recomputed?" readout

    def __init__(self, role: str, text: str = "", position: int = 0, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.role = role
        self.position = position
        self.text = text
        self.stats: dict[str, Any] = {}
        self.draft_spans: list[list[int]] = []  # characters of ``text`` from accepted draft tokens
        self.tint = False  # draw them tinted (the window's setting)
        self.fidelity_spans: list[list[int]] = []  # the fidelity check's worst tokens here (drawn over the draft tint)
        self.priority = False  # the eviction policy is Priority pinning (what a pin line may promise)
        self.waiting = ""  # what an empty reply waits for, shown instead of "…" (``app.chat.reply_wait``)
        self._dirty = True
        self.setObjectName(f"bubble_{role}")
        self.setFrameShape(QFrame.Shape.NoFrame)

        self.role_label = QLabel({"user": "You", "assistant": "Model"}.get(role, role.title()))
        self.role_label.setObjectName("roleLabel")
        self.body = MessageBody()  # the text in pieces, laid out a frame's budget at a time; long ones collapse
        self.editor: QPlainTextEdit | None = None  # made on the first edit: 0.7 of a bubble's 3.5 ms
        self.stats_label = QLabel("")
        self.stats_label.setObjectName("statsLine")
        self.versions: list[dict[str, Any]] = []
        self.version = 0
        self.is_last = False
        self._make_lines()
        self._make_buttons(role)
        self._lay_out()
        self.render()

    def _make_lines(self) -> None:
        """The plain-text lines under the body: stats, cache, error, notes, save state (hidden until set)."""
        self.cache_label = QLabel("")
        self.cache_label.setObjectName("cacheLine")
        self.error_label = QLabel("")  # why an error stopped the reply
        self.error_label.setObjectName("errorLine")
        self.notes_label = QLabel("")  # notes the engine sent during the reply
        self.notes_label.setObjectName("noteLine")
        self.save_label = QLabel("")  # "not saved — retrying" while the history file cannot be written
        self.save_label.setObjectName("saveLine")
        self.why_label = QLabel("")  # why prompt tokens were recomputed; its link opens the "Why recomputed?" readout
        self.why_label.setObjectName("whyLine")
        self.why_label.linkActivated.connect(lambda _link: self.why_requested.emit())
        self.progress_label = QLabel("")  # work the reply waits on mid-way (tokens read again after a cache change)
        self.progress_label.setObjectName("progressLine")
        self.fidelity_label = QLabel("")  # what the fidelity check found here (its worst tokens are tinted)
        self.fidelity_label.setObjectName("fidelityLine")
        for label in (self.stats_label, self.cache_label, self.why_label, self.error_label, self.notes_label,
                      self.save_label, self.progress_label, self.fidelity_label):
            label.setWordWrap(True)
            label.setTextFormat(Qt.TextFormat.RichText if label is self.why_label else Qt.TextFormat.PlainText)
            label.setTextInteractionFlags(Qt.TextInteractionFlag.TextBrowserInteraction if label is self.why_label
                                          else Qt.TextInteractionFlag.TextSelectableByMouse)
            label.setMinimumWidth(1)  # never widens the bubble past the column (their text is made breakable)
            label.setVisible(False)

    def _lay_out(self) -> None:
        head = QHBoxLayout()
        head.setContentsMargins(0, 0, 0, 0)
        head.addWidget(self.role_label)
        head.addStretch(1)
        for w in (self.version_prev, self.version_label, self.version_next):
            w.setVisible(False)
            head.addWidget(w)
        for b in (self.copy_button, self.pin_button, self.edit_button, self.regen_button, self.save_button,
                  self.cancel_button):
            head.addWidget(b)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(12, 8, 12, 8)
        layout.setSpacing(4)
        layout.addLayout(head)
        layout.addWidget(self.body)
        layout.addWidget(self.progress_label)
        layout.addWidget(self.error_label)
        layout.addWidget(self.notes_label)
        layout.addWidget(self.stats_label)
        layout.addWidget(self.cache_label)
        layout.addWidget(self.why_label)
        layout.addWidget(self.fidelity_label)
        layout.addWidget(self.save_label)

    def _make_buttons(self, role: str) -> None:
        """The header's buttons: versions, copy, pin, edit, regenerate, save / cancel of an edit."""
        self.version_prev = QPushButton("‹")
        self.version_label = QLabel("")
        self.version_label.setObjectName("versionLabel")
        self.version_next = QPushButton("›")
        self.version_prev.setToolTip("Show the previous version of this reply (Regenerate keeps every version)")
        self.version_next.setToolTip("Show the next version of this reply")
        self.version_prev.clicked.connect(lambda: self._step_version(-1))
        self.version_next.clicked.connect(lambda: self._step_version(1))
        self.copy_button = QPushButton("Copy")
        self.copy_button.setToolTip("Copy this message's text (Markdown) to the clipboard")
        self._copied = QTimer(self)  # puts "Copy" back (a child: it goes with the bubble)
        self._copied.setSingleShot(True)
        self._copied.setInterval(COPIED_MS)
        self._copied.timeout.connect(self._uncopied)
        self.pin_button = QPushButton("Pin")
        self.pin_button.setCheckable(True)
        self.pin_button.setVisible(role in ("user", "assistant"))
        self.pin_button.setToolTip("Pinned messages are never dropped by the Priority pinning policy (nor is the "
                                   "system prompt). Memory: pinned tokens count against its budget.")
        self.pin_button.toggled.connect(self._on_pin)
        self.edit_button = QPushButton("Edit")
        self.edit_button.setToolTip("Change this message and ask again (what came after it is replaced)")
        self.regen_button = QPushButton("Regenerate")
        self.regen_button.setToolTip("Ask for another reply (Ctrl+R); this one stays as a version you can go "
                                     "back to")
        self.save_button = QPushButton("Save && resend")
        self.cancel_button = QPushButton("Cancel")
        for b in (self.version_prev, self.version_next, self.copy_button, self.pin_button, self.edit_button,
                  self.regen_button, self.save_button, self.cancel_button):
            b.setObjectName("flatButton")
            b.setCursor(Qt.CursorShape.PointingHandCursor)
        self.save_button.setVisible(False)
        self.cancel_button.setVisible(False)
        self.edit_button.setVisible(role == "user")
        self.regen_button.setVisible(False)
        self.copy_button.clicked.connect(self.copy)
        self.edit_button.clicked.connect(self.begin_edit)
        self.save_button.clicked.connect(self._save_edit)
        self.cancel_button.clicked.connect(self.end_edit)
        self.regen_button.clicked.connect(self.regenerate_requested)

    # streaming ----------------------------------------------------------------------------------------
    def append(self, delta: str, draft: bool = False) -> None:
        """Streamed text; ``draft``: it came from a draft token the model accepted (tinted when ``tint``)."""
        if delta:
            if draft:
                add_span(self.draft_spans, len(self.text), len(self.text) + len(delta))
            self.text += delta
            self._dirty = True

    def set_tint(self, on: bool) -> None:
        """Tint accepted draft tokens (or not); redrawn now."""
        if on != self.tint:
            self.tint, self._dirty = on, True
            self.render()

    def set_fidelity(self, spans, line: str = "") -> None:
        """Tint the characters of the fidelity check's worst tokens (``spans``: [start, end) of ``text``; [] clears)
        and say what it found under the text (``line``; "" hides it); redrawn now."""
        self.fidelity_spans = [list(span) for span in spans]
        self.fidelity_label.setText(line)
        self.fidelity_label.setVisible(bool(line))
        self._dirty = True
        self.render()

    def set_text(self, text: str) -> None:
        if text != self.text and self.fidelity_spans:  # another text: the check's places no longer hold
            self.fidelity_spans = []
            self.fidelity_label.setVisible(False)
        self.text = text
        self._dirty = True
        self.render()

    def render(self) -> bool:
        """Redraw the body if text changed. Returns True if it did."""
        if not self._dirty:
            return False
        self._dirty = False
        if self.fidelity_spans:
            self.body.show_text(self.text, self.fidelity_spans, True, colour=FIDELITY_TINT)
        elif self.role == "user":
            self.body.show_text(self.text)
        else:  # an empty reply: "…" while it streams, "no text" once it ended (say, an error before a token)
            empty = "no text" if self.stats else html.escape(self.waiting, quote=False) or "…"
            calls = self.stats.get("tool_calls")
            if calls:  # a reply that only called tools: which (the results follow, each in its own message)
                empty = "called " + ", ".join(html.escape(c["function"]["name"]) for c in calls)
            self.body.show_text(self.text, self.draft_spans, self.tint,
                                f"<span style='color:#6d7480'>{empty}</span>")
        return True

    def set_live(self, live: bool) -> None:
        """A reply being written shows all of its text as it grows (never collapsed under the reader); a
        long one offers "Show less" once it ended."""
        self.body.live = live
        if live:
            self.body.expanded = True
        self._dirty = True
        self.render()

    def set_waiting(self, text: str) -> None:
        """What the reply waits for before its first token ("" when the wait is over)."""
        if text != self.waiting:
            self.waiting = text
            self._dirty = True
            self.render()

    def set_progress(self, text: str) -> None:
        """A line under the text while the reply waits on work mid-way ("" hides it): 'Re-prefilling 916 tokens
        after switching to Heavy hitters (H2O): 312 of 916 (34%) …'."""
        self.progress_label.setText(text)
        self.progress_label.setVisible(bool(text))

    def set_stats(self, stats: dict[str, Any]) -> None:
        """The finished reply's lines: error (if one stopped it), notes, stats, cache reuse; a tool result's header
        (which tool, its arguments, what became of the call)."""
        self.stats = dict(stats or {})
        if self.role == "tool":
            self.role_label.setText(tool_title(self.stats))
        if "stop_reason" in self.stats:  # a finished reply's record replaces what streaming collected
            self.draft_spans = [list(span) for span in self.stats.get("draft_spans", ())]
            self.set_progress("")
        line = stats_line(self.stats) or pin_line(self.stats, self.priority)
        for label, text in ((self.stats_label, line), (self.cache_label, cache_line(self.stats)),
                            (self.error_label, breakable(error_line(self.stats)))):
            label.setText(text)
            label.setVisible(bool(text))
        why = footer_line(self.stats)
        self.why_label.setText(html.escape(why, quote=False) + " · <a href='why'>Why?</a>" if why else "")
        self.why_label.setVisible(bool(why))
        self.set_notes(note_lines(self.stats))
        self.set_versions(self.stats.get("versions") or [], self.stats.get("version", 0))
        self._dirty = True
        self.render()

    def set_versions(self, versions: list[dict[str, Any]], shown: int) -> None:
        """'‹ 2 / 3 ›' when the reply has more than one version (switching only on the last reply)."""
        self.versions, self.version = list(versions), shown
        many = len(versions) > 1 or (bool(versions) and shown >= len(versions))
        total = max(len(versions), shown + 1)
        self.version_label.setText(f"{shown + 1} / {total}")
        for w in (self.version_prev, self.version_label, self.version_next):
            w.setVisible(many)
        self.enable_versions(True)

    def enable_versions(self, on: bool) -> None:
        ok = on and self.is_last and shown_is_stored(self.versions, self.version)
        self.version_prev.setEnabled(ok and self.version > 0)
        self.version_next.setEnabled(ok and self.version < len(self.versions) - 1)

    def _step_version(self, step: int) -> None:
        self.version_requested.emit(self.position, self.version + step)

    def set_notes(self, notes: list[str]) -> None:
        """Show the reply's notes, one per line (also while it streams)."""
        self.notes_label.setText(breakable("\n".join(f"• {n}" for n in notes)))  # a path or URL in a note wraps
        self.notes_label.setVisible(bool(notes))

    def set_unsaved(self, text: str) -> None:
        """Say why this message is not in the history file yet ('' once it is)."""
        self.save_label.setText(text)
        self.save_label.setVisible(bool(text))

    def set_last_reply(self, is_last: bool) -> None:
        self.is_last = is_last
        self.regen_button.setVisible(is_last and self.role == "assistant")
        self.enable_versions(True)

    # actions ------------------------------------------------------------------------------------------
    @property
    def pinned(self) -> bool:
        return self.pin_button.isChecked()

    def set_pinned(self, pinned: bool) -> None:
        """Show the stored pin state without emitting ``pin_toggled``."""
        self.pin_button.blockSignals(True)
        self.pin_button.setChecked(bool(pinned))
        self.pin_button.blockSignals(False)
        self.pin_button.setText("Pinned" if pinned else "Pin")

    def set_priority(self, on: bool) -> None:
        """Whether Priority pinning is the eviction policy now: a pinned message's line says what keeps it."""
        if bool(on) != self.priority:
            self.priority = bool(on)
            if self.stats.get("pinned"):
                self._show_pin_line()

    def set_pinned_tokens(self, tokens: int) -> None:
        """The pinned message's token count (saved with it)."""
        self.stats["tokens"] = tokens
        self._show_pin_line()

    def _show_pin_line(self) -> None:
        if self.role == "user":
            line = pin_line(self.stats, self.priority)
            self.stats_label.setText(line)
            self.stats_label.setVisible(bool(line))

    def _on_pin(self, on: bool) -> None:
        self.pin_button.setText("Pinned" if on else "Pin")
        if on:
            self.stats["pinned"] = True
        else:
            self.stats.pop("pinned", None)
            self.stats.pop("tokens", None)
        self._show_pin_line()
        self.pin_toggled.emit(self.position, on)

    def copy(self) -> None:
        """Copy the text, and say so on the button for a moment."""
        QGuiApplication.clipboard().setText(self.text)
        self.copy_button.setText("Copied ✓")
        self._copied.start()
        self.copy_requested.emit()

    def _uncopied(self) -> None:
        self.copy_button.setText("Copy")

    def begin_edit(self) -> None:
        if self.editor is None:
            self.editor = QPlainTextEdit()
            self.editor.setMaximumHeight(140)
            self.layout().insertWidget(2, self.editor)  # under the body
        self.editor.setPlainText(self.text)
        self.editor.setVisible(True)
        self.body.setVisible(False)
        for b, on in ((self.save_button, True), (self.cancel_button, True), (self.edit_button, False)):
            b.setVisible(on)
        self.editor.setFocus()

    def end_edit(self) -> None:
        if self.editor is not None:
            self.editor.setVisible(False)
        self.body.setVisible(True)
        for b, on in ((self.save_button, False), (self.cancel_button, False), (self.edit_button, True)):
            b.setVisible(on)

    def _save_edit(self) -> None:
        text = self.editor.toPlainText().strip() if self.editor is not None else ""
        self.end_edit()
        if text:
            self.edit_submitted.emit(self.position, text)
