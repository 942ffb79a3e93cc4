"""Expected Attention (``engine.policies.expected``, scores by ``engine.core.expected``): the scoring equals the
method written out with explicit rotation matrices, nothing evicted gives HF's greedy tokens, under a budget it
keeps its sinks and recent window per layer and says what its scoring cost, a mid-chat switch says when it has no
query statistics yet."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from engine import snapshot as snap
from engine.config import CacheConfig, SamplingConfig
from engine.core.eviction import Scores
from engine.core.expected import FUTURE, QueryStats
from engine.core.session import ChatSession
from engine.kv.store.rope import LayerRope
from engine.policies import ExpectedAttentionPolicy, PolicyState, get_policy


def rope_matrix(pos: int, inv_freq: torch.Tensor, d: int, interleaved: bool) -> torch.Tensor:
    """RoPE at ``pos`` as a [D, D] matrix, written out pair by pair (float64)."""
    r = torch.zeros(d, d, dtype=torch.float64)
    for i, f in enumerate(inv_freq.tolist()):
        a, b = (2 * i, 2 * i + 1) if interleaved else (i, i + d // 2)
        c, s = math.cos(pos * f), math.sin(pos * f)
        r[a, a], r[a, b], r[b, a], r[b, b] = c, -s, s, c
    return r


@pytest.mark.parametrize("interleaved", [False, True])
def test_scores_are_the_expected_attention_of_the_coming_queries(interleaved):
    torch.manual_seed(0)
    hq, hkv, d, n, m, start = 4, 2, 8, 24, 10, 30
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    spec = LayerRope(inv_freq=inv_freq, rotary_dim=d, interleaved=interleaved)
    pre = torch.randn(hq, m, d, dtype=torch.float64)  # queries before RoPE
    post = torch.stack([pre[:, j] @ rope_matrix(start + j, inv_freq, d, interleaved).T for j in range(m)], 1)
    k, v = torch.randn(hkv, n, d), torch.randn(hkv, n, d)

    qs = QueryStats(None, 1)
    qs._specs = [spec]
    qs.configure(window=m, sinks=0)
    qs.scores = Scores(1, hkv, "cpu")
    qs.scores.start(n)
    qs.begin(start, m, score=True)
    qs.observe(0, post.float()[None], k[None], v[None], None)
    got = qs.scores.t[0]  # [Hkv, n]

    nxt = start + m
    r_bar = sum(rope_matrix(p, inv_freq, d, interleaved) for p in range(nxt, nxt + FUTURE)) / FUTURE
    mu = pre.mean(1)  # [Hq, D]
    c = pre - mu[:, None]
    cov = c.transpose(1, 2) @ c / m  # [Hq, D, D]
    mu, cov = mu @ r_bar.T, r_bar @ cov @ r_bar.T
    kk = k.double().repeat_interleave(hq // hkv, 0)  # [Hq, n, D]
    s = d ** -0.5
    logit = s * torch.einsum("hnd,hd->hn", kk, mu) + 0.5 * s * s * torch.einsum("hnd,hde,hne->hn", kk, cov, kk)
    want = torch.softmax(logit, -1).view(hkv, hq // hkv, n).mean(1) * v.double().norm(dim=-1)
    assert torch.allclose(got.double(), want, rtol=1e-4, atol=1e-7)
    assert qs.ms > 0  # timed: the policy's cost is shown


def test_the_policy_drops_the_lowest_expected_attention_and_keeps_sinks_and_recent():
    p = ExpectedAttentionPolicy(budget=7, recent=2, sinks=1)
    scores = np.array([[0.0, 5, 0.1, 3, 0.2, 0.2, 4, 0.0, 9, 1]])
    drops = p.select(PolicyState(positions=np.arange(10)[None], scores=scores), target=7)
    # sink 0 and recent 8, 9 stay; the lowest of 1..7: 7 (0.0), 2 (0.1), then 4 (0.2, the older of 4 and 5)
    assert drops[0].tolist() == [2, 4, 7]
    with pytest.raises(ValueError, match="recent 64 \\+ sinks 4 must be smaller than budget 60"):
        get_policy("expected", {"budget": 60})


def _run(lm, cfg, ids, n):
    s = ChatSession(lm, cfg)
    s.start_ids(ids, SamplingConfig(max_new_tokens=n, ignore_eos=True))
    snaps, notes = [], []
    while True:
        r = s.step()
        snaps.append(r.snapshot)
        notes += [str(w) for w in (r.warnings or ())]
        if r.done:
            return s, r, snaps, notes


@pytest.mark.parametrize("mode", ["paged", "contiguous"])
def test_nothing_evicted_gives_hf_greedy_tokens(stories, mode):
    ids = stories.tokenizer("Once upon a time, there was a little girl named Lily.")["input_ids"]
    x = torch.tensor([ids])
    with torch.inference_mode():
        hf = stories.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=160, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    s, r, _, _ = _run(stories, CacheConfig(mode=mode, policy="expected", policy_params={"budget": 500}), ids, 160)
    assert s.generated_ids == hf and s.evicted_total == 0
    s.close()


def test_under_a_budget_each_head_keeps_sinks_and_recent_and_its_own_tokens_and_says_what_scoring_cost(stories):
    ids = stories.tokenizer("Once upon a time, there was a little girl named Lily.")["input_ids"]
    cfg = CacheConfig(mode="paged", page_size=8, policy="expected",
                      policy_params={"budget": 64, "recent": 16, "sinks": 4, "queries": 32})
    s, r, snaps, _ = _run(stories, cfg, ids, 150)
    assert all(sn.tokens_per_layer.max() <= 64 for sn in snaps) and s.evicted_total > 0
    heads = stories.info.num_kv_heads
    assert s.index.heads == heads > 1 and s.index.split
    logs = [[set(row.tolist()) for row in s.index.log[layer]] for layer in range(stories.info.num_layers)]
    assert any(len({frozenset(h) for h in layer}) > 1 for layer in logs)  # the heads of a layer kept their own
    assert any(logs[0][0] != other[0] for other in logs[1:])  # and the layers theirs
    recent = set(range(s.index.next_pos - 16, s.index.next_pos))
    assert all(recent <= kept and {0, 1, 2, 3} <= kept for layer in logs for kept in layer)
    assert (r.snapshot.token_state[:4] == snap.TOKEN_SINK).all()  # the strip draws the sinks
    state = r.snapshot.token_state
    some = set().union(*(h for layer in logs for h in layer))
    partial = {p for p in some if not any(all(p in h for h in layer) for layer in logs)}
    assert partial and set(np.nonzero(state == snap.TOKEN_PARTIAL)[0].tolist()) == partial - {0, 1, 2, 3}
    assert float(s.evictor.scores.t[0].sum()) > 0  # the forward before each eviction scored the keys
    assert r.stats.policy_decode_ms > 0 and any(sn.policy_ms > 0 for sn in snaps)
    s.close()


def test_switched_on_mid_chat_it_says_it_has_no_statistics_yet_then_scores(stories):
    s = ChatSession(stories, CacheConfig(mode="paged", page_size=4))
    s.start_completion("Once upon a time", SamplingConfig(max_new_tokens=160, ignore_eos=True))
    for _ in range(80):
        s.step()
    s.apply(CacheConfig(mode="paged", page_size=4, policy="expected", policy_params={"budget": 48, "recent": 8}))
    r = s.step()
    assert any("no query statistics yet to score the" in str(n) for n in r.snapshot.notes)
    assert s.cached_tokens <= 48
    while not (r := s.step()).done:
        pass
    assert r.stop_reason == "max_tokens" and s.evictor.queries.seen
    assert float(s.evictor.scores.t[0].sum()) > 0  # the evictions after the switch were scored
    s.close()
