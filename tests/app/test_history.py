"""Chat history in SQLite (WAL), written incrementally; a killed process keeps what it committed; a damaged,
locked or deleted file loses nothing (the window side: test_history_file.py)."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time

from conftest import REPO
from history_files import corrupt_index, stored_messages, write_history

from app.history import recover as history_recover
from app.history.store import HistoryStore


def test_chats_messages_and_incremental_append(tmp_path):
    store = HistoryStore(tmp_path / "h.sqlite3")
    probe = sqlite3.connect(tmp_path / "h.sqlite3")  # the file itself is in WAL mode (a mode the file keeps)
    assert probe.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    probe.close()
    chat = store.create_chat("First", "be brief")
    u = store.add_message(chat.id, "user", "hello")
    a = store.add_message(chat.id, "assistant")
    for piece in ("Hel", "lo ", "there"):
        store.append_text(a.id, piece)
    store.set_stats(a.id, {"reused_tokens": 3})
    msgs = store.messages(chat.id)
    assert [(m.position, m.role, m.content) for m in msgs] == [(0, "user", "hello"), (1, "assistant", "Hello there")]
    assert msgs[1].stats == {"reused_tokens": 3}
    assert u.position == 0
    store.truncate_after(chat.id, 0)
    assert [m.role for m in store.messages(chat.id)] == ["user"]
    store.set_system_prompt(chat.id, "be kind")
    store.rename_chat(chat.id, "Renamed")
    assert store.chat(chat.id).system_prompt == "be kind" and store.chat(chat.id).title == "Renamed"
    second = store.create_chat()
    assert [c.id for c in store.chats()][0] == second.id
    store.delete_chat(chat.id)
    assert store.messages(chat.id) == []
    store.close()


def test_killed_process_keeps_history(tmp_path):
    db = tmp_path / "h.sqlite3"
    code = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {str(REPO)!r})
        from app.history.store import HistoryStore
        s = HistoryStore({str(db)!r})
        c = s.create_chat("killed")
        s.add_message(c.id, "user", "hi")
        a = s.add_message(c.id, "assistant")
        s.append_text(a.id, "partial ")
        s.append_text(a.id, "reply")
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True)
    assert proc.returncode == -signal.SIGKILL
    store = HistoryStore(db)
    chat = store.chats()[0]
    assert chat.title == "killed"
    assert [m.content for m in store.messages(chat.id)] == ["hi", "partial reply"]
    store.close()
    assert os.path.exists(db)


def test_a_damaged_file_is_moved_aside_and_everything_readable_is_kept_with_its_ids(tmp_path):
    path = tmp_path / "h.sqlite3"
    write_history(path, 50, chats=2)
    corrupt_index(path)
    store = HistoryStore(path)
    (notice,) = store.take_notices()
    assert notice.kind == "damaged" and "2 chat(s) and 100 message(s) were recovered" in notice.message
    assert store.writable and store.problem == "" and len(list(tmp_path.glob("h.sqlite3.damaged-*"))) == 1
    ids = [m.id for m in store.messages(1)]
    store.add_message(1, "user", "new")
    store.close()
    again = HistoryStore(path)  # the fresh file holds all of it, under the same ids
    assert again.take_notices() == [] and [m.id for m in again.messages(1)][:50] == ids
    assert [m.content for m in again.messages(1)][-1] == "new" and len(again.messages(2)) == 50
    again.close()


def test_writes_that_fail_wait_in_memory_and_go_in_order(tmp_path, monkeypatch):
    now = [0.0]
    path = tmp_path / "h.sqlite3"
    store = HistoryStore(path)
    store.clock = lambda: now[0]  # retries follow this clock: no sleeping
    chat = store.create_chat("c")
    lock = sqlite3.connect(str(path), isolation_level=None)
    lock.execute("BEGIN IMMEDIATE")
    reply = store.add_message(chat.id, "assistant")
    for piece in ("a", "b", "c"):
        store.append_text(reply.id, piece)
    assert store.unsaved_positions(chat.id) == {0} and "database is locked" in store.problem
    assert [n.kind for n in store.take_notices()] == ["write_failed"]  # said once, not once per write
    lock.execute("ROLLBACK")
    store.tick()
    assert store.unsaved_positions(chat.id) == {0}  # not retried before RETRY_S
    now[0] += history_recover.RETRY_S
    store.tick()
    assert store.unsaved_positions(chat.id) == set() and store.problem == ""
    assert [n.kind for n in store.take_notices()] == ["saved"]
    assert stored_messages(path) == [(chat.id, 0, "abc")]
    store.close()
    lock.close()


def test_a_file_deleted_while_open_is_written_again_from_memory(tmp_path):
    path = tmp_path / "h.sqlite3"
    write_history(path, 20, chats=3)
    store = HistoryStore(path)
    store.add_message(3, "user", "in memory and in the old file")
    store.delete_chat(2)  # deleted in memory stays deleted
    for f in tmp_path.glob("h.sqlite3*"):
        f.unlink()
    store.tick()
    assert [n.kind for n in store.take_notices()] == ["deleted"] and path.exists()
    assert sorted({m[0] for m in stored_messages(path)}) == [1, 3] and len(stored_messages(path)) == 41
    store.close()


# -- remote chats ------------------------------------------------------------------------------------------------
OLD_SCHEMA = """
CREATE TABLE chats (id INTEGER PRIMARY KEY AUTOINCREMENT, title TEXT NOT NULL DEFAULT 'New chat',
    system_prompt TEXT NOT NULL DEFAULT '', created REAL NOT NULL, updated REAL NOT NULL);
CREATE TABLE messages (id INTEGER PRIMARY KEY AUTOINCREMENT,
    chat_id INTEGER NOT NULL REFERENCES chats(id) ON DELETE CASCADE, position INTEGER NOT NULL, role TEXT NOT NULL,
    content TEXT NOT NULL DEFAULT '', stats TEXT NOT NULL DEFAULT '{}', created REAL NOT NULL);
"""
SERVER = '{"events": "", "model": "m", "url": "http://10.0.0.5:8000"}'


def _old_file(path) -> None:
    """A history written before remote chats were saved (no ``server`` column)."""
    db = sqlite3.connect(str(path))
    db.executescript(OLD_SCHEMA)
    db.execute("INSERT INTO chats VALUES (1, 'old chat', 'sys', 1.0, 2.0)")
    db.execute("INSERT INTO messages(chat_id, position, role, content, created) VALUES (1, 0, 'user', 'hi', 1.0)")
    db.commit()
    db.close()


def test_remote_chats_are_kept_apart_from_local_ones_with_their_server(tmp_path):
    path = tmp_path / "h.sqlite3"
    store = HistoryStore(path)
    local = store.create_chat("local")
    remote = store.create_chat(server=SERVER)
    store.add_message(remote.id, "user", "hello server")
    assert [c.id for c in store.chats()] == [local.id]
    assert [c.id for c in store.chats(remote=True)] == [remote.id]
    assert store.chat(remote.id).remote == {"url": "http://10.0.0.5:8000", "model": "m", "events": ""}
    assert store.chat(local.id).remote is None
    store.set_server(remote.id, SERVER.replace('"m"', '"other"'))
    store.close()
    again = HistoryStore(path)
    assert [c.id for c in again.chats()] == [local.id]
    (back,) = again.chats(remote=True)
    assert back.remote["model"] == "other" and [m.content for m in again.messages(back.id)] == ["hello server"]
    again.close()


def test_a_history_from_before_remote_chats_gets_the_column_and_keeps_its_chats(tmp_path):
    path = tmp_path / "h.sqlite3"
    _old_file(path)
    store = HistoryStore(path)
    assert store.writable
    (chat,) = store.chats()
    assert (chat.title, chat.system_prompt, chat.server) == ("old chat", "sys", "")
    assert [m.content for m in store.messages(chat.id)] == ["hi"]
    remote = store.create_chat(server=SERVER)
    store.close()
    db = sqlite3.connect(str(path))
    rows = db.execute("SELECT id, server FROM chats ORDER BY id").fetchall()
    db.close()
    assert rows == [(1, ""), (remote.id, SERVER)]


def test_a_history_from_before_chats_kept_their_model_gets_the_column(tmp_path):
    """#31: a chat is tied to the model that wrote it. A file with a ``server`` column but no ``model`` one (the
    last schema) opens writable, gains the column (its chats: model not known), and keeps a model set after."""
    path = tmp_path / "h.sqlite3"
    db = sqlite3.connect(str(path))
    db.executescript(OLD_SCHEMA.replace("updated REAL NOT NULL)", "updated REAL NOT NULL, server TEXT NOT NULL "
                                        "DEFAULT '')"))
    db.execute("INSERT INTO chats VALUES (1, 'a story', '', 1.0, 2.0, '')")
    db.commit()
    db.close()
    store = HistoryStore(path)
    (chat,) = store.chats()
    assert store.writable and chat.model == "" and chat.model_name == ""
    store.set_model(chat.id, '{"name": "stories260K", "source": "stories260K"}')
    store.close()
    again = HistoryStore(path)
    assert again.chat(1).model_name == "stories260K" and again.chat(1).title == "a story"
    again.close()


def test_an_old_read_only_history_reads_as_local_chats(tmp_path):
    path = tmp_path / "h.sqlite3"
    _old_file(path)
    from app.history import db as hdb

    db = hdb.open_read_only(path)
    try:
        assert hdb.read_chats(db) == [(1, "old chat", "sys", 1.0, 2.0, "", "", "")]
        assert hdb.salvage(db)[0] == [(1, "old chat", "sys", 1.0, 2.0, "", "", "")]
    finally:
        db.close()


def test_a_damaged_history_keeps_its_remote_chats_marked(tmp_path):
    path = tmp_path / "h.sqlite3"
    store = HistoryStore(path)
    remote = store.create_chat("far", server=SERVER)
    for i in range(300):  # enough rows for the index to span pages
        store.add_message(remote.id, "user", f"message {i} " * 20)
    store.close()
    corrupt_index(path)
    again = HistoryStore(path)
    try:
        (back,) = again.chats(remote=True)
        assert back.title == "far" and back.server == SERVER and again.chats() == []
        assert len(again.messages(back.id)) == 300
        assert [n.kind for n in again.take_notices()] == ["damaged"]
    finally:
        again.close()
