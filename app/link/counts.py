"""Token counts the GUI asks the worker for, on the worker's thread (it renders with the model's tokenizer): a chat's
or one message's tokens, and what a reply would read and pass over unread to fit the context
(``engine.core.foresee``). Each a nicety: unknown (-1, None) where it cannot be said, never a failure."""

from __future__ import annotations

import traceback
from typing import Any

from engine.config import CacheConfig


def count(tokenizer, messages: list[dict], index: int) -> int:
    """-1: the whole chat ready for a reply; -2: the chat as it is; n >= 0: message n's span."""
    if tokenizer is None:
        return -1
    if not messages:
        return 0
    try:
        from engine.model.chat import message_spans, render_chat

        if index >= 0:
            start, end = message_spans(tokenizer, messages)[index]
            return end - start
        return len(render_chat(tokenizer, messages, for_reply=index == -1))
    except BaseException:  # noqa: BLE001 - a count is a nicety: unknown, never a failure
        traceback.print_exc()
        return -1


def foresight(loaded: Any, session: Any, messages: list[dict], cache: CacheConfig):
    """What a reply to ``messages`` would read and drop unread under ``cache``: on ``session``'s cache (the chat's
    own), or as a new chat's where it has none; None when unknown."""
    tokenizer = getattr(loaded, "tokenizer", None)
    if tokenizer is None or not messages:
        return None
    try:
        from engine.core.foresee import foresee, foresee_new

        if session is not None and not session.closed:
            return foresee(session, messages, cache)
        return foresee_new(tokenizer, messages, cache, loaded.info.context_length)
    except BaseException:  # noqa: BLE001 - a forecast is a nicety: unknown, never a failure
        traceback.print_exc()
        return None
