"""Token counts the conversation asks the worker for: before sending, and for pinned messages.

Before a message goes out: if the prompt alone (the chat plus the new message) would leave less than
``ROOM`` of the model's context for the reply, the message is not sent; the notice bar says how much is
left and offers the way on: "Drop the oldest turns and send" (the app's default overflow), "Send anyway" where the
reply has some room, or a new chat; the text goes back into the message box. Under a setting that drops tokens to
make room, a prompt whose reply would pass some of it over unread (a paste longer than the context) waits too, saying
what goes — the earlier messages whole, this message's oldest part, the system prompt kept — as the engine foresees
it (``engine.core.foresee``, the evictor's own rule), with "Send". The exact answer needs the tokenizer (on the
worker), so the UTF-8 bytes of what the turn must read (a token is at least one byte) decide first whether asking is
needed at all: most messages go out at once. A setting changed while the notice shows says it again for that setting.

A pinned message's token count is saved with it, so it shows under it, also after the chat is reopened.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any, Callable

from PySide6.QtCore import QObject

from app.chat.model_tie import ModelTie
from app.ground.glossary import MODES, OVERFLOWS
from engine.config import CacheConfig

if TYPE_CHECKING:
    from engine.core.foresee import Foresight

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
        self._warned: tuple | None = None  # the notice shown, its text, what was foreseen and the context
        engine.worker.measured.connect(self._on_measured)
        engine.worker.foreseen.connect(self._on_foreseen)
        engine.worker.applied.connect(self._on_applied)
        self.tie = ModelTie(conversation, pane)  # a chat written by another model asks first

    def _evicts(self) -> bool:
        """The cache makes room itself (as ``ChatSession`` decides: an eviction policy or an overflow mode
        that drops tokens, on a cache that is on), so the reply never stops at the context."""
        return self._cache().evicts_to_fit

    def fits(self, text: str) -> bool:
        """True: send now. False: held — the chat was written by another model (``ModelTie`` asks), or the worker
        was asked what a reply would read (``_on_foreseen`` sends or warns)."""
        if self.tie.holds(text):
            return False
        ctx = self.context_length
        if ctx <= 0:
            return True
        messages = self._prompt(text)
        if self._known(messages) + TEMPLATE_SLACK * len(messages) <= self._room(ctx):
            return True  # bytes bound tokens: it fits without asking the tokenizer
        self._ask(text, messages, warn_only=False)
        return False

    def watch(self, screen) -> None:
        """Read the chat on screen's tokens from the screen's record (``app.ground.screen.Screen``)."""
        self.screen = screen

    @property
    def chat_tokens(self) -> int:
        """Tokens the chat on screen takes now: every token of it, as the screen's record counts them."""
        context = self.screen.context if self.screen is not None else None
        return context.chat if context is not None else 0

    def _prompt(self, text: str) -> list[dict]:
        """The messages a reply to ``text`` answers (a new chat's system prompt is the one it will get)."""
        before = self.conv.engine_messages()
        if self.conv.chat_id is None and (system := str(self.conv.settings.get("chat/system_prompt") or "").strip()):
            before = [{"role": "system", "content": system}]
        return before + [{"role": "user", "content": text}]

    def _known(self, messages: list[dict]) -> int:
        """At most the tokens this turn must hold (a token is at least one UTF-8 byte): settings that drop tokens go
        on from the cache and keep only the system prompt and pins besides the new message; the others hold the chat
        (its tokens as the screen's record counts them) and the new message."""
        new = len(messages[-1]["content"].encode("utf-8"))
        if not self._evicts():
            return self.chat_tokens + new
        kept = [m for m in messages[:-1] if m["role"] == "system" or m.get("pinned")]
        return new + sum(len(m["content"].encode("utf-8")) for m in kept)

    def _room(self, ctx: int) -> float:
        """What the turn may hold before it is asked about: the prompt must leave the reply ``ROOM``; overflow
        "turns" keeps all but an eighth of the context (``engine.policies.turns``); other settings that drop tokens
        read the new message whole when it fits the context."""
        cfg = self._cache()
        if not cfg.evicts_to_fit:
            return (1 - ROOM) * ctx
        return ctx - max(1, ctx // 8) if cfg.overflow == "turns" and cfg.policy == "none" else ctx

    def _ask(self, text: str, messages: list[dict], warn_only: bool, cfg: CacheConfig | None = None) -> None:
        request = next(self._ids)
        cfg = cfg or self._cache()
        self._asked[request] = ("send", self.conv.chat_id, text, warn_only, cfg)
        self.engine.foresee(request, messages, self.conv.chat_id, cfg)

    def count_pinned(self, chat_id: int, message_id: int, position: int) -> None:
        messages = self.conv.engine_messages(chat_id)
        index = self.conv.engine_index(chat_id, message_id)
        if index is not None:
            request = next(self._ids)
            self._asked[request] = ("pin", chat_id, message_id, position)
            self.engine.measure(request, messages, index)

    def _on_measured(self, request: int, tokens: int) -> None:
        asked = self._asked.pop(request, None)
        if asked is not None and asked[0] == "pin" and not self.conv.closed:
            self._save_pinned(*asked[1:], tokens)

    def _on_foreseen(self, request: int, seen: Foresight | None) -> None:
        asked = self._asked.pop(request, None)
        if asked is None or asked[0] != "send" or self.conv.closed:
            return
        _kind, chat_id, text, warn_only, cfg = asked
        ctx = self.context_length
        fits = seen is None or (seen.unread == 0 and (cfg.evicts_to_fit or seen.tokens <= (1 - ROOM) * ctx))
        if chat_id == self.conv.chat_id and fits and not warn_only:
            self.conv.send(text, checked=True)
        elif seen is not None:
            self.warn(text, seen, ctx, cfg)
        elif not self.pane.input.toPlainText().strip():
            self.pane.input.setPlainText(text)  # the chat changed and nothing is known: the text is not lost

    def warn(self, text: str, seen: Foresight, ctx: int, cfg: CacheConfig | None = None) -> None:
        """Give the text back to the message box and say how little room is left under ``cfg`` (default: the
        setting in force), with the ways on as buttons; ``seen``: what the reply would read and drop unread."""
        if not self.pane.input.toPlainText().strip():
            self.pane.input.setPlainText(text)
        cfg = cfg or self._cache()
        tokens = seen.tokens
        size = f"Not sent yet: the chat and this message take {tokens:,} tokens"
        if cfg.evicts_to_fit:  # it drops tokens to make room: said before, with how many are never read
            notice = (f"{size} (the model's context holds {ctx:,}), and the setting now in force drops tokens to make "
                      f"room{unread_words(seen)}; it can be sent.")
            self._show(notice, text, seen, ctx, [("Send", lambda: self._send(text)), ("New chat", self.conv.new_chat)],
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
                   f"tokens ({where}).", text, seen, ctx, actions)

    def _show(self, notice: str, text: str, seen: Foresight | None, ctx: int, actions: list,
              tone: str = "problem") -> None:
        self.pane.notice.show_message(notice, actions=actions, tone=tone)
        self._warned = (notice, text, seen, ctx)

    def _send(self, text: str, cfg: CacheConfig | None = None) -> None:
        """Send ``text`` as it was warned about, after switching to ``cfg`` first where given (the worker applies
        calls in order: the setting is in force when the reply starts, and the controls show it)."""
        self._warned = None
        if cfg is not None:
            self.conv.apply_cache(cfg)
        self.pane.input.clear()
        self.conv.send(text, checked=True)

    def _on_applied(self, cfg: CacheConfig, _notes: list) -> None:
        """A cache setting was applied while the notice warns about a message: it says so for that setting, asking
        the worker again what a reply would drop under it."""
        warned, self._warned = self._warned, None
        if warned is None or self.conv.closed or self.pane.notice.text != warned[0]:
            return  # dismissed, sent, or replaced by another message
        _notice, text, _seen, _ctx = warned
        self._ask(text, self._prompt(text), warn_only=True, cfg=cfg)

    def _save_pinned(self, chat_id: int, message_id: int, position: int, tokens: int) -> None:
        if tokens < 0:
            return
        m = next((m for m in self.conv.history.messages(chat_id) if m.id == message_id), None)
        if m is None or not m.stats.get("pinned"):
            return
        self.conv.history.set_stats(message_id, dict(m.stats, tokens=tokens))
        if chat_id == self.conv.chat_id:
            self.pane.show_pinned_tokens(position, tokens)


def unread_words(seen: Foresight | None) -> str:
    """': 2,726 of them are dropped unread (the oldest 2,726 tokens of this message; the system prompt is kept), the
    model reads 448' — what the reply passes over to fit the context, as the engine foresaw it; "" when nothing
    (the system prompt named only where the chat has one)."""
    if seen is None or not seen.unread:
        return ""
    parts = [f"{seen.whole} earlier message{'s' if seen.whole != 1 else ''} whole"] if seen.whole else []
    if seen.part:
        parts.append(f"the oldest {seen.part:,} tokens of this message")
    if seen.system:
        parts[-1] += "; the system prompt is kept" if seen.kept_system else "; the system prompt too"
    return f": {seen.unread:,} of them are dropped unread ({' and '.join(parts)}), the model reads {seen.read:,}"
