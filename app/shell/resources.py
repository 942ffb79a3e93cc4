"""Where the app's resource files (icons) live: ``resources/`` next to the package, or inside a
PyInstaller bundle (``sys._MEIPASS/resources``)."""

from __future__ import annotations

import sys
from pathlib import Path

ICON_SIZES = (16, 32, 48, 64, 128, 256)


def resources_dir() -> Path:
    frozen = getattr(sys, "_MEIPASS", None)
    candidates = ([Path(frozen) / "resources"] if frozen else []) + [Path(__file__).resolve().parents[2] / "resources"]
    for c in candidates:
        if c.is_dir():
            return c
    return candidates[-1]


def app_icon():
    """The KV Scope icon (an empty QIcon if the files are missing)."""
    from PySide6.QtGui import QIcon

    icon = QIcon()
    folder = resources_dir() / "icons"
    for n in ICON_SIZES:
        path = folder / f"kvscope-{n}.png"
        if path.exists():
            icon.addFile(str(path))
    return icon
