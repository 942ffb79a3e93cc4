"""Chat history in SQLite (WAL): chats and their messages, written as tokens arrive.

A streamed reply is one row whose ``content`` grows by ``append_text`` batches (``content = content || ?``),
so a reply never rewrites the whole chat and a killed app reopens with everything committed so far.
Only the GUI thread uses a ``HistoryStore`` (one connection, no locks).
"""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_SCHEMA = """
CREATE TABLE IF NOT EXISTS chats (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    title TEXT NOT NULL DEFAULT 'New chat',
    system_prompt TEXT NOT NULL DEFAULT '',
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    chat_id INTEGER NOT NULL REFERENCES chats(id) ON DELETE CASCADE,
    position INTEGER NOT NULL,
    role TEXT NOT NULL,
    content TEXT NOT NULL DEFAULT '',
    stats TEXT NOT NULL DEFAULT '{}',
    created REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS messages_by_chat ON messages(chat_id, position);
"""


@dataclass
class Message:
    """One stored message. ``stats`` holds the reply's timing and cache line (assistant messages)."""

    id: int
    chat_id: int
    position: int
    role: str
    content: str
    stats: dict[str, Any] = field(default_factory=dict)


@dataclass
class Chat:
    """One stored chat (without its messages)."""

    id: int
    title: str
    system_prompt: str
    created: float
    updated: float


class HistoryStore:
    """Chats and messages in ``<data_dir>/history.sqlite3``."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(self.path), isolation_level=None)  # autocommit; explicit txns below
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA foreign_keys=ON")
        self._db.executescript(_SCHEMA)

    @classmethod
    def in_data_dir(cls, data_dir: Path) -> "HistoryStore":
        return cls(Path(data_dir) / "history.sqlite3")

    def close(self) -> None:
        self._db.close()

    @property
    def journal_mode(self) -> str:
        return self._db.execute("PRAGMA journal_mode").fetchone()[0]

    # chats -------------------------------------------------------------------------------------------
    def create_chat(self, title: str = "New chat", system_prompt: str = "") -> Chat:
        now = time.time()
        cur = self._db.execute(
            "INSERT INTO chats(title, system_prompt, created, updated) VALUES (?, ?, ?, ?)",
            (title, system_prompt, now, now),
        )
        return Chat(cur.lastrowid, title, system_prompt, now, now)

    def chats(self) -> list[Chat]:
        rows = self._db.execute(
            "SELECT id, title, system_prompt, created, updated FROM chats ORDER BY updated DESC, id DESC"
        ).fetchall()
        return [Chat(*r) for r in rows]

    def chat(self, chat_id: int) -> Chat | None:
        row = self._db.execute(
            "SELECT id, title, system_prompt, created, updated FROM chats WHERE id = ?", (chat_id,)
        ).fetchone()
        return Chat(*row) if row else None

    def rename_chat(self, chat_id: int, title: str) -> None:
        self._db.execute("UPDATE chats SET title = ?, updated = ? WHERE id = ?", (title, time.time(), chat_id))

    def set_system_prompt(self, chat_id: int, text: str) -> None:
        self._db.execute("UPDATE chats SET system_prompt = ? WHERE id = ?", (text, chat_id))

    def delete_chat(self, chat_id: int) -> None:
        self._db.execute("DELETE FROM chats WHERE id = ?", (chat_id,))

    def _touch(self, chat_id: int) -> None:
        self._db.execute("UPDATE chats SET updated = ? WHERE id = ?", (time.time(), chat_id))

    # messages ----------------------------------------------------------------------------------------
    def messages(self, chat_id: int) -> list[Message]:
        rows = self._db.execute(
            "SELECT id, chat_id, position, role, content, stats FROM messages WHERE chat_id = ? ORDER BY position",
            (chat_id,),
        ).fetchall()
        return [Message(r[0], r[1], r[2], r[3], r[4], json.loads(r[5] or "{}")) for r in rows]

    def add_message(self, chat_id: int, role: str, content: str = "") -> Message:
        row = self._db.execute("SELECT COALESCE(MAX(position), -1) FROM messages WHERE chat_id = ?", (chat_id,))
        position = row.fetchone()[0] + 1
        cur = self._db.execute(
            "INSERT INTO messages(chat_id, position, role, content, created) VALUES (?, ?, ?, ?, ?)",
            (chat_id, position, role, content, time.time()),
        )
        self._touch(chat_id)
        return Message(cur.lastrowid, chat_id, position, role, content)

    def append_text(self, message_id: int, text: str) -> None:
        """Append a batch of streamed text to one message (no rewrite of the chat)."""
        if text:
            self._db.execute("UPDATE messages SET content = content || ? WHERE id = ?", (text, message_id))

    def set_content(self, message_id: int, text: str) -> None:
        self._db.execute("UPDATE messages SET content = ? WHERE id = ?", (text, message_id))

    def set_stats(self, message_id: int, stats: dict[str, Any]) -> None:
        self._db.execute("UPDATE messages SET stats = ? WHERE id = ?", (json.dumps(stats), message_id))

    def delete_message(self, message_id: int) -> None:
        self._db.execute("DELETE FROM messages WHERE id = ?", (message_id,))

    def truncate_after(self, chat_id: int, position: int) -> None:
        """Delete every message after ``position`` (edit-and-resend, regenerate)."""
        self._db.execute("DELETE FROM messages WHERE chat_id = ? AND position > ?", (chat_id, position))
        self._touch(chat_id)
