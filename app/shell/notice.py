"""``NoticeBar``: the message area above the transcript, for what is not part of the chat.

The transcript shows only what is saved with the chat (messages, and each reply with its stop reason,
error and notes). A model that did not load, cache settings the engine refused, or a request that could
not be made are not saved, so they show here instead: one message at a time, until the user closes it or
sends the next message.
"""

from __future__ import annotations

import html

from typing import Callable, Sequence

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QFrame, QGridLayout, QHBoxLayout, QLabel, QPushButton, QSizePolicy, QToolButton, QWidget


class NoticeBar(QFrame):
    """One dismissible message (plain text; line breaks kept), with optional action buttons that each close
    it. Hidden when empty. The text takes the bar's whole width and wraps; × sits in the top-right corner."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("notice")
        self.setProperty("tone", "problem")
        self.text = ""
        self.label = QLabel()
        self.label.setObjectName("noticeText")
        self.label.setWordWrap(True)
        self.label.setTextFormat(Qt.TextFormat.RichText)
        self.label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.close_button = QToolButton()
        self.close_button.setText("×")
        self.close_button.setObjectName("flatButton")
        self.close_button.setToolTip("Dismiss")
        self.close_button.clicked.connect(self.clear)
        self.label.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Preferred)
        # The buttons live in a widget hidden while there are none: an empty layout in the text's column caps
        # that column at the text's longest word (an empty box layout's maximum width is 0), which left one
        # word per line in a narrow centred strip.
        self.actions = QWidget()
        self.actions_row = QHBoxLayout(self.actions)
        self.actions_row.setContentsMargins(0, 0, 0, 0)
        self.actions.setVisible(False)
        self.action_buttons: list[QPushButton] = []
        grid = QGridLayout(self)
        grid.setContentsMargins(10, 6, 6, 6)
        grid.addWidget(self.label, 0, 0)
        grid.addWidget(self.close_button, 0, 1, Qt.AlignmentFlag.AlignTop | Qt.AlignmentFlag.AlignRight)
        grid.addWidget(self.actions, 1, 0, 1, 2)
        grid.setColumnStretch(0, 1)
        self.setVisible(False)

    def show_message(self, text: str, actions: Sequence[tuple[str, Callable[[], None]]] = (),
                     tone: str = "problem") -> None:
        """Show ``text`` in place of any earlier message, with a button per (label, action). ``tone``: "problem"
        (red: something failed or was refused) or "info" (what the chat on screen is, e.g. a saved remote chat
        that is not connected — red would read as a failure)."""
        self._clear_actions()
        self.text = text
        if self.property("tone") != tone:
            self.setProperty("tone", tone)
            self.style().unpolish(self)  # the style sheet's [tone="info"] rules apply on re-polish
            self.style().polish(self)
            self.label.style().unpolish(self.label)
            self.label.style().polish(self.label)
        self.label.setText(html.escape(text).replace("\n", "<br>"))
        for label, action in actions:
            button = QPushButton(label)
            button.clicked.connect(lambda _=False, a=action: (self.clear(), a()))
            self.actions_row.addWidget(button)
            self.action_buttons.append(button)
        if actions:
            self.actions_row.addStretch(1)
        self.actions.setVisible(bool(actions))
        self.setVisible(True)

    def _clear_actions(self) -> None:
        while self.actions_row.count():
            item = self.actions_row.takeAt(0)
            if item.widget() is not None:
                item.widget().deleteLater()
        self.action_buttons = []
        self.actions.setVisible(False)

    def clear(self) -> None:
        self._clear_actions()
        self.text = ""
        self.label.setText("")
        self.setVisible(False)
