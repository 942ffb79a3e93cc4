"""Command-line arguments checked before any work: a file the user names, a file a result goes to, a size.

Each check raises ``ValueError`` (``argparse.ArgumentTypeError`` for a flag's type) with one line; the CLI
prints it as ``error: ...`` and exits 2. They run before the model loads, so a bad argument costs
milliseconds instead of a model load (seconds) or a whole benchmark (minutes).
"""

from __future__ import annotations

import json
import math
import os
import stat
from typing import Any

from engine.inputs import file_kind, read_json

MESSAGES_HINT = "give a JSON list of {role, content}"


def read_messages(path: str) -> list[dict]:
    """``--messages FILE``: a chat, read through ``engine.inputs`` (regular files only, 16 MiB, JSON
    nested at most 64 deep) and checked as the API checks ``messages``."""
    from engine.model.chat import validate_messages

    data = read_json(path, "messages file", hint=MESSAGES_HINT)
    if isinstance(data, list) and data and isinstance(data[-1], dict) and data[-1].get("role") == "assistant":
        data = data[:-1]  # a trailing assistant message has nothing to answer
    return validate_messages(data)


def check_output_path(path: str, flag: str = "--json") -> None:
    """Fail before a long run, not at its end: the ``--json`` file must be creatable, or an existing regular
    file that is writable. A device or pipe is refused: ``/dev/full`` opens but fails the write, which a
    bench found only after its whole run; a FIFO with no reader blocks the write. Leaves no file behind (a new
    one is created and removed; an existing one is opened to append, not changed)."""
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path} is a directory: give a file name")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ValueError(f"{flag} {path}: the folder {parent} does not exist")
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:  # a new file (or a dangling link, which the "xb" open below refuses)
        mode = None
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot write there ({e.strerror or e})") from None
    if mode is not None and not stat.S_ISREG(mode):
        raise ValueError(f"{flag} {path} is {file_kind(mode)}, not a file: give a file name")
    existed = mode is not None
    try:
        open(path, "ab" if existed else "xb").close()
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot write there ({e.strerror or e})") from None
    if not existed:
        os.unlink(path)


def write_json(path: str, data: Any, flag: str = "--json") -> None:
    """The result written to the file ``check_output_path`` accepted; a full disk is one line, not a traceback."""
    text = json.dumps(data, indent=1)
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot write there ({e.strerror or e})") from None


def check_disk_budget(gib: float | None) -> None:
    """``--kv-disk-budget GB``: a finite size above 0, checked before the model loads. ``inf`` overflowed
    converting to bytes (an "internal OverflowError" after loading); ``nan`` and ``-1`` were refused only
    after loading."""
    if gib is not None and not (math.isfinite(gib) and gib > 0):
        raise ValueError(f"--kv-disk-budget {gib}: give more than 0 GiB (a finite number, e.g. 4)")
