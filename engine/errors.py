"""Typed errors of the engine.

Every error a user can cause carries a one-line, human-readable reason in ``str(err)``. The CLI prints
that line (no traceback) and exits non-zero; the app shows it in a message.
"""

from __future__ import annotations


class EngineError(Exception):
    """Base class: a failure the user can understand and act on."""


class ModelNotFoundError(EngineError):
    """The path does not exist, or the hub id is not in the local cache and cannot be downloaded."""


class ModelFormatError(EngineError):
    """The folder exists but is not a usable model: no config, corrupt or truncated weights, no tokenizer."""


class UnsafeModelError(EngineError):
    """The model needs pickle weights or remote code and the caller did not allow it."""


class UnsupportedModelError(EngineError):
    """The architecture cannot run with this engine (not a causal LM, unknown model type, ...)."""


class ContextOverflowError(EngineError):
    """The request does not fit the model's context window (and the overflow policy is 'stop')."""


class CacheCapacityError(EngineError):
    """The page pool cannot hold the sequence (its page limit or memory limit is reached)."""


class OutOfMemoryError(CacheCapacityError):
    """The device (or host) ran out of memory while the KV cache grew; the cache is left as it was."""


class SessionClosedError(EngineError):
    """The session was closed (its chat was deleted or the model unloaded): start a new one."""


class NonFiniteLogitsError(EngineError):
    """The model's output for the next token is not a number (NaN, or +inf, or -inf everywhere): its weights
    hold NaN/inf or its dtype overflowed. Greedy argmax of an all-NaN row is token 0, so without this check such
    a model "answers" with token 0 forever."""


class InternalError(EngineError):
    """An unexpected failure inside the engine (a bug). The operation was ended and the state rolled back;
    ``__cause__`` holds the original exception."""


class OfflineError(ModelNotFoundError):
    """A download was needed but the hub cannot be reached."""


class LoadCancelled(EngineError):
    """The caller cancelled a model load (the previously loaded model, if any, stays in use)."""


def is_oom(exc: BaseException) -> bool:
    """True for the ways torch reports an allocation failure (CUDA, MPS, CPU), without importing torch."""
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text
                                              or "not enough memory" in text)


def as_engine_error(exc: BaseException, during: str = "the reply") -> BaseException:
    """The typed error to raise for ``exc`` after an operation was ended and rolled back: engine errors as
    they are, out of memory as ``OutOfMemoryError``, ``ValueError`` as ``EngineError``, anything else (a bug)
    as ``InternalError`` (the caller chains the original). Non-``Exception``s (KeyboardInterrupt) pass."""
    if isinstance(exc, EngineError) or not isinstance(exc, Exception):
        return exc
    first = str(exc).splitlines()[0][:200] if str(exc) else ""
    if is_oom(exc):
        return OutOfMemoryError(f"out of memory during {during} ({first[:160]}): close other chats, use a smaller "
                                "model, KV int8/int4 or a shorter context")
    if isinstance(exc, ValueError):
        return EngineError(first or type(exc).__name__)
    return InternalError(f"internal error in {during} ({type(exc).__name__}: {first}); {during} was stopped "
                         "and the chat can go on")


def first_line(exc: BaseException, limit: int = 300) -> str:
    """``exc`` in one line for a user: its first line — with the next one when the first only introduces it
    (transformers' "Validation error for field 'x':" is followed by what is wrong) — without pointers to reports
    printed elsewhere; the exception's type name when it says nothing."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    if not lines:
        return type(exc).__name__
    line = lines[0]
    if line.endswith(":") and len(lines) > 1:
        line = f"{line} {lines[1]}"
    line = line.replace(" For details look at the above report!", "").strip()
    return line[:limit] or type(exc).__name__
