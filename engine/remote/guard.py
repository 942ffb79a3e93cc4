"""What keeps a remote server from holding or filling the client: a deadline over a whole request, size caps on
every answer, and server text made safe to print.

A socket timeout bounds one read, not a request: a server that drips a byte every 5 s never trips a 10 s
timeout. ``Watchdog`` bounds the request itself: a thread that shuts the socket down (``SHUT_RDWR``) when the
deadline passes or Stop is pressed, so the blocked read returns at once — the same way for connect, headers,
body and stream. Callers check ``fired`` before they trust what a read returned: a read cut by the watchdog
looks like the server closing.
"""

from __future__ import annotations

import http.client
import socket
import threading
import time

POLL_S = 0.05  # how soon a deadline or Stop reaches a read that waits: 50 ms, a wake-up the reader never sees
# answer caps: a vLLM /v1/models with a few hundred LoRA adapters is ~100 KB; /metrics ~100 KB per engine (64
# engines: ~6 MB); /kv_event_sources ~300 bytes per engine; an error body is a sentence
MODELS_MAX_BYTES = 2 << 20
METRICS_MAX_BYTES = 8 << 20
SOURCES_MAX_BYTES = 1 << 20
ERROR_BODY_BYTES = 64 << 10


class Watchdog:
    """Hangs up ``conn``'s socket once ``deadline`` (monotonic) passes, saying ``why`` in ``fired``, or once
    ``cancel`` is set (``fired`` stays None: Stop is not a failure). ``arm`` moves the deadline; ``close`` ends
    the watch (always: a thread per request)."""

    def __init__(self, conn, deadline: float, why: str, cancel: threading.Event | None = None) -> None:
        self.conn, self.sock = conn, None
        self.deadline, self.why = deadline, why
        self.cancel = cancel
        self.fired: str | None = None
        self._done = threading.Event()
        threading.Thread(target=self._watch, name="kvscope-remote-deadline", daemon=True).start()

    def arm(self, deadline: float, why: str) -> None:
        self.deadline, self.why = deadline, why

    def close(self) -> None:
        self._done.set()

    def _watch(self) -> None:
        while not self._done.wait(POLL_S):
            if self.cancel is not None and self.cancel.is_set():
                self._hang_up()
                return
            if time.monotonic() >= self.deadline:
                self.fired = self.why
                self._hang_up()
                return

    def _hang_up(self) -> None:
        if self._done.is_set():
            return
        sock = self.sock or getattr(self.conn, "sock", None)  # during connect, the connection's own
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # the blocked read returns; the server sees the client go
            except OSError:
                pass  # closed meanwhile


class TooLarge(Exception):
    """An answer past its cap (``read_capped``)."""


def read_capped(resp: http.client.HTTPResponse, limit: int) -> bytes:
    """The body of ``resp``, at most ``limit`` bytes (``TooLarge`` past it: a declared length is refused before a
    byte is read, an endless body once ``limit + 1`` bytes came)."""
    declared = resp.getheader("Content-Length")
    if declared is not None and declared.strip().isdigit() and int(declared) > limit:
        raise TooLarge(int(declared))
    raw = resp.read(limit + 1)
    if len(raw) > limit:
        raise TooLarge(None)
    return raw


def size_words(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB" if n >= 1 << 10 else f"{n} bytes"


def printable(text, limit: int = 200) -> str:
    """Server text as one safe line: control characters (terminal escapes, newlines) become ``?``, at most
    ``limit`` characters."""
    text = str(text)
    out = "".join(c if c.isprintable() else "?" for c in text[:limit])
    return out + ("…" if len(text) > limit else "")
