"""``NoticeBar``: the message area above the transcript, for what is not part of the chat.

The transcript shows only what is saved with the chat (messages, and each reply with its stop reason,
error and notes). A model that did not load, cache settings the engine refused, or a request that could
not be made are not saved, so they show here instead: one message at a time, until the user closes it or
sends the next message.
"""

from __future__ import annotations

import html

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QFrame, QHBoxLayout, QLabel, QToolButton, QWidget


class NoticeBar(QFrame):
    """One dismissible message (plain text; line breaks kept). Hidden when empty."""

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
        row = QHBoxLayout(self)
        row.setContentsMargins(10, 6, 6, 6)
        row.addWidget(self.label, 1)
        row.addWidget(self.close_button, 0, Qt.AlignmentFlag.AlignTop)
        self.setVisible(False)

    def show_message(self, text: str) -> None:
        """Show ``text`` in place of any earlier message."""
        self.text = text
        self.label.setText(html.escape(text).replace("\n", "<br>"))
        self.setVisible(True)

    def clear(self) -> None:
        self.text = ""
        self.label.setText("")
        self.setVisible(False)
