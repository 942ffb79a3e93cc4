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
from PySide6.QtWidgets import QFrame, QHBoxLayout, QLabel, QPushButton, QToolButton, QVBoxLayout, QWidget


class NoticeBar(QFrame):
    """One dismissible message (plain text; line breaks kept), with optional action buttons that each close
    it. Hidden when empty."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("notice")
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
        self.actions_row = QHBoxLayout()
        self.actions_row.setContentsMargins(0, 0, 0, 0)
        self.action_buttons: list[QPushButton] = []
        body = QVBoxLayout()
        body.addWidget(self.label)
        body.addLayout(self.actions_row)
        row = QHBoxLayout(self)
        row.setContentsMargins(10, 6, 6, 6)
        row.addLayout(body, 1)
        row.addWidget(self.close_button, 0, Qt.AlignmentFlag.AlignTop)
        self.setVisible(False)

    def show_message(self, text: str, actions: Sequence[tuple[str, Callable[[], None]]] = ()) -> None:
        """Show ``text`` in place of any earlier message, with a button per (label, action)."""
        self._clear_actions()
        self.text = text
        self.label.setText(html.escape(text).replace("\n", "<br>"))
        for label, action in actions:
            button = QPushButton(label)
            button.clicked.connect(lambda _=False, a=action: (self.clear(), a()))
            self.actions_row.addWidget(button)
            self.action_buttons.append(button)
        if actions:
            self.actions_row.addStretch(1)
        self.setVisible(True)

    def _clear_actions(self) -> None:
        while self.actions_row.count():
            item = self.actions_row.takeAt(0)
            if item.widget() is not None:
                item.widget().deleteLater()
        self.action_buttons = []

    def clear(self) -> None:
        self._clear_actions()
        self.text = ""
        self.label.setText("")
        self.setVisible(False)
