"""The cache settings in force: what the controls ask for, what the worker applied, what is saved and shown.

A change goes from the controls to the worker (applied between two decode steps, also mid-reply); only
the worker's ``applied`` makes it the setting in force, which is then saved and shown. A refused change
puts the controls back to the setting in force.
"""

from __future__ import annotations

from typing import Any, Callable

from PySide6.QtCore import QObject, Signal

from app.settings.cache_settings import cache_from_settings, save_cache
from app.controls.cache_controls import CacheControls
from app.shell.glossary import describe_cache
from app.chat.note_words import plain_note, precision_note
from app.settings.store import Settings
from app.shell.status_bar import StatusBar
from app.link.engine_thread import EngineThread
from engine.config import CacheConfig


class CacheController(QObject):
    """``applied`` is the ``CacheConfig`` in force; ``changed(cfg, notes)`` fires when the worker applied one."""

    changed = Signal(object, object)

    def __init__(self, settings: Settings, controls: CacheControls, engine: EngineThread, status: StatusBar,
                 parent: QObject | None = None, info: Callable[[], Any] = lambda: None,
                 notes_on_screen: Callable[[], bool] = lambda: True) -> None:
        super().__init__(parent)
        self._info = info  # the loaded model's ModelInfo (or None), for what only the app can say
        self._notes_on_screen = notes_on_screen  # the worker's notes describe the chat on screen
        self.settings = settings
        self.controls = controls
        self.engine = engine
        self.status = status
        self.applied: CacheConfig = cache_from_settings(settings)
        self.previous: CacheConfig = self.applied  # the setting before the last one applied
        controls.set_config(self.applied)
        status.show_cache(self.applied)
        controls.changed.connect(self.apply)
        engine.worker.applied.connect(self._on_applied)

    def apply(self, cfg: CacheConfig) -> None:
        """Send a new cache configuration; the worker applies it between steps (also mid-reply)."""
        self.engine.apply_cache_config(cfg)

    @property
    def requested(self) -> CacheConfig:
        """The setting a message sent now runs under: the last one sent to the worker, which applies commands in
        order (a change chosen a moment ago is in force when the reply starts), else the one in force."""
        return self.engine.sent_cache or self.applied

    def refused(self) -> None:
        """The worker refused the last change: the controls show what is really applied."""
        self.engine.sent_cache = None
        self.controls.set_config(self.applied)

    def _on_applied(self, cfg: CacheConfig, notes: list) -> None:
        self.previous = self.applied  # a reply in flight names what changed (``changed``'s listeners read it)
        self.applied = cfg
        notes = self.words(cfg, notes)
        save_cache(self.settings, cfg)
        if cfg != self.controls.config() and not self.controls.pending:
            self.controls.set_config(cfg)  # applied from elsewhere (Compare, the self-test): the controls agree
        self.controls.show_notes(list(notes))
        self.changed.emit(cfg, list(notes))  # the window's readouts show it with the first frame under it

    def words(self, cfg: CacheConfig, notes: list) -> list[str]:
        """The worker's notes in the controls' words. They describe the chat whose cache the worker holds: when
        another chat is on screen (a new one, one not run since the app started) they are about a chat the user
        does not see, so the note says what this chat will get instead."""
        if notes and not self._notes_on_screen():
            notes = [f"{describe_cache(cfg)}: this chat uses it from its next message"]
        out = [plain_note(n, cfg) for n in notes]
        extra = precision_note(cfg, self._info())
        return out + ([extra] if extra and extra not in out else [])
