"""``Failure``: what the worker sends through ``EngineWorker.failed`` when something raised.

The GUI decides what a failure means from ``stage`` and ``type`` (never from the words of ``message``):
a failure at a reply stage ends that reply; ``load``, ``apply`` and ``compare`` failures leave the chat
as it was.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass

from engine.errors import EngineError, InternalError, SessionClosedError
from engine.core.vocab import REPLY_STAGES  # failures at these stages end the reply they belong to


@dataclass(frozen=True)
class Failure:
    """One failure, as the GUI sees it.

    generation_id  the reply running when it happened (0: none, or a comparison; -1: a load); only a
                   failure at a reply stage (``ends_reply``) ended that reply
    stage          "load" | "start" | "swap" | "step" | "apply" | "speculate" (speculative decoding's setting,
                   refused: nothing changed) | "compare" | "history" (the chat history
                   file: damaged, read-only, gone or not writable; sent by the conversation, not the worker)
    message        one line a user can act on
    type           the exception's class name ("ContextOverflowError", "InternalError", "RuntimeError", ...)
    recoverable    the engine state the failure touched is intact: a typed engine error (the engine rolled
                   back) or a bad value. False for an untyped exception escaping the engine, or a closed
                   session; the worker then discards the chat's session (its next message re-reads the
                   chat into a fresh one).
    """

    generation_id: int
    stage: str
    message: str
    type: str
    recoverable: bool = True

    @property
    def ends_reply(self) -> bool:
        return self.generation_id > 0 and self.stage in REPLY_STAGES

    @classmethod
    def from_exception(cls, generation_id: int, stage: str, exc: BaseException, prefix: str = "") -> "Failure":
        """A failure from ``exc``; ``prefix`` says what did not happen ("Could not load demo")."""
        text = describe(exc)
        recoverable = isinstance(exc, (EngineError, ValueError)) and not isinstance(exc, SessionClosedError)
        return cls(generation_id, stage, f"{prefix}: {text}" if prefix else text, exc.__class__.__name__,
                   recoverable)


def describe(exc: BaseException) -> str:
    """One line a user can act on. An ``InternalError`` names its cause (what a bug report needs)."""
    if isinstance(exc, (EngineError, ValueError)):
        text = _first_line(exc) or exc.__class__.__name__
        cause = exc.__cause__
        if isinstance(exc, InternalError) and cause is not None and _first_line(cause) not in text:
            text += f" ({_untyped(cause)})"
        return text
    if isinstance(exc, MemoryError):
        return "out of memory"
    line = _first_line(exc)
    return f"out of memory: {line}" if "out of memory" in line.lower() else _untyped(exc)


def log(exc: BaseException) -> None:
    """Print the traceback of unexpected failures (typed ones are just messages)."""
    if not isinstance(exc, (EngineError, ValueError)) or isinstance(exc, InternalError):
        traceback.print_exception(exc)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def _untyped(exc: BaseException) -> str:
    text = _first_line(exc)
    return f"{exc.__class__.__name__}: {text}" if text else exc.__class__.__name__
