"""A masked attention of several queries over grouped K/V heads (a prefix-reuse prefill: new tokens after cached
ones) reads each K/V head for its group of query heads instead of copying K/V out per query head: the same bits as
transformers' sdpa, and the same greedy tokens as HF ``generate``."""

from __future__ import annotations

import itertools

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from engine.config import CacheConfig, SamplingConfig
from engine.core.session import ChatSession
from engine.kv.store import attention, prefill_attend


class _Layer(torch.nn.Module):
    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups, self.is_causal = groups, True


def _inputs(dt, hq, hk, q, n, additive):
    g = torch.Generator().manual_seed(q * 7919 + n)
    query = torch.randn(1, hq, q, 64, generator=g).to(dt)  # [1, Hq, q, D]
    key, value = (torch.randn(1, hk, n, 64, generator=g).to(dt) for _ in range(2))  # [1, Hk, n, D]
    mask = torch.ones(q, n, dtype=torch.bool).tril(n - q)[None, None]  # [1, 1, q, n]: the new tokens end the K/V
    if additive:
        mask = torch.zeros(1, 1, q, n, dtype=dt).masked_fill(~mask, torch.finfo(dt).min)
    return query, key, value, mask


@pytest.mark.parametrize("dt,additive", itertools.product((torch.float32, torch.bfloat16), (False, True)))
@pytest.mark.parametrize("hq,hk", [(9, 3), (4, 1), (14, 2)])
@pytest.mark.parametrize("q,n", [(2, 40), (17, 300), (80, 1080)])
def test_masked_gqa_gives_transformers_sdpa_bits(dt, additive, hq, hk, q, n):
    query, key, value, mask = _inputs(dt, hq, hk, q, n, additive)
    layer = _Layer(hq // hk)
    ref, _ = sdpa_attention_forward(layer, query, key, value, mask, scaling=0.125)  # repeat_kv, then SDPA
    out = attention._masked_gqa(layer, query, key, value, mask, {"scaling": 0.125})
    assert out.shape == ref.shape == (1, q, hq, 64)
    assert torch.equal(out, ref)
    if dt == torch.float32:  # (a few reduced-precision queries run in float32 there: another path)
        got = attention.sdpa(layer, query, key, value, mask, scaling=0.125)[0]
        if prefill_attend.attend(layer, query, key, value, mask, {"scaling": 0.125}) is None:
            assert torch.equal(got, ref)
        else:  # the native kernel (one thread, enough keys): float32 summation order
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)


def test_masked_gqa_leaves_what_it_does_not_cover_to_transformers():
    query, key, value, mask = _inputs(torch.float32, 9, 3, 5, 40, False)
    layer = _Layer(3)
    assert attention._masked_gqa(layer, query[:, :, :1], key, value, mask[:, :, :1], {}) is None  # one query
    assert attention._masked_gqa(layer, query, key, value, None, {}) is None  # no mask: transformers' GQA already
    assert attention._masked_gqa(_Layer(1), query[:, :3], key, value, mask, {}) is None  # no groups
    assert attention._masked_gqa(layer, query, key, value, mask, {"softcap": 30.0}) is None
    assert attention._masked_gqa(layer, query, key, value, mask, {"s_aux": torch.zeros(9)}) is None


@pytest.mark.parametrize("shape", ["tiny-llama", "tiny-qwen2"])
def test_a_reused_prefix_prefill_over_grouped_heads_gives_hf_greedy_tokens(shape, monkeypatch):
    from engine.model.shapes import build_shape

    lm = build_shape(shape, seed=11)
    assert lm.info.num_kv_heads < lm.info.num_q_heads  # GQA
    ids = torch.randint(0, lm.info.vocab_size, (90,), generator=torch.Generator().manual_seed(5)).tolist()
    x = torch.tensor([ids])
    with torch.inference_mode():
        ref = lm.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=40, min_new_tokens=40,
                                do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    taken = []
    real = attention._masked_gqa

    def counted(*a):
        out = real(*a)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(attention, "_masked_gqa", counted)
    s = ChatSession(lm, CacheConfig(mode="paged", page_size=16))
    s.start_ids(ids[:50], SamplingConfig(max_new_tokens=3, ignore_eos=True))  # 50 cached, then 40 new after them
    while not s.step().done:
        pass
    taken.clear()
    stats = s.start_ids(ids, SamplingConfig(max_new_tokens=40, ignore_eos=True))
    assert stats.reused_tokens == 50 and stats.recomputed_tokens == 40
    while not s.step().done:
        pass
    assert any(taken)  # the suffix's prefill took the grouped read
    assert s.generated_ids == ref
    s.close()
