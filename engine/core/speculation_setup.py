"""Setting speculative decoding up on a session: the one path every owner takes (the app's chats through the
session pool, the API server's conversations through theirs, a tool's single session).

``Speculation`` is what a set of sessions speculates with: a ``SpecConfig`` and, for a draft model, a maker of
drafters. Each session gets its own drafter (its own draft cache in the draft model's arena); the draft model's
weights are loaded once and shared. ``engine.speculation.draft_model.speculation`` checks the draft model against the chat's model
once, before anything changes ("can I?" before "do it"), so making a drafter later cannot be refused.
``Speculation.onto(session)`` puts the setting on a session when it differs, making a drafter only when the
session does not draft with that model already. ``speculator`` is the step under ``ChatSession.speculate``: the
session's next ``Speculator`` from its old one, the setting and a drafter.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from engine.config import SpecConfig
from engine.errors import EngineError
from engine.core.verify import NgramDrafter, Speculator

NO_DRAFT_MODEL = "speculative decoding with a draft model needs the draft model loaded"


def same_draft_model(old: SpecConfig | None, new: SpecConfig | None) -> bool:
    """Both draft with the same draft model (a drafter of ``old`` can go on drafting for ``new``)."""
    return (old is not None and new is not None and old.method == new.method == "draft"
            and old.draft_path == new.draft_path)


@dataclass(frozen=True)
class Speculation:
    """``cfg`` for every session of a pool, with ``make_drafter`` (a new draft-model drafter per session; only
    for method draft, where it is required: ``ValueError`` without it)."""

    cfg: SpecConfig = field(default_factory=SpecConfig)
    make_drafter: Callable[[], Any] | None = None

    def __post_init__(self) -> None:
        if self.cfg.method == "draft" and self.make_drafter is None:
            raise ValueError(NO_DRAFT_MODEL)
        if self.cfg.method != "draft" and self.make_drafter is not None:
            object.__setattr__(self, "make_drafter", None)  # frozen: a maker the method does not use is dropped

    @classmethod
    def of(cls, cfg: SpecConfig | None, make_drafter: Callable[[], Any] | None = None) -> "Speculation":
        """``cfg`` (None: off) with ``make_drafter`` where it drafts with a draft model."""
        return cls(cfg or SpecConfig(), make_drafter)

    def onto(self, session: Any) -> str:
        """``session`` speculating as this says: its note, or "" when it does already. The drafter is made
        before the session changes, so a failure leaves the session as it was."""
        old = session.spec.cfg if session.spec is not None else None
        if old == self.cfg or (old is None and self.cfg.method == "off"):
            return ""
        # the same draft model: the session keeps its drafter (and its draft cache, which follows the chat)
        fresh = self.make_drafter is not None and not same_draft_model(old, self.cfg)
        return session.speculate(self.cfg, self.make_drafter() if fresh else None)


def speculator(old: Speculator | None, cfg: SpecConfig | None, drafter: Any, verdicts: dict | None) -> Speculator | None:
    """The session's speculator after a change to ``cfg`` (None or method off: none). Its drafter: ``drafter``
    if given; else the old one's when it drafts with the same draft model; else a new prompt lookup. The old
    speculator is closed unless its drafter goes on. A draft model without a drafter is refused (typed) before
    anything changes."""
    on = cfg is not None and cfg.method != "off"
    keep = on and drafter is None and old is not None and same_draft_model(old.cfg, cfg)
    if on and drafter is None and not keep:
        if cfg.method != "ngram":
            raise EngineError(NO_DRAFT_MODEL)
        drafter = NgramDrafter(cfg.max_ngram)
    if old is not None and not keep:
        old.close()  # a draft model's cache gives its pages back
    if not on:
        return None
    return Speculator(cfg, old.drafter if keep else drafter, verdicts)


def describe(cfg: SpecConfig | None) -> str:
    """The note a change of speculation leaves."""
    if cfg is None or cfg.method == "off":
        return "speculative decoding off"
    return f"speculative decoding: {cfg.label}, " + (f"{cfg.draft_tokens} draft tokens per forward"
                                                     if cfg.draft_tokens else "draft length adapts")
