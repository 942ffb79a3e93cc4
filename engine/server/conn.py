"""Connections that cannot hold the server (slowloris): uvicorn's h11 protocol with deadlines and a cap.

uvicorn times out only idle keep-alive connections: a client that sends half a request head, or a body one byte
at a time, kept its connection (and a file descriptor) for good — 2,000 such connections stayed open 60 s, and
under ``ulimit -n 512`` 600 of them made normal requests time out. Here:

- the request head must be complete within ``header_timeout_s`` of its first byte (of the connection, for
  the first request), the body within ``body_timeout_s`` of the head; past either the connection is closed;
- at ``max_connections`` open connections a new one takes the place of the oldest that has no request in
  flight (waiting for its head, or idle between keep-alive requests): a normal client sends its head at once,
  so connections held open by slowloris are the ones that go; only when every connection has a request in
  flight does a new one get 503 and is closed. The cap stays below the process's file-descriptor limit less a
  margin, so the engine and the logs always have descriptors left;
- each accepted socket's send buffer is ``SEND_BUFFER`` bytes: Linux grows it up to ``tcp_wmem``'s 4 MiB for a
  client that does not read, which then absorbed >3,000 streamed tokens (~800 KB) before the stream's own
  bound (``engine.server.jobs``) could see it; 64 KiB is ~280 token events.
"""

from __future__ import annotations

import asyncio
import json
import resource
import socket

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

SEND_BUFFER = 64 * 1024
FD_MARGIN = 64  # descriptors kept for everything else (model files, logs, the engine's own)


def connection_cap(wanted: int) -> int:
    """``wanted``, lowered to fit the process's descriptor limit (soft) less ``FD_MARGIN``."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return wanted
    return max(1, min(wanted, soft - FD_MARGIN))


def _refusal() -> bytes:
    body = json.dumps({"error": {"message": "too many open connections: try again later", "type": "server_error",
                                 "param": None, "code": "too_many_connections"}}).encode()
    return (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
            b"connection: close\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


class GuardedH11(H11Protocol):
    """uvicorn's h11 protocol with the deadlines and the cap above; ``guarded`` makes one for a server."""

    header_timeout_s = 10.0
    body_timeout_s = 30.0
    max_connections = 512
    metrics = None  # engine.server.metrics.Metrics: closed connections are counted by reason

    @classmethod
    def guarded(cls, header_timeout_s: float, body_timeout_s: float, max_connections: int, metrics) -> type:
        return type("GuardedH11", (cls,), {"header_timeout_s": header_timeout_s, "body_timeout_s": body_timeout_s,
                                           "max_connections": connection_cap(max_connections), "metrics": metrics})

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._deadline: asyncio.TimerHandle | None = None
        self._waiting_for = ""
        self._since = 0.0  # loop time the connection last had no request in flight
        self.refused = len(self.connections) >= self.max_connections and not self._evict_one()
        if self.refused:
            self._count("over_limit")
            transport.write(_refusal())
            transport.close()
            return
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
            except OSError:
                pass
        super().connection_made(transport)
        self._arm("header")

    def _evict_one(self) -> bool:
        """Close the connection that has gone longest without a request in flight; False if every one has one."""
        idle = [c for c in self.connections if isinstance(c, GuardedH11) and c.idle()]
        if not idle:
            return False
        oldest = min(idle, key=lambda c: c.idle_since)
        oldest.evict()
        self.connections.discard(oldest)  # its slot is this connection's now (uvicorn drops it again on close)
        return True

    @property
    def idle_since(self) -> float:
        """Loop time this connection last had no request in flight."""
        return self._since

    def evict(self) -> None:
        """Close this idle connection to make room for a new one (counted as evicted)."""
        self._count("evicted")
        self._disarm()
        self.transport.close()

    def idle(self) -> bool:
        """No request in flight: waiting for a head, or between keep-alive requests."""
        if self.transport is None or self.transport.is_closing():
            return False
        return self._waiting_for == "header" or (self.conn.their_state is h11.IDLE and
                                                 (self.cycle is None or self.cycle.response_complete))

    def data_received(self, data: bytes) -> None:
        if self.refused:
            return
        super().data_received(data)
        state = self.conn.their_state
        if state is h11.SEND_BODY:
            self._arm("body")
        elif state is h11.IDLE and self.conn.trailing_data[0]:
            self._arm("header")  # part of the next request's head
        elif state is not h11.IDLE:
            self._disarm()  # the request is in: the reply takes as long as it takes

    def connection_lost(self, exc: Exception | None) -> None:
        if self.refused:
            return
        self._disarm()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        self._disarm()  # uvicorn's keep-alive timeout takes over until the next request's first byte
        self._since = self.loop.time()
        super().on_response_complete()

    def _arm(self, what: str) -> None:
        if self._waiting_for == what:
            return  # a deadline counts from the first byte, not from the latest
        self._disarm()
        self._waiting_for = what
        if what == "header":
            self._since = self.loop.time()
        delay = self.header_timeout_s if what == "header" else self.body_timeout_s
        self._deadline = self.loop.call_later(delay, self._expired, what)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline, self._waiting_for = None, ""

    def _expired(self, what: str) -> None:
        if self._waiting_for != what or self.transport is None or self.transport.is_closing():
            return
        self._count(f"{what}_timeout")
        self.transport.close()

    def _count(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.connection_closed(reason)
