"""Real history files for the tests, written with ``sqlite3`` directly, and the ways they break.

``read_only_for_real()``: tests often run as root, and root writes through ``chmod``; this drops
``CAP_DAC_OVERRIDE`` from the calling thread's effective capabilities (the GUI thread: the only one that
touches the history) so a read-only file or folder is read-only, and gives it back afterwards.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import sqlite3
import stat
from pathlib import Path

import pytest

from app.history.db import SCHEMA

CAP_DAC_OVERRIDE = 1


def write_history(path: Path, messages: int, chats: int = 1, words: str = "") -> None:
    """A history of ``chats`` chats of ``messages`` messages each (user/assistant turns, replies with stats),
    written the way the app writes it (WAL, its schema) and closed cleanly."""
    db = sqlite3.connect(str(path))
    db.execute("PRAGMA journal_mode=WAL")
    db.executescript(SCHEMA)
    stats = json.dumps({"generated_tokens": 12, "decode_tokens_per_s": 30.0, "ttft_ms": 20, "mode": "paged",
                        "reused_tokens": 8, "recomputed_tokens": 4, "first_divergence": 8, "stop_reason": "eos"})
    for c in range(1, chats + 1):
        db.execute("INSERT INTO chats(id, title, system_prompt, created, updated) VALUES (?, ?, '', ?, ?)",
                   (c, f"chat {c}", float(c), float(c)))
        db.executemany(
            "INSERT INTO messages(chat_id, position, role, content, stats, created) VALUES (?, ?, ?, ?, ?, 1.0)",
            [(c, i, "user" if i % 2 == 0 else "assistant",
              f"message {i} of chat {c} {words}**bold** and `code`\n- one\n- two",
              stats if i % 2 else "{}") for i in range(messages)])
    db.commit()
    db.close()


def stored_messages(path: Path) -> list[tuple[int, int, str]]:
    """(chat id, position, content) of every message in the file, read without changing it. Without a
    ``-wal`` it is read as immutable: SQLite would make a read-only file's ``-wal``/``-shm`` read-only too,
    and they would keep the app from writing once the file is writable again."""
    wal = Path(str(path) + "-wal").exists()
    uri = path.resolve().as_uri() + ("?mode=ro" if wal else "?immutable=1")
    db = sqlite3.connect(uri, uri=True)
    try:
        return db.execute("SELECT chat_id, position, content FROM messages ORDER BY chat_id, position").fetchall()
    finally:
        db.close()


def overwrite_header(path: Path) -> None:
    with open(path, "r+b") as f:
        f.write(b"this is not the SQLite header any more...".ljust(100, b"!"))


def truncate_to_half(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def corrupt_index(path: Path) -> None:
    """Fill the root page of ``messages_by_chat`` (the index every chat is read through) with 0xff."""
    db = sqlite3.connect(str(path))
    root = db.execute("SELECT rootpage FROM sqlite_master WHERE name = 'messages_by_chat'").fetchone()[0]
    page_size = db.execute("PRAGMA page_size").fetchone()[0]
    db.close()
    with open(path, "r+b") as f:
        f.seek((root - 1) * page_size)
        f.write(b"\xff" * page_size)


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _set_dac_override(on: bool) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    header, data = _CapHeader(0x20080522, 0), (_CapData * 2)()  # _LINUX_CAPABILITY_VERSION_3, this thread
    if libc.capget(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capget")
    mask = 1 << CAP_DAC_OVERRIDE
    data[0].effective = data[0].effective | mask if on else data[0].effective & ~mask
    if libc.capset(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capset")


@contextlib.contextmanager
def read_only_for_real():
    """Within the block, file modes bind this thread even as root (see the module)."""
    if os.geteuid() != 0:
        yield
        return
    try:
        _set_dac_override(False)
    except (OSError, AttributeError) as exc:
        pytest.skip(f"running as root and cannot drop CAP_DAC_OVERRIDE ({exc}): chmod would not bind")
    try:
        yield
    finally:
        _set_dac_override(True)


def make_read_only(path: Path) -> None:
    path.chmod(stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH | (stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH
                                                             if path.is_dir() else 0))


def make_writable(path: Path) -> None:
    path.chmod(0o755 if path.is_dir() else 0o644)
