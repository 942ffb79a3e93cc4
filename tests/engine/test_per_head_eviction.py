"""Per-head eviction (Expected Attention keeps, per KV head, its own tokens, as kvpress's press does): the cache
index per layer and head, the stores' compaction per head, re-rotation of heads that moved apart, and a chat."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import snapshot as snap
from engine.config import CacheConfig, SamplingConfig
from engine.core.session import ChatSession
from engine.kv.paged.positions import CacheIndex
from engine.kv.quantized.roles import KVShape
from engine.kv.store.arena import PageArena
from engine.kv.store.rope import Rerotator
from engine.kv.store.contiguous import ContiguousKV
from engine.kv.store.storage import PagedKV, take_slots
from engine.policies import get_policy


def _per_head_keep(rng: np.random.Generator, heads: int, n: int, m: int, first: int = 0) -> np.ndarray:
    """[heads, m] ascending slots, the first ``first`` kept by every head."""
    rows = [np.concatenate([np.arange(first), np.sort(rng.choice(np.arange(first, n), m - first, replace=False))])
            for _ in range(heads)]
    return np.stack(rows).astype(np.int64)


def test_the_index_keeps_each_heads_own_slots_and_says_which_tokens_some_heads_dropped():
    index = CacheIndex(2, capacity=4, heads=3)
    index.append(10)
    assert not index.split and index.intact == 10 and index.layer_log.shape == (2, 10)
    keep0 = np.array([[0, 1, 2, 5, 9], [0, 1, 3, 5, 9], [0, 1, 2, 5, 9]])
    index.keep([keep0, np.array([0, 1, 2, 3, 9])])  # layer 1: every head the same slots
    index.check()
    assert index.split and index.n == 5 and index.intact == 2
    assert index.log[0].tolist() == keep0.tolist() and index.log[1].tolist() == [[0, 1, 2, 3, 9]] * 3
    with pytest.raises(ValueError, match="different tokens"):
        _ = index.layer_log
    assert np.nonzero(index.held(10))[0].tolist() == [0, 1, 2, 3, 5, 9]
    # every head of layer 1 holds 0-3 and 9, every head of layer 0 holds 0, 1, 5 and 9: no token is partly held
    assert index.held_by_all(10).tolist() == index.held(10).tolist()
    index.keep([np.array([[0, 2, 3, 4]] * 3), np.array([[0, 1, 2, 4], [0, 1, 3, 4], [0, 2, 3, 4]])])
    index.check()
    # layer 0 keeps 0, 2, 5, 9 in heads 0 and 2, 0, 3, 5, 9 in head 1; layer 1: 0, 1|2|3 (one head each), 9
    assert np.nonzero(index.held(10) & ~index.held_by_all(10))[0].tolist() == [1, 2, 3]
    other = index.copy()
    assert other.log.tolist() == index.log.tolist() and other.split
    index.append(2)
    assert index.log[:, :, -2:].tolist() == [[[10, 11]] * 3] * 2 and index.intact == 1
    index.rerotate()
    assert index.rope.tolist() == [[list(range(6))] * 3] * 2 and index.next_rope == 6
    with pytest.raises(ValueError, match="one row per head"):
        index.keep([np.zeros((2, 3), dtype=np.int64)] * 2)


@pytest.mark.parametrize("heads", [1, 3])
def test_the_index_grows_by_doubling_and_a_step_writes_in_place(heads):
    """A decode step appends one token: into the arrays it has while there is room (a copy of the whole index at
    every step would cost O(L*H*n) a token), doubling them when there is none."""
    index = CacheIndex(2, capacity=4, heads=heads)
    grown = 0
    for _ in range(1000):
        before = index._log
        index.append(1)
        grown += index._log is not before
    assert index.n == 1000 and grown == 8  # 4 -> 8 -> ... -> 1024
    assert index._log.shape == (2, heads, 1024) and index.log[:, :, -1].tolist() == [[999] * heads] * 2
    index.check()


def _stores(kind: str, L: int, H: int, D: int):
    shape = KVShape(L, H, D, torch.float32, torch.device("cpu"))
    if kind == "contiguous":
        return ContiguousKV(shape, 16), ContiguousKV(shape, 16)
    arena = PageArena(shape, 8, 8, k_kind=kind, v_kind=kind)
    return PagedKV(arena, 1), PagedKV(arena, 2)


@pytest.mark.parametrize("kind", ["contiguous", "auto", "int8", "int4", "tq3"])
def test_a_store_compacts_each_head_as_that_head_alone_would_be(kind):
    """Head ``h`` after a per-head compaction holds what a compaction of every head to head ``h``'s slots leaves
    in head ``h``: the same rows, re-quantized alike (quantized pages group a head's own tokens)."""
    L, H, D, n, m = 2, 3, 64, 45, 22
    g, rng = torch.Generator().manual_seed(0), np.random.default_rng(0)
    k, v = torch.randn(1, H, n, D, generator=g), torch.randn(1, H, n, D, generator=g)
    keep = [_per_head_keep(rng, H, n, m, first=3) for _ in range(L)]
    split, _ = _stores(kind, L, H, D)
    split.reserve(n)
    for layer in range(L):
        split.update(layer, k, v)
    split.commit()
    before = [tuple(t.clone() for t in split.read_layer(layer)) for layer in range(L)]  # contiguous: views
    split.compact(keep, start=3)
    assert split.num_tokens == m
    for layer in range(L):
        got_k, got_v = split.read_layer(layer)
        if kind in ("contiguous", "auto"):  # full precision: the very rows
            assert torch.equal(got_k, take_slots(before[layer][0], keep[layer]))
            assert torch.equal(got_v, take_slots(before[layer][1], keep[layer]))
        for h in range(H):
            alone, _ = _stores(kind, L, H, D)
            alone.reserve(n)
            for ll in range(L):
                alone.update(ll, k, v)
            alone.commit()
            alone.compact([keep[ll][h] for ll in range(L)], start=3)
            want_k, want_v = alone.read_layer(layer)
            assert torch.equal(got_k[h], want_k[h]) and torch.equal(got_v[h], want_v[h])
            alone.free()
    split.free()


def test_heads_moved_by_their_own_distances_are_rotated_as_each_alone():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2))
    rot = Rerotator(model)
    k = torch.randn(2, 9, 16)  # [H, n, D]
    delta = torch.tensor([[-3] * 9, list(range(-9, 0))])  # [H, n]
    both = rot(0, k, delta)
    for h in range(2):
        assert torch.equal(both[h], rot(0, k[h:h + 1], delta[h])[0])


@pytest.mark.parametrize("then", ["streaming", "h2o", "none"])
def test_a_chat_whose_heads_kept_their_own_tokens_goes_on_under_another_policy(stories, then):
    """Expected Attention parts the heads; contiguous and paged caches part them alike (same greedy reply); then
    the chat switches to a policy of whole layers (StreamingLLM re-rotates each head by its own distances) or to
    none (the evicted tokens are read again), and goes on."""
    params = {"budget": 48, "recent": 8, "sinks": 4, "queries": 16}
    replies, sessions = [], []
    for mode in ("contiguous", "paged"):
        s = ChatSession(stories, CacheConfig(mode=mode, page_size=8, policy="expected", policy_params=params))
        s.start_completion("Once upon a time", SamplingConfig(max_new_tokens=90, ignore_eos=True))
        for _ in range(90):
            r = s.step()
        assert s.index.split
        replies.append(list(s.generated_ids))
        sessions.append(s)
    assert replies[0] == replies[1]
    s = sessions[1]
    sessions[0].close()
    assert (r.snapshot.token_state == snap.TOKEN_PARTIAL).any()
    extra = {"streaming": {"sinks": 4, "window": 40}, "h2o": {"budget": 40, "recent": 8}, "none": {}}[then]
    s.apply(CacheConfig(mode="paged", page_size=8, policy=then, policy_params=extra))
    s.start_completion(" The end.", SamplingConfig(max_new_tokens=20, ignore_eos=True))
    while not (r := s.step()).done:
        s.index.check()
    assert r.stop_reason == "max_tokens" and len(s.generated_ids) == 20
    if then == "none":  # every token is read again into every head
        assert not s.index.split and s.index.n == s.index.next_pos
    else:
        assert s.index.n <= 48
    s.close()


def test_per_head_off_keeps_one_set_per_layer_and_a_switch_must_be_true_or_false(stories):
    params = {"budget": 48, "recent": 8, "sinks": 4, "queries": 16, "per_head": False}
    s = ChatSession(stories, CacheConfig(mode="paged", page_size=8, policy="expected", policy_params=params))
    s.start_completion("Once upon a time", SamplingConfig(max_new_tokens=70, ignore_eos=True))
    while not (r := s.step()).done:
        pass
    assert s.evicted_total > 0 and not s.index.split and not (r.snapshot.token_state == snap.TOKEN_PARTIAL).any()
    s.close()
    with pytest.raises(ValueError, match="per_head 1 is not true or false"):
        get_policy("expected", {"per_head": 1})
