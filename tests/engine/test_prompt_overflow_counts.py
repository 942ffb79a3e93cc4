"""A prompt longer than the context under "drop the middle" / "rolling" (#19 item 5): the turn's numbers count
what the model computed, and what was dropped is said, with its count and positions. (A 100 KB paste said
"prefill 1,622,326 tok/s · 43,389 prompt tokens · recomputed 43389" when ~256 tokens were computed.)"""

from __future__ import annotations

import dataclasses

import pytest

from engine.config import CacheConfig, SamplingConfig
from engine.core.session import ChatSession

PROMPT = 3_000  # ids, on stories260K's context of 512


@pytest.mark.parametrize("overflow", ["truncate_middle", "rolling"])
def test_dropped_prompt_tokens_are_neither_computed_nor_reused(stories, overflow):
    lm = dataclasses.replace(stories, arenas=None)
    ctx = lm.info.context_length
    s = ChatSession(lm, CacheConfig(mode="paged", page_size=16, overflow=overflow))
    ids = [1] + [403, 407, 261, 378, 432, 383, 286, 261, 376, 298] * ((PROMPT - 1) // 10) + [315] * ((PROMPT - 1) % 10)
    assert len(ids) == PROMPT
    s.start_ids(ids, SamplingConfig(temperature=0.0, max_new_tokens=4, ignore_eos=True))
    events, warnings = [], []
    while not (r := s.step()).done:
        events += [r.event] if r.event else []
        warnings += r.warnings
    events += [r.event] if r.event else []
    warnings += r.warnings
    st = r.stats
    read = ctx // 2  # what the overflow keeps of a prompt that does not fit
    assert (st.prompt_tokens, st.reused_tokens, st.recomputed_tokens, st.dropped_tokens) == \
        (PROMPT, 0, read, PROMPT - read)
    # the rate is over the tokens computed, in the time they took
    assert st.prefill_tokens_per_s == pytest.approx(read / (st.prefill_ms / 1000.0))
    # the first token's event counts the prompt tokens its prefill read, not the ones dropped
    first = events[0]
    assert first.phase == "prefill" and first.tokens_in_step == read
    assert r.snapshot.recomputed_tokens == read
    # the account the Why readout and the footer show says the same, its misses after the dropped tokens
    for account in (st.cache, r.snapshot.account):
        assert (account.prompt, account.reused, account.recomputed, account.dropped) == (PROMPT, 0, read, PROMPT - read)
        assert account.misses[0].start == PROMPT - read and account.misses[-1].end == PROMPT
        assert sum(m.tokens for m in account.misses) == read
    note = f"{PROMPT - read:,} tokens of the prompt (positions 0–{PROMPT - read - 1:,}) were dropped to fit the " \
           f"context of {ctx} tokens, unread; the {read} after them were read"
    assert note in warnings, warnings
    # the next turn on the same chat: nothing is dropped, the counts start over
    s.start_ids(ids[-read:] + s.generated_ids + [403, 407], SamplingConfig(temperature=0.0, max_new_tokens=2))
    while not (r := s.step()).done:
        pass
    assert r.stats.dropped_tokens == 0 and r.stats.recomputed_tokens + r.stats.reused_tokens == r.stats.prompt_tokens
    s.close()
