"""int8 / int4 pages in the cache: bytes held, round trips through the store, mid-reply switching, swap."""

from __future__ import annotations

import pytest
import torch

from engine import snapshot as snap
from engine.config import CacheConfig, SamplingConfig
from engine.kv.quantized import quant
from engine.kv.store.arena import PageArena
from engine.kv.quantized.roles import KVShape
from engine.kv.store.storage import PagedKV
from engine.core.session import ChatSession


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("n", [1, 15, 16, 17, 50])
def test_store_round_trip_and_bytes_formula(kind, n):
    H, D, P, L = 4, 64, 16, 2
    arena = PageArena(KVShape(L, H, D, torch.float32, torch.device("cpu")), P, 2, k_kind=kind, v_kind=kind)
    store = PagedKV(arena)
    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, H, n, D, generator=g)
    v = torch.randn(1, H, n, D, generator=g)
    store.reserve(n)
    for layer in range(L):
        kk, vv = store.update(layer, k, v)
        assert kk.shape == (1, H, n, D)
    store.commit()
    full, fill = divmod(n, P)
    for layer in range(L):
        rk, rv = store.read_layer(layer)
        # the partial page is exact; full pages within the quantizer's bound
        assert torch.equal(rk[:, full * P:], k[0][:, full * P:])
        err_k = (rk - k[0]).abs().max().item()
        err_v = (rv - v[0]).abs().max().item()
        bound = (k.abs().max().item() / 127) if kind == "int8" else (k.max() - k.min()).item() / 15
        assert err_k <= bound and err_v <= bound * (1 if kind == "int8" else 1.0)
    per_k = quant.bytes_per_token(kind, "k", H, D, P)
    per_v = quant.bytes_per_token(kind, "v", H, D, P)
    fp_page = H * P * D * 4
    expect = int(round(full * P * per_k)) + int(round(full * P * per_v)) + (2 * fp_page if fill else 0)
    assert store.bytes_per_layer() == [expect] * L
    # quantized pages are flagged for the page map
    assert [bool(arena.pool.flags[p]) for p in store.table.pages] == [i < full for i in range(len(store.table.pages))]


def test_bytes_per_token_targets_vs_fp16():
    """int8 ≤ 0.53× and int4 vs the model dtype (fp16 here), at head_dim 128 and page 64."""
    H, D = 8, 128
    fp16 = 2 * H * D * 2
    int8 = quant.bytes_per_token("int8", "k", H, D, 64) + quant.bytes_per_token("int8", "v", H, D, 64)
    int4 = quant.bytes_per_token("int4", "k", H, D, 64) + quant.bytes_per_token("int4", "v", H, D, 64, group=128)
    assert int8 / fp16 <= 0.53
    assert int4 / fp16 <= 0.28


def generate(lm, cache, n=80, switches=None, prompt="Once upon a time"):
    s = ChatSession(lm, cache)
    s.start_completion(prompt, SamplingConfig(max_new_tokens=n, ignore_eos=True))
    snaps, step = [], 0
    while True:
        if switches and step in switches:
            s.apply(switches[step])
        r = s.step()
        snaps.append(r.snapshot)
        step += 1
        if r.done:
            return s, r, snaps


def test_int8_cache_tracks_full_precision_and_saves_bytes(stories):
    full, rf, _ = generate(stories, CacheConfig(mode="paged", page_size=16), n=120)
    q8, r8, snaps = generate(stories, CacheConfig(mode="paged", page_size=16, k_dtype="int8", v_dtype="int8"), n=120)
    agree = sum(a == b for a, b in zip(full.generated_ids, q8.generated_ids))
    assert agree >= 100
    assert r8.snapshot.kv_bytes < 0.5 * rf.snapshot.kv_bytes  # float32 model: int8 pages are ~0.31×
    assert (r8.snapshot.token_state[:16] == snap.TOKEN_QUANTIZED).all()
    assert (r8.snapshot.page_state[q8.store.table.pages[0]] == snap.PAGE_QUANTIZED)


@pytest.mark.parametrize("k_dtype,v_dtype", [("int4", "int4"), ("int8", "auto"), ("auto", "int4")])
def test_mixed_precision_generates(stories, k_dtype, v_dtype):
    s, r, _ = generate(stories, CacheConfig(mode="paged", page_size=8, k_dtype=k_dtype, v_dtype=v_dtype), n=60)
    assert len(s.generated_ids) == 60 and r.text.startswith(", there was")


def test_lossy_switch_mid_reply_completes_and_shows_new_mode(stories):
    switches = {20: CacheConfig(mode="paged", page_size=8, k_dtype="int8", v_dtype="int8"),
                45: CacheConfig(mode="paged", page_size=8, k_dtype="int4", v_dtype="int4"),
                70: CacheConfig(mode="contiguous")}
    s, r, snaps = generate(stories, CacheConfig(mode="paged", page_size=8), n=100, switches=switches)
    assert r.stop_reason == "max_tokens" and len(s.generated_ids) == 100
    assert snaps[20].k_dtype == "int8" and snaps[45].k_dtype == "int4" and snaps[70].mode == "contiguous"
    assert snaps[21].kv_bytes < snaps[19].kv_bytes  # quantized right away
    assert snaps[70].kv_bytes > snaps[69].kv_bytes  # dequantized back to float32


@pytest.mark.parametrize("cache", [CacheConfig(mode="paged", page_size=4), CacheConfig(mode="contiguous"),
                                   CacheConfig(mode="paged", page_size=16, k_dtype="int8", v_dtype="int8"),
                                   CacheConfig(mode="paged", page_size=16, k_dtype="int4", v_dtype="int4")],
                         ids=["paged", "contiguous", "paged-int8", "paged-int4"])
def test_swap_out_and_back_gives_identical_tokens(stories, cache):
    msgs = [{"role": "user", "content": "Tell me a story."}]

    def chat(swap: bool):
        s = ChatSession(stories, cache)
        other = ChatSession(stories, cache)
        s.start(msgs, SamplingConfig(max_new_tokens=30))
        while not (r := s.step()).done:
            pass
        swapped = None
        if swap:
            moved = s.swap_out()
            assert moved > 0 and s.offloaded
            swapped = s.snapshot()
            # another chat uses the pool meanwhile
            other.start_completion("The dog ran", SamplingConfig(max_new_tokens=40, ignore_eos=True))
            while not other.step().done:
                pass
        st = s.start(msgs + [{"role": "assistant", "content": r.text}, {"role": "user", "content": "More."}],
                     SamplingConfig(max_new_tokens=30))
        while not s.step().done:
            pass
        return s.generated_ids, st, swapped

    ids_a, st_a, _ = chat(False)
    ids_b, st_b, swapped = chat(True)
    assert ids_a == ids_b
    # the swapped chat reuses at least as much: its own cache, plus pages the first chat's second turn
    # computed (the automatic prefix cache names them by their tokens)
    assert st_b.reused_tokens >= st_a.reused_tokens > 0 and st_a.shared_tokens == 0
    assert swapped.offloaded and swapped.kv_bytes == 0
    if cache.mode == "paged":
        assert (swapped.page_state == snap.PAGE_OFFLOADED).sum() == swapped.pages_used_per_layer[0] > 0


@pytest.mark.parametrize("k,v", [("int8", "int8"), ("int4", "int4"), ("int8", "auto"), ("auto", "int4"),
                                 ("tq3-qjl", "tq2")])
def test_swap_keeps_quantized_pages_as_held(stories, k, v):
    """A quantized chat swaps out at its quantized size (codes + scales + the full-precision tail page, the
    bytes its snapshot showed) and comes back bit for bit, not re-quantized from a dequantized copy."""
    s = ChatSession(stories, CacheConfig(mode="paged", page_size=16, k_dtype=k, v_dtype=v))
    s.start_completion("Once upon a time", SamplingConfig(max_new_tokens=45, ignore_eos=True))
    while not s.step().done:
        pass
    held = s.snapshot().kv_bytes
    n = s.cached_tokens
    assert n % 16 and n > 32  # full pages and a partial tail
    before = [tuple(t.clone() for t in s.store.read_layer(layer)) for layer in range(s.info.num_layers)]
    arena = s.store.arena
    full, fill = divmod(n, 16)
    token_fp = arena.shape.kv_heads * arena.shape.head_dim * arena.shape.elem_bytes  # one token of K or V, float32
    want = s.info.num_layers * sum(
        n * token_fp if kind == "auto" else full * arena.roles[role].page_bytes() + fill * token_fp
        for role, kind in (("k", k), ("v", v)))
    moved = s.swap_out()
    assert moved == want and moved < held  # the cache holds whole pages; the host only the tokens
    assert s.snapshot().bytes_per_layer.sum() == moved
    s.cache.swap_in(s.seq)
    assert s.snapshot().kv_bytes == held
    for layer, (bk, bv) in enumerate(before):
        ak, av = s.store.read_layer(layer)
        assert torch.equal(ak, bk) and torch.equal(av, bv)
    s.close()


def test_switching_to_int8_keys_says_how_they_are_grouped(stories):
    """stories260K's head dim is 8: pages of 16+ tokens group int8 keys per channel; shorter pages per token."""
    s = ChatSession(stories, CacheConfig(mode="paged", page_size=16))
    notes = s.apply(CacheConfig(mode="paged", page_size=16, k_dtype="int8", v_dtype="int8"))
    assert any(n.startswith("int8 keys: per channel over each 16-token page") for n in notes)
    notes = s.apply(CacheConfig(mode="paged", page_size=8, k_dtype="int8", v_dtype="int8"))
    assert any(n.startswith("int8 keys: one scale per token") and "pages of 16+ tokens" in n for n in notes)
    assert not any("int8 keys" in n for n in s.apply(CacheConfig(mode="paged", page_size=8, v_dtype="int8")))
    s.close()
