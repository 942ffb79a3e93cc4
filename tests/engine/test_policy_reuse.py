"""A chat under an eviction policy goes on from its cache: the next turn feeds only its new tokens (#19 item 10:
it used to keep only the sinks, 'reused 12, recomputed 1132'). Real stories260K."""

from __future__ import annotations

import pytest

from engine.config import CacheConfig, SamplingConfig
from engine.core.session import ChatSession

POLICIES = {
    "streaming": {"sinks": 4, "window": 60},
    "h2o": {"budget": 64, "recent": 32},
    "expected": {"budget": 64, "recent": 16},
}


def _reply(s: ChatSession, messages: list[dict], n: int):
    st = s.start(messages, SamplingConfig(max_new_tokens=n, ignore_eos=True))
    text = []
    while True:
        r = s.step()
        if r.event is not None:
            text.append(r.event.text_delta)
        if r.done:
            return st, r.stats, "".join(text)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_the_next_turn_goes_on_from_the_evicted_cache(stories, policy):
    s = ChatSession(stories, CacheConfig(mode="paged", page_size=4, policy=policy, policy_params=POLICIES[policy]))
    msgs = [{"role": "user", "content": "Once upon a time there was a little girl named Lily."}]
    _, first, text = _reply(s, msgs, 120)
    assert s.evicted_total > 0  # the policy ran during the first reply
    fed, gone = s.index.next_pos, s.index.evicted_count()  # gone: positions no layer holds (H2O: per layer)
    msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": "Tell me more."}]
    start, second, _ = _reply(s, msgs, 20)
    new = start.prompt_tokens - fed
    assert 0 < new < 40  # the new message and the template's markers, not the whole chat
    assert start.reused_tokens == fed - gone and second.recomputed_tokens == new and start.dropped_tokens == gone > 0
    assert start.reused_tokens + start.recomputed_tokens + start.dropped_tokens == start.prompt_tokens
    s.index.check()
    assert s.cached_tokens <= sum(POLICIES[policy].values()) + 1


def test_a_prompt_that_does_not_go_on_recomputes_with_the_policy(stories):
    s = ChatSession(stories, CacheConfig(mode="paged", page_size=4, policy="streaming",
                                         policy_params=POLICIES["streaming"]))
    _reply(s, [{"role": "user", "content": "Once upon a time there was a little girl named Lily."}], 120)
    start, stats, _ = _reply(s, [{"role": "user", "content": "A different story about a dog."}], 8)
    assert start.dropped_tokens == 0 and stats.generated_tokens == 8  # edited history: the common-prefix path
