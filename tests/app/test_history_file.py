"""The real window on a history file that is damaged, read-only, locked or deleted while it runs.

Each test breaks a real SQLite file (written with ``sqlite3`` in the test) and opens the real
``MainWindow`` on it (a scripted engine: the history is what is tested): the window opens, the notice
above the chat says what happened, and a message sent afterwards is kept (in the file, or for a file
that cannot be written, in memory and on screen with "not saved — retrying" under it until it is).
"""

from __future__ import annotations

import sqlite3

import pytest
from app_helpers import ScriptedSession, close_window, make_info, open_window, send_and_wait
from history_files import (
    corrupt_index,
    make_read_only,
    make_writable,
    overwrite_header,
    read_only_for_real,
    stored_messages,
    truncate_to_half,
    write_history,
)

from app.link.worker import EngineBackend

NOT_SAVED = "not saved — retrying"


def _open(qtbot, data_dir):
    backend = EngineBackend(load=lambda spec, progress, cancel: type("L", (), {"info": make_info()})(),
                            make_session=lambda loaded, cache: ScriptedSession(chunks=1, tokens=3))
    return open_window(qtbot, data_dir, "demo", backend=backend)


def _send(qtbot, w, text: str) -> None:
    assert send_and_wait(qtbot, w, text)[1] == "max_tokens"  # a recovered chat is counted before it is sent


def _contents(path) -> list[str]:
    return [m[2] for m in stored_messages(path)]


@pytest.mark.parametrize("damage", [overwrite_header, truncate_to_half, corrupt_index])
def test_a_damaged_history_is_moved_aside_and_a_fresh_one_keeps_new_messages(qtbot, data_dir, damage):
    path = data_dir / "history.sqlite3"
    write_history(path, 200)
    damage(path)
    damaged = path.read_bytes()
    w = _open(qtbot, data_dir)
    try:
        (aside,) = [p for p in data_dir.glob("history.sqlite3.damaged-*") if not p.name.endswith(("-wal", "-shm"))]
        assert aside.read_bytes() == damaged  # kept as it was, for whoever wants to look
        notice = w.chat.notice.text
        assert w.chat.notice.isVisibleTo(w) and "damaged" in notice and aside.name in notice, notice
        recovered = [m.content for m in w.history.messages(w.chat_id)]
        if damage is overwrite_header:  # nothing of it can be read
            assert recovered == [] and "nothing in it could be read" in notice
        elif damage is truncate_to_half:  # the rows before the cut are kept
            assert 0 < len(recovered) < 200 and "recovered" in notice, (len(recovered), notice)
            assert recovered[0].startswith("message 0 of chat 1")
        else:  # the tables are intact: everything is read around the broken index
            assert len(recovered) == 200 and "1 chat(s) and 200 message(s) were recovered" in notice
            assert w.chat.bubbles[-1].text.startswith("message 199 of chat 1")
        _send(qtbot, w, "kept after the damage")
        assert _contents(path) == recovered + ["kept after the damage", "xxx"]
        assert not any(b.save_label.isVisibleTo(w) for b in w.chat.bubbles)
    finally:
        close_window(w)


def _wait_saved(qtbot, w, bubbles) -> None:
    qtbot.waitUntil(lambda: not any(b.save_label.isVisibleTo(w) for b in bubbles), timeout=15_000)


@pytest.mark.parametrize("what", ["file", "folder"])
def test_a_read_only_history_is_shown_and_new_messages_wait_in_memory(qtbot, data_dir, what):
    path = data_dir / "history.sqlite3"
    write_history(path, 6)
    target = path if what == "file" else data_dir
    make_read_only(target)
    try:
        with read_only_for_real():
            w = _open(qtbot, data_dir)
            try:
                notice = w.chat.notice.text
                assert "can only be read" in notice and str(path) in notice, notice
                assert [b.text.split(" of ")[0] for b in w.chat.bubbles] == [f"message {i}" for i in range(6)]
                _send(qtbot, w, "typed while read-only")
                user, reply = w.chat.bubbles[6:]
                assert user.text == "typed while read-only" and reply.text == "xxx"
                for b in (user, reply):
                    assert b.save_label.isVisibleTo(w) and b.save_label.text() == NOT_SAVED
                assert [m.content for m in w.history.messages(w.chat_id)][6:] == ["typed while read-only", "xxx"]
                assert "typed while read-only" not in _contents(path)
                assert w.chat.notice.text == notice  # sending did not hide the standing problem
                make_writable(target)  # the user fixes it: the next retry writes what waited
                _wait_saved(qtbot, w, (user, reply))
                assert "saved again" in w.chat.notice.text
                assert _contents(path)[6:] == ["typed while read-only", "xxx"]
            finally:
                close_window(w)
    finally:
        make_writable(target)


def test_a_failed_write_is_shown_on_the_message_retried_and_nothing_is_lost(qtbot, data_dir):
    path = data_dir / "history.sqlite3"
    write_history(path, 4)
    w = _open(qtbot, data_dir)
    lock = sqlite3.connect(str(path), isolation_level=None)
    try:
        lock.execute("BEGIN IMMEDIATE")  # another process holds the write lock
        _send(qtbot, w, "typed while locked")
        user, reply = w.chat.bubbles[4:]
        assert user.save_label.isVisibleTo(w) and user.save_label.text() == NOT_SAVED
        assert reply.save_label.text() == NOT_SAVED
        assert "database is locked" in w.chat.notice.text and "retried" in w.chat.notice.text
        lock.execute("ROLLBACK")
        _wait_saved(qtbot, w, (user, reply))
        assert "saved again" in w.chat.notice.text
        assert _contents(path)[4:] == ["typed while locked", "xxx"]
        stats = sqlite3.connect(str(path)).execute("SELECT stats FROM messages ORDER BY id DESC").fetchone()[0]
        assert '"stop_reason": "max_tokens"' in stats  # the statements ran in order, the last one too
    finally:
        lock.close()
        close_window(w)


def test_a_history_deleted_while_running_is_written_again_from_memory(qtbot, data_dir):
    path = data_dir / "history.sqlite3"
    write_history(path, 10, chats=2)
    w = _open(qtbot, data_dir)
    try:
        assert w.chat_id == 2  # the most recent chat opens; chat 1 is never read into the window
        _send(qtbot, w, "before the delete")
        for f in data_dir.glob("history.sqlite3*"):
            f.unlink()
        qtbot.waitUntil(lambda: "deleted" in w.chat.notice.text, timeout=5_000)
        assert "2 chat(s) and 22 message(s)" in w.chat.notice.text and path.exists()
        _send(qtbot, w, "after the delete")
        stored = stored_messages(path)
        assert [m[2] for m in stored if m[0] == 1] == [f"message {i} of chat 1 **bold** and `code`\n- one\n- two"
                                                        for i in range(10)]
        assert [m[2] for m in stored if m[0] == 2][10:] == ["before the delete", "xxx", "after the delete", "xxx"]
    finally:
        close_window(w)
