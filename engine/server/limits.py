"""Limits that keep one client from holding the server: the longest reply, and a stream whose reader stopped.

``max_tokens`` 4,096 by default: under an eviction policy a reply is not bounded by the context, and 8 clients
asking for 10**12 tokens ran at ~1,800 tok/s for good while a 9th waited; 4,096 is 8x stories' context and
longer than any reply a chat client asks for unbidden. ``stream_buffer`` 256 events (~60 KB of JSON at ~230 B
each) wait for a reader before its request is held; ``stall_s`` 30 s held, and it is cancelled.

``ConnLimits`` (``engine.server.conn``): a request head within 10 s of its first byte (a local client sends
it in well under 1 ms; nginx allows 60 s, Apache's mod_reqtimeout 20-40 s), a body within 30 s of the head
(the 4 MiB body limit at 1 Mbit/s), and at most 512 open connections (fewer under a lower descriptor limit).
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_TOKENS = 4096
DEFAULT_STREAM_BUFFER = 256
DEFAULT_STALL_S = 30.0
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 30.0
DEFAULT_MAX_CONNECTIONS = 512


@dataclass(frozen=True)
class StreamLimits:
    max_tokens: int = DEFAULT_MAX_TOKENS  # tokens one reply may generate (a larger max_tokens is a 400)
    stream_buffer: int = DEFAULT_STREAM_BUFFER  # unsent events of a stream before its request is held
    stall_s: float = DEFAULT_STALL_S  # seconds held without its reader catching up before it is cancelled


@dataclass(frozen=True)
class ConnLimits:
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S  # a request head complete within this, from its first byte
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S  # the body complete within this, from the head
    max_connections: int = DEFAULT_MAX_CONNECTIONS  # open connections; beyond: 503 and closed
