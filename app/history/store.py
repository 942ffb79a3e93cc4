"""Chat history: chats and their messages, kept in memory and written behind to SQLite (WAL).

Memory is the truth while the app runs; the file follows it. Every change updates memory, then runs as one
SQLite transaction. A transaction that fails (a read-only file, a full disk, a lock) stays queued, in
order, and ``tick()`` retries it every ``RETRY_S``, so nothing typed is lost while the file cannot be
written, and it all reaches the file once it can. A streamed reply is one row whose ``content`` grows by
``append_text`` batches (``content = content || ?``): a reply never rewrites the chat, and a killed app
reopens with everything committed so far.

When the file is damaged (at start or later) it is moved aside as ``history.sqlite3.damaged-<time>`` after
everything still readable in it is copied to memory, and a fresh file is written from memory; a file
deleted while the app runs is written again from memory the same way. A file that opens only for reading
(read-only file or folder) is read, and changes wait in memory. Each of these leaves one ``HistoryNotice``
(``take_notices``) and, while changes wait, a standing ``problem``; ``on_change`` says when either or the
set of unsaved messages changed. Only the GUI thread uses a ``HistoryStore`` (one connection, no locks).
"""

from __future__ import annotations

import json
import sqlite3
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from app.history import db as hdb
from app.history.recover import Recovery
from app.history.records import Chat, HistoryNotice, Message, message_from_row

__all__ = ["Chat", "HistoryNotice", "HistoryStore", "Message", "message_from_row"]


class HistoryStore(Recovery):
    """Chats and messages in ``<data_dir>/history.sqlite3``. Never raises for a bad file: see the module."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._db: sqlite3.Connection | None = None
        self._writable = False
        self._file: tuple[int, int] | None = None  # (device, inode) of the file ``_db`` has open
        self._chats: dict[int, Chat] = {}
        self._messages: dict[int, list[Message]] = {}  # by chat, by position; only chats read so far
        self._owner: dict[int, int] = {}  # message id -> chat id, for every message in ``_messages``
        self._ops: list[tuple[str, tuple]] = []  # statements memory has and the file has not, in order
        self._rewrite = False  # the file must be written whole from memory (after a recovery)
        self._dirty: set[int] = set()  # messages changed since the last successful write
        self._next_chat = self._next_message = 1
        self._chats_read = False  # ``_chats`` holds the file's chats (read once; memory is the truth after)
        self._retry_at = 0.0  # ``clock()`` time of the next retry while writes fail
        self.clock: Callable[[], float] = time.monotonic  # injected by tests (a retry without waiting 2 s)
        self._recovering = False
        self._closed = False
        self.problem = ""  # why changes are not being saved ('' while they are)
        self._problem_kind = ""
        self._notices: list[HistoryNotice] = []  # not yet taken by the GUI
        self._reported_dirty: frozenset[int] = frozenset()  # ``_dirty`` as ``on_change`` last reported it
        self.on_change: Callable[[], None] | None = None  # the GUI's: notices or unsaved messages changed
        self._open()

    @classmethod
    def in_data_dir(cls, data_dir: Path) -> "HistoryStore":
        return cls(Path(data_dir) / "history.sqlite3")

    def close(self) -> None:
        """Write what waits (one last try), then close. What still cannot be written is reported on stderr."""
        if self._closed:
            return
        self._retry_at = 0.0
        if not self._gone():  # a file deleted since the last tick is written again first
            self._flush()
        if self._ops or self._rewrite:
            print(f"kvscope: {len(self._dirty)} unsaved message(s) lost: {self.problem}", file=sys.stderr)
        self._closed = True
        self._set_db(None, False)

    @property
    def writable(self) -> bool:
        """The file is open for writing (changes reach it as they happen)."""
        return self._db is not None and self._writable

    # state for the GUI -------------------------------------------------------------------------------
    def take_notices(self) -> list[HistoryNotice]:
        """The notices since the last call (oldest first)."""
        out, self._notices = self._notices, []
        return out

    def unsaved_positions(self, chat_id: int) -> set[int]:
        """Positions of the chat's messages whose latest change is not in the file yet."""
        out = set()
        for message_id in self._dirty:
            found = self._find(message_id)
            if found is not None and found[0] == chat_id:
                out.add(self._messages[chat_id][found[1]].position)
        return out

    def tick(self) -> None:
        """Called by the GUI every few hundred ms: notices a deleted or replaced file (and writes it again
        from memory), and retries writes that failed (every ``RETRY_S``)."""
        if self._closed:
            return
        if not self._gone() and (self._ops or self._rewrite) and self.clock() >= self._retry_at:
            self._flush()
        self._changed()

    # chats -------------------------------------------------------------------------------------------
    def create_chat(self, title: str = "New chat", system_prompt: str = "", server: str = "",
                    settings: str = "") -> Chat:
        """A new chat; ``server``: a remote chat's server (``Chat.server``), '' for a chat with this app's engine;
        ``settings``: its own settings (``Chat.settings``: a new local chat starts from the user's defaults)."""
        now = time.time()
        chat = Chat(self._next_chat, title, system_prompt, now, now, server, "", settings)
        self._next_chat += 1
        self._chats[chat.id] = chat
        self._messages[chat.id] = []
        self._write("INSERT INTO chats(id, title, system_prompt, created, updated, server, settings) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?)", (chat.id, title, system_prompt, now, now, server, settings))
        return chat

    def chats(self, remote: bool = False) -> list[Chat]:
        """The local chats (``remote``: the remote chats instead), most recently updated first."""
        return sorted((c for c in self._chats.values() if bool(c.server) == remote),
                      key=lambda c: (c.updated, c.id), reverse=True)

    def chat(self, chat_id: int) -> Chat | None:
        return self._chats.get(chat_id)

    def rename_chat(self, chat_id: int, title: str) -> None:
        if chat_id in self._chats:
            now = time.time()
            self._chats[chat_id] = replace(self._chats[chat_id], title=title, updated=now)
            self._write("UPDATE chats SET title = ?, updated = ? WHERE id = ?", (title, now, chat_id))

    def set_system_prompt(self, chat_id: int, text: str) -> None:
        if chat_id in self._chats:
            self._chats[chat_id] = replace(self._chats[chat_id], system_prompt=text)
            self._write("UPDATE chats SET system_prompt = ? WHERE id = ?", (text, chat_id))

    def set_server(self, chat_id: int, server: str) -> None:
        """A remote chat's server changed (it connected again, to another model)."""
        if chat_id in self._chats and server:
            self._chats[chat_id] = replace(self._chats[chat_id], server=server)
            self._write("UPDATE chats SET server = ? WHERE id = ?", (server, chat_id))

    def set_model(self, chat_id: int, model: str) -> None:
        """The model that writes this local chat's replies now (``Chat.model``)."""
        if chat_id in self._chats and model != self._chats[chat_id].model:
            self._chats[chat_id] = replace(self._chats[chat_id], model=model)
            self._write("UPDATE chats SET model = ? WHERE id = ?", (model, chat_id))

    def set_settings(self, chat_id: int, settings: str) -> None:
        """A local chat's own settings changed (``Chat.settings``)."""
        if chat_id in self._chats and settings != self._chats[chat_id].settings:
            self._chats[chat_id] = replace(self._chats[chat_id], settings=settings)
            self._write("UPDATE chats SET settings = ? WHERE id = ?", (settings, chat_id))

    def delete_chat(self, chat_id: int) -> None:
        self._chats.pop(chat_id, None)
        for m in self._messages.pop(chat_id, []):
            self._owner.pop(m.id, None)
            self._dirty.discard(m.id)
        self._write("DELETE FROM messages WHERE chat_id = ?", (chat_id,),
                    ("DELETE FROM chats WHERE id = ?", (chat_id,)))

    def _touch(self, chat_id: int) -> tuple[str, tuple]:
        now = time.time()
        self._chats[chat_id] = replace(self._chats[chat_id], updated=now)
        return "UPDATE chats SET updated = ? WHERE id = ?", (now, chat_id)

    # messages ----------------------------------------------------------------------------------------
    def messages(self, chat_id: int) -> list[Message]:
        """The chat's messages by position (a new list; the messages themselves are immutable)."""
        return list(self._chat_messages(chat_id))

    def add_message(self, chat_id: int, role: str, content: str = "") -> Message:
        msgs = self._chat_messages(chat_id)
        position = msgs[-1].position + 1 if msgs else 0
        msg = Message(self._next_message, chat_id, position, role, content, {}, time.time())
        self._next_message += 1
        if chat_id not in self._chats:  # a chat deleted meanwhile: nothing to add the message to
            return msg
        msgs.append(msg)
        self._owner[msg.id] = chat_id
        self._dirty.add(msg.id)
        self._write("INSERT INTO messages(id, chat_id, position, role, content, created) VALUES (?, ?, ?, ?, ?, ?)",
                    (msg.id, chat_id, position, role, content, msg.created), self._touch(chat_id))
        return msg

    def append_text(self, message_id: int, text: str, tokens: int | None = None) -> None:
        """Append a batch of streamed text to one message (no rewrite of the chat). ``tokens``: how many
        tokens the reply has streamed so far, saved in the same statement as ``stats["streamed_tokens"]``,
        so a reply the app did not live to finish (kill -9) still says how long it was."""
        found = self._find(message_id)
        if not text or found is None:
            return
        msg = self._messages[found[0]][found[1]]
        if tokens is None:
            self._update(found, content=msg.content + text)
            self._write("UPDATE messages SET content = content || ? WHERE id = ?", (text, message_id))
            return
        self._update(found, content=msg.content + text, stats={**msg.stats, "streamed_tokens": tokens})
        self._write("UPDATE messages SET content = content || ?, stats = json_set(CASE WHEN json_valid(stats) "
                    "THEN stats ELSE '{}' END, '$.streamed_tokens', ?) WHERE id = ?", (text, tokens, message_id))

    def set_content(self, message_id: int, text: str) -> None:
        found = self._find(message_id)
        if found is not None:
            self._update(found, content=text)
            self._write("UPDATE messages SET content = ? WHERE id = ?", (text, message_id))

    def set_stats(self, message_id: int, stats: dict[str, Any]) -> None:
        found = self._find(message_id)
        if found is not None:
            self._update(found, stats=dict(stats))
            self._write("UPDATE messages SET stats = ? WHERE id = ?", (json.dumps(stats), message_id))

    def truncate_after(self, chat_id: int, position: int) -> None:
        """Delete every message after ``position`` (edit-and-resend, regenerate)."""
        msgs = self._chat_messages(chat_id)
        for m in msgs:
            if m.position > position:
                self._owner.pop(m.id, None)
                self._dirty.discard(m.id)
        msgs[:] = [m for m in msgs if m.position <= position]
        if chat_id in self._chats:
            self._write("DELETE FROM messages WHERE chat_id = ? AND position > ?", (chat_id, position),
                        self._touch(chat_id))

    # memory ------------------------------------------------------------------------------------------
    def _chat_messages(self, chat_id: int) -> list[Message]:
        """The chat's list in memory, read from the file the first time."""
        msgs = self._messages.get(chat_id)
        if msgs is not None:
            return msgs
        if chat_id not in self._chats or self._db is None:
            return []
        try:
            rows = hdb.read_messages(self._db, chat_id)
        except sqlite3.Error as exc:
            if hdb.is_damage(exc):
                self._recover("damaged", hdb.reason(exc))  # copies what is readable to memory
                return self._messages.get(chat_id, [])
            self._notify("unavailable", f"Could not read this chat from {self.path} ({hdb.reason(exc)}).")
            return []
        msgs = self._messages[chat_id] = [message_from_row(r) for r in rows]
        self._owner.update((m.id, chat_id) for m in msgs)
        return msgs

    def _find(self, message_id: int) -> tuple[int, int] | None:
        """(chat id, index in its list) of a message in memory; recent messages are found first."""
        chat_id = self._owner.get(message_id)
        if chat_id is None:
            return None
        msgs = self._messages[chat_id]
        for i in range(len(msgs) - 1, -1, -1):
            if msgs[i].id == message_id:
                return chat_id, i
        return None

    def _update(self, found: tuple[int, int], **changes: Any) -> None:
        msgs = self._messages[found[0]]
        msgs[found[1]] = replace(msgs[found[1]], **changes)
        self._dirty.add(msgs[found[1]].id)
