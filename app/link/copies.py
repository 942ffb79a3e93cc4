"""Quantized copies in the app (``engine.model.quant_copies``): their setting, and their control on the engine's thread.

``CopiesConfig`` is Settings ▸ Quantized copies (on by default, in the engine's own folder, 16 GiB): a Hugging Face
folder loaded with 8-bit or 4-bit weights keeps its quantized blocks there, so the next load maps them (a 1B model:
~0.1 s) instead of quantizing again (2-5 s). The engine reads ``KVSCOPE_QUANTIZED_CACHE`` and
``KVSCOPE_QUANTIZED_CACHE_GIB`` at each load, and loads run on the worker's thread in this process: ``CopiesControl``
(a child of ``EngineWorker``) sets them there, in the order of the commands sent, so the next load runs under the
setting. A setting at its default leaves what the environment said when KV Scope started (a user's
``KVSCOPE_QUANTIZED_CACHE=/big/disk`` stays the default folder). It also counts the copies and clears them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from PySide6.QtCore import QObject, Signal, Slot

from app.ground.failure import describe, log
from app.settings.store import Settings

# engine.model.quant_copies' variables and default, repeated: importing it here would import torch (2 s on the GUI
# thread); tests/app/test_quant_copies_app.py checks that ``engine_default`` is its ``root()``
ENV, BUDGET_ENV = "KVSCOPE_QUANTIZED_CACHE", "KVSCOPE_QUANTIZED_CACHE_GIB"
DEFAULT_BUDGET_GIB = 16.0
OFF = ("off", "0", "no", "false")


@dataclass(frozen=True)
class CopiesConfig:
    """Settings ▸ Quantized copies. ``folder`` "": the engine's default (``engine_default``)."""

    enabled: bool = True
    folder: str = ""
    budget_gib: float = DEFAULT_BUDGET_GIB


@dataclass(frozen=True)
class CopiesState:
    """What the form shows: the copies in ``folder`` (the one the setting names, also while copies are off: Clear
    still empties it), whether loads keep copies (``on``), the budget in force, notes to show once."""

    folder: str
    on: bool
    count: int = 0
    nbytes: int = 0
    budget: int = 0
    notes: tuple[str, ...] = ()


def started_with() -> dict[str, str | None]:
    """The two variables as the environment has them now (taken when the worker is made: KV Scope's start)."""
    return {ENV: os.environ.get(ENV), BUDGET_ENV: os.environ.get(BUDGET_ENV)}


def off(value: str | None) -> bool:
    return (value or "").strip().lower() in OFF


def engine_default(base: Mapping[str, str | None]) -> str:
    """The folder the engine uses under ``base``'s variables: ``KVSCOPE_QUANTIZED_CACHE`` where it names one, else
    ``$XDG_CACHE_HOME/kvscope/quantized`` (``~/.cache`` without it)."""
    env = (base.get(ENV) or "").strip()
    if env and not off(env):
        return env
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return str(Path(cache) / "kvscope" / "quantized")


def folder_of(cfg: CopiesConfig, base: Mapping[str, str | None]) -> str:
    """The folder ``cfg`` names (counted and cleared even where copies are off)."""
    return os.path.abspath(os.path.expanduser(cfg.folder)) if cfg.folder.strip() else engine_default(base)


def environment(cfg: CopiesConfig, base: Mapping[str, str | None]) -> dict[str, str | None]:
    """The variables the engine reads for ``cfg`` (None: unset); a value at its default keeps ``base``'s."""
    if not cfg.enabled:
        folder: str | None = "off"
    else:
        folder = folder_of(cfg, base) if cfg.folder.strip() else base.get(ENV)
    budget = base.get(BUDGET_ENV) if cfg.budget_gib == DEFAULT_BUDGET_GIB else f"{cfg.budget_gib:g}"
    return {ENV: folder, BUDGET_ENV: budget}


def copies_from_settings(settings: Settings) -> CopiesConfig:
    cfg = CopiesConfig(bool(settings.get("quant_copies/enabled")), str(settings.get("quant_copies/folder")),
                       float(settings.get("quant_copies/budget_gib")))
    if not cfg.budget_gib > 0:  # a hand-edited INI file: the default, never a budget that keeps nothing
        cfg = CopiesConfig(cfg.enabled, cfg.folder, DEFAULT_BUDGET_GIB)
    return cfg


def save_copies(settings: Settings, cfg: CopiesConfig) -> None:
    settings.set("quant_copies/enabled", cfg.enabled)
    settings.set("quant_copies/folder", cfg.folder)
    settings.set("quant_copies/budget_gib", cfg.budget_gib)
    settings.sync()


class CopiesControl(QObject):
    """The setting in force for the loads on the worker's thread; ``changed(CopiesState)`` after each ``measure``
    and ``clear``."""

    changed = Signal(object)

    def __init__(self, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.base = started_with()  # made with the worker, before any setting was applied
        self.cfg = CopiesConfig()

    @Slot(object)
    def configure(self, cfg: CopiesConfig) -> None:
        """The setting for the loads from now on (the engine reads its variables at each load)."""
        self.cfg = cfg
        self._set(environment(cfg, self.base))

    def restore(self) -> None:
        """The variables as they were when the worker was made (the worker stops)."""
        self._set(self.base)

    @staticmethod
    def _set(values: Mapping[str, str | None]) -> None:
        for name, value in values.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value

    @Slot()
    def measure(self, notes: tuple[str, ...] = ()) -> None:
        """Count the copies (imports the engine's module, and torch with it: on this thread, never the GUI's)."""
        folder = folder_of(self.cfg, self.base)
        try:
            from engine.model import quant_copies

            count, nbytes = quant_copies.held(Path(folder))
            on, budget = quant_copies.root() is not None, quant_copies.budget()
        except Exception as exc:  # noqa: BLE001 - a folder that cannot be read: a note, never a crash
            log(exc)
            count, nbytes, on, budget = 0, 0, not off(os.environ.get(ENV)), 0
            notes = (*notes, f"Quantized copies: could not read {folder} ({describe(exc)})")
        self.changed.emit(CopiesState(folder, on, count, nbytes, budget, tuple(notes)))

    @Slot()
    def clear(self) -> None:
        """Settings ▸ Quantized copies ▸ Clear: the copies in the setting's folder go; then counted again."""
        folder = folder_of(self.cfg, self.base)
        notes: tuple[str, ...] = ()
        try:
            from engine.model import quant_copies

            quant_copies.clear(Path(folder))
        except Exception as exc:  # noqa: BLE001
            log(exc)
            notes = (f"Quantized copies: could not clear {folder} ({describe(exc)})",)
        self.measure(notes)
