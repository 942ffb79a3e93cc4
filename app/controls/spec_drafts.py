"""The worker's speculative decoding: the setting in force on the engine thread and the draft model it loaded.

One draft model is loaded (on the worker's thread, by the backend that loads the chat's model) and shared by
every chat's drafter; each chat gets its own ``engine.speculation.draft_model.ModelDrafter`` (its own draft cache) from the
session pool when it becomes active. A draft model is checked against the chat's model before anything
changes ("can I?" before "do it"): one with another tokenizer is refused with the reason, the setting stays.
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
        and checked first."""
        if cfg.method != "draft":
            return None
        from engine.speculation.draft_model import DraftMismatchError, ModelDrafter, tokenizer_mismatch

        draft = self._model(cfg.draft_path, target, like)
        why = tokenizer_mismatch(draft, target)
        if why:
            raise DraftMismatchError(f"draft model {draft.info.name}: {why}")
        return lambda: ModelDrafter(draft, target, check=False)

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


def with_draft_pool(snap: Any, session: Any) -> Any:
    """``snap`` with the chat's draft model's pool drawn after the model's own (a second group of the page map:
    "draft model: pages 32–63"), when the chat drafts with a draft model; else ``snap`` itself. The draft
    model's pages are its own arena's, shared by every chat's drafter: this chat's are marked as its own."""
    drafter = getattr(getattr(session, "spec", None), "drafter", None)
    cache = getattr(drafter, "cache", None)
    if snap is None or cache is None or cache.store is None or not snap.num_pages:
        return snap
    import numpy as np

    from engine.core.observe import own_pages, page_map

    state, owner, fill, ref, _held, groups = page_map(cache)
    if groups or not len(state):  # a draft model whose layers differ: not drawn (its pools would not line up)
        return snap
    n = snap.num_pages
    mine = snap.page_mine if snap.page_mine is not None else np.ones(n, dtype=bool)
    return dataclasses.replace(
        snap, num_pages=n + len(state),
        page_state=np.concatenate([snap.page_state, state]), page_owner=np.concatenate([snap.page_owner, owner]),
        page_fill=np.concatenate([snap.page_fill, fill]), page_refcount=np.concatenate([snap.page_refcount, ref]),
        page_groups=tuple(snap.page_groups or (("model", n),)) + (("draft model", len(state)),),
        page_mine=np.concatenate([mine, own_pages(cache, len(state), ())]))
