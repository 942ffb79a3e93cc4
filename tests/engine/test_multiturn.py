"""Prefix reuse across turns: same tokens as re-prefilling from scratch, and only new tokens prefilled."""

from __future__ import annotations

import pytest

from engine.config import CacheConfig, SamplingConfig
from engine.core.session import ChatSession

USER_TURNS = ["Tell me a story about a cat.", "What did the cat eat?", "And then?"]
SAMPLING = SamplingConfig(max_new_tokens=30)


def run_chat(lm, cache: CacheConfig):
    """Three turns; returns [(stats, generated ids, text)] and the session."""
    s = ChatSession(lm, cache)
    history: list[dict] = [{"role": "system", "content": "You tell short stories."}]
    out = []
    for u in USER_TURNS:
        history.append({"role": "user", "content": u})
        stats = s.start(history, SAMPLING)
        while not (r := s.step()).done:
            pass
        out.append((stats, s.generated_ids, r.text, r.stats))
        history.append({"role": "assistant", "content": r.text})
    return out, s


@pytest.mark.parametrize("model", ["stories", "demo"])
@pytest.mark.parametrize("cache", [CacheConfig(mode="paged", page_size=4), CacheConfig(mode="contiguous")],
                         ids=["paged4", "contiguous"])
def test_reuse_equals_scratch_and_prefills_only_new_tokens(request, model, cache):
    lm = request.getfixturevalue("stories") if model == "stories" else request.getfixturevalue("demo_model")
    reuse, s = run_chat(lm, cache)
    scratch, _ = run_chat(lm, cache.replace(prefix_reuse=False))
    assert [ids for _, ids, _, _ in reuse] == [ids for _, ids, _, _ in scratch]
    # turn 1: nothing cached
    first = reuse[0][0]
    assert first.reused_tokens == 0 and first.recomputed_tokens == first.prompt_tokens
    assert first.first_divergence == -1
    for turn in (1, 2):
        stats = reuse[turn][0]
        prev_stats, prev_ids = reuse[turn - 1][0], reuse[turn - 1][1]
        cached_before = prev_stats.prompt_tokens + len(prev_ids) - 1  # the last sampled token is never fed
        # the rendered chat repeats the reply's text; everything up to where it diverged is reused
        assert stats.reused_tokens == stats.first_divergence
        assert stats.reused_tokens >= prev_stats.prompt_tokens
        assert stats.reused_tokens <= cached_before
        assert stats.recomputed_tokens == stats.prompt_tokens - stats.reused_tokens
        assert stats.recomputed_tokens < stats.prompt_tokens // 2
        # scratch re-prefills everything
        assert scratch[turn][0].reused_tokens == 0
        assert scratch[turn][0].recomputed_tokens == scratch[turn][0].prompt_tokens
    s.close()


def test_reuse_counts_exact_with_raw_continuation(stories):
    """A raw prompt that extends the whole cached sequence reuses all of it: prefill = new tokens only."""
    s = ChatSession(stories, CacheConfig(mode="paged", page_size=8))
    s.start_completion("Once upon a time", SamplingConfig(max_new_tokens=20))
    while not s.step().done:
        pass
    cached = s.cached_tokens
    assert cached == len(s.seq) - 1
    extra = stories.tokenizer(" Lily smiled.", add_special_tokens=False)["input_ids"]
    stats = s.start_ids(s.seq + extra, SamplingConfig(max_new_tokens=5))
    assert stats.reused_tokens == cached
    assert stats.recomputed_tokens == 1 + len(extra)
    assert stats.first_divergence == cached


def test_regenerate_and_edit_reuse_exactly_the_common_prefix(stories):
    tok = stories.tokenizer
    s = ChatSession(stories, CacheConfig(mode="paged", page_size=4))
    msgs = [{"role": "user", "content": "Tell me a story about a dog."}]
    s.start(msgs, SAMPLING)
    while not s.step().done:
        pass
    first_ids = s.generated_ids
    # regenerate: the same messages again → everything but the last prompt token is reused
    stats = s.start(msgs, SAMPLING)
    assert stats.reused_tokens == stats.prompt_tokens - 1
    assert stats.recomputed_tokens == 1
    while not s.step().done:
        pass
    assert s.generated_ids == first_ids  # greedy: regenerate is deterministic
    # edit: change the last word → reuse stops exactly where the token ids start to differ
    edited = [{"role": "user", "content": "Tell me a story about a fish."}]
    from engine.model.chat import render_chat

    a, b = render_chat(tok, msgs), render_chat(tok, edited)
    common = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    stats = s.start(edited, SAMPLING)
    assert stats.first_divergence == common
    assert stats.reused_tokens == common
    assert stats.recomputed_tokens == len(b) - common
    while not s.step().done:
        pass
    fresh = ChatSession(stories, CacheConfig(mode="paged", page_size=4))
    fresh.start(edited, SAMPLING)
    while not fresh.step().done:
        pass
    assert s.generated_ids == fresh.generated_ids


def test_fork_shares_full_pages_and_diverges_independently(stories):
    s = ChatSession(stories, CacheConfig(mode="paged", page_size=4))
    s.start_completion("Once upon a time there was", SamplingConfig(max_new_tokens=10))
    while not s.step().done:
        pass
    pool = s.store.arena.pool
    before = [pool.ref[p] for p in s.store.table.pages]  # > 1 where an earlier test's live chat shares a prefix page
    f = s.fork()
    assert f.store.table.pages == s.store.table.pages
    assert [pool.ref[p] for p in s.store.table.pages] == [r + 1 for r in before]
    base = list(s.seq)
    tail_a = stories.tokenizer(" a cat", add_special_tokens=False)["input_ids"]
    tail_b = stories.tokenizer(" a big dog", add_special_tokens=False)["input_ids"]
    s.start_ids(base + tail_a, SamplingConfig(max_new_tokens=15))
    while not s.step().done:
        pass
    f.start_ids(base + tail_b, SamplingConfig(max_new_tokens=15))
    while not f.step().done:
        pass
    full_pages = (len(base) - 1) // 4
    shared = [p for p in s.store.table.pages if p in set(f.store.table.pages)]
    assert len(shared) == full_pages
    for ref_sess, tail in ((s, tail_a), (f, tail_b)):
        fresh = ChatSession(stories, CacheConfig(mode="contiguous"))
        fresh.start_ids(base + tail, SamplingConfig(max_new_tokens=15))
        while not fresh.step().done:
            pass
        assert ref_sess.generated_ids == fresh.generated_ids
    s.close()
    f.close()
    pool.check()


def test_snapshot_reports_reuse_and_pages(stories):
    s = ChatSession(stories, CacheConfig(mode="paged", page_size=8))
    msgs = [{"role": "user", "content": "Hello"}]
    s.start(msgs, SamplingConfig(max_new_tokens=12))
    while not (r := s.step()).done:
        snap = r.snapshot
        assert snap.tokens_per_layer.tolist() == [s.cached_tokens] * stories.info.num_layers
        assert snap.pages_used_per_layer[0] == -(-s.cached_tokens // 8)
        assert snap.kv_bytes == snap.pages_used_per_layer[0] * 8 * stories.info.kv_bytes_per_token
    msgs += [{"role": "assistant", "content": r.text}, {"role": "user", "content": "More"}]
    s.start(msgs, SamplingConfig(max_new_tokens=3))
    r = s.step()
    assert r.snapshot.reused_tokens > 0
    assert r.snapshot.reused_tokens + r.snapshot.recomputed_tokens == len(s.seq) - 1
    assert r.event.phase == "prefill" and r.event.tokens_in_step == r.snapshot.recomputed_tokens
    r2 = s.step()
    assert r2.event.phase == "decode" and r2.event.tokens_in_step == 1
