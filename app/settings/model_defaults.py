"""A model's own defaults for new chats (Qt-free): the cache and speculation settings saved per model
(``model/defaults``: {model source: a chat's own settings, {"cache": {...}, "spec": {...}}}), chosen with "Make
default for this model". A new chat of that model starts from them, else from the user's defaults; a chat's own
settings always come first (opening a chat puts its own back in force, whatever the model's defaults say since).
"""

from __future__ import annotations

import json
from typing import Any

KEPT_MODELS = 32  # models whose defaults are kept (the least recently saved go)


class ModelDefaults:
    """Reads and writes ``model/defaults`` in ``settings``."""

    def __init__(self, settings) -> None:
        self.settings = settings

    def _all(self) -> dict:
        found = self.settings.get("model/defaults")
        return found if isinstance(found, dict) else {}

    def get(self, model: str) -> dict:
        """``model``'s own defaults as a chat's own settings ({} when it has none)."""
        found = self._all().get(model) if model else None
        return found if isinstance(found, dict) else {}

    def save(self, model: str, own_json: str) -> None:
        """``own_json`` (a chat's own settings, as ``chat_settings_json`` writes them) as ``model``'s defaults."""
        if not model:
            return
        every = self._all()
        every.pop(model, None)
        every[model] = json.loads(own_json)
        self.settings.set("model/defaults", dict(list(every.items())[-KEPT_MODELS:]))

    def forget(self, model: str) -> bool:
        """``model``'s new chats follow the user's defaults again; True if it had its own."""
        every = self._all()
        if every.pop(model, None) is None:
            return False
        self.settings.set("model/defaults", every)
        return True

    @staticmethod
    def name(info: Any) -> str:
        """The key a loaded model's defaults are kept under (its source: a folder, a file, a hub id)."""
        return str(getattr(info, "source", "") or "") if info is not None else ""
