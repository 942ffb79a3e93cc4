"""Token counts the conversation asks the worker for: before sending, and for pinned messages.

Before a message goes out: if the prompt alone (the chat plus the new message) would leave less than
``ROOM`` of the model's context for the reply, the message is not sent; the notice bar says how much is
left and offers "Send anyway" or a new chat, and the text goes back into the message box. The exact count
needs the tokenizer (on the worker), so the chat's known token count plus the message's UTF-8 bytes (a
token is at least one byte) decides first whether asking is needed at all: most messages go out at once.
Settings that drop tokens to make room (an overflow mode or eviction policy) need no warning.

A pinned message's token count is saved with it, so it shows under it, also after the chat is reopened.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable

from PySide6.QtCore import QObject

from engine.config import CacheConfig

ROOM = 0.10  # warn when the prompt leaves less than this share of the context
TEMPLATE_SLACK = 32  # tokens the chat template may add around a new message


class SendCheck(QObject):
    """Owned by the ``Conversation``; ``context_length`` and ``chat_tokens`` are kept up to date by the
    window (model loaded, chat described, reply snapshots)."""

    def __init__(self, conversation: Any, pane: Any, engine: Any, cache: Callable[[], CacheConfig]) -> None:
        super().__init__(conversation)
        self.conv = conversation
        self.pane = pane
        self.engine = engine
        self._cache = cache
        self.context_length = 0
        self.chat_tokens = 0  # tokens the chat on screen takes now
        self._ids = itertools.count(1)
        self._asked: dict[int, tuple] = {}
        engine.worker.measured.connect(self._on_measured)

    def _evicts(self) -> bool:
        """The cache makes room itself (as ``ChatSession`` decides: an eviction policy or an overflow mode
        that drops tokens, on a cache that is on), so the reply never stops at the context."""
        return self._cache().evicts_to_fit

    def fits(self, text: str) -> bool:
        """True: send now. False: the count was asked for; ``_on_measured`` sends or warns."""
        ctx = self.context_length
        if ctx <= 0 or self._evicts():
            return True
        if self.chat_tokens + len(text.encode("utf-8")) + TEMPLATE_SLACK <= (1 - ROOM) * ctx:
            return True
        request = next(self._ids)
        self._asked[request] = ("send", self.conv.chat_id, text)
        self.engine.measure(request, self.conv.engine_messages() + [{"role": "user", "content": text}], -1)
        return False

    def count_pinned(self, chat_id: int, message_id: int, position: int) -> None:
        messages = self.conv.engine_messages(chat_id)
        index = self.conv.engine_index(chat_id, message_id)
        if index is not None:
            request = next(self._ids)
            self._asked[request] = ("pin", chat_id, message_id, position)
            self.engine.measure(request, messages, index)

    def _on_measured(self, request: int, tokens: int) -> None:
        asked = self._asked.pop(request, None)
        if asked is None or self.conv.closed:
            return
        if asked[0] == "pin":
            self._save_pinned(*asked[1:], tokens)
            return
        _kind, chat_id, text = asked
        ctx = self.context_length
        if chat_id == self.conv.chat_id and (tokens < 0 or tokens <= (1 - ROOM) * ctx):
            self.conv.send(text, checked=True)
        else:
            self.warn(text, tokens, ctx)

    def warn(self, text: str, tokens: int, ctx: int) -> None:
        """Give the text back to the message box and say how little room is left."""
        if not self.pane.input.toPlainText().strip():
            self.pane.input.setPlainText(text)
        left = max(ctx - tokens, 0)

        def send_anyway() -> None:
            self.pane.input.clear()
            self.conv.send(text, checked=True)

        actions = [("New chat", self.conv.new_chat)]
        if tokens >= ctx:  # sent as it is it could only fail: no "Send anyway"
            room = (f"more than the model's context of {ctx:,}: it cannot read them all, and nothing set here drops "
                    "tokens to make them fit")
        else:
            room = (f"of the model's {ctx:,} context tokens, leaving {left:,} ({100 * left / max(ctx, 1):.0f}%) for "
                    "the reply, which stops when the context is full")
            actions.insert(0, ("Send anyway", send_anyway))
        self.pane.notice.show_message(
            f"Not sent yet: the chat and this message take {tokens:,} tokens, {room}. Start a new chat, shorten "
            "the message, or choose an overflow policy that drops tokens (Cache policy ▸ When the context is full).",
            actions=actions)

    def _save_pinned(self, chat_id: int, message_id: int, position: int, tokens: int) -> None:
        if tokens < 0:
            return
        m = next((m for m in self.conv.history.messages(chat_id) if m.id == message_id), None)
        if m is None or not m.stats.get("pinned"):
            return
        self.conv.history.set_stats(message_id, dict(m.stats, tokens=tokens))
        if chat_id == self.conv.chat_id:
            self.pane.show_pinned_tokens(position, tokens)
