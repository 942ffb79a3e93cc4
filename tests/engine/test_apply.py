"""Switching the cache between two decode steps, in the middle of a reply."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings

from engine.config import CacheConfig, SamplingConfig
from engine.core.session import ChatSession

N = 80


def reply(lm, cache, switches: dict[int, CacheConfig]):
    s = ChatSession(lm, cache)
    s.start_completion("Once upon a time", SamplingConfig(max_new_tokens=N, ignore_eos=True))
    notes, step, snaps = [], 0, []
    while True:
        if step in switches:
            notes += s.apply(switches[step])
        r = s.step()
        snaps.append(r.snapshot)
        step += 1
        if r.done:
            return s.generated_ids, notes, snaps


@pytest.mark.parametrize("start,switches", [
    (CacheConfig(mode="contiguous"), {10: CacheConfig(mode="paged", page_size=4)}),
    (CacheConfig(mode="paged", page_size=16), {5: CacheConfig(mode="contiguous"), 30: CacheConfig(mode="paged", page_size=3)}),
    (CacheConfig(mode="paged", page_size=1), {20: CacheConfig(mode="paged", page_size=256)}),
    (CacheConfig(mode="paged", page_size=8), {15: CacheConfig(mode="off"), 25: CacheConfig(mode="paged", page_size=8)}),
], ids=["contig-paged", "paged-contig-paged", "page1-page256", "paged-off-paged"])
def test_lossless_switch_mid_reply_gives_unswitched_tokens(stories, start, switches):
    ref, _, _ = reply(stories, CacheConfig(mode="contiguous"), {})
    got, notes, snaps = reply(stories, start, switches)
    assert got == ref
    assert notes  # every switch says what it did
    last_switch = max(switches)
    after = snaps[last_switch]
    assert after.mode == switches[last_switch].mode
    if after.mode == "paged":
        assert after.page_size == switches[last_switch].page_size


def test_switch_reports_copy_and_reprefill(stories):
    _, notes, snaps = reply(stories, CacheConfig(mode="paged", page_size=8),
                            {10: CacheConfig(mode="contiguous"), 20: CacheConfig(mode="off"),
                             30: CacheConfig(mode="paged", page_size=8)})
    assert any("moved" in n and "paged/8 → contiguous" in n for n in notes)
    assert any("recomputed every step" in n for n in notes)
    assert any("re-prefilled" in n for n in notes)
    assert snaps[20].mode == "off" and snaps[20].kv_bytes == 0
    assert snaps[30].mode == "paged" and snaps[30].tokens_per_layer[0] == snaps[30].seq_len - 1 > 30


LOSSLESS = st.one_of(st.just(CacheConfig(mode="off")), st.just(CacheConfig(mode="contiguous")),
                     st.builds(lambda p: CacheConfig(mode="paged", page_size=p), st.integers(1, 64)))


@pytest.fixture(scope="module")
def hf_reference(stories):
    from test_exact import hf_greedy

    ids = stories.tokenizer("Once upon a time")["input_ids"]
    return ids, hf_greedy(stories, ids, 120)


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(start=LOSSLESS, switches=st.lists(st.tuples(st.integers(0, 119), LOSSLESS), max_size=6))
def test_random_lossless_switches_mid_reply_give_exactly_hf_greedy_tokens(stories, hf_reference, start, switches):
    """Only lossless settings (off, contiguous, paged at any page size), switched at random steps of the reply:
    the tokens are exactly those of HF's own greedy ``generate``."""
    ids, ref = hf_reference
    s = ChatSession(stories, start)
    s.start_ids(ids, SamplingConfig(max_new_tokens=120, ignore_eos=True))
    at = dict(switches)
    step = 0
    while True:
        if step in at:
            s.apply(at[step])
        r = s.step()
        step += 1
        if r.done:
            break
    s.close()
    assert s.generated_ids == ref


def test_a_page_size_change_keeps_each_pages_turn(stories):
    """#19 item 13: after a page-size change every page took the current turn's colour; each page keeps the turn
    that wrote its first token."""
    from engine.config import CacheConfig, SamplingConfig
    from engine.core.session import ChatSession

    s = ChatSession(stories, CacheConfig(mode="paged", page_size=4))
    msgs = [{"role": "user", "content": "Once upon a time"}]
    for turn in range(2):
        s.start(msgs, SamplingConfig(max_new_tokens=20, ignore_eos=True))
        while not s.step().done:
            pass
        msgs += [{"role": "assistant", "content": "And then"}, {"role": "user", "content": "Tell me more"}]
    pool = s.store.arena.pool
    before = [pool.owner[p] for p in s.store.table.pages]
    assert len(set(before)) >= 2
    s.apply(CacheConfig(mode="paged", page_size=8))
    pool = s.store.arena.pool
    after = [pool.owner[p] for p in s.store.table.pages]
    assert after == [before[2 * j] for j in range(len(after))]  # page j of 8 starts where page 2j of 4 did
