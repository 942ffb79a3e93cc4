"""Lossless cache modes give exactly the tokens of HF's own ``generate`` (greedy, float32)."""

from __future__ import annotations

import pytest
import torch

from engine.config import CacheConfig, SamplingConfig
from engine.core.session import ChatSession

N_STORIES = 300


def hf_greedy(lm, ids: list[int], n: int) -> list[int]:
    x = torch.tensor([ids])
    with torch.inference_mode():
        out = lm.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                                do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def engine_greedy(lm, ids: list[int], n: int, cache: CacheConfig) -> list[int]:
    s = ChatSession(lm, cache)
    s.start_ids(ids, SamplingConfig(max_new_tokens=n, ignore_eos=True))
    while not (r := s.step()).done:
        pass
    assert r.stop_reason == "max_tokens"
    s.close()
    return s.generated_ids


@pytest.fixture(scope="module")
def stories_ref(stories):
    ids = stories.tokenizer("Once upon a time")["input_ids"]
    return ids, hf_greedy(stories, ids, N_STORIES)


def test_reference_is_the_published_story(stories, stories_ref):
    _, ref = stories_ref
    text = stories.tokenizer.decode(ref[:40])
    assert text.startswith(", there was a little girl named Lily.")


@pytest.mark.parametrize("cache", [
    CacheConfig(mode="off"),
    CacheConfig(mode="contiguous"),
    CacheConfig(mode="paged", page_size=1),
    CacheConfig(mode="paged", page_size=3),
    CacheConfig(mode="paged", page_size=16),
    CacheConfig(mode="paged", page_size=256),
], ids=lambda c: f"{c.mode}-{c.page_size}")
def test_stories_exact(stories, stories_ref, cache):
    ids, ref = stories_ref
    got = engine_greedy(stories, ids, N_STORIES, cache)
    assert len(got) == N_STORIES
    assert got == ref


def test_stories_exact_with_scattered_pages(stories, stories_ref):
    """Another session holds every other page, so this one's pages are not consecutive (gather path)."""
    ids, ref = stories_ref
    cache = CacheConfig(mode="paged", page_size=3, max_pages=None)
    arena = stories.kv_arenas.get(3, None, "auto", "auto")
    pool = arena.pool
    arena.ensure_free(40)
    held = pool.allocate(40)
    for p in held[::2]:
        pool.decref(p)
    s = ChatSession(stories, cache)
    s.start_ids(ids, SamplingConfig(max_new_tokens=120, ignore_eos=True))
    while not s.step().done:
        pass
    assert s.store.table.contiguous_start() is None
    assert s.generated_ids == ref[:120]
    s.close()
    for p in held[1::2]:
        pool.decref(p)
    pool.check()


@pytest.mark.parametrize("shape", ["tiny-llama", "tiny-qwen2"])
@pytest.mark.parametrize("mode,page", [("off", 16), ("contiguous", 16), ("paged", 1), ("paged", 5), ("paged", 64)])
def test_random_gqa_models_exact(shape, mode, page):
    from engine.model.shapes import build_shape

    lm = build_shape(shape, seed=7)
    assert lm.info.num_kv_heads < lm.info.num_q_heads  # GQA
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, lm.info.vocab_size, (37,), generator=g).tolist()
    ref = hf_greedy(lm, ids, 120)
    assert engine_greedy(lm, ids, 120, CacheConfig(mode=mode, page_size=page)) == ref


@pytest.mark.parametrize("cache", [CacheConfig(mode="paged", page_size=16), CacheConfig(mode="contiguous")],
                         ids=lambda c: c.mode)
def test_teacher_force_with_a_prefilled_prompt(stories, stories_ref, cache):
    """``teacher_force(ids, prefill=n)``: one yield for the prompt, then one per token, each the logits HF's
    greedy run chose its token from (the first 60 tokens of the published story, prompt as one prefill)."""
    ids, ref = stories_ref
    s = ChatSession(stories, cache)
    rows = list(s.teacher_force(ids + ref[:59], prefill=len(ids)))
    s.close()
    assert len(rows) == 60
    assert [int(r.argmax()) for r in rows] == ref[:60]
    one_by_one = list(ChatSession(stories, cache).teacher_force(ids + ref[:59]))[len(ids) - 1:]
    assert max(float((a - b).abs().max()) for a, b in zip(rows, one_by_one)) < 1e-4
