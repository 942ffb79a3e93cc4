"""``kvscope::paged_decode`` (engine.kv.store.paged_decode): one new token's attention read in place from a sequence's
pages through its slots. Its three kernels (the C++ one the compiled step calls, the native one through ctypes and
torch's) agree on every shape the kernel has a path for, and the attention takes it only where it applies."""

from __future__ import annotations

import pytest
import torch

from engine.kv.quantized import native
from engine.kv.store import paged_decode as pd
from engine.model import linear_op

needs_native = pytest.mark.skipif(native.library() is None, reason="no C compiler: the torch kernel only")


def _case(dt, hk, rep, dk, dv, n, seed=0, pages=64):
    g = torch.Generator().manual_seed(seed)
    S = pages * 16
    kp = torch.randn(hk, S, dk, generator=g).to(dt)  # [Hk, S, Dk] page rows
    vp = torch.randn(hk, S, dv, generator=g).to(dt)
    slots = torch.randperm(S, generator=g)[:n]  # scattered pages, as a chat's after reuse and eviction
    q = torch.randn(1, hk * rep, 1, dk, generator=g).to(dt)
    nk = torch.randn(1, hk, 1, dk, generator=g).to(dt)
    nv = torch.randn(1, hk, 1, dv, generator=g).to(dt)
    return q, kp, vp, slots, nk, nv


SHAPES = [  # (hk, rep, dk, dv, n): the vector paths (head_dim 64 / 128, query heads four at a time), the others
    (3, 3, 64, 64, 129), (1, 1, 64, 64, 2), (2, 8, 128, 128, 300), (4, 4, 64, 64, 16), (2, 2, 64, 64, 17),
    (1, 12, 64, 64, 40), (1, 7, 128, 128, 50), (2, 3, 48, 48, 33), (2, 2, 80, 80, 31), (2, 2, 64, 32, 20),
    (2, 5, 96, 96, 45),  # AVX2: query heads two at a time and one left; values thirty-two columns at a time
    (1, 40, 128, 128, 20),  # more query heads a KV head than the AVX2 path keeps (40 x 128 > 4,096): the plain one
]


@needs_native
@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hk, rep, dk, dv, n", SHAPES)
def test_the_native_kernels_give_what_torch_gives(dt, hk, rep, dk, dv, n):
    args = _case(dt, hk, rep, dk, dv, n)
    scale = dk ** -0.5
    ref = pd.reference(*args, scale).float()  # [1, 1, Hq, Dv]
    assert linear_op.attach(), linear_op.why()
    got = {"ctypes": pd.native_run(*args, scale), "C++": torch.ops.kvscope.paged_decode(*args, scale)}
    tol = 1e-5 if dt == torch.float32 else 1e-2  # float32 summation order; one bfloat16 rounding of the output
    for name, out in got.items():
        assert out is not None and out.shape == (1, 1, hk * rep, dv) and out.dtype == dt, name
        err = (out.float() - ref).abs().max().item()
        assert err < tol * max(1.0, ref.abs().max().item()), f"{name}: {err:.2e}"


@needs_native
def test_one_cached_token_and_a_dominant_key_are_exact_in_their_limits():
    """A query aligned with one key puts all weight on it: the output is that value row (softmax underflow)."""
    q, kp, vp, slots, nk, nv = _case(torch.float32, 1, 2, 64, 64, 5)
    kp[0, slots[3]] = q[0, 0, 0] * 100  # head 0's query meets key 3 with a score ~1e5 above the rest
    out = torch.ops.kvscope.paged_decode(q, kp, vp, slots, nk, nv, 1.0)
    assert torch.equal(out[0, 0, 0], vp[0, slots[3]])


def test_the_attention_takes_the_operator_only_where_it_applies():
    q, kp, vp, slots, nk, nv = _case(torch.float32, 2, 2, 64, 64, 10)
    k = torch.cat([kp.index_select(1, slots)[None], nk], 2)  # what the cache returned
    v = torch.cat([vp.index_select(1, slots)[None], nv], 2)
    step = (kp, vp, slots, None, nk, nv, k, v)
    ref = pd.reference(q, kp, vp, slots, nk, nv, 0.125)
    out = pd.attend(q, k, v, None, step, {"scaling": 0.125})
    assert out is not None and torch.allclose(out, ref, atol=1e-5)
    assert pd.attend(q, k.clone(), v, None, step, {}) is None  # the model changed what the cache returned
    assert pd.attend(q, k, v, torch.ones(1, 1, 1, 11, dtype=torch.bool), step, {}) is None  # a mask
    for extra in ({"softcap": 30.0}, {"s_aux": torch.zeros(4)}, {"sliding_window": 8}):
        assert pd.attend(q, k, v, None, step, extra) is None, extra
    assert pd.attend(q.half(), k, v, None, step, {}) is None  # float16 pages are not read here


def test_without_the_native_library_the_operator_is_torchs(monkeypatch):
    monkeypatch.setattr(native, "library", lambda: None)
    args = _case(torch.bfloat16, 2, 3, 64, 64, 20)
    assert pd.native_run(*args, 0.125) is None
    assert torch.equal(pd.python_kernel(*args, 0.125), pd.reference(*args, 0.125))


@needs_native
def test_write_slot_writes_each_layers_row_into_its_slot_and_nothing_else():
    assert linear_op.attach(), linear_op.why()
    g = torch.Generator().manual_seed(1)
    pages = [torch.randn(3, 64, 16, generator=g).to(dt) for dt in (torch.float32, torch.bfloat16) * 2]
    rows = [torch.randn(1, 3, 1, 16, generator=g).to(p.dtype) for p in pages]
    rows[2] = torch.randn(1, 16, 1, 3, generator=g).transpose(1, 3)  # not contiguous: torch's copy answers
    before = [p.clone() for p in pages]
    torch.ops.kvscope.write_slot(pages, rows, 37)
    for p, b, r in zip(pages, before, rows):
        assert torch.equal(p[:, 37], r[0, :, 0].to(p.dtype))
        p[:, 37] = b[:, 37]
        assert torch.equal(p, b)  # every other slot untouched
    with pytest.raises(RuntimeError, match="does not fit"):
        torch.ops.kvscope.write_slot(pages, rows, 64)


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
def test_a_batch_of_sequences_gets_what_each_gets_alone(dt):
    """The compiled batched step's operator: each sequence's own slots (padded to the longest, the padding pointing
    at another sequence's rows) and its own length; every kernel gives what the one-sequence operator gives."""
    hk, rep, d, B = 3, 3, 64, 4
    q, kp, vp, _, _, _ = _case(dt, hk, rep, d, d, 1)
    g = torch.Generator().manual_seed(2)
    lens = torch.tensor([40, 3, 0, 17])
    slots = torch.randperm(kp.shape[1], generator=g)[:B * 40].view(B, 40)  # [B, n]: beyond lens[b], someone's rows
    q = torch.randn(B, hk * rep, 1, d, generator=g).to(dt)
    nk, nv = (torch.randn(B, hk, 1, d, generator=g).to(dt) for _ in range(2))
    alone = torch.cat([pd.reference(q[b:b + 1], kp, vp, slots[b, :int(lens[b])], nk[b:b + 1], nv[b:b + 1], 0.125)
                       for b in range(B)]).float()  # [B, 1, Hq, D]
    tol = 1e-5 if dt == torch.float32 else 1e-2
    outs = {"python": pd.paged_decode_batch._init_fn(q, kp, vp, slots, lens, nk, nv, 0.125),
            "reference": pd.reference_batch(q, kp, vp, slots, lens, nk, nv, 0.125)}
    if native.library() is not None:
        assert linear_op.attach(), linear_op.why()
        outs["C++"] = torch.ops.kvscope.paged_decode_batch(q, kp, vp, slots, lens, nk, nv, 0.125)
    for name, out in outs.items():
        assert out.shape == (B, 1, hk * rep, d) and out.dtype == dt, name
        assert (out.float() - alone).abs().max().item() < tol, name


@needs_native
def test_an_eager_bfloat16_decode_reads_its_run_of_pages_in_place():
    """transformers' attention hands a decode step the K/V its cache returned (here a view of one run of pages: head
    stride of the whole page tensor); the bfloat16 query takes the native kernel, with what float32 SDPA gives."""
    from types import SimpleNamespace

    from engine.kv.store.attention import sdpa

    g = torch.Generator().manual_seed(3)
    pages_k, pages_v = (torch.randn(2, 256, 64, generator=g).to(torch.bfloat16) for _ in range(2))  # [Hk, S, D]
    k, v = pages_k[None, :, 32:32 + 91], pages_v[None, :, 32:32 + 91]  # [1, Hk, 91, D]: one run, in place
    q = torch.randn(1, 6, 1, 64, generator=g).to(torch.bfloat16)
    module = SimpleNamespace(is_causal=True, num_key_value_groups=3, training=False)
    out, _ = sdpa(module, q, k, v, None, scaling=0.125)
    want = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), scale=0.125,
                                                            enable_gqa=True).transpose(1, 2)  # [1, 1, Hq, D]
    assert out.dtype == torch.bfloat16 and out.shape == (1, 1, 6, 64)
    assert (out.float() - want).abs().max().item() < 1e-2
    assert pd.attend_tensors(q, k, v, None, {"scaling": 0.125}) is not None  # the kernel answered
    assert pd.attend_tensors(q.float(), k.float(), v.float(), None, {}) is None  # float32: torch's, exactly
    hide = torch.ones(1, 1, 1, 91, dtype=torch.bool)
    hide[..., 5] = False
    assert pd.attend_tensors(q, k, v, hide, {}) is None  # a mask that hides a key: SDPA


@needs_native
def test_an_eager_bfloat16_chat_takes_the_kernel_at_every_decode_step_and_keeps_its_reply(monkeypatch):
    """A bfloat16 model decoding eager (the installed app has no compiler): every layer of every decode step reads
    its pages through the kernel, and the greedy reply is the one the float32 SDPA path gives."""
    from engine.config import CacheConfig, SamplingConfig
    from engine.core.session import ChatSession
    from engine.model.shapes import build_shape

    lm = build_shape("tiny-llama-hd64", dtype=torch.bfloat16)
    lm.fast.set_mode("off")

    def reply():
        s = ChatSession(lm, CacheConfig(page_size=16))
        s.start_ids(list(range(5, 60)), SamplingConfig(max_new_tokens=40, ignore_eos=True))
        while not s.step().done:
            pass
        ids = s.generated_ids
        s.close()
        return ids

    calls = []
    real = pd.native_run
    monkeypatch.setattr(pd, "native_run", lambda *a: calls.append(1) or real(*a))
    with_kernel = reply()
    assert len(calls) == 39 * lm.info.num_layers  # every decode step after the prefill's token, every layer
    monkeypatch.setattr(pd, "attend_tensors", lambda *a: None)
    assert reply() == with_kernel
