"""A chat is tied to the model that wrote it: each reply saves its model with the chat (``Chat.model``), and a chat
written by another model than the one loaded now says so before it goes on.

Opened with another model loaded (or when another model loads while it is on screen), the chat's notice says
which model wrote it and which one would answer now, with "Load <its model>" as the way back; the chat list marks
it ("… · stories260K"). A message sent there is held until the user chooses: "Send with <model now>" (the chat
goes on with it, and is tied to it from then on), load its model, or start a new chat. Chats from before chats kept
their model are not marked (nothing is known of them).
"""

from __future__ import annotations

import json
from typing import Any, Callable

from PySide6.QtCore import QObject


def model_key(info: Any) -> str:
    """What a chat saves of the model that wrote it: JSON {"name", "source"}."""
    return json.dumps({"name": info.name, "source": info.source}) if info is not None else ""


def _source(chat: Any) -> str:
    try:
        found = json.loads(chat.model)
    except (TypeError, ValueError):
        return ""
    return str(found.get("source") or "") if isinstance(found, dict) else ""


class ModelTie(QObject):
    """Owned by the conversation's ``SendCheck`` (it asks ``holds`` before a message goes out); ``attach`` gives it
    the window's model controller (what is loaded, and Models' own load for "Load <its model>")."""

    def __init__(self, conversation: Any, pane: Any) -> None:
        super().__init__(conversation)
        self.conv, self.pane = conversation, pane
        self.info: Any = None  # the model loaded now (``ModelInfo``)
        self.loader: Callable[[str], None] | None = None
        self._agreed: set[int] = set()  # chats the user chose to go on with the model loaded now
        conversation.reply_started.connect(self._on_reply)
        models = getattr(conversation.parent(), "models", None)  # the window's, made before its conversation
        if models is not None:
            self.attach(models)
        conversation.chat_opened.connect(self._on_opened)

    def attach(self, models: Any) -> None:
        """Follow ``models`` (``app.models.controller.ModelController``): its loads, and its ``load`` for ours."""
        from engine.config import ModelSpec

        self.loader = lambda source: models.load(ModelSpec(source=source))
        models.loaded.connect(self._on_loaded)

    # -- what the chat on screen is --------------------------------------------------------------------------
    def other_model(self, chat_id: int | None) -> str:
        """The name of the model that wrote chat ``chat_id`` when another one is loaded now ('' otherwise)."""
        chat = self.conv.history.chat(chat_id) if chat_id is not None else None
        if chat is None or chat.server or self.info is None or chat_id in self._agreed:
            return ""
        name = chat.model_name
        return name if name and name != self.info.name and self.conv.history.messages(chat_id) else ""

    def holds(self, text: str) -> bool:
        """Before a message goes out: True when it is held (the chat was written by another model; the notice asks
        whether to go on with this one), False to send it now."""
        written_by = self.other_model(self.conv.chat_id)
        if not written_by:
            return False
        self.pane.input.setPlainText(text)
        now = self.info.name
        self._say(f"Not sent yet: this chat was written by {written_by}, and {now} is loaded now. Sent here, {now} "
                  f"reads the chat and answers it, and the chat goes on with {now}.",
                  [(f"Send with {now}", lambda: self._agree_and_send(text))])
        return True

    # -- events ------------------------------------------------------------------------------------------------
    def _on_loaded(self, info: Any) -> None:
        self.info = info
        self._agreed.clear()
        self.conv.chat_list.set_model(info.name if info is not None else "")
        self._on_opened(self.conv.chat_id)

    def _on_reply(self, _generation_id: int, _mode: str) -> None:
        """A reply starts in the chat on screen: the model loaded now writes it (saved with the chat)."""
        chat_id = self.conv.chat_id
        if chat_id is not None and self.info is not None:
            self.conv.history.set_model(chat_id, model_key(self.info))
            self._agreed.discard(chat_id)
            self.conv.chat_list.set_chats(self.conv.history.chats(), chat_id)

    def _on_opened(self, chat_id: int | None) -> None:
        written_by = self.other_model(chat_id)
        if written_by:
            self._say(f"This chat was written by {written_by}; {self.info.name} is loaded now and would answer a "
                      "message sent here.", [])

    def _say(self, text: str, actions: list) -> None:
        chat = self.conv.history.chat(self.conv.chat_id)
        source, name = _source(chat), chat.model_name
        if self.loader is not None and source:
            actions = actions + [(f"Load {name}", lambda: self.loader(source))]
        self.pane.notice.show_message(text, actions + [("New chat", self.conv.new_chat)], tone="info")

    def _agree_and_send(self, text: str) -> None:
        self._agreed.add(self.conv.chat_id)
        self.pane.input.clear()
        self.conv.send(text)
