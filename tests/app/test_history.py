"""Chat history in SQLite (WAL), written incrementally; a killed process keeps what it committed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

from conftest import REPO

from app.history import HistoryStore


def test_chats_messages_and_incremental_append(tmp_path):
    store = HistoryStore(tmp_path / "h.sqlite3")
    assert store.journal_mode == "wal"
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
        from app.history import HistoryStore
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
