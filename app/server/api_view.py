"""An API conversation on screen: one conversation at a time, whole.

Selecting an API conversation (the list under the chats while serving) puts it where a chat would be: its
tokens as the model saw them in the transcript (template included: the API sends messages, the cache holds
tokens), "API #N" as the title, no chat highlighted — and the panels draw its cache. Nothing is typed into
it: the input and Send say why. The chat that was on screen leaves (``Conversation.leave``); a reply running
in it goes on in the background. Clicking a chat (or New chat) brings the chats back and deselects the API
conversation; so do its session closing and Stop serving, which reopen the chat that was on screen.
"""

from __future__ import annotations

from types import SimpleNamespace

from PySide6.QtCore import QObject

from app.ground.screen import OnScreen, Screen

READ_ONLY = ("An API conversation is on screen: its messages come from the API's client. Select a chat "
             "(or New chat) to type here.")


class ApiView(QObject):
    """Shows the selected API conversation in the chat pane (``show(session_id)``; 0: back to the chats)."""

    def __init__(self, conversation, api_list, server, settings, parent: QObject | None = None,
                 entered=lambda _session_id: None, screen: Screen | None = None) -> None:
        super().__init__(parent)
        self.screen = screen  # the window's: which chat the pane's requests go to
        self._entered = entered  # what else follows the conversation on screen (``ChatSwitch.api_opened``)
        self.conversation = conversation
        self.pane = conversation.pane
        self.api_list = api_list
        self.settings = settings
        self.session_id = 0  # the API conversation on screen (0: a chat is)
        self._text = None
        server.transcript.connect(self._on_transcript)
        conversation.chat_opened.connect(self._on_chat_opened)

    def show(self, session_id: int) -> None:
        if session_id:
            self._enter(session_id)
        elif self.session_id:
            self._back()

    def _enter(self, session_id: int) -> None:
        if self.conversation.chat_id is not None:
            self.conversation.leave()
        self.session_id, self._text = session_id, None
        if self.screen is not None:
            self.screen.show(OnScreen.API)  # nothing typed or asked in the pane reaches a chat now
        self._entered(session_id)
        self.pane.notice.clear()  # it spoke of the chat that left the screen
        self.pane.set_chat(f"API #{self.api_list.number(session_id)}", "")
        self.pane.set_messages([])
        self.pane.set_read_only(READ_ONLY)

    def _back(self) -> None:
        """The API conversation left the screen without a chat being chosen: the last chat comes back."""
        self.session_id = 0
        self.pane.set_read_only("")
        ids = [c.id for c in self.conversation.history.chats()]
        last = self.settings.get("window/last_chat")
        if self.conversation.chat_id is None:
            if last in ids:
                self.conversation.open_chat(last)
            else:
                self.conversation.load_chats()

    def _on_chat_opened(self, _chat_id: int) -> None:
        if self.session_id:
            self.session_id = 0
            self.pane.set_read_only("")

    def _on_transcript(self, session_id: int, text: str, tokens: int) -> None:
        """The conversation's tokens (each poll while it is on screen): the transcript follows them."""
        if session_id != self.session_id or text == self._text:
            return
        self._text = text
        record = SimpleNamespace(role="api", content=text or "(its tokens cannot be shown as text)", position=0,
                                 stats={})
        self.pane.set_messages([record])
        for bubble in self.pane.bubbles:  # a short head (it sets the bubble's width); the count below the text
            bubble.role_label.setText("API conversation")
            bubble.stats_label.setText(f"{tokens:,} tokens, as the model saw them (its chat template included)")
            bubble.stats_label.setVisible(True)
