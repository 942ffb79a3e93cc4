"""What a reply to a chat will read and what it will pass over unread to fit the context, asked before it is sent.

The app asks it before a message goes out (a paste longer than the context says what it drops first); the answer
comes from the rules the evictor applies (``engine.policies.turns`` for overflow "turns", the last half of the
context for the other overflow settings that drop tokens), on the chat's own cache: the tokens it holds of the
prompt's common prefix count, the rest are read. A setting that drops nothing foresees nothing dropped (the prompt
then does not fit, which the caller says from ``tokens``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from engine.config import OVERFLOW_EVICTS, CacheConfig
from engine.core.sequence import protection
from engine.model.chat import message_spans, render_chat, validate_messages
from engine.policies import turns


@dataclass(frozen=True)
class Foresight:
    """A reply's prompt before it is sent: ``tokens`` in all, ``read`` of them fed now (computed, or taken from the
    prefix cache), ``unread`` passed over to fit the context — ``whole`` messages and ``part`` tokens of a message
    cut at its oldest end — and the system prompt's tokens (``system``; 0: none) and whether they stay
    (``kept_system``)."""

    tokens: int
    read: int
    unread: int = 0
    whole: int = 0
    part: int = 0
    system: int = 0
    kept_system: bool = True


def foresee(session, messages: Sequence[dict], cfg: CacheConfig | None = None) -> Foresight:
    """``session`` (a ``ChatSession``) answering ``messages`` under ``cfg`` (default: its own setting)."""
    messages = validate_messages(messages)
    ids = session.with_fed_ids(render_chat(session.tokenizer, messages, model=session.info.name))
    cache = session.cache
    first, held = 0, np.zeros(0, dtype=np.int64)
    if cache.store is not None:
        fed = session.fed_ids()
        first = next((i for i, (a, b) in enumerate(zip(fed, ids)) if a != b), min(len(fed), len(ids)))
        first = min(first, len(ids) - 1)  # the last token is always fed again (its logits start the reply)
        held = np.flatnonzero(cache.index.held(first))
    return plan(session.tokenizer, messages, ids, cfg or cache.cache_config, session.context_length, held, first)


def foresee_new(tokenizer, messages: Sequence[dict], cfg: CacheConfig, context_length: int) -> Foresight:
    """The same for a chat with nothing cached yet (a new chat's first message)."""
    messages = validate_messages(messages)
    return plan(tokenizer, messages, render_chat(tokenizer, messages), cfg, context_length,
                np.zeros(0, dtype=np.int64), 0)


def plan(tokenizer, messages: list[dict], ids: Sequence[int], cfg: CacheConfig, ctx: int, held: np.ndarray,
         first: int) -> Foresight:
    """The evictor's plan for a prompt ``ids`` whose tokens before ``first`` are cached at ``held``."""
    n, todo = len(ids), len(ids) - first
    if cfg.mode == "off" or cfg.policy != "none" or cfg.overflow not in OVERFLOW_EVICTS:
        return Foresight(n, todo)
    if cfg.overflow != "turns":
        unread = todo - ctx // 2 if todo > ctx else 0
        return Foresight(n, todo - unread, unread, part=unread, kept_system=unread == 0)
    if len(held) + todo <= ctx:
        return Foresight(n, todo)
    spans = message_spans(tokenizer, messages)
    _protected, pri = protection(messages, spans, n)
    starts = [a for a, _ in spans]
    _cached, runs = turns.unread_runs(held, first, todo, starts, pri, ctx - max(1, ctx // 8))
    gone = np.zeros(n, dtype=bool)
    for a, b in runs:
        gone[a:b] = True
    whole = sum(1 for a, b in spans if b > a and gone[a:b].all())
    in_whole = sum(b - a for a, b in spans if b > a and gone[a:b].all())
    unread = int(gone.sum())
    system = [(a, b) for m, (a, b) in zip(messages, spans) if m["role"] == "system"]
    kept = not any(gone[a:b].any() for a, b in system)
    return Foresight(n, todo - unread, unread, whole, unread - in_whole, sum(b - a for a, b in system), kept)
