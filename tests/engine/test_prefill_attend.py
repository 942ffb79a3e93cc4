"""The native attention of a few new rows over many cached keys (a suffix prefill after a prefix-cache hit, a prompt's
chunk): torch's SDPA's output within float32 summation error over odd sizes (rows, keys not a multiple of its block,
GQA ratios, head widths, K/V as views of longer pages), the prefill's causal mask and none; the attention takes it
only where it applies; and a reused prefix's prefill through it gives HF ``generate``'s greedy tokens."""

from __future__ import annotations

import itertools

import pytest
import torch

from engine.config import CacheConfig, SamplingConfig
from engine.core.session import ChatSession
from engine.kv.store import attention, prefill_attend

pytestmark = pytest.mark.skipif(prefill_attend._lib() is None, reason="no native attention library (no compiler)")
WIDE = prefill_attend._lib() is not None and prefill_attend._wide(prefill_attend._lib())
# the attention takes the kernel only in a 16-lane (AVX-512) build: on AVX2 torch's SDPA is the faster (``attend``)
wide_only = pytest.mark.skipif(not WIDE, reason="a build narrower than 16 lanes leaves the attention to SDPA")


@pytest.fixture
def one_thread():
    was = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(was)


class _Layer(torch.nn.Module):
    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups, self.is_causal = groups, True


def _inputs(rows, n, hk, rep, d, seed=0):
    g = torch.Generator().manual_seed(seed + rows * 7919 + n * 31 + hk * rep * 5 + d)
    pages_k = torch.randn(hk, n + 37, d, generator=g) * 2  # [Hk, S, D]: the K/V are views of longer pages
    pages_v = torch.randn(hk, n + 37, d, generator=g)
    query = torch.randn(1, rows, hk * rep, d, generator=g).transpose(1, 2)  # [1, Hq, q, D], as the model's view
    return query, pages_k[None, :, 5:5 + n], pages_v[None, :, 5:5 + n]


def _sdpa(query, key, value, causal):
    rows, n = query.shape[2], key.shape[2]
    mask = torch.ones(rows, n, dtype=torch.bool).tril(causal)[None, None] if causal >= 0 else None
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, enable_gqa=True)
    return out.transpose(1, 2)  # [1, q, Hq, D]


@pytest.mark.parametrize("rows,n", [(1, 1), (1, 333), (7, 7), (7, 129), (80, 80), (80, 1037)])
@pytest.mark.parametrize("hk,rep", [(3, 1), (3, 3), (2, 4), (1, 8)])
@pytest.mark.parametrize("d", [64, 128, 8])
def test_the_kernel_gives_sdpa_within_float32_error(rows, n, hk, rep, d):
    query, key, value = _inputs(rows, n, hk, rep, d)
    for causal in sorted({n - rows, -1}):  # the prefill's causal mask (new rows end the K/V), and every key
        out = prefill_attend.kernel(query, key, value, causal, d ** -0.5)
        ref = _sdpa(query, key, value, causal)
        assert out.shape == ref.shape == (1, rows, hk * rep, d)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("causal", [0, 5, 150])
def test_row_i_sees_the_keys_up_to_causal_plus_i(causal):
    query, key, value = _inputs(9, 300, 2, 3, 64)  # with 0: the rows see the first keys only (blocks after: skipped)
    out = prefill_attend.kernel(query, key, value, causal, 0.125)
    mask = torch.ones(9, 300, dtype=torch.bool).tril(causal)[None, None]
    ref = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=0.125,
                                                           enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


@wide_only
@pytest.mark.parametrize("rows,n", [(16, 300), (80, 1080), (300, 300)])
def test_the_attention_takes_the_kernel_where_it_applies(rows, n, one_thread):
    query, key, value = _inputs(rows, n, 3, 3, 64, seed=1)
    layer = _Layer(3)
    mask = torch.ones(rows, n + 16, dtype=torch.bool).tril(n - rows)[None, None]  # wider than the K/V: sliced
    got = prefill_attend.attend(layer, query, key, value, mask, {"scaling": 0.125})
    assert got is not None
    out, _ = attention.sdpa(layer, query, key, value, mask, scaling=0.125)
    assert torch.equal(out, got)
    ref = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask[..., :n], scale=0.125,
                                                           enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    if rows == n:  # a whole prompt: transformers hands no mask (SDPA's is_causal)
        torch.testing.assert_close(prefill_attend.attend(layer, query, key, value, None, {"scaling": 0.125}), ref,
                                   rtol=1e-4, atol=1e-5)


@wide_only
def test_what_the_kernel_does_not_read_is_left_to_sdpa(one_thread):
    query, key, value = _inputs(16, 300, 3, 3, 64, seed=2)
    layer, kw = _Layer(3), {"scaling": 0.125}
    mask = torch.ones(16, 300, dtype=torch.bool).tril(284)[None, None]
    assert prefill_attend.attend(layer, query, key, value, mask, kw) is not None
    window = mask & ~torch.ones(16, 300, dtype=torch.bool).tril(284 - 100)[None, None]  # a sliding window's mask
    assert prefill_attend.attend(layer, query, key, value, window, kw) is None
    additive = torch.zeros(1, 1, 16, 300).masked_fill(~mask, float("-inf"))
    assert prefill_attend.attend(layer, query, key, value, additive, kw) is None
    assert prefill_attend.attend(layer, query, key, value, None, kw) is None  # fewer rows than keys, no mask
    assert prefill_attend.attend(layer, query[:, :, :4], key, value, mask[:, :, :4], kw) is None  # a few rows
    assert prefill_attend.attend(layer, query, key[:, :, :200], value[:, :, :200], mask[..., :200], kw) is None
    assert prefill_attend.attend(layer, query.bfloat16(), key.bfloat16(), value.bfloat16(), mask, kw) is None
    for extra in ({"softcap": 30.0}, {"s_aux": torch.zeros(9)}, {"sliding_window": 100}, {"dropout": 0.1}):
        assert prefill_attend.attend(layer, query, key, value, mask, {**kw, **extra}) is None
    torch.set_num_threads(2)  # torch shares the heads among its threads; the kernel runs on the caller's
    assert prefill_attend.attend(layer, query, key, value, mask, kw) is None


@pytest.mark.skipif(WIDE, reason="a 16-lane build: the attention takes the kernel (the tests above)")
def test_a_narrow_build_leaves_the_attention_to_sdpa(one_thread):
    query, key, value = _inputs(80, 1080, 3, 3, 64, seed=1)
    mask = torch.ones(80, 1080, dtype=torch.bool).tril(1000)[None, None]
    assert prefill_attend.attend(_Layer(3), query, key, value, mask, {"scaling": 0.125}) is None


@wide_only
def test_a_mask_changed_in_place_is_checked_again(one_thread):
    query, key, value = _inputs(16, 300, 3, 3, 64, seed=3)
    layer, kw = _Layer(3), {"scaling": 0.125}
    mask = torch.ones(16, 300, dtype=torch.bool).tril(284)[None, None]
    assert prefill_attend.attend(layer, query, key, value, mask, kw) is not None
    mask[0, 0, 3, :10] = False  # e.g. padding: no longer the prefill's causal mask
    assert prefill_attend.attend(layer, query, key, value, mask, kw) is None


@wide_only
@pytest.mark.parametrize("shape,cached,new", [("tiny-llama", 300, 40), ("tiny-qwen2", 260, 24)])
def test_a_reused_prefix_prefill_through_the_kernel_gives_hf_greedy_tokens(shape, cached, new, one_thread,
                                                                           monkeypatch):
    from engine.model.shapes import build_shape

    lm = build_shape(shape, seed=13)
    ids = torch.randint(0, lm.info.vocab_size, (cached + new,), generator=torch.Generator().manual_seed(9)).tolist()
    x = torch.tensor([ids])
    with torch.inference_mode(), monkeypatch.context() as m:
        m.setattr(prefill_attend, "_lib", lambda: None)  # the reference: torch's attention throughout
        ref = lm.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=30, min_new_tokens=30,
                                do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    taken = []
    real = prefill_attend.kernel

    def counted(*a):
        out = real(*a)
        taken.append(a[0].shape[2])
        return out

    monkeypatch.setattr(prefill_attend, "kernel", counted)
    s = ChatSession(lm, CacheConfig(mode="paged", page_size=16))
    s.start_ids(ids[:cached], SamplingConfig(max_new_tokens=3, ignore_eos=True))
    while not s.step().done:
        pass
    taken.clear()
    stats = s.start_ids(ids, SamplingConfig(max_new_tokens=30, ignore_eos=True))
    assert stats.reused_tokens == cached and stats.recomputed_tokens == new
    while not s.step().done:
        pass
    assert new in taken  # the suffix's prefill ran the kernel (decode tokens stay with SDPA)
    assert set(taken) == {new}
    assert s.generated_ids == ref
    s.close()


def test_sizes_the_kernel_refuses_leave_nothing_written():
    query, key, value = _inputs(4, 10, 1, 2, 64)
    lib = prefill_attend._lib()
    out = torch.full((1, 4, 2, 2048), 7.0)
    rc = lib.kvs_prefill_attend(0, 1, 2, 4, 10, 2048, 2048, query.data_ptr(), 0, 0, key.data_ptr(), 0, 0,
                                value.data_ptr(), 0, 0, 1.0, -1, out.data_ptr(), 4096)  # head_dim over 1024
    assert rc == -1 and torch.equal(out, torch.full((1, 4, 2, 2048), 7.0))


@pytest.mark.parametrize("rep,d", itertools.product((1, 3), (64, 8)))
def test_no_keys_gives_zeros(rep, d):
    query, key, value = _inputs(3, 0, 2, rep, d)
    out = prefill_attend.kernel(query, key, value, -1, 0.1)
    assert torch.equal(out, torch.zeros(1, 3, 2 * rep, d))
