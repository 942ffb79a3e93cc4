"""What a cache setting needs from the rest (``CacheConfig.need`` / ``unmet`` / ``fitted``) is exactly what the
engine refuses, and the overflow modes' notes say what they do rather than blame a budget (#31 item 4)."""

from __future__ import annotations

import itertools

import pytest

from engine.config import FALLBACK, OVERFLOWS, CacheConfig, Need, SamplingConfig
from engine.core.reconfigure import validate
from engine.core.session import ChatSession

FIELDS = ("k_dtype", "v_dtype", "policy", "overflow")
COMBOS = list(itertools.product(("off", "contiguous", "paged"), ("auto", "int8"), ("none", "streaming"), OVERFLOWS))


@pytest.mark.parametrize("mode,kv,policy,overflow", COMBOS)
def test_the_engine_refuses_a_config_exactly_when_a_need_is_unmet(stories, mode, kv, policy, overflow):
    cfg = CacheConfig(mode=mode, k_dtype=kv, v_dtype=kv, policy=policy, overflow=overflow)
    unmet = {name: cfg.unmet(name) for name in FIELDS if cfg.unmet(name) is not None}
    if unmet:
        with pytest.raises(ValueError):
            validate(cfg, stories)
    else:
        validate(cfg, stories)
    fitted = cfg.fitted()
    validate(fitted, stories)  # what the controls fall back to always runs
    assert (fitted == cfg) == (not unmet)
    changed = {n for n in FIELDS if getattr(fitted, n) != getattr(cfg, n)}
    assert fitted.mode == cfg.mode and set(unmet) <= changed and all(getattr(fitted, n) == FALLBACK[n] for n in changed)


def test_each_need_names_what_it_waits_for():
    paged = CacheConfig()
    assert paged.need("overflow", "rolling") is Need.CACHE and paged.need("overflow", "stop") is None
    assert paged.need("overflow", "policy") is Need.POLICY and paged.unmet("overflow", "policy") is Need.POLICY
    assert paged.need("k_dtype", "int4") is Need.PAGED and paged.unmet("k_dtype", "int4") is None
    off = CacheConfig(mode="off")
    assert off.unmet("overflow", "truncate_middle") is Need.CACHE and off.unmet("policy", "h2o") is Need.CACHE
    assert CacheConfig(mode="contiguous").unmet("v_dtype", "int8") is Need.PAGED
    # the policy falls back first, so an overflow that needed it falls back too
    assert CacheConfig(mode="off", policy="h2o", overflow="policy").fitted().overflow == "stop"


def _past_the_context(s: ChatSession) -> list[str]:
    """Three turns of 200 tokens on stories260K's 512-token context: the third goes past it."""
    warnings: list[str] = []
    msgs: list[dict] = []
    for text in ("Once upon a time there was a little dog.", "What did the dog do next?", "And then?"):
        msgs.append({"role": "user", "content": text})
        s.start(msgs, SamplingConfig(max_new_tokens=200, ignore_eos=True))
        while not (r := s.step()).done:
            pass
        assert r.stop_reason == "max_tokens"
        warnings += r.warnings
        msgs.append({"role": "assistant", "content": r.text})
    return warnings


def test_drop_the_oldest_says_it_drops_the_start_not_that_a_budget_is_too_small(stories):
    """#31 item 4: "The budget (256) is smaller than the protected prompt (… 12 tokens)" showed under the rolling
    overflow on every reply past the context; dropping the start is what the setting does."""
    s = ChatSession(stories, CacheConfig(overflow="rolling"))
    try:
        notes = " ".join(_past_the_context(s))
    finally:
        s.close()
    assert "rolling: drops the oldest tokens to make room, the start of the chat (system + first message" in notes
    assert "smaller than the protected prompt" not in notes and "raise the budget" not in notes
