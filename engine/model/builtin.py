"""The model shipped with KV Scope: Karpathy's pretrained stories260K (MIT), in ``resources/models/stories260K``.

It is the default when no other model is chosen, because it writes real (tiny-story) English in about a
megabyte; ``demo`` (random weights, ``engine.model.demo``) stays for shapes only a made-up model has. The folder is
found the same way in a source checkout, an installed wheel (``resources/`` is installed beside ``engine/``)
and the PyInstaller bundle (``sys._MEIPASS/resources``), so nothing outside the project is read.
"""

from __future__ import annotations

import sys
from pathlib import Path

BUILTIN_MODEL = "stories260K"  # the source name: ``--model stories260K``, the app's "model/last" default
BUILTIN_LABEL = "stories260K (built-in, tiny stories)"  # how menus and lists name it
DEMO_LABEL = "demo (random weights)"


def builtin_model_dir() -> Path:
    """The shipped stories260K folder (``config.json``, weights, tokenizer, README with licence and provenance).

    Frozen: ``sys._MEIPASS/resources/models/stories260K``; otherwise ``<project>/resources/models/stories260K``
    next to the ``engine`` package. Returns the last candidate when none exists, so an error names a real path.
    """
    frozen = getattr(sys, "_MEIPASS", None)
    roots = ([Path(frozen)] if frozen else []) + [Path(__file__).resolve().parents[2]]
    candidates = [r / "resources" / "models" / BUILTIN_MODEL for r in roots]
    for c in candidates:
        if (c / "config.json").is_file():
            return c
    return candidates[-1]


def is_builtin(source: str) -> bool:
    """Whether ``source`` names the shipped model (its name, any case)."""
    return source.strip().lower() == BUILTIN_MODEL.lower()
