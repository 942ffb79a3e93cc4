"""The records of the chat history: immutable chats, messages and notices (``app.history.store`` keeps them)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Message:
    """One stored message. ``stats`` holds the reply's timing and cache line (assistant messages)."""

    id: int
    chat_id: int
    position: int
    role: str
    content: str
    stats: dict[str, Any] = field(default_factory=dict)
    created: float = 0.0

    def row(self) -> tuple:
        return (self.id, self.chat_id, self.position, self.role, self.content, json.dumps(self.stats), self.created)


@dataclass(frozen=True)
class Chat:
    """One stored chat (without its messages). ``server``: '' for a chat with this app's engine; for a remote
    chat, JSON {"url", "model", "events"} of the server its replies came from (never its API key). ``model``: a
    local chat's model, JSON {"name", "source"} of the one that wrote its last reply ('' before its first, or in a
    file written before chats kept it). ``settings``: a local chat's own settings, JSON {"cache": {CacheConfig's
    fields}, "spec": {SpecConfig's}} ('' in a file written before chats kept them: the user's defaults)."""

    id: int
    title: str
    system_prompt: str
    created: float
    updated: float
    server: str = ""
    model: str = ""
    settings: str = ""

    @property
    def model_name(self) -> str:
        """The name of the model that wrote this local chat ('' when not known)."""
        try:
            found = json.loads(self.model) if self.model else {}
        except ValueError:
            return ""
        return str(found.get("name") or "") if isinstance(found, dict) else ""

    @property
    def remote(self) -> dict[str, str] | None:
        """The server of a remote chat ({"url", "model", "events"}), None for a local chat (or unreadable)."""
        if not self.server:
            return None
        try:
            found = json.loads(self.server)
        except ValueError:
            return None
        if not isinstance(found, dict) or not isinstance(found.get("url"), str):
            return None
        return {k: str(found.get(k) or "") for k in ("url", "model", "events")}

    def row(self) -> tuple:
        return (self.id, self.title, self.system_prompt, self.created, self.updated, self.server, self.model,
                self.settings)

    @property
    def own_settings(self) -> dict:
        """The chat's own settings ({"cache": {...}, "spec": {...}}; {} when it has none saved or they are
        unreadable)."""
        try:
            found = json.loads(self.settings) if self.settings else {}
        except ValueError:
            return {}
        return found if isinstance(found, dict) else {}


@dataclass(frozen=True)
class HistoryNotice:
    """Something the user should know about the history file. ``kind``: "damaged", "deleted",
    "read_only", "unavailable", "write_failed", or "saved" (changes that waited are written now)."""

    kind: str
    message: str


def message_from_row(row: tuple) -> Message:
    try:
        stats = json.loads(row[5] or "{}")
    except (TypeError, ValueError):
        stats = {}
    return Message(row[0], row[1], row[2], row[3], row[4] or "", stats if isinstance(stats, dict) else {},
                   row[6] or 0.0)
