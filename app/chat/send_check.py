"""Token counts the conversation asks the worker for: before sending, and for pinned messages.

Before a message goes out: if the prompt alone (the chat plus the new message) would leave less than
``ROOM`` of the model's context for the reply, the message is not sent; the notice bar says how much is
left and offers the way on: "Drop the oldest and send" (the overflow setting that drops the chat's oldest tokens,
the app's default), "Send anyway" where the reply has some room, or a new chat; the text goes back into the
message box. The exact count needs the tokenizer (on the worker), so the chat's known token count plus the
message's UTF-8 bytes (a token is at least one byte) decides first whether asking is needed at all: most messages
go out at once. Settings that drop tokens to make room (an overflow mode or eviction policy) need no warning, and a
setting changed while the notice shows says it again for that setting at once.

A pinned message's token count is saved with it, so it shows under it, also after the chat is reopened.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable

from PySide6.QtCore import QObject

from app.chat.model_tie import ModelTie
from app.shell.glossary import MODES, OVERFLOWS
from engine.config import CacheConfig

ROOM = 0.10  # warn when the prompt leaves less than this share of the context
WAY_ON = "turns"  # the overflow setting the notice offers: it drops the oldest whole turns, so the chat goes on
TEMPLATE_SLACK = 32  # tokens the chat template may add around a new message


class SendCheck(QObject):
    """Owned by the ``Conversation``; ``context_length`` is the loaded model's (the window sets it), the chat's
    tokens are read from the screen's record (``watch``)."""

    def __init__(self, conversation: Any, pane: Any, engine: Any, cache: Callable[[], CacheConfig]) -> None:
        super().__init__(conversation)
        self.conv = conversation
        self.pane = pane
        self.engine = engine
        self._cache = cache
        self.context_length = 0
        self.screen = None  # the screen's record (``watch``): the chat on screen's context counts
        self._ids = itertools.count(1)
        self._asked: dict[int, tuple] = {}
        self._warned: tuple[str, str, int, int] | None = None  # the notice shown, its text, tokens and context
        engine.worker.measured.connect(self._on_measured)
        engine.worker.applied.connect(self._on_applied)
        self.tie = ModelTie(conversation, pane)  # a chat written by another model asks first

    def watch(self, screen) -> None:
        """Read the chat on screen's tokens from the screen's record (``app.shell.screen.Screen``)."""
        self.screen = screen

    @property
    def chat_tokens(self) -> int:
        """Tokens the chat on screen takes now: every token of it (a prompt under settings that drop nothing holds
        them all), as the screen's record counts them."""
        context = self.screen.context if self.screen is not None else None
        return context.chat if context is not None else 0

    def _evicts(self) -> bool:
        """The cache makes room itself (as ``ChatSession`` decides: an eviction policy or an overflow mode
        that drops tokens, on a cache that is on), so the reply never stops at the context."""
        return self._cache().evicts_to_fit

    def fits(self, text: str) -> bool:
        """True: send now. False: held — the chat was written by another model (``ModelTie`` asks), or the count
        was asked for (``_on_measured`` sends or warns)."""
        if self.tie.holds(text):
            return False
        ctx = self.context_length
        if ctx <= 0:
            return True
        # Settings that drop tokens go on from the cache: only the new message is read, so it is asked about only
        # when it alone may not fit the context (its bytes bound its tokens); the others when the whole prompt may not
        # leave the reply room.
        before = 0 if self._evicts() else self.chat_tokens
        room = ctx if self._evicts() else (1 - ROOM) * ctx
        if before + len(text.encode("utf-8")) + TEMPLATE_SLACK <= room:
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
        if self._evicts():  # what is read this turn: the prompt past what the chat's cache was fed already
            new = tokens - self.chat_tokens if tokens >= 0 else -1
            fits = new <= ctx
        else:
            new, fits = tokens, tokens <= (1 - ROOM) * ctx
        if chat_id == self.conv.chat_id and (tokens < 0 or fits):
            self.conv.send(text, checked=True)
        else:
            self.warn(text, tokens, ctx, new=new)

    def warn(self, text: str, tokens: int, ctx: int, cfg: CacheConfig | None = None, new: int | None = None) -> None:
        """Give the text back to the message box and say how little room is left under ``cfg`` (default: the
        setting in force), with the ways on as buttons; ``new``: the tokens this turn reads (past the cache)."""
        if not self.pane.input.toPlainText().strip():
            self.pane.input.setPlainText(text)
        cfg = cfg or self._cache()
        size = f"Not sent yet: the chat and this message take {tokens:,} tokens"
        if cfg.evicts_to_fit:  # it drops tokens to make room: said before, with how many are never read
            new = tokens if new is None else new
            read = ctx // 2 if new > ctx else new
            dropped = (f": {new - read:,} of them are dropped unread (the oldest), the model reads the last "
                       f"{read:,}" if new > ctx else "")
            notice = (f"{size} (the model's context holds {ctx:,}), and the setting now in force drops tokens to make "
                      f"room{dropped}; it can be sent.")
            self._show(notice, text, tokens, ctx, [("Send", lambda: self._send(text)), ("New chat", self.conv.new_chat)],
                       tone="info")
            return
        actions = [("New chat", self.conv.new_chat)]
        if tokens >= ctx:  # sent as it is it could only fail: no "Send anyway"
            room = (f"more than the model's context of {ctx:,}: it cannot read them all, and nothing set here drops "
                    "tokens to make them fit")
        else:
            left = max(ctx - tokens, 0)
            room = (f"of the model's {ctx:,} context tokens, leaving {left:,} ({100 * left / max(ctx, 1):.0f}%) for "
                    "the reply, which stops when the context is full")
            actions.insert(0, ("Send anyway", lambda: self._send(text)))
        way_on, name = cfg.replace(overflow=WAY_ON), OVERFLOWS[WAY_ON].name.split(" (")[0]
        where = f"Cache policy ▸ When the context is full ▸ \"{name}\""
        if way_on.evicts_to_fit:
            actions.insert(0, (f"{name} and send", lambda: self._send(text, way_on)))
        else:  # the cache is off: it keeps nothing to drop, so that choice waits for a cache
            where = f"{MODES['paged'].name} under Cache, then {where}"
        self._show(f"{size}, {room}. Start a new chat, shorten the message, or choose an overflow policy that drops "
                   f"tokens ({where}).", text, tokens, ctx, actions)

    def _show(self, notice: str, text: str, tokens: int, ctx: int, actions: list, tone: str = "problem") -> None:
        self.pane.notice.show_message(notice, actions=actions, tone=tone)
        self._warned = (notice, text, tokens, ctx)

    def _send(self, text: str, cfg: CacheConfig | None = None) -> None:
        """Send ``text`` as it was warned about, after switching to ``cfg`` first where given (the worker applies
        calls in order: the setting is in force when the reply starts, and the controls show it)."""
        self._warned = None
        if cfg is not None:
            self.conv.apply_cache(cfg)
        self.pane.input.clear()
        self.conv.send(text, checked=True)

    def _on_applied(self, cfg: CacheConfig, _notes: list) -> None:
        """A cache setting was applied while the notice warns about a message: it says so for that setting now."""
        warned, self._warned = self._warned, None
        if warned is None or self.conv.closed or self.pane.notice.text != warned[0]:
            return  # dismissed, sent, or replaced by another message
        _notice, text, tokens, ctx = warned
        self.warn(text, tokens, ctx, cfg)

    def _save_pinned(self, chat_id: int, message_id: int, position: int, tokens: int) -> None:
        if tokens < 0:
            return
        m = next((m for m in self.conv.history.messages(chat_id) if m.id == message_id), None)
        if m is None or not m.stats.get("pinned"):
            return
        self.conv.history.set_stats(message_id, dict(m.stats, tokens=tokens))
        if chat_id == self.conv.chat_id:
            self.pane.show_pinned_tokens(position, tokens)
