"""``NoticeBar``: the message area above the transcript, for what is not part of the chat.

The transcript shows only what is saved with the chat (messages, and each reply with its stop reason,
error and notes). A model that did not load, cache settings the engine refused, or a request that could
not be made are not saved, so they show here instead.

Two kinds of entry. A *problem* (``add_problem``: a failed load, refused settings, an export that failed) stays
until the user dismisses it with ×, whatever happens meanwhile — another chat opened, a message sent, another
notice shown: a failure said for six seconds and then replaced is a failure the user never read. The same
problem twice is one entry ("×2"). A *chat notice* (``show_message``: "Not sent yet…", "This chat was written
by…", "Saved in…") is about the chat on screen: one at a time, gone when the chat changes or the user sends
(``clear``). The newest entry is in front; with more than one, "‹ 1 of 3 ›" pages through them.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from typing import Callable, Sequence

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (QFrame, QGridLayout, QHBoxLayout, QLabel, QPushButton, QSizePolicy, QToolButton,
                               QWidget)

Action = tuple[str, Callable[[], None]]
MAX_PROBLEMS = 20  # the oldest go first past this: a loop that fails every second must not grow the list forever


@dataclass
class Notice:
    """One entry: its text, buttons and tone; ``standing``: a problem kept until dismissed."""

    text: str
    actions: Sequence[Action] = ()
    tone: str = "problem"
    standing: bool = False
    times: int = 1  # the same problem again counts here instead of adding an entry
    key: str = field(default="")  # what resolves it (``resolve``): its own text unless given


class NoticeBar(QFrame):
    """The entry in front (plain text; line breaks kept), with its action buttons (each closes it) and, with more
    than one entry, a pager. Hidden when empty. The text takes the bar's whole width and wraps; × sits in the
    top-right corner and dismisses the entry in front. ``changed`` fires whenever the entries change."""

    changed = Signal()

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("notice")
        self.setProperty("tone", "problem")
        self.entries: list[Notice] = []  # oldest first
        self.front = -1  # index of the entry shown
        self.label = QLabel()
        self.label.setObjectName("noticeText")
        self.label.setWordWrap(True)
        self.label.setTextFormat(Qt.TextFormat.RichText)
        self.label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.close_button = QToolButton()
        self.close_button.setText("×")
        self.close_button.setObjectName("flatButton")
        self.close_button.setToolTip("Dismiss")
        self.close_button.clicked.connect(self.dismiss)
        self.label.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Preferred)
        # The buttons live in a widget hidden while there are none: an empty layout in the text's column caps
        # that column at the text's longest word (an empty box layout's maximum width is 0), which left one
        # word per line in a narrow centred strip.
        self.actions = QWidget()
        self.actions_row = QHBoxLayout(self.actions)
        self.actions_row.setContentsMargins(0, 0, 0, 0)
        self.actions.setVisible(False)
        self.action_buttons: list[QPushButton] = []
        self._build_pager()
        grid = QGridLayout(self)
        grid.setContentsMargins(10, 6, 6, 6)
        grid.addWidget(self.label, 0, 0)
        grid.addWidget(self.close_button, 0, 1, Qt.AlignmentFlag.AlignTop | Qt.AlignmentFlag.AlignRight)
        grid.addWidget(self.actions, 1, 0, 1, 2)
        grid.addWidget(self.pager, 2, 0, 1, 2)
        grid.setColumnStretch(0, 1)
        self.setVisible(False)

    def _build_pager(self) -> None:
        self.pager = QWidget()
        row = QHBoxLayout(self.pager)
        row.setContentsMargins(0, 0, 0, 0)
        self.older = QToolButton()
        self.older.setText("‹")
        self.older.setToolTip("The message before")
        self.newer = QToolButton()
        self.newer.setText("›")
        self.newer.setToolTip("The next message")
        self.position = QLabel()
        self.position.setObjectName("noticeText")
        self.dismiss_all_button = QPushButton("Dismiss all")
        self.dismiss_all_button.setObjectName("flatButton")
        self.older.clicked.connect(lambda: self._page(-1))
        self.newer.clicked.connect(lambda: self._page(1))
        self.dismiss_all_button.clicked.connect(self.dismiss_all)
        for w in (self.older, self.position, self.newer):
            row.addWidget(w)
        row.addStretch(1)
        row.addWidget(self.dismiss_all_button)
        self.pager.setVisible(False)

    # -- what callers say ---------------------------------------------------------------------------------------
    @property
    def text(self) -> str:
        """The text of the entry in front ('' when none)."""
        return self.entries[self.front].text if self.entries else ""

    @property
    def problems(self) -> list[str]:
        """The standing problems' texts, oldest first."""
        return [e.text for e in self.entries if e.standing]

    def show_message(self, text: str, actions: Sequence[Action] = (), tone: str = "problem") -> None:
        """The chat notice: ``text`` in front, in place of the chat notice before it (problems stay behind it), with a
        button per (label, action). ``tone``: "problem" (red: something failed or was refused) or "info" (what the
        chat on screen is, e.g. a saved remote chat that is not connected — red would read as a failure)."""
        self.entries = [e for e in self.entries if e.standing]
        self.entries.append(Notice(text, tuple(actions), tone))
        self._show(len(self.entries) - 1)

    def add_problem(self, text: str, actions: Sequence[Action] = (), key: str = "") -> None:
        """A problem that stays until dismissed, in front; the same problem again counts ("×2") instead."""
        key = key or text
        same = next((e for e in self.entries if e.standing and e.key == key), None)
        if same is not None:
            self.entries.remove(same)
            same.times += 1 if same.text == text else 0
            same.text, same.actions = text, tuple(actions)
            entry = same
        else:
            entry = Notice(text, tuple(actions), "problem", standing=True, key=key)
        chat = [e for e in self.entries if not e.standing]
        self.entries = [e for e in self.entries if e.standing][-(MAX_PROBLEMS - 1):] + [entry] + chat
        self._show(len(self.entries) - 1 - len(chat))

    def resolve(self, key: str) -> None:
        """The problem ``key`` is over (the history file is written again): its entry goes."""
        kept = [e for e in self.entries if not (e.standing and e.key == key)]
        if len(kept) != len(self.entries):
            self.entries = kept
            self._show(len(kept) - 1)

    def clear(self) -> None:
        """The chat on screen changed or the user moved on: the chat notice goes; problems stay."""
        kept = [e for e in self.entries if e.standing]
        if len(kept) != len(self.entries) or not kept:
            self.entries = kept
            self._show(len(kept) - 1)

    def dismiss(self) -> None:
        """× : the entry in front goes (the one before it comes forward)."""
        if self.entries:
            del self.entries[self.front]
            self._show(min(self.front, len(self.entries) - 1))

    def dismiss_all(self) -> None:
        self.entries = []
        self._show(-1)

    # -- drawing ------------------------------------------------------------------------------------------------
    def _page(self, step: int) -> None:
        if self.entries:
            self._show(max(0, min(len(self.entries) - 1, self.front + step)))

    def _show(self, index: int) -> None:
        self._clear_actions()
        self.front = index
        if index < 0 or not self.entries:
            self.front = -1
            self.label.setText("")
            self.pager.setVisible(False)
            self.setVisible(False)
            self.changed.emit()
            return
        entry = self.entries[index]
        self._set_tone(entry.tone)
        times = f" (×{entry.times})" if entry.times > 1 else ""
        self.label.setText(html.escape(entry.text + times).replace("\n", "<br>"))
        for label, action in entry.actions:
            button = QPushButton(label)
            button.clicked.connect(lambda _=False, e=entry, a=action: (self._drop(e), a()))
            self.actions_row.addWidget(button)
            self.action_buttons.append(button)
        if entry.actions:
            self.actions_row.addStretch(1)
        self.actions.setVisible(bool(entry.actions))
        many = len(self.entries) > 1
        self.pager.setVisible(many)
        if many:
            self.position.setText(f"{index + 1} of {len(self.entries)}")
            self.older.setEnabled(index > 0)
            self.newer.setEnabled(index < len(self.entries) - 1)
        self.setVisible(True)
        self.changed.emit()

    def _drop(self, entry: Notice) -> None:
        """An action button was clicked: its entry has done its work."""
        if entry in self.entries:
            self.entries.remove(entry)
        self._show(len(self.entries) - 1)

    def _set_tone(self, tone: str) -> None:
        if self.property("tone") == tone:
            return
        self.setProperty("tone", tone)
        self.style().unpolish(self)  # the style sheet's [tone="info"] rules apply on re-polish
        self.style().polish(self)
        self.label.style().unpolish(self.label)
        self.label.style().polish(self.label)

    def _clear_actions(self) -> None:
        while self.actions_row.count():
            item = self.actions_row.takeAt(0)
            if item.widget() is not None:
                item.widget().deleteLater()
        self.action_buttons = []
        self.actions.setVisible(False)
