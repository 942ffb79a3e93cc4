"""Overflow "turns" (the app's default): which of a chat's tokens go when it no longer fits the context. numpy only.

Whole messages go, oldest first, never the system prompt or a pinned message (``PINNED`` priorities), what sits
before the first message (a template's header) or the latest message (the one being answered, and the reply after
it). Only when no whole message is left to drop is a message cut, from its oldest token: the latest message's
oldest part goes before anything kept (a paste longer than the context keeps the system prompt and reads the
paste's end), the system prompt and pins last of all (only when they alone cannot fit). The newest token always
stays.

One rule for three askers: the evictor's ``TurnsOverflow`` (cached tokens), the evictor's planning of a prompt too
long to read whole (``unread_runs``: the prompt's tokens it passes over unread) and the question the app asks
before a message is sent (``engine.core.foresee``).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from engine.policies.base import PINNED


def dropped(pos: np.ndarray, starts: Sequence[int], priorities: np.ndarray | None, need: int) -> np.ndarray:
    """``[n]`` bool over ``pos`` (logical positions, ascending): which go so that at least ``need`` are dropped
    (more when a whole message is longer than what is left to drop); ``starts``: where each message begins."""
    pos = np.asarray(pos, dtype=np.int64)
    drop = np.zeros(len(pos), dtype=bool)
    if need <= 0 or not len(pos):
        return drop
    starts = sorted({int(a) for a in starts})
    pinned = _pinned(pos, priorities)
    for a, b in zip(starts, starts[1:]):
        if need <= 0:
            break
        if priorities is not None and a < len(priorities) and priorities[a] >= PINNED:
            continue  # the system prompt, a pinned message
        inside = (pos >= a) & (pos < b)
        drop |= inside
        need -= int(np.count_nonzero(inside))
    if need <= 0:
        return drop
    last = starts[-1] if starts else 0
    kept = pinned | (pos < starts[0] if starts else np.zeros(len(pos), dtype=bool))
    # no whole message is left: the oldest tokens of older messages' leftovers, then of the latest message (and
    # its reply), then of anything; the newest token stays
    for group in (~kept & (pos < last), ~kept, np.ones(len(pos), dtype=bool)):
        idx = np.flatnonzero(group[:-1] & ~drop[:-1])[:need]
        drop[idx] = True
        need -= len(idx)
        if need <= 0:
            break
    return drop


def _pinned(pos: np.ndarray, priorities: np.ndarray | None) -> np.ndarray:
    if priorities is None or not len(priorities):
        return np.zeros(len(pos), dtype=bool)
    inside = pos < len(priorities)
    out = np.zeros(len(pos), dtype=bool)
    out[inside] = np.asarray(priorities)[pos[inside]] >= PINNED
    return out


def unread_runs(held: np.ndarray, first: int, todo: int, starts: Sequence[int], priorities: np.ndarray | None,
                target: int) -> tuple[int, list[tuple[int, int]]]:
    """A prompt whose unfed tokens ``[first, first + todo)`` and the cached ones (``held``: their logical
    positions) are more than ``target``: (how many cached tokens the rule drops, the runs ``[a, b)`` of unfed
    tokens it drops, ascending). No runs: dropping cached messages makes the room (the evictor's usual way)."""
    pos = np.concatenate([np.asarray(held, dtype=np.int64), np.arange(first, first + todo, dtype=np.int64)])
    drop = dropped(pos, starts, priorities, len(pos) - max(1, target))
    cached = int(np.count_nonzero(drop & (pos < first)))
    gone = pos[drop & (pos >= first)]
    if not len(gone):
        return cached, []
    cuts = np.flatnonzero(np.diff(gone) != 1) + 1
    return cached, [(int(r[0]), int(r[-1]) + 1) for r in np.split(gone, cuts)]


def run_words(a: int, b: int, starts: Sequence[int]) -> str:
    """What the run ``[a, b)`` of a chat's tokens is, in messages: '2 whole messages and the oldest 1,204 tokens of
    the latest message'."""
    starts = sorted({int(s) for s in starts})
    whole, parts = 0, []
    for i, s in enumerate(starts):
        e = starts[i + 1] if i + 1 < len(starts) else None
        lo, hi = max(a, s), b if e is None else min(b, e)
        if hi <= lo:
            continue
        if lo == s and e is not None and hi == e:
            whole += 1
        else:
            which = "the latest message" if e is None else "a message"
            parts.append(f"the {'oldest' if lo == s else 'newest' if hi == e else 'middle'} {hi - lo:,} tokens of {which}")
    said = [f"{whole} whole message{'s' if whole != 1 else ''}"] if whole else []
    return " and ".join(said + parts) or f"{b - a:,} tokens"
