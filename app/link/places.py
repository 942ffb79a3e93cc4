"""Where a prompt token sits in the chat: the message a cache account's miss starts (and ends) in, so the reply
footer can say "the system prompt changed at token 12" instead of "the prompt changed at token 12".

Runs on the engine's thread (it renders the chat with the model's tokenizer), once per finished reply whose prompt
recomputed tokens (a plain follow-up computes only new ones: nothing to render), and only for its misses' ends:
each position is found by bisecting the chat's rendered prefixes (a few renders, not one per message). A position
past every message is in the reply's header (the generation prompt).
"""

from __future__ import annotations

import traceback
from typing import Any, Sequence

MAX_MISSES = 16  # a readout lists a handful; an account with more names the first ones


def message_at(tokenizer, messages: Sequence[dict], pos: int, ends: dict[int, int]) -> int:
    """Index of the message token ``pos`` of the rendered chat falls in (``len(messages)``: after all of them);
    ``ends`` caches the rendered length of each prefix ``messages[:i + 1]``."""
    from engine.model.chat import message_at as bisect_messages, render_chat

    def end(i: int) -> int:
        if i not in ends:
            ends[i] = len(render_chat(tokenizer, messages[: i + 1], for_reply=False))
        return ends[i]

    return bisect_messages(end, len(messages), pos)


def miss_places(tokenizer, messages: Sequence[dict], account: Any) -> list[dict]:
    """``{"at", "message", "role", "number"}`` for the first and last token of each miss of ``account`` (a
    ``CacheAccount``) but its new tokens' (those need no "why"): ``number`` counts that role's messages from 1;
    ``message`` -1 and role "header": the reply's header. Empty without a tokenizer, messages or misses, or if
    rendering fails (a nicety, never an error)."""
    misses = getattr(account, "misses", ()) or ()
    if tokenizer is None or not messages or not misses:
        return []
    try:
        msgs = [{"role": m["role"], "content": m["content"]} for m in messages]
        ends: dict[int, int] = {}
        out: dict[int, dict] = {}
        told = [m for m in misses if getattr(m.reason, "value", m.reason) != "new"]
        for m in told[:MAX_MISSES]:
            for pos in (m.start, max(m.start, m.end - 1)):
                if pos not in out:
                    out[pos] = _place(pos, message_at(tokenizer, msgs, pos, ends), msgs)
        return [out[p] for p in sorted(out)]
    except Exception:  # noqa: BLE001 - a template that refuses a prefix: the footer says "the prompt"
        traceback.print_exc()
        return []


def _place(pos: int, i: int, messages: Sequence[dict]) -> dict:
    if i >= len(messages):
        return {"at": pos, "message": -1, "role": "header", "number": 0}
    role = messages[i]["role"]
    number = sum(1 for m in messages[: i + 1] if m["role"] == role)
    return {"at": pos, "message": i, "role": role, "number": number}
