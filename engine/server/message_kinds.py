"""Where each message of an API conversation sits in its tokens, and its kind — system, user, assistant, tool_call
(an assistant's calls), tool_result — for a viewer (the app draws them on the page map's token strip, in the kinds'
colours: an agent's loop reads as its calls and results). The tokens after the last message are the reply's
(``reply``: the generation prompt's header and what the model wrote).

Kept per conversation from its latest chat request (``note``, engine thread, as it starts) and measured only when a
viewer asks (``spans``): a message's end is the length of the chat rendered up to it, as the template renders it; an
end measured once is kept while the next request's messages start with the same ones (an agent loop appends a call
and a result a step: two renders a step, for a conversation on screen).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence

from engine.server.render import kind_of, render_messages

KEPT = 64  # conversations whose messages are kept (the least recently noted go)


@dataclass(frozen=True)
class MessageSpan:
    """Tokens ``[start, end)`` of one message; ``number``: its place among the conversation's messages of its
    kind (1: the first tool result)."""

    start: int
    end: int
    kind: str
    number: int

    def as_tuple(self) -> tuple[int, int, str, int]:
        return (self.start, self.end, self.kind, self.number)


@dataclass
class _Conversation:
    messages: list[dict]
    tools: list[dict]
    ends: list[int] = field(default_factory=list)  # measured ends of the first messages


class MessageKinds:
    """The messages of each conversation (by session id); engine thread only."""

    def __init__(self) -> None:
        self._by: OrderedDict[int, _Conversation] = OrderedDict()

    def note(self, session_id: int, messages: Sequence[dict], tools: Sequence[dict] | None) -> None:
        """A chat request of ``session_id`` starts with ``messages`` (and ``tools``)."""
        messages, tools = [dict(m) for m in messages], [dict(t) for t in tools or ()]
        old = self._by.pop(session_id, None)
        kept: list[int] = []
        if old is not None and old.tools == tools:
            same = next((i for i, (a, b) in enumerate(zip(old.messages, messages)) if a != b),
                        min(len(old.messages), len(messages)))
            kept = old.ends[:same]
        self._by[session_id] = _Conversation(messages, tools, kept)
        while len(self._by) > KEPT:
            self._by.popitem(last=False)

    def forget(self, session_id: int) -> None:
        self._by.pop(session_id, None)

    def spans(self, tok, session_id: int, tokens: int) -> tuple[MessageSpan, ...]:
        """The messages of ``session_id``'s latest request within its first ``tokens`` tokens, then the reply's
        (empty when none was noted, or the template refuses to render a prefix: the strip then shows none)."""
        conv = self._by.get(session_id)
        if conv is None or tok is None:
            return ()
        try:
            for i in range(len(conv.ends), len(conv.messages)):
                conv.ends.append(len(render_messages(tok, conv.messages[: i + 1], conv.tools, for_reply=False)))
        except Exception:  # noqa: BLE001 - a help for the eye, never an error
            return ()
        out, start, counts = [], 0, {}
        for m, end in zip(conv.messages, conv.ends):
            kind = kind_of(m)
            counts[kind] = counts.get(kind, 0) + 1
            end = min(max(start, end), tokens)
            if end > start:
                out.append(MessageSpan(start, end, kind, counts[kind]))
            start = max(start, end)
        if tokens > start:
            out.append(MessageSpan(start, tokens, "reply", 1))
        return tuple(out)
