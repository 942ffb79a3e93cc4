"""What follows the chat on screen besides its transcript and panels: the message being typed. A draft belongs to
the chat it was typed in (a new chat starts with an empty input; going back brings the draft back), so nothing of
one chat is shown as another's (its decode speed comes from the screen's record, ``app.shell.readouts``).
"""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import QObject


class ChatSwitch(QObject):
    """Keeps drafts per chat (``drafts``)."""

    def __init__(self, conversation, status, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.conversation = conversation
        self.pane = conversation.pane
        self.status = status
        self.drafts: dict[Any, str] = {}
        self._owner: Any = None  # whose draft the input holds: a chat id, or ("api", session) for an API one
        conversation.chat_opened.connect(self._on_chat_opened)

    def switch_draft(self, owner: Any) -> None:
        """The input now belongs to ``owner``: the text typed for the one before is kept for it."""
        if owner == self._owner:
            return
        text = self.pane.input.toPlainText()
        if text.strip():
            self.drafts[self._owner] = text
        else:
            self.drafts.pop(self._owner, None)
        self._owner = owner
        self.pane.input.setPlainText(self.drafts.pop(owner, ""))

    def api_opened(self, session_id: int) -> None:
        """An API conversation took the chat's place: the chat's draft waits for it."""
        self.switch_draft(("api", session_id))

    def _on_chat_opened(self, chat_id: int) -> None:
        self.switch_draft(chat_id)

    def last_speed(self, chat_id: int) -> float:
        """The decode speed of the chat's last reply (0: it has none yet)."""
        for m in reversed(self.conversation.history.messages(chat_id)):
            if m.role == "assistant":
                return float(m.stats.get("decode_tokens_per_s") or 0.0)
        return 0.0
