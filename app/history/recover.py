"""How ``HistoryStore`` keeps its file: opening it as far as it allows, writing behind memory, retrying,
and starting a fresh file from memory when the one it had is damaged, deleted or replaced.

A mixin of ``HistoryStore`` (``app.history.store``): the state it works on is the store's own, declared and
described in ``HistoryStore.__init__``; this file holds the policy, ``app.history.db`` the SQL.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from app.history import db as hdb
from app.history.records import Chat, HistoryNotice, message_from_row

RETRY_S = 2.0  # a failing write is retried at most every 2 s (a failed attempt costs well under 1 ms)
HIGH_IDS = 1 << 31  # ids for chats made while an existing file cannot be read at all: never clash with its ids


class Recovery:
    """The file side of ``HistoryStore``. Invariant: while ``_rewrite`` is set every known chat has its
    messages in memory, because the next write replaces the file's whole content by memory's."""

    path: Path
    _db: sqlite3.Connection | None

    # opening -----------------------------------------------------------------------------------------
    def _open(self) -> None:
        """First open: read-write; else read-only (changes wait in memory); else memory only. A damaged
        file is recovered (``_recover``)."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            db = hdb.open_writable(self.path)
        except (sqlite3.Error, OSError) as exc:
            if hdb.is_damage(exc):
                self._recover("damaged", hdb.reason(exc))
            else:
                self._open_read_only(exc)
            return
        self._attach(db, True)

    def _open_read_only(self, why: BaseException) -> None:
        try:
            db = hdb.open_read_only(self.path)
        except (sqlite3.Error, OSError) as exc:
            if hdb.is_damage(exc):
                self._recover("damaged", hdb.reason(exc))
                return
            if self.path.exists():
                self._next_chat = self._next_message = HIGH_IDS
            self._notify("unavailable", f"The chat history could not be opened ({hdb.reason(why)}): {self.path}.\n"
                         "New chats are kept in memory and saved once it can be written (retried every "
                         f"{RETRY_S:.0f} s).", standing=True)
            return
        self._attach(db, False)
        if self._db is db:
            self._notify("read_only", f"The chat history can only be read ({hdb.reason(why)}): {self.path}.\n"
                         "Your chats are shown; new messages are kept in memory and saved once the file can "
                         f"be written (retried every {RETRY_S:.0f} s).", standing=True)

    def _reconnect(self) -> bool:
        """Open the file for writing again (it was read-only, gone or unreadable). True if it is now."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            db = hdb.open_writable(self.path)
        except (sqlite3.Error, OSError) as exc:
            if hdb.is_damage(exc) and not self._recovering:
                self._recover("damaged", hdb.reason(exc))
            return False
        self._attach(db, True)
        return self.writable

    def _attach(self, db: sqlite3.Connection, writable: bool) -> None:
        """Use ``db``; the first time, read its chats (messages are read per chat when first needed)."""
        try:
            rows = [] if self._chats_read else hdb.read_chats(db)
            next_chat, next_message = hdb.next_ids(db)
        except sqlite3.Error as exc:
            db.close()
            if hdb.is_damage(exc) and not self._recovering:
                self._recover("damaged", hdb.reason(exc))
            else:
                self._notify("unavailable", f"The chat history could not be read ({hdb.reason(exc)}): "
                             f"{self.path}.", standing=True)
            return
        self._set_db(db, writable)
        if not self._chats_read:
            for row in rows:
                self._chats.setdefault(row[0], Chat(*row))
            self._chats_read = True
        self._next_chat = max(self._next_chat, next_chat)
        self._next_message = max(self._next_message, next_message)

    def _set_db(self, db: sqlite3.Connection | None, writable: bool) -> None:
        if self._db is not None and self._db is not db:
            hdb.rollback(self._db)
            try:
                self._db.close()
            except sqlite3.Error:
                pass
        self._db, self._writable = db, writable and db is not None
        self._file = hdb.file_id(self.path) if db is not None else None

    # writing -----------------------------------------------------------------------------------------
    def _write(self, sql: str, params: tuple, *more: tuple[str, tuple]) -> None:
        """Queue one change (already made in memory) and write what waits."""
        self._ops.append((sql, params))
        self._ops.extend(more)
        self._flush()
        self._changed()

    def _flush(self) -> None:
        """Write what memory has and the file has not: the queued statements, or (after a recovery) all
        of memory, in one transaction. On failure everything stays queued for ``tick()``."""
        if self._closed or not (self._ops or self._rewrite) or self._gone():
            return
        if self.problem and self.clock() < self._retry_at:
            return  # still failing: tick() retries
        if not self.writable and not self._reconnect():
            self._retry_at = self.clock() + RETRY_S
            if not self.problem:
                self._notify("unavailable", f"The chat history cannot be written: {self.path}.\nChanges are "
                             f"kept in memory and saving is retried every {RETRY_S:.0f} s.", standing=True)
            return
        if not (self._ops or self._rewrite):
            return  # the reconnect recovered the file and wrote everything
        try:
            if self._rewrite:
                hdb.write_all(self._db, [c.row() for c in self._chats.values()],
                              [m.row() for msgs in self._messages.values() for m in msgs])
            else:
                hdb.run_all(self._db, self._ops)
        except sqlite3.Error as exc:
            if hdb.is_damage(exc) and not self._recovering:
                self._recover("damaged", hdb.reason(exc))
                return
            self._retry_at = self.clock() + RETRY_S
            self._notify("write_failed", f"Could not save the chat history ({hdb.reason(exc)}).\nChanges are "
                         f"kept in memory and saving is retried every {RETRY_S:.0f} s.", standing=True)
            return
        self._ops.clear()
        self._rewrite = False
        self._dirty.clear()
        if self.problem:
            self.problem, self._problem_kind = "", ""
            self._notices.append(self._notice("saved", f"The chat history is saved again ({self.path.name})."))

    # recovering --------------------------------------------------------------------------------------
    def _gone(self) -> bool:
        """The file ``_db`` has open was deleted or replaced: write it again from memory. True if so."""
        if self._db is None or self._file is None or self._recovering:
            return False
        now = hdb.file_id(self.path)
        if now == self._file:
            return False
        self._recover("deleted" if now is None else "replaced", "")
        return True

    def _recover(self, label: str, why: str) -> None:
        """Copy what the file still holds to memory, move a damaged or replaced file aside, and write a
        fresh one from memory. ``label``: "damaged", "deleted" or "replaced"."""
        self._recovering = True
        try:
            if self._db is not None:
                complete = self._take_all(hdb.salvage(self._db))
            else:
                complete = self._take_all(hdb.salvage_file(self.path) if self.path.exists() else ([], [], False))
            self._set_db(None, False)
            self._rewrite = True
            try:
                aside = hdb.move_aside(self.path, label) if label != "deleted" and self.path.exists() else None
            except OSError as exc:
                self._retry_at = self.clock() + RETRY_S
                self._notify(label, self._lost_text(label, why) + f" It could not be moved aside ({exc.strerror}); "
                             "your chats are kept in memory and saving is retried.", standing=True)
                return
            hdb.remove_side_files(self.path)
            self._notify(label, self._recovered_text(label, why, aside, complete))
            self._retry_at = 0.0
            if self._reconnect():
                self._flush()
            if self._rewrite:
                self._notify("unavailable", f"A new chat history could not be started at {self.path}: your "
                             "chats are kept in memory and saving is retried.", standing=True)
        finally:
            self._recovering = False

    def _take_all(self, salvaged: tuple[list[tuple], list[tuple], bool]) -> bool:
        """Copy to memory every chat (the first time) and every message of a chat not read yet from the
        ``salvaged`` rows; afterwards every chat is in memory. True if all of the file could be read."""
        chat_rows, message_rows, complete = salvaged
        now = time.time()
        if not self._chats_read:  # memory's chats are the truth once read (a deleted one stays deleted)
            for row in chat_rows:
                self._chats.setdefault(row[0], Chat(*row))
            for row in message_rows:  # messages whose chat row was lost get a chat again
                if row[1] not in self._chats:
                    self._chats[row[1]] = Chat(row[1], "Recovered chat", "", now, now)
            self._chats_read = True
        found: dict[int, list] = {}
        for row in message_rows:
            if row[1] in self._chats and row[1] not in self._messages:
                found.setdefault(row[1], []).append(message_from_row(row))
        for chat_id in self._chats:
            msgs = self._messages.setdefault(chat_id, sorted(found.get(chat_id, []), key=lambda m: m.position))
            self._owner.update((m.id, chat_id) for m in msgs)
        self._next_chat = max([self._next_chat, *(c + 1 for c in self._chats)])
        self._next_message = max([self._next_message, *(m + 1 for m in self._owner)])
        return complete

    def _recovered_text(self, label: str, why: str, aside: Path | None, complete: bool) -> str:
        chats, messages = len(self._chats), sum(len(v) for v in self._messages.values())
        kept = f"{chats} chat(s) and {messages} message(s)"
        if label == "deleted":
            return (f"The chat history file was deleted while KV Scope was running: it was written again "
                    f"from memory ({kept}): {self.path}.")
        moved = f"It was moved aside to {aside.name if aside else '(nothing to move)'} and a new one was started"
        if label == "replaced":
            return (f"The chat history file was replaced while KV Scope was running. {moved}, written from "
                    f"memory ({kept}).")
        found = f"{kept} were recovered from it" if messages or chats else "nothing in it could be read"
        partly = " (some of it could not be read)" if not complete and (messages or chats) else ""
        return f"The chat history file was damaged ({why}). {moved}; {found}{partly}."

    def _lost_text(self, label: str, why: str) -> str:
        if label == "damaged":
            return f"The chat history file is damaged ({why}): {self.path}."
        return f"The chat history file was {label} while KV Scope was running: {self.path}."

    # notices -----------------------------------------------------------------------------------------
    def _notify(self, kind: str, message: str, standing: bool = False) -> None:
        """Say ``message`` once. A ``standing`` one is also the current ``problem`` (changes are waiting),
        said again only when its kind changes; the next successful write clears it."""
        if standing:
            if self._problem_kind == kind:
                return
            self._problem_kind, self.problem = kind, message
        self._notices.append(self._notice(kind, message))

    @staticmethod
    def _notice(kind: str, message: str) -> HistoryNotice:
        return HistoryNotice(kind, message)

    def _changed(self) -> None:
        """Call ``on_change`` when there are notices to take or the set of unsaved messages changed."""
        dirty = frozenset(self._dirty)
        if self.on_change is not None and (self._notices or dirty != self._reported_dirty):
            self._reported_dirty = dirty
            self.on_change()
