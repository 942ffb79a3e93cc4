"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with the HTTP status that fits.

Every failure a client can cause becomes an ``ApiError``; engine errors map to 400 (the request cannot be
served as asked), 503 (no room in the KV cache or device memory: try again later) or 500 (a bug), always
with the engine's one-line reason and never a traceback.
"""

from __future__ import annotations

from typing import Any

from engine.errors import (
    CacheCapacityError,
    ContextOverflowError,
    EngineError,
    InternalError,
    SessionClosedError,
)

INVALID = "invalid_request_error"
SERVER = "server_error"


class ApiError(Exception):
    """A request that gets an error response (``status``, OpenAI's ``type``, ``param`` and ``code``)."""

    def __init__(self, status: int, message: str, type_: str = INVALID, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, INVALID, param, code)


def one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:500] if text else type(exc).__name__


def from_exception(exc: BaseException) -> ApiError:
    """The response for an exception raised while serving a request (nothing of a traceback in it)."""
    if isinstance(exc, ApiError):
        return exc
    msg = one_line(exc)
    if isinstance(exc, ContextOverflowError):
        return ApiError(400, msg, INVALID, "messages", "context_length_exceeded")
    if isinstance(exc, CacheCapacityError):  # OutOfMemoryError too: the cache is full now, not forever
        return ApiError(503, msg, SERVER, None, "kv_cache_full")
    if isinstance(exc, (InternalError, SessionClosedError)):
        return ApiError(500, msg, SERVER, None, "internal_error")
    if isinstance(exc, (EngineError, ValueError)):
        return ApiError(400, msg, INVALID, None, None)
    return ApiError(500, f"internal error ({type(exc).__name__}): the request was stopped; the server goes on",
                    SERVER, None, "internal_error")
