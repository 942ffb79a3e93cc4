"""The chat's input box: the keys a chat app's input answers (Enter sends, Shift+Enter a new line, Esc stops)."""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QKeyEvent
from PySide6.QtWidgets import QPlainTextEdit


class ChatInput(QPlainTextEdit):
    """Multi-line input: Enter (or Ctrl+Enter) submits, Shift+Enter inserts a newline, Tab moves the focus
    on (to Send and the controls) instead of typing a tab."""

    submitted = Signal()
    escape_pressed = Signal()

    def keyPressEvent(self, event: QKeyEvent) -> None:  # noqa: N802 - Qt name
        if event.key() == Qt.Key.Key_Escape:
            self.escape_pressed.emit()
            return
        if event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter) and not (
            event.modifiers() & Qt.KeyboardModifier.ShiftModifier
        ):
            self.submitted.emit()
            return
        super().keyPressEvent(event)
