"""The SQLite file under ``HistoryStore``: opening it as far as it allows, reading what a damaged one still
holds, moving a damaged one aside, and writing a whole history into a fresh one.

Plain rows in and out (tuples in the column order of ``CHAT_COLUMNS`` / ``MESSAGE_COLUMNS``); the store
(``app.history.store``) owns the objects and decides what to do. Nothing here keeps state.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import tempfile
import time
from pathlib import Path
from typing import Iterable

SCHEMA = """
CREATE TABLE IF NOT EXISTS chats (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    title TEXT NOT NULL DEFAULT 'New chat',
    system_prompt TEXT NOT NULL DEFAULT '',
    created REAL NOT NULL,
    updated REAL NOT NULL,
    server TEXT NOT NULL DEFAULT '',
    model TEXT NOT NULL DEFAULT '',
    settings TEXT NOT NULL DEFAULT ''
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
CHAT_COLUMNS = "id, title, system_prompt, created, updated, server, model, settings"
# Columns added since the first files: ``server`` (remote chats), ``model`` (the model that wrote a chat),
# ``settings`` (a chat's own cache and speculation settings). A file
# without one reads it as '' (a local chat, its model not known), and a writable one gets the column (``ALTER TABLE
# ... ADD COLUMN`` rewrites nothing: old rows read its default), so an older app still opens the file.
ADDED_COLUMNS = ("server", "model", "settings")
MESSAGE_COLUMNS = "id, chat_id, position, role, content, stats, created"

# quick_check reads every page: 14 ms for a 5.5 MB history of 20,000 messages here (2.5 ms/MB), so a file up
# to 64 MiB costs at most ~0.2 s of start-up; a bigger one is checked as it is read instead.
QUICK_CHECK_MAX_BYTES = 64 << 20
_DAMAGE_CODES = (11, 26)  # SQLITE_CORRUPT ("disk image is malformed"), SQLITE_NOTADB ("file is not a database")
_SIDE_FILES = ("-wal", "-shm")


class Damaged(sqlite3.DatabaseError):
    """``quick_check`` found the file damaged (its first finding is the message)."""


def is_damage(exc: BaseException) -> bool:
    """Whether ``exc`` says the file's content is broken (as opposed to: locked, read-only, disk full)."""
    if isinstance(exc, Damaged):
        return True
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return (code & 0xFF) in _DAMAGE_CODES
    return type(exc) is sqlite3.DatabaseError


def reason(exc: BaseException) -> str:
    """One line for the user: SQLite's own words ("attempt to write a readonly database"), or the
    system's ("Permission denied")."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    text = [line for line in str(exc).strip().splitlines() if line.strip() and not line.startswith("***")]
    return text[0] if text else exc.__class__.__name__


def open_writable(path: Path) -> sqlite3.Connection:
    """Open (or create) ``path`` for reading and writing, in WAL mode, checked. Raises ``sqlite3.Error``
    when it cannot be written (read-only file or folder) or is damaged (``is_damage``)."""
    if path.exists():  # SQLite would make -wal/-shm read-only like the file, and they outlive the attempt
        os.close(os.open(path, os.O_RDWR))  # PermissionError for a read-only file: nothing created
    # Autocommit: the store runs explicit transactions. A write lock held elsewhere (another KV Scope)
    # blocks the GUI thread at most 200 ms (Python's default is 5 s); then the write waits in memory.
    db = sqlite3.connect(str(path), isolation_level=None, timeout=0.2)
    try:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        db.execute("PRAGMA foreign_keys=ON")
        db.executescript(SCHEMA)
        _check(db, path)
        have = _columns(db)
        for column in ADDED_COLUMNS:
            if column not in have:
                db.execute(f"ALTER TABLE chats ADD COLUMN {column} TEXT NOT NULL DEFAULT ''")
        # SQLite opens a read-only file without a word and fails only at the first write: write one now.
        version = db.execute("PRAGMA user_version").fetchone()[0]
        db.execute(f"PRAGMA user_version={int(version)}")
    except BaseException:
        db.close()
        raise
    return db


def open_read_only(path: Path) -> sqlite3.Connection:
    """Open an existing ``path`` for reading only.

    Without a ``-wal`` next to it every change is in the file itself, and it is opened immutable: no
    locks, and no ``-wal``/``-shm`` created (SQLite would make them read-only like the file, and they
    would keep failing writes after the user makes the file writable again). With a ``-wal`` it is opened
    read-only to read that too; immutable is the fallback (a read-only folder, where ``-shm`` cannot be made).
    """
    uri = path.resolve().as_uri()
    last: sqlite3.Error | None = None
    modes = ("mode=ro", "immutable=1") if Path(str(path) + "-wal").exists() else ("immutable=1",)
    for mode in modes:
        try:
            db = sqlite3.connect(f"{uri}?{mode}", uri=True, isolation_level=None)
        except sqlite3.Error as exc:
            last = exc
            continue
        try:
            db.execute("SELECT 1 FROM chats LIMIT 1").fetchall()
            db.execute("SELECT 1 FROM messages LIMIT 1").fetchall()
            _check(db, path)
            return db
        except sqlite3.Error as exc:
            db.close()
            if is_damage(exc):
                raise
            last = exc
    assert last is not None
    raise last


def _check(db: sqlite3.Connection, path: Path) -> None:
    try:
        size = path.stat().st_size
    except OSError:
        return
    if size <= QUICK_CHECK_MAX_BYTES:
        found = db.execute("PRAGMA quick_check(1)").fetchone()
        if found is not None and found[0] != "ok":  # "*** in database main ***\nPage 5: btreeInitPage() ..."
            raise Damaged(f"SQLite's check found: {reason(sqlite3.DatabaseError(found[0]))}")


def file_id(path: Path) -> tuple[int, int] | None:
    """(device, inode) of ``path``, or None when it is gone: tells a deleted or replaced file."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def next_ids(db: sqlite3.Connection) -> tuple[int, int]:
    """The next free chat id and message id (AUTOINCREMENT never reuses an id, so neither does the store)."""
    out = []
    for table in ("chats", "messages"):
        high = db.execute(f"SELECT COALESCE(MAX(id), 0) FROM {table}").fetchone()[0]
        seq = db.execute("SELECT seq FROM sqlite_sequence WHERE name = ?", (table,)).fetchone()
        out.append(max(int(high), int(seq[0]) if seq else 0) + 1)
    return out[0], out[1]


def _columns(db: sqlite3.Connection) -> set[str]:
    return {row[1] for row in db.execute("PRAGMA table_info(chats)")}


def _chat_columns(db: sqlite3.Connection) -> str:
    """``CHAT_COLUMNS`` as this file can give them (a column it lacks read as '')."""
    try:
        have = _columns(db)
    except sqlite3.Error:  # a schema that cannot be read: the scan itself says what is wrong
        return CHAT_COLUMNS
    return ", ".join(c if c in have or c not in ADDED_COLUMNS else f"'' AS {c}"
                     for c in CHAT_COLUMNS.split(", "))


def read_chats(db: sqlite3.Connection) -> list[tuple]:
    return db.execute(f"SELECT {_chat_columns(db)} FROM chats").fetchall()


def read_messages(db: sqlite3.Connection, chat_id: int) -> list[tuple]:
    return db.execute(f"SELECT {MESSAGE_COLUMNS} FROM messages WHERE chat_id = ? ORDER BY position",
                      (chat_id,)).fetchall()


def salvage(db: sqlite3.Connection) -> tuple[list[tuple], list[tuple], bool]:
    """Every chat and message row still readable in a damaged (or deleted, still open) file: (chats,
    messages, complete). Full table scans without the index (a broken index must not hide its table);
    a scan that hits a broken page keeps the rows read before it."""
    complete = True
    tables = []
    for sql in (f"SELECT {_chat_columns(db)} FROM chats NOT INDEXED",
                f"SELECT {MESSAGE_COLUMNS} FROM messages NOT INDEXED"):
        rows: list[tuple] = []
        try:
            for row in db.execute(sql):  # row by row: a fetchmany that hits a broken page loses its batch
                rows.append(row)
        except sqlite3.Error:
            complete = False
        tables.append(rows)
    return tables[0], tables[1], complete


def salvage_file(path: Path) -> tuple[list[tuple], list[tuple], bool]:
    """``salvage`` of a damaged file that is not open, read-only. A truncated file (SQLite refuses a file
    shorter than its header says) is read from a copy padded with zeros to that length: the pages cut off
    read as damaged, the rows before them are kept."""
    db = _open_for_salvage(path)
    if db is not None:
        try:
            return salvage(db)
        finally:
            db.close()
    with tempfile.TemporaryDirectory(prefix="kvscope-salvage-") as tmp:
        copy = Path(tmp) / "padded.sqlite3"
        if _padded_copy(path, copy) and (db := _open_for_salvage(copy)) is not None:
            try:
                return salvage(db)
            finally:
                db.close()
    return [], [], False


def _open_for_salvage(path: Path) -> sqlite3.Connection | None:
    """A read-only connection whose schema can be read, or None."""
    uri = path.resolve().as_uri()
    for mode in ("mode=ro", "immutable=1"):
        try:
            db = sqlite3.connect(f"{uri}?{mode}", uri=True, isolation_level=None)
        except sqlite3.Error:
            continue
        try:
            db.execute("SELECT name FROM sqlite_master").fetchall()
            return db
        except sqlite3.Error:
            db.close()
    return None


def _padded_copy(path: Path, copy: Path) -> bool:
    """Copy ``path`` to ``copy`` zero-padded to the page count in its header. False if that cannot help."""
    try:
        with open(path, "rb") as f:
            header = f.read(100)
        if len(header) < 100 or not header.startswith(b"SQLite format 3\0"):
            return False
        page_size = int.from_bytes(header[16:18], "big")
        page_size = 65536 if page_size == 1 else page_size
        length = page_size * int.from_bytes(header[28:32], "big")
        if length <= path.stat().st_size:
            return False
        shutil.copyfile(path, copy)
        os.truncate(copy, length)
        return True
    except OSError:
        return False


def move_aside(path: Path, label: str) -> Path:
    """Rename ``path`` (and a ``-wal`` with frames in it) to ``<name>.<label>-YYYYMMDD-HHMM[-n]``; returns
    the new path. Raises ``OSError`` (a read-only folder) with nothing moved. An empty ``-wal`` and the
    ``-shm`` (an index SQLite rebuilds) are deleted instead."""
    stamp = time.strftime("%Y%m%d-%H%M")
    target = path.with_name(f"{path.name}.{label}-{stamp}")
    n = 2
    while target.exists():
        target = path.with_name(f"{path.name}.{label}-{stamp}-{n}")
        n += 1
    os.replace(path, target)
    wal = Path(str(path) + "-wal")
    try:
        if wal.stat().st_size > 0:
            os.replace(wal, Path(str(target) + "-wal"))
    except OSError:
        pass  # no -wal, or it cannot move: it must still not meet the fresh file (below)
    remove_side_files(path)
    return target


def remove_side_files(path: Path) -> None:
    """Delete a gone file's ``-wal``/``-shm``: SQLite would replay a stale WAL into a fresh file of that name."""
    for suffix in _SIDE_FILES:
        try:
            os.remove(str(path) + suffix)
        except OSError:
            pass


def write_all(db: sqlite3.Connection, chats: Iterable[tuple], messages: Iterable[tuple]) -> None:
    """Replace the file's whole content by these rows, in one transaction (all or nothing)."""
    db.execute("BEGIN IMMEDIATE")
    try:
        db.execute("DELETE FROM messages")
        db.execute("DELETE FROM chats")
        db.executemany(f"INSERT INTO chats({CHAT_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?)", chats)
        db.executemany(f"INSERT INTO messages({MESSAGE_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?)", messages)
        db.execute("COMMIT")
    except BaseException:
        rollback(db)
        raise


def run_all(db: sqlite3.Connection, ops: Iterable[tuple[str, tuple]]) -> None:
    """Run ``(sql, params)`` statements in one transaction (all or nothing)."""
    db.execute("BEGIN IMMEDIATE")
    try:
        for sql, params in ops:
            db.execute(sql, params)
        db.execute("COMMIT")
    except BaseException:
        rollback(db)
        raise


def rollback(db: sqlite3.Connection) -> None:
    try:
        if db.in_transaction:
            db.execute("ROLLBACK")
    except sqlite3.Error:
        pass
