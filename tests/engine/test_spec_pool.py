"""``SessionPool.speculate``: speculation set once for every chat of the app, applied to the active chat now
(also mid-reply) and to the others when they become active; a draft model per chat, its pages given back."""

from __future__ import annotations

import pytest

from engine.config import CacheConfig, SamplingConfig, SpecConfig
from engine.model.loader import load_model
from engine.core.session_pool import SessionPool
from engine.speculation.draft_model import DraftMismatchError, ModelDrafter, speculation

MESSAGES = [{"role": "user", "content": "Once upon a time, there was a little girl named Lily. Once upon a time"}]
GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=60, ignore_eos=True)


def reply(session, switch=None):
    """The reply's token ids and stats; ``switch(step)`` runs between steps (a setting changed mid-reply)."""
    session.start(MESSAGES, GREEDY, 1)
    step = 0
    while not (r := session.step()).done:
        step += 1
        if switch is not None:
            switch(step)
    return list(session.generated_ids), r.stats


def test_pool_speculates_in_the_active_chat_now_and_in_others_on_activate(stories):
    plain = SessionPool(stories, CacheConfig())
    want, _ = reply(plain.activate(1)[0])
    plain.close()

    pool = SessionPool(stories, CacheConfig())
    first, _ = pool.activate(1)
    assert pool.speculate(SpecConfig(method="ngram", auto_off=False)) == [
        "speculative decoding: ngram, draft length adapts"]
    ids, stats = reply(first)
    assert ids == want and stats.speculative == "ngram" and stats.draft_tokens > 0
    second, notes = pool.activate(2)  # made after the change: it speculates too
    assert second.spec is not None and second.spec.cfg.method == "ngram"
    ids, _ = reply(second, lambda step: step == 10 and pool.speculate(None))  # off mid-reply
    assert ids == want and second.spec is None and first.spec is not None  # the idle chat: on its activation
    assert pool.activate(1)[0].spec is None
    pool.close()


def test_pool_draft_model_per_chat_and_refusal_leaves_the_setting(stories, stories_path, demo_model):
    draft = load_model(str(stories_path))  # the same tokenizer: stories260K drafting for itself
    made = []

    def make():
        made.append(ModelDrafter(draft, stories))
        return made[-1]

    pool = SessionPool(stories, CacheConfig())
    a, _ = pool.activate("a")
    cfg = SpecConfig(method="draft", draft_path=str(stories_path), auto_off=False)
    pool.speculate(cfg, make)
    ids, stats = reply(a)
    assert stats.accepted_draft_tokens == stats.draft_tokens > 0 and len(made) == 1
    b, _ = pool.activate("b")
    assert b.spec.drafter is made[1] and a.spec.drafter is made[0]  # its own draft cache
    with pytest.raises(DraftMismatchError):
        pool.speculate(SpecConfig(method="draft", draft_path="demo"), lambda: ModelDrafter(demo_model, stories))
    assert pool.spec == cfg and b.spec.cfg == cfg  # refused: nothing changed
    pool.speculate(SpecConfig(method="ngram"))  # the draft model's caches are given back in every chat
    assert made[0].cache.n == 0 and a.spec is not None and a.spec.cfg.method == "ngram"
    pool.close()
    assert all(arena.pool.num_used == 0 for arena in draft.arenas)


def test_one_set_up_path_checks_the_draft_model_once_and_changes_only_what_differs(stories, stories_path,
                                                                                  demo_model):
    """``engine.core.speculation_setup``: a draft model with another tokenizer is refused before any session changes;
    a session keeps its drafter for the same draft model; a refused change leaves the session as it was."""
    from engine.core.session import ChatSession
    from engine.errors import EngineError
    from engine.core.speculation_setup import Speculation

    with pytest.raises(DraftMismatchError):
        speculation(SpecConfig(method="draft", draft_path="demo"), demo_model, stories)
    with pytest.raises(ValueError):
        Speculation.of(SpecConfig(method="draft", draft_path="demo"))  # no draft model to draft with
    draft = load_model(str(stories_path))
    cfg = SpecConfig(method="draft", draft_path=str(stories_path), auto_off=False)
    s = ChatSession(stories, CacheConfig())
    assert speculation(cfg, draft, stories).onto(s).startswith("speculative decoding: draft")
    drafter = s.spec.drafter
    assert speculation(cfg, draft, stories).onto(s) == ""  # nothing differs: nothing made
    k2 = SpecConfig(method="draft", draft_path=str(stories_path), draft_tokens=2, auto_off=False)
    speculation(k2, draft, stories).onto(s)
    assert s.spec.drafter is drafter and s.spec.cfg == k2  # the same draft model: its cache goes on
    with pytest.raises(EngineError):
        s.speculate(SpecConfig(method="draft", draft_path="elsewhere"))  # no drafter for another draft model
    assert s.spec.cfg == k2 and s.spec.drafter is drafter
    reply(s)
    assert drafter.cache.n > 0
    assert Speculation.of(None).onto(s) == "speculative decoding off" and s.spec is None
    assert drafter.cache.n == 0  # its pages went back
    s.close()
