"""Speculative decoding's setting in force: what the controls ask for, what the worker applied, what is saved.

As with the cache settings (``app.controls.cache_controller``), only the worker's ``speculated`` makes a setting the
one in force (saved, shown); a refusal (a draft model with another tokenizer, one that does not load) puts the
controls back. The tint of accepted draft tokens is a view setting, owned here too and saved at once.
"""

from __future__ import annotations

from PySide6.QtCore import QObject, Signal

from app.settings.cache_settings import _load, _save
from app.link.engine_thread import EngineThread
from app.shell.glossary import describe_spec
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
                 parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.settings = settings
        self.controls = controls
        self.engine = engine
        self.applied = spec_from_settings(settings)
        self.tint = bool(settings.get("spec/tint"))
        controls.set_config(self.applied)
        controls.set_tint(self.tint)
        controls.changed.connect(self.apply)
        controls.tint_changed.connect(self.set_tint)
        engine.worker.speculated.connect(self._on_applied)
        if self.applied.method != "off":
            engine.speculate(self.applied)  # queued before the model loads: the worker keeps it for the model

    def apply(self, cfg: SpecConfig) -> None:
        """Ask the worker for ``cfg`` (between two steps, also mid-reply; a draft model loads first)."""
        self.engine.speculate(cfg)

    def refused(self) -> None:
        """The worker refused the last change: the controls show the setting in force."""
        self.controls.set_config(self.applied)

    def set_tint(self, on: bool) -> None:
        self.tint = bool(on)
        self.settings.set("spec/tint", self.tint)
        self.controls.set_tint(self.tint)
        self.tint_changed.emit(self.tint)

    def _on_applied(self, cfg: SpecConfig, notes: list) -> None:
        self.applied = cfg
        _save(self.settings, "spec", cfg, ())
        self.controls.set_config(cfg)
        # the engine's own "speculative decoding: ngram, ..." says it with ids: the plain words instead
        said = [n for n in notes if not (n.startswith("speculative decoding: ") or n == "speculative decoding off")]
        self.controls.show_notes([describe_spec(cfg)] + said)
        self.changed.emit(cfg, list(notes))
