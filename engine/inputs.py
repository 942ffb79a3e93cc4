"""Reading a file the user named on the command line: size-capped, never blocking, one-line errors.

Every file argument of every CLI verb (``--messages``, ``--text``, ``--prompt-file``, configs) goes through
``read_input``: a FIFO, a character device (``/dev/zero``) or a socket would block or never end, so only
regular files are read; the file is opened ``O_NONBLOCK`` (opening a FIFO with no writer would block in
``open`` itself) and ``fstat``-ed before a byte is read; at most ``limit + 1`` bytes are read, so a file
that grows while it is read still stops at the cap. Errors are ``InputError`` (a ``ValueError``) with one
line that names the file and what to give instead.
"""

from __future__ import annotations

import json
import os
import stat

# a 128k-token chat is under 1 MB of text: 16 MiB is room to spare, and /dev/zero or a log file given by
# mistake stops there instead of reading until MemoryError (21 s and all of RAM for /dev/zero)
DEFAULT_LIMIT = 16 << 20
JSON_MAX_DEPTH = 64  # a messages file nests 3 deep, a config 2; the json module recurses once per level


class InputError(ValueError):
    """A file argument that cannot be used: the message is one line naming the file."""


def file_kind(mode: int) -> str:
    """What a non-regular file is, for an error message ("a directory", "a pipe (FIFO)", "a device", ...)."""
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a pipe (FIFO)"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def _check_regular(mode: int, path: str, what: str, tail: str) -> None:
    if not stat.S_ISREG(mode):
        raise InputError(f"{what} {path} is {file_kind(mode)}, not a file{tail}")


def read_input(path: str, what: str, *, limit: int = DEFAULT_LIMIT, hint: str = "") -> bytes:
    """The bytes of the regular file ``path`` (at most ``limit``); ``what`` names the argument in errors
    ("messages file", "--text file"), ``hint`` says what to give instead ("give a JSON list of {role, content}")."""
    tail = f": {hint}" if hint else ""
    try:
        # stat before open: opening a device can act on it (a tape device rewinds, a tty becomes the
        # controlling terminal), so only a path that is a regular file now is opened at all
        _check_regular(os.stat(path).st_mode, path, what, tail)
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise InputError(f"{what} not found: {path}") from None
    except OSError as e:
        raise InputError(f"cannot read {what} {path}: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        _check_regular(st.st_mode, path, what, tail)  # again on what was opened: the path may have changed
        if st.st_size > limit:
            raise InputError(f"{what} {path} is larger than {_size(limit)} ({_size(st.st_size)}){tail}")
        chunks, left = [], limit + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    except OSError as e:
        raise InputError(f"cannot read {what} {path}: {e.strerror or e}") from None
    finally:
        os.close(fd)
    raw = b"".join(chunks)
    if len(raw) > limit:  # it grew while being read
        raise InputError(f"{what} {path} is larger than {_size(limit)}{tail}")
    return raw


def read_text(path: str, what: str, *, limit: int = DEFAULT_LIMIT, hint: str = "") -> str:
    """``read_input`` decoded as UTF-8 (a BOM is dropped); a bad byte is named with its position."""
    raw = read_input(path, what, limit=limit, hint=hint)
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise InputError(f"{what} {path} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at position "
                         f"{e.start}): save it as UTF-8") from None


def read_json(path: str, what: str, *, limit: int = DEFAULT_LIMIT, hint: str = "") -> object:
    """``read_text`` parsed as JSON, nested at most ``JSON_MAX_DEPTH`` deep; every failure is an ``InputError``."""
    text = read_text(path, what, limit=limit, hint=hint)
    return parse_json(text, f"{what} {path}", hint=hint)


def parse_json(text: str, where: str, *, hint: str = "", max_depth: int = JSON_MAX_DEPTH) -> object:
    """JSON from untrusted text: a depth check before parsing (the json module recurses per level and a
    100,000-deep input raises ``RecursionError``), then ``json.loads``; errors name ``where``."""
    tail = f": {hint}" if hint else ""
    if json_depth(text) > max_depth:
        raise InputError(f"{where} is nested too deeply (more than {max_depth} levels){tail}")
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:
        raise InputError(f"{where} is not valid JSON: {e}") from None


def json_depth(text: str) -> int:
    """The deepest nesting of ``[`` / ``{`` outside strings (linear time, no recursion)."""
    depth = deepest = 0
    in_str = escaped = False
    for ch in text:
        if in_str:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB" if n >= 1 << 10 else f"{n} bytes"
