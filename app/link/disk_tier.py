"""The KV disk tier in the app (``engine.kv.tier.disk``): its setting, and its control on the engine's thread.

``DiskConfig`` is Settings ▸ KV disk cache (on by default, under the data folder's ``kv/``, 4 GiB): a chat
reopened after a restart takes its pages from disk instead of reading the whole chat again. ``DiskTierControl``
lives on the worker's thread (a child of ``EngineWorker``): it turns the tier on for each model loaded and
whenever the setting changes, clears its files, and reports the tier (``changed``) so the window can show its
size. Errors (a read-only or missing folder) become notes, never a crash: the chat works without the tier.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PySide6.QtCore import QObject, Signal, Slot

from app.ground.failure import describe, log
from app.settings.store import Settings

# engine.kv.tier's page and state file suffixes, repeated: importing the engine's modules here would import torch
SUFFIXES = (".kvp", ".kvs")


@dataclass(frozen=True)
class DiskConfig:
    """Settings ▸ KV disk cache. ``folder`` "" is the data folder's ``kv/``."""

    enabled: bool = True
    folder: str = ""
    budget_gib: float = 4.0


@dataclass(frozen=True)
class DiskState:
    """What the window shows of the tier: the tier itself (None: off, or no model yet) for its size, its folder,
    and notes to show once (a folder that cannot be written)."""

    tier: Any
    folder: str
    notes: tuple[str, ...] = ()

    @property
    def nbytes(self) -> int:
        # a plain int read from the GUI thread: the writer thread updates it under its lock
        return int(self.tier.nbytes) if self.tier is not None else 0


def default_folder(settings: Settings) -> str:
    """``kv/`` beside the settings file (the app's data folder)."""
    return str(Path(settings.path).resolve().parent / "kv")


def disk_from_settings(settings: Settings) -> tuple[DiskConfig, str]:
    """The saved setting, and the folder it means."""
    cfg = DiskConfig(bool(settings.get("kv_disk/enabled")), str(settings.get("kv_disk/folder")),
                     float(settings.get("kv_disk/budget_gib")))
    if not cfg.budget_gib > 0:  # a hand-edited INI file: the default, never a tier that evicts everything
        cfg = DiskConfig(cfg.enabled, cfg.folder, DiskConfig.budget_gib)
    return cfg, resolve(cfg, settings)


def resolve(cfg: DiskConfig, settings: Settings) -> str:
    return os.path.abspath(os.path.expanduser(cfg.folder)) if cfg.folder.strip() else default_folder(settings)


def save_disk(settings: Settings, cfg: DiskConfig) -> None:
    settings.set("kv_disk/enabled", cfg.enabled)
    settings.set("kv_disk/folder", cfg.folder)
    settings.set("kv_disk/budget_gib", cfg.budget_gib)
    settings.sync()


def clear_folder(folder: str) -> int:
    """Delete the tier's files under ``folder`` (page and state files and temporary ones, in its shelves) and the shelves
    left empty; nothing else a user keeps there. Returns the bytes deleted."""
    freed = 0
    if not os.path.isdir(folder):
        return 0
    for shelf in os.scandir(folder):
        if not shelf.is_dir(follow_symlinks=False):
            continue
        for entry in os.scandir(shelf.path):
            if entry.is_file(follow_symlinks=False) and (entry.name.endswith(SUFFIXES)
                                                         or any(x + ".tmp" in entry.name for x in SUFFIXES)):
                freed += entry.stat().st_size
                os.unlink(entry.path)
        try:
            os.rmdir(shelf.path)  # only when empty
        except OSError:
            pass
    return freed


class DiskTierControl(QObject):
    """The tier of the loaded model, on the worker's thread. ``changed(DiskState)`` after every change."""

    changed = Signal(object)

    def __init__(self, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.cfg: DiskConfig | None = None  # None: no setting received yet (the window sends it at start)
        self.folder = ""
        self._lm: Any = None

    @Slot(object, str)
    def configure(self, cfg: DiskConfig, folder: str) -> None:
        """The setting (and the folder it means) for the loaded model now and the models loaded later."""
        self.cfg, self.folder = cfg, folder
        self._apply()

    def attach(self, lm: Any) -> None:
        """A model was loaded: the previous one's tier writes what it queued and stops; the new one gets its own."""
        if self._lm is not None and self._lm is not lm:
            self.detach()
        self._lm = lm
        self._apply()

    def detach(self) -> None:
        """The model goes (or the app quits): its queued pages are written, then the writer stops."""
        lm, self._lm = self._lm, None
        if lm is not None and getattr(getattr(lm, "kv_arenas", None), "disk", None) is not None:
            from engine.kv.tier.disk import configure

            configure(lm, None)

    @Slot()
    def clear(self) -> None:
        """Settings ▸ KV disk cache ▸ Clear: the tier stops (its queue written first, so no file appears after
        the clear), its files go, then it starts again empty."""
        lm = self._lm
        self.detach()
        self._lm = lm
        notes: list[str] = []
        try:
            clear_folder(self.folder)
        except OSError as e:
            log(e)
            notes.append(f"KV disk cache: could not clear {self.folder} ({e.strerror or e})")
        self._apply(notes)

    def _apply(self, notes: list[str] | None = None) -> None:
        notes = list(notes or ())
        tier = None
        if self._lm is not None and self.cfg is not None and hasattr(self._lm, "kv_arenas"):
            try:
                from engine.kv.tier.disk import configure

                tier = configure(self._lm, self.folder if self.cfg.enabled else None,
                                 int(self.cfg.budget_gib * (1 << 30)))
                if tier is not None and not tier.writable:  # said now, not only under the next reply
                    notes += tier.take_notes()
            except Exception as exc:  # noqa: BLE001 - the chat works without the tier: a note, never a crash
                log(exc)
                notes.append(f"KV disk cache off: {describe(exc)}")
                tier = None
        self.changed.emit(DiskState(tier, self.folder, tuple(notes)))
