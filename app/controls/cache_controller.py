"""The cache settings of the chat on screen: what the controls ask for, what the worker applied, what is saved and
shown.

Each chat keeps its own settings in its history row (``Chat.settings``); a new chat starts from the loaded model's
own defaults where it has them ("Make default for this model": ``app.settings.model_defaults``), else from the
user's defaults (the ``cache/*`` settings: "Make default for new chats"), and opening a chat puts its own in force —
a chat opened tomorrow runs on what it ran on, not on what was last chosen for another. A change goes from the controls to the
worker (applied between two decode steps, also mid-reply) for the chat on screen; only the worker's ``applied``
makes it the setting in force, which is then saved with that chat. A refused change puts the controls back.

Two changes ask first, in the controls (``CacheControls.ask``): a lossy one (keys or values below 8 bits, an
eviction policy: ``app.controls.lossy``) says what the fidelity check measured it to cost on this model, or that it
was not measured yet; one that would have the chat read tokens again for longer than ``ASK_REREAD_MS`` says how
many and how long (the worker estimates it before applying: ``EngineWorker.apply_cache_config``).
"""

from __future__ import annotations

import json
from collections import deque
from typing import Any, Callable

from PySide6.QtCore import QObject, Signal

from app.ground.note_words import SHOW_AFTER_MS, plain_note, precision_note
from app.controls import lossy
from app.controls.cache_controls import CacheControls
from app.settings.cache_settings import cache_from_settings, chat_cache, chat_settings_json, chat_spec, save_cache
from app.settings.model_defaults import ModelDefaults
from app.settings.store import Settings
from app.ground.glossary import describe_cache
from app.link.engine_thread import EngineThread
from app.link.worker import NEXT_MESSAGE
from engine.config import CacheConfig

ASK_REREAD_MS = 2 * SHOW_AFTER_MS  # a switch that reads tokens again for a second or more asks first


class CacheController(QObject):
    """``applied`` is the ``CacheConfig`` in force for the chat on screen; ``changed(cfg, notes)`` fires when the
    worker applied one for it. ``history``: where each chat's own settings are kept."""

    changed = Signal(object, object)

    def __init__(self, settings: Settings, controls: CacheControls, engine: EngineThread, status: Any = None,
                 parent: QObject | None = None, info: Callable[[], Any] = lambda: None,
                 notes_on_screen: Callable[[], bool] = lambda: True, history: Any = None) -> None:
        super().__init__(parent)
        self._info = info  # the loaded model's ModelInfo (or None), for what only the app can say
        self._notes_on_screen = notes_on_screen  # the worker's notes describe the chat on screen
        self.settings = settings
        self.controls = controls
        self.engine = engine
        self.history = history
        self.measured = lossy.Measured(settings)
        self.model_defaults = ModelDefaults(settings)  # a model's own settings for its new chats
        self.defaults: CacheConfig = cache_from_settings(settings)  # what a new chat starts with
        self.applied: CacheConfig = self.defaults
        self.previous: CacheConfig = self.applied  # the setting before the last one applied
        self.chat: Any = None  # the chat on screen (a local chat's id; None: none, or not a local chat)
        self._sent: deque[tuple[Any, CacheConfig, bool]] = deque()  # changes sent, in order: (chat, setting, quiet)
        controls.set_config(self.applied)
        controls.show_lossy(self.applied)
        controls.changed.connect(self.apply)
        controls.default_requested.connect(self.make_default)
        engine.worker.applied.connect(self._on_applied)
        engine.worker.asked.connect(self._on_asked)

    def watch(self, screen) -> None:
        """The controls follow the chat on screen (``app.ground.screen.Screen``): its own settings come into force, its
        length (what cache off can take), and no notes about the chat that left."""
        screen.connect("context", lambda c: c is not None and self.controls.set_chat_length(c.chat, c.total))
        screen.connect("chat", self._on_chat)

    # -- the chat on screen -----------------------------------------------------------------------------------
    def own(self, chat_id: Any) -> CacheConfig:
        """``chat_id``'s own settings (a new chat's start for one that has none saved)."""
        chat = self.history.chat(chat_id) if self.history is not None and isinstance(chat_id, int) else None
        start = chat_cache(self._model_own(), self.defaults)
        return chat_cache(chat.own_settings, start) if chat is not None else start

    def _model_own(self) -> dict:
        return self.model_defaults.get(ModelDefaults.name(self._info()))

    def new_chat_settings(self, spec=None) -> str:
        """What a new chat's row starts with: the loaded model's own defaults, else the user's (``spec``:
        speculation's defaults, the other controller's)."""
        mine = self._model_own()
        own = json.loads(chat_settings_json({}, chat_cache(mine, self.defaults)))
        return chat_settings_json(own, chat_spec(mine, spec), "spec") if spec is not None else json.dumps(own, sort_keys=True)

    def make_model_default(self, spec=None) -> None:
        """The settings in force (``spec``: the chat's speculation) become what the loaded model's new chats start
        with, before the defaults for new chats."""
        info = self._info()
        if info is None:
            return
        own = json.loads(chat_settings_json({}, self.applied))
        self.model_defaults.save(ModelDefaults.name(info), chat_settings_json(own, spec, "spec") if spec is not None
                                 else json.dumps(own))
        self.controls.show_notes([f"New chats of {info.name} start with {describe_cache(self.applied)} (its own "
                                  "defaults, before the defaults for new chats)"])

    def _on_chat(self, chat: Any) -> None:
        self.controls.show_notes([])
        self.controls.clear_ask()
        if not isinstance(chat, int):  # an API conversation or a remote chat: the server's settings, not a chat's
            self.chat = None
            return
        self.chat = chat
        cfg = self.own(chat)
        if self.history is not None and not self.history.chat(chat).settings:
            self._save(chat, cfg)  # a chat from before chats kept settings: it keeps what it runs on from now
        if cfg != self.requested:
            self.controls.set_config(cfg)
            self._send(cfg, ask=False, quiet=True)  # its own setting: nothing to ask or to say

    @property
    def requested(self) -> CacheConfig:
        """The setting a message sent now runs under: the last one sent to the worker, which applies commands in
        order (a change chosen a moment ago is in force when the reply starts), else the one in force."""
        return self.engine.sent_cache or self.applied

    # -- changes ----------------------------------------------------------------------------------------------
    def apply(self, cfg: CacheConfig, confirmed: bool = False, lossy_ok: bool = False) -> None:
        """A change for the chat on screen (the controls', or Compare's and the self-test's: ``confirmed``, nothing
        asked). A lossy one asks first, with what it was measured to cost here (``lossy_ok``: the user said use it);
        then the worker asks for one that reads many tokens again."""
        self.controls.clear_ask()
        if not (confirmed or lossy_ok):
            new = lossy.added(self.applied, cfg)
            if new:
                self._ask_lossy(cfg, new)
                return
        self._send(cfg, ask=not confirmed)

    def _send(self, cfg: CacheConfig, ask: bool, quiet: bool = False) -> None:
        self._sent.append((self.chat, cfg, quiet))
        self.engine.apply_cache_config(cfg, self.chat, ASK_REREAD_MS if ask else None)

    def _ask_lossy(self, cfg: CacheConfig, parts: list[str]) -> None:
        info = self._info()
        name = info.name if info is not None else "this model"
        cost = lossy.cost_words(name, self.measured.cost(info.source, cfg) if info is not None else [])
        verb = "loses" if len(parts) == 1 else "lose"  # "Keys 4-bit (int4, KIVI), StreamingLLM lose information"
        self.controls.ask(f"{_first_up(', '.join(parts))} {verb} information: replies may change. {cost}",
                          "Use it", lambda: self.apply(cfg, lossy_ok=True), self.cancel)

    def _on_asked(self, cfg: CacheConfig, chat: Any, tokens: int, ms: float) -> None:
        """The worker did not apply ``cfg``: it would have the chat read ``tokens`` again (about ``ms``)."""
        self._forget(cfg, chat)
        self.engine.sent_cache = None
        if chat != self.chat:
            return
        when = "before the reply goes on" if self._replying() else "with its next message"
        self.controls.ask(f"{_first_up(describe_cache(cfg))}: this chat reads {tokens:,} tokens again {when} "
                          f"(about {ms / 1000:.1f} s at this model's prefill rate).", "Switch",
                          lambda: self.apply(cfg, confirmed=True), self.cancel)

    def _replying(self) -> bool:
        parent = self.parent()
        return bool(getattr(parent, "generation_id", 0))

    def cancel(self) -> None:
        """The user kept the setting in force: the controls show it again."""
        self.controls.clear_ask()
        self.controls.set_config(self.applied)

    def refused(self) -> None:
        """The worker refused the last change: the controls show what is really applied."""
        if self._sent:
            self._sent.popleft()
        self.engine.sent_cache = None
        self.controls.set_config(self.applied)

    def make_default(self) -> None:
        """The setting in force becomes what new chats start with; the loaded model's own defaults are forgotten
        (the button pressed last says what its new chats get)."""
        self.defaults = self.applied
        save_cache(self.settings, self.applied)
        info = self._info()
        mine = " (its own defaults for this model are forgotten)" if self.model_defaults.forget(
            ModelDefaults.name(info)) else ""
        self.controls.show_notes([f"New chats start with {describe_cache(self.applied)}{mine}"])

    def _forget(self, cfg: CacheConfig, chat: Any) -> None:
        if self._sent and self._sent[0][:2] == (chat, cfg):
            self._sent.popleft()

    def _on_applied(self, cfg: CacheConfig, notes: list) -> None:
        chat, quiet = self._sent.popleft()[::2] if self._sent and self._sent[0][1] == cfg else (self.chat, False)
        if quiet:
            notes = []  # a chat's own setting put back when it was opened: nothing happened to tell
        if chat is not None:
            self._save(chat, cfg)
        if chat != self.chat:
            return  # taken for a chat no longer on screen: saved with it
        self.previous = self.applied  # a reply in flight names what changed (``changed``'s listeners read it)
        self.applied = cfg
        notes = self.words(cfg, notes)
        if cfg != self.controls.config() and not self.controls.pending and not self.controls.asking:
            self.controls.set_config(cfg)  # applied from elsewhere (Compare, the self-test): the controls agree
        self.controls.show_notes(list(notes))
        self.controls.show_lossy(cfg)
        self.changed.emit(cfg, list(notes))  # the window's readouts show it with the first frame under it

    def _save(self, chat: Any, cfg: CacheConfig) -> None:
        if self.history is None or not isinstance(chat, int):
            return
        found = self.history.chat(chat)
        if found is not None and not found.server:
            self.history.set_settings(chat, chat_settings_json(found.own_settings, cfg))

    def words(self, cfg: CacheConfig, notes: list) -> list[str]:
        """The worker's notes in the controls' words. They describe the chat whose cache the worker holds: when
        another chat is on screen (a new one, one not run since the app started) they are about a chat the user
        does not see, so the note says what this chat will get instead."""
        if notes and (not self._notes_on_screen() or notes == [NEXT_MESSAGE]):
            notes = [f"{describe_cache(cfg)}: this chat uses it from its next message"]
        out = [plain_note(n, cfg) for n in notes]
        extra = precision_note(cfg, self._info())
        return out + ([extra] if extra and extra not in out else [])


def _first_up(text: str) -> str:
    return text[:1].upper() + text[1:]
