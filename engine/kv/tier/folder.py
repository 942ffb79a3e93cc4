"""The folder of the KV disk tier (``engine.kv.tier.disk``) as several processes share it: one lock, a count of the
folder's changes, what is there, and the writing of one file.

Several processes may point ``--kv-disk`` at one folder (two ``serve``s, the app and a ``generate``). Each knew
only its own files, so each kept its own budget and together they overshot it (×1.36 with two writers). Now a
writer holds ``<folder>/.lock`` (``fcntl.flock``, exclusive) from making room to renaming its file, and bumps a
change count kept in the lock file's first 8 bytes; a writer that finds the count moved since it last held the
lock counts the folder again (a listing and an ``lstat`` per file: ~2 ms per 1,000 files) before it evicts. So
the folder never holds more than the budget, plus the one page being written.

Temporary files (``<page>.kvp.tmp<pid>``) exist only while their writer holds the lock, so one seen under the
lock belongs to a writer that died (kill -9, power loss): it is counted and removed at once (it stayed, outside
the budget, for 600 s). Where ``flock`` does not work (some network file systems) every write counts the folder
again, and a temporary file goes only when its pid is gone or it is older than ``STALE_TMP_S``.

The lock is waited for at most ``LOCK_WAIT_S``, polling: a process that holds it longer is stuck or hostile,
and the writer stops with a note instead of hanging the engine's exit (``flush`` waits for the writer).
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
import struct
import time
from typing import Iterator

from engine.kv.tier.page_file import SUFFIX, kind, listdir, remove

STATE_SUFFIX = ".kvs"  # a hybrid model's recurrent states at a page boundary (``engine.kv.tier.state_file``)

try:
    import fcntl
except ImportError:  # Windows: no flock; every write counts the folder again
    fcntl = None

LOCK_NAME = ".lock"
KEY_NAME = ".key"
KEY_BYTES = 32  # HMAC-SHA256's block is 64 bytes; 32 random ones are its full strength
LOCK_WAIT_S = 10.0  # a writer holds the lock for one page file (~1 ms for 1 MB); 10 s is a stuck holder
POLL_S = 0.005
STALE_TMP_S = 600  # without a lock: a temporary file this old is a torn write of a dead process
WRITE_FLAGS = (os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
PAGE_ERRNOS = (errno.EISDIR, errno.ENOTEMPTY, errno.EEXIST, errno.ELOOP)  # about this page's path, not the disk


class LockTimeout(OSError):
    """Another process held the folder's lock past ``LOCK_WAIT_S``."""


class FolderLock:
    """``<folder>/.lock``: held around every change of the folder, with the count of changes."""

    def __init__(self, folder: str) -> None:
        self.path = os.path.join(folder, LOCK_NAME)
        self.fd: int | None = None
        self.seen = -1  # the change count after this process last held the lock
        self.dirty = False

    @property
    def works(self) -> bool:
        return self.fd is not None

    def open(self) -> str:
        """Open the lock file; "" or why it cannot be used (then every write counts the folder again)."""
        if fcntl is None:
            return "no flock on this system"
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | os.O_NONBLOCK
                         | getattr(os, "O_CLOEXEC", 0), 0o644)
        except OSError as e:
            return f"{self.path}: {e.strerror or e}"
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            os.close(fd)
            return f"{self.path} is {kind(mode)}"
        self.fd = fd
        return ""

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    @contextlib.contextmanager
    def held(self) -> Iterator[bool]:
        """Hold the lock; yields whether another process changed the folder since this one last held it
        (always True without a working lock). ``LockTimeout`` past ``LOCK_WAIT_S``."""
        if self.fd is None:
            yield True
            return
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise LockTimeout(errno.ETIMEDOUT, f"{self.path} held by another process for over "
                                                       f"{LOCK_WAIT_S:g} s") from None
                time.sleep(POLL_S)
        try:
            count = self._count()
            self.dirty = False
            yield count != self.seen
            if self.dirty:
                count += 1
                os.pwrite(self.fd, struct.pack("<Q", count), 0)
            self.seen = count
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)

    def _count(self) -> int:
        raw = os.pread(self.fd, 8, 0)
        return struct.unpack("<Q", raw)[0] if len(raw) == 8 else 0


def scan(folder: str, locked: bool, clear_tmp: bool) -> tuple[list[tuple[float, str, int]], int, int]:
    """The page files in ``folder``'s shelves as (mtime, path, bytes), least recently used first; bytes of the
    temporary files left; temporary files removed (only with ``clear_tmp``: under the lock all of them, as no
    writer is between create and rename; without a working lock those of a dead pid or older than
    ``STALE_TMP_S``). Only regular files count: a link, FIFO or directory named like a page is no page."""
    found, tmp_bytes, cleared, now = [], 0, 0, time.time()
    for shelf in listdir(folder):
        for entry in listdir(os.path.join(folder, shelf)):
            path = os.path.join(folder, shelf, entry)
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode):
                continue
            if entry.endswith((SUFFIX, STATE_SUFFIX)):
                found.append((st.st_mtime, path, st.st_size))
            elif SUFFIX + ".tmp" in entry or STATE_SUFFIX + ".tmp" in entry:
                if clear_tmp and (locked or _stale(entry, now - st.st_mtime)) and remove(path):
                    cleared += 1
                else:
                    tmp_bytes += st.st_size
    found.sort()
    return found, tmp_bytes, cleared


def _stale(entry: str, age: float) -> bool:
    pid = entry.rsplit(".tmp", 1)[-1]
    if age > STALE_TMP_S or not pid.isdigit() or int(pid) == os.getpid():  # ours: the writer scans between writes
        return True
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except OSError:  # alive, another user's
        return False
    return False


def folder_key(folder: str) -> tuple[bytes | None, str]:
    """The folder's page-file key (``engine.kv.tier.page_file.mac``): ``<folder>/.key``, 32 random bytes made by the
    first tier that finds none (written under a temporary name, then linked: two processes starting at once
    agree on one). (key, "") or (None, why there is none: then the tier neither reads nor writes)."""
    path = os.path.join(folder, KEY_NAME)
    for _ in range(2):
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | os.O_NONBLOCK
                         | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            why = _make_key(path)
            if why:
                return None, why
            continue
        except OSError as e:
            return None, f"{path}: {e.strerror or e}"
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return None, f"{path} is {kind(st.st_mode)}, not a key file"
            if st.st_size != KEY_BYTES:
                return None, f"{path} has {st.st_size:,} bytes, not a key's {KEY_BYTES}"
            key = os.read(fd, KEY_BYTES)
        finally:
            os.close(fd)
        return (key, "") if len(key) == KEY_BYTES else (None, f"{path} is not a key file")
    return None, f"{path} could not be made"


def _make_key(path: str) -> str:
    tmp = f"{path}.tmp{os.getpid()}"
    remove(tmp)
    try:
        fd = os.open(tmp, WRITE_FLAGS, 0o600)  # only this user can read it: nobody else can sign a page
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(KEY_BYTES))
        os.link(tmp, path)
    except FileExistsError:
        pass  # another process made it first: its key is the folder's
    except OSError as e:
        return f"{path}: {e.strerror or e}"
    finally:
        remove(tmp)
    return ""


def disk_full(shelf: str, folder: str, need: int) -> str:
    """Why a page of ``need`` bytes cannot be written under ``shelf`` (its folder when it is not made yet): "No
    space left on device" or "Read-only file system", as the writer's ``OSError`` would say; "" when it can, or
    when the file system does not say (one ``statvfs``: ~2 µs, on the engine thread at each save)."""
    for path in (shelf, folder):
        try:
            st = os.statvfs(path)
        except FileNotFoundError:
            continue
        except (OSError, AttributeError):
            return ""
        if st.f_flag & getattr(os, "ST_RDONLY", 1 << 30):
            return os.strerror(errno.EROFS)
        free = (st.f_bfree if os.geteuid() == 0 else st.f_bavail) * st.f_frsize  # root may use the reserve
        return os.strerror(errno.ENOSPC) if free < need else ""
    return ""


def clear_path(path: str) -> str:
    """Make room for a page file at ``path``: a link, FIFO, socket or empty directory there is removed. "" when
    the path is free (or a regular file, which the rename replaces), else what is in the way."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return ""
    except OSError as e:
        return e.strerror or str(e)
    if stat.S_ISREG(mode) or remove(path):
        return ""
    return f"{kind(mode)} that cannot be removed"


def put(path: str, parts: tuple) -> None:
    """Write ``parts`` (bytes-like) to ``path``: a temporary file of this process (created exclusively, never
    through a link someone left at its name), then renamed. ``OSError`` as the system said it."""
    tmp = f"{path}.tmp{os.getpid()}"
    remove(tmp)  # ours from a writer that failed, or a name an earlier process with this pid left
    fd = os.open(tmp, WRITE_FLAGS, 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            for part in parts:
                f.write(part)
        os.replace(tmp, path)
    except BaseException:
        remove(tmp)
        raise
