"""Speculative decoding's setting in force: what the controls ask for, what the worker applied, what is saved.

As with the cache settings (``app.controls.cache_controller``), each chat keeps its own (its history row's "spec"; a
new chat starts from the defaults, the ``spec/*`` settings), opening a chat puts its own in force, and only the
worker's ``speculated`` makes a setting the one in force (saved with the chat on screen, shown); a refusal (a draft
model with another tokenizer, one that does not load) puts the controls back. The tint of accepted draft tokens is a
view setting, owned here too and saved at once.
"""

from __future__ import annotations

from PySide6.QtCore import QObject, Signal

from app.settings.cache_settings import _load, _save, chat_settings_json, chat_spec
from app.link.engine_thread import EngineThread
from app.ground.glossary import describe_spec
from app.settings.store import Settings
from app.controls.spec_controls import SpecControls
from engine.config import SpecConfig


def spec_from_settings(settings: Settings) -> SpecConfig:
    """The saved speculation (off when the saved values are not valid any more)."""
    return _load(settings, "spec", SpecConfig, ())


class SpecController(QObject):
    """``applied``: the ``SpecConfig`` in force; ``tint``: replies tint accepted draft tokens.
    ``changed(cfg, notes)`` fires when the worker applied one; ``tint_changed(bool)`` when the tint did."""

    changed = Signal(object, object)
    tint_changed = Signal(bool)

    def __init__(self, settings: Settings, controls: SpecControls, engine: EngineThread,
                 parent: QObject | None = None, history=None) -> None:
        super().__init__(parent)
        self.settings = settings
        self.controls = controls
        self.engine = engine
        self.history = history  # each chat's own setting, in its row
        self.chat = None  # the local chat on screen
        self.defaults = spec_from_settings(settings)  # what a new chat starts with
        self.applied = self.defaults
        self.requested = self.defaults  # the last setting sent (the worker applies them in order)
        self.tint = bool(settings.get("spec/tint"))
        controls.set_config(self.applied)
        controls.set_tint(self.tint)
        controls.changed.connect(self.apply)
        controls.tint_changed.connect(self.set_tint)
        engine.worker.speculated.connect(self._on_applied)
        if self.applied.method != "off":
            self.apply(self.applied)  # queued before the model loads: the worker keeps it for the model

    def watch(self, screen) -> None:
        """The chat on screen's own setting comes into force when it is opened."""
        screen.connect("chat", self._on_chat)

    def _on_chat(self, chat) -> None:
        self.chat = chat if isinstance(chat, int) else None
        found = self.history.chat(self.chat) if self.history is not None and self.chat is not None else None
        if found is None:
            return
        cfg = chat_spec(found.own_settings, self.defaults)
        if "spec" not in found.own_settings:
            self._save(cfg)  # it keeps what it runs on from now
        if cfg != self.requested:
            self.controls.set_config(cfg)
            self.apply(cfg)

    def make_default(self) -> None:
        """The setting in force becomes what new chats start with."""
        self.set_defaults(self.applied)

    def set_defaults(self, cfg: SpecConfig) -> None:
        """What new chats start with (Settings ▸ Speculation's options, "Make default for new chats")."""
        self.defaults = cfg
        _save(self.settings, "spec", cfg, ())

    def _save(self, cfg: SpecConfig) -> None:
        found = self.history.chat(self.chat) if self.history is not None and self.chat is not None else None
        if found is not None and not found.server:
            self.history.set_settings(self.chat, chat_settings_json(found.own_settings, cfg, "spec"))

    def apply(self, cfg: SpecConfig) -> None:
        """Ask the worker for ``cfg`` (between two steps, also mid-reply; a draft model loads first)."""
        self.requested = cfg
        self.engine.speculate(cfg)

    def refused(self) -> None:
        """The worker refused the last change: the controls show the setting in force."""
        self.requested = self.applied
        self.controls.set_config(self.applied)

    def set_tint(self, on: bool) -> None:
        self.tint = bool(on)
        self.settings.set("spec/tint", self.tint)
        self.controls.set_tint(self.tint)
        self.tint_changed.emit(self.tint)

    def _on_applied(self, cfg: SpecConfig, notes: list) -> None:
        self.applied = cfg
        self._save(cfg)
        self.controls.set_config(cfg)
        # the engine's own "speculative decoding: ngram, ..." says it with ids: the plain words instead
        said = [n for n in notes if not (n.startswith("speculative decoding: ") or n == "speculative decoding off")]
        self.controls.show_notes([describe_spec(cfg)] + said)
        self.changed.emit(cfg, list(notes))
