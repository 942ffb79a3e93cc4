"""Remote chats in the history file: each change of a remote chat is written through to ``HistoryStore`` as it
happens, the way a local chat's are, so a remote chat outlives the session (and a killed app keeps what streamed).

The chat row carries ``server`` = JSON {"url", "model", "events"}: where its replies came from, so the list marks it
and a later session can connect again. The API key is never written (the history is a plain file): a server that
wants one asks for it again. The history owns the rows; ``RemoteChat.messages`` mirror them, each with its row id.
"""

from __future__ import annotations

import json

from app.chat.chat_list import title_from
from app.history.store import HistoryStore
from app.remote.chat_list import Message, RemoteChat
from app.chat.replies import interrupted

TITLE_CHARS = 32  # the list row also names the model and server


def server_json(url: str, model: str, events: str) -> str:
    return json.dumps({"url": url, "model": model, "events": events}, sort_keys=True)


class RemoteSaver:
    """Writes remote chats to ``history`` and reads the saved ones back."""

    def __init__(self, history: HistoryStore) -> None:
        self.history = history

    def saved(self) -> list[RemoteChat]:
        """The remote chats of earlier sessions, not connected, most recent first (messages read when opened)."""
        out = []
        for chat in self.history.chats(remote=True):
            server = chat.remote
            if server is None:  # a row this version cannot read: left in the file as it is
                continue
            out.append(RemoteChat(chat.id, None, url=server["url"], model_name=server["model"],
                                  events=server["events"], title=chat.title if chat.title != "New chat" else "",
                                  system_prompt=chat.system_prompt, loaded=False))
        return out

    def load(self, rc: RemoteChat) -> None:
        """Read a saved chat's messages (once). A reply left without a stop reason (the app closed or was killed
        while it streamed) is saved as interrupted, so it says why it stopped."""
        if rc.loaded:
            return
        rc.messages = []
        for m in self.history.messages(rc.id):
            msg = Message(m.role, m.content, m.position, dict(m.stats), m.id)
            if m.role == "assistant" and "stop_reason" not in m.stats:
                msg.stats = interrupted(m.content, m.stats)
                self.history.set_stats(m.id, msg.stats)
            rc.messages.append(msg)
        rc.loaded = True

    def create(self, url: str, model: str, events: str) -> int:
        """A new remote chat's row; returns its id."""
        return self.history.create_chat(server=server_json(url, model, events)).id

    def set_server(self, rc: RemoteChat) -> None:
        """The chat connected again (the same server or a model it chose): its row says so."""
        self.history.set_server(rc.id, server_json(rc.url, rc.model_name, rc.events))

    def add(self, rc: RemoteChat, role: str, content: str) -> Message:
        """Append a message to the chat and its row; the first user message names the chat."""
        row = self.history.add_message(rc.id, role, content)
        msg = Message(role, content, row.position, {}, row.id)
        rc.messages.append(msg)
        if role == "user" and not rc.title:
            rc.title = title_from(content, TITLE_CHARS)
            self.history.rename_chat(rc.id, rc.title)
        return msg

    def append(self, msg: Message, text: str, tokens: int) -> None:
        """Streamed text of the reply in flight (``tokens``: how many so far, kept for a reply cut short)."""
        msg.content += text
        self.history.append_text(msg.id, text, tokens)

    def finish(self, msg: Message, text: str, stats: dict) -> None:
        msg.content, msg.stats = text, dict(stats)
        self.history.set_content(msg.id, text)
        self.history.set_stats(msg.id, msg.stats)

    def edit(self, msg: Message, text: str) -> None:
        msg.content = text
        self.history.set_content(msg.id, text)

    def truncate(self, rc: RemoteChat, position: int) -> None:
        """Drop every message after ``position`` (regenerate, edit)."""
        rc.messages = [m for m in rc.messages if m.position <= position]
        self.history.truncate_after(rc.id, position)

    def set_system_prompt(self, rc: RemoteChat, text: str) -> None:
        rc.system_prompt = text
        self.history.set_system_prompt(rc.id, text)

    def delete(self, rc: RemoteChat) -> None:
        self.history.delete_chat(rc.id)
