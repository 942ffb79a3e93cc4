"""The worker's speculative decoding: the setting in force on the engine thread and the draft model it loaded.

One draft model is loaded (on the worker's thread, by the backend that loads the chat's model) and shared by
every chat's drafter; each chat gets its own ``engine.speculation.draft_model.ModelDrafter`` (its own draft cache)
from the session pool when it becomes active, through the engine's one set-up path (``engine.core.speculation_setup``).
A draft model is checked against the chat's model before anything changes ("can I?" before "do it"): one with
another tokenizer is refused with the reason, the setting stays. The draft model's pool in a chat's page map is
the engine's snapshot's own (``engine.core.observe.with_draft_pool``).
Imports torch only when a draft model is loaded (this module is imported with the worker, on the GUI thread).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable

from engine.config import ModelSpec, SpecConfig


class SpecDrafts:
    """``cfg``: the speculation the chats have (or will have when a model loads)."""

    def __init__(self, load: Callable[[ModelSpec, Callable[..., None], threading.Event], Any]) -> None:
        self._load = load  # the backend's model loader
        self.cfg = SpecConfig()
        self._draft: tuple[str, str, Any] | None = None  # (path, device, loaded draft model)

    def apply(self, cfg: SpecConfig, target: Any, like: ModelSpec | None, pool: Any) -> list[str]:
        """Make ``cfg`` the speculation of ``pool``'s chats (``target``: the chat's loaded model; None: no model
        yet, the setting waits for one). Raises (typed) with nothing changed: a draft model that does not
        load, or one with another tokenizer (``DraftMismatchError``)."""
        make = self.drafters(cfg, target, like) if target is not None else None
        notes = list(pool.speculate(cfg, make)) if pool is not None and hasattr(pool, "speculate") else []
        self.cfg = cfg
        if cfg.method != "draft":
            self._draft = None  # the weights go with the last drafter that used them
        return notes

    def drafters(self, cfg: SpecConfig, target: Any, like: ModelSpec | None) -> Callable[[], Any] | None:
        """A maker of drafters for ``cfg`` on ``target`` (None unless a draft model), the draft model loaded
        and checked first (``engine.speculation.draft_model.speculation``)."""
        if cfg.method != "draft":
            return None
        from engine.speculation.draft_model import speculation

        return speculation(cfg, self._model(cfg.draft_path, target, like), target).make_drafter

    def _model(self, path: str, target: Any, like: ModelSpec | None) -> Any:
        """The draft model at ``path`` on ``target``'s device: the one loaded already, or loaded now."""
        device = target.device.type
        if self._draft is not None and self._draft[:2] == (path, device):
            return self._draft[2]
        base = like if like is not None else ModelSpec(source=path)
        spec = dataclasses.replace(base, source=path, device=device, quantization="none")
        loaded = self._load(spec, lambda *a, **k: None, threading.Event())
        self._draft = (path, device, loaded)
        return loaded

