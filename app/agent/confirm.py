"""The question before a tool runs: which tool, on which MCP server, with which arguments — Run or Don't run.

Not modal (the window and other chats go on); closing it is "Don't run". Nothing runs without the user's word.
"""

from __future__ import annotations

import html
import json

from PySide6.QtCore import Signal
from PySide6.QtWidgets import QDialog, QDialogButtonBox, QLabel, QPlainTextEdit, QPushButton, QVBoxLayout, QWidget

from app.agent.mcp_hub import McpTool


class ToolCallDialog(QDialog):
    """``decided(run)`` once: True for Run, False for Don't run (or the dialog closed)."""

    decided = Signal(bool)

    def __init__(self, tool: McpTool, arguments: dict, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Run a tool?")
        self.setObjectName("ToolCallDialog")
        self._said = False
        self.head = head = QLabel(f"The model calls <b>{_escape(tool.remote)}</b> on the MCP server <b>{_escape(tool.server)}</b>"
                      + (f" — {_escape(tool.description.strip().rstrip('.'))}" if tool.description.strip() else "")
                      + ". Its arguments:")
        head.setWordWrap(True)
        self.arguments = QPlainTextEdit(json.dumps(arguments, indent=2, ensure_ascii=False))
        self.arguments.setReadOnly(True)
        note = QLabel("Run it only if you trust the server with these arguments: a tool can read or change files "
                      "and reach the network as its program may. Don't run tells the model the call was declined.")
        note.setWordWrap(True)
        note.setObjectName("hint")
        buttons = QDialogButtonBox()
        self.run_button = QPushButton("Run")
        self.skip_button = QPushButton("Don't run")
        buttons.addButton(self.run_button, QDialogButtonBox.ButtonRole.AcceptRole)
        buttons.addButton(self.skip_button, QDialogButtonBox.ButtonRole.RejectRole)
        self.run_button.clicked.connect(lambda: self._decide(True))
        self.skip_button.clicked.connect(lambda: self._decide(False))
        layout = QVBoxLayout(self)
        layout.addWidget(head)
        layout.addWidget(self.arguments, 1)
        layout.addWidget(note)
        layout.addWidget(buttons)
        self.resize(520, 320)

    def _decide(self, run: bool) -> None:
        if not self._said:
            self._said = True
            self.decided.emit(run)
        self.close()

    def closeEvent(self, event) -> None:  # noqa: N802 - Qt name
        if not self._said:  # closed without a word: it does not run
            self._said = True
            self.decided.emit(False)
        super().closeEvent(event)

    def reject(self) -> None:  # Esc
        self._decide(False)


def _escape(text: str) -> str:
    return html.escape(text, quote=False)
