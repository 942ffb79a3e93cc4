"""Where a recomputed range of an API prompt starts: the message it falls in and that message's kind — system,
user, assistant, tool_call (an assistant's calls) or tool_result — so an agent's client reads "tool result 3
diverged" rather than "token 2,912 diverged". A client that renders an earlier tool result differently, or drops
one, is told which.

Only misses with a reason are placed (new tokens need no "why"), each by bisecting the chat's rendered prefixes
(a few renders, on the engine thread, only for a prompt that diverged or lost pages).
"""

from __future__ import annotations

from typing import Sequence

from engine.model.chat import message_at
from engine.server.render import kind_of, render_messages

MAX_PLACED = 8  # misses placed per reply (an account with more names the first ones)


def _message_at(tok, messages: Sequence[dict], tools, pos: int, ends: dict[int, int]) -> int:
    def end(i: int) -> int:
        if i not in ends:
            ends[i] = len(render_messages(tok, messages[: i + 1], tools, for_reply=False))
        return ends[i]

    return message_at(end, len(messages), pos)


def place_misses(tok, messages: Sequence[dict], tools, account: dict) -> dict:
    """``account`` (a public cache account) with ``"where": {"message", "kind", "number"}`` on each of its first
    misses that has a reason (kind ``header``: the reply's header after the last message). Unchanged when
    rendering fails: the placing is a help, never an error."""
    told = [m for m in account.get("misses", ()) if m.get("reason") != "new"][:MAX_PLACED]
    if not told or tok is None:
        return account
    ends: dict[int, int] = {}
    try:
        for m in told:
            i = _message_at(tok, messages, tools, m["start"], ends)
            if i >= len(messages):
                m["where"] = {"message": -1, "kind": "header", "number": 0}
                continue
            kind = kind_of(messages[i])
            m["where"] = {"message": i, "kind": kind,
                          "number": sum(1 for x in messages[: i + 1] if kind_of(x) == kind)}
    except Exception:  # noqa: BLE001 - a template refusing a prefix: the misses stay as they are
        pass
    return account
