"""Sampling pipeline: filters by exact values, seeded repeatability, repetition penalty semantics."""

from __future__ import annotations

import pytest
import torch

from engine.config import CacheConfig, SamplingConfig
from engine.core.sampling import Sampler, apply_repetition_penalty, sampling_probs
from engine.core.session import ChatSession

LOGITS = torch.log(torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]))


def test_greedy_is_argmax():
    assert Sampler(SamplingConfig())(torch.tensor([0.1, 3.0, 2.0])) == 1


def test_top_k_keeps_k_largest():
    p = sampling_probs(LOGITS, SamplingConfig(temperature=1.0, top_k=2))
    assert torch.allclose(p, torch.tensor([0.5, 0.2, 0, 0, 0]) / 0.7)


def test_top_p_keeps_smallest_prefix_reaching_p():
    p = sampling_probs(LOGITS, SamplingConfig(temperature=1.0, top_p=0.8))
    assert torch.allclose(p, torch.tensor([0.5, 0.2, 0.15, 0, 0]) / 0.85)
    p = sampling_probs(LOGITS, SamplingConfig(temperature=1.0, top_p=0.01))
    assert torch.allclose(p, torch.tensor([1.0, 0, 0, 0, 0]))


def test_min_p_is_relative_to_the_top_token():
    p = sampling_probs(LOGITS, SamplingConfig(temperature=1.0, min_p=0.3))  # keep p >= 0.15
    assert torch.allclose(p, torch.tensor([0.5, 0.2, 0.15, 0, 0]) / 0.85)


def test_temperature_sharpens():
    p = sampling_probs(LOGITS, SamplingConfig(temperature=0.5))
    q = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]) ** 2
    assert torch.allclose(p, q / q.sum())


def test_repetition_penalty_matches_hf():
    from transformers import RepetitionPenaltyLogitsProcessor

    logits = torch.tensor([2.0, -1.0, 0.5, -3.0, 1.0])
    seen = torch.tensor([0, 1, 1, 3])
    ours = apply_repetition_penalty(logits, seen, 1.3)
    hf = RepetitionPenaltyLogitsProcessor(1.3)(seen[None], logits[None].clone())[0]
    assert torch.allclose(ours, hf)


def test_seeded_sampling_repeats_and_seeds_differ(stories):
    def run(seed):
        s = ChatSession(stories, CacheConfig())
        s.start_completion("Once upon a time", SamplingConfig(temperature=1.0, top_p=0.95, seed=seed,
                                                              max_new_tokens=40, ignore_eos=True))
        while not s.step().done:
            pass
        return s.generated_ids

    a, b, c = run(1), run(1), run(2)
    assert a == b and a != c


def test_cancel_between_steps(stories):
    s = ChatSession(stories, CacheConfig())
    s.start_completion("Once upon a time", SamplingConfig(max_new_tokens=100, ignore_eos=True))
    for _ in range(5):
        s.step()
    s.cancel()
    r = s.step()
    assert r.done and r.stop_reason == "cancelled" and r.event is None
    assert len(s.generated_ids) == 5
    assert not s.generating
    with pytest.raises(Exception, match="no reply in progress"):
        s.step()
    # the session goes on: the next turn reuses what was cached
    st = s.start_ids(s.seq, SamplingConfig(max_new_tokens=2))
    assert st.reused_tokens == len(s.seq) - 1


@pytest.mark.parametrize("change", [dict(temperature=1e-40), dict(temperature=1e-45), dict(temperature=1e-300),
                                    dict(temperature=1.0, top_p=1e-46), dict(temperature=1.0, top_p=1e-300)])
def test_extreme_but_valid_values_pick_the_top_token(change):
    """Float32 underflow: a temperature of 1e-40 made the largest logit +inf (NaN in the softmax), a top_p below
    float32's range compared as 0 and dropped every token. Both are valid and mean "the top token"."""
    logits = torch.tensor([0.5, 3.0, -1.0, 2.9, float("-inf")])
    s = Sampler(SamplingConfig(seed=1, **change))
    assert {s(logits) for _ in range(20)} == {1}


def test_a_seed_a_generator_cannot_hold_is_refused_by_name():
    for seed in (1 << 64, -(1 << 63) - 1, 10 ** 30):
        with pytest.raises(ValueError, match=r"^seed: .* is outside"):
            SamplingConfig(temperature=1.0, seed=seed)
    Sampler(SamplingConfig(temperature=1.0, seed=(1 << 64) - 1))  # the edges are fine
    Sampler(SamplingConfig(temperature=1.0, seed=-(1 << 63)))


def test_min_new_tokens_keeps_the_stop_tokens_out_until_then():
    s = Sampler(SamplingConfig(min_new_tokens=2), stop_ids=(1,))
    assert [s(torch.tensor([0.1, 3.0, 2.0])) for _ in range(3)] == [2, 2, 1]  # [vocab]: stop token 1 leads
    with pytest.raises(ValueError, match="min new tokens"):
        SamplingConfig(min_new_tokens=5, max_new_tokens=4)


def test_stop_strings_are_looked_for_only_after_the_minimum(stories):
    def reply(least):
        s = ChatSession(stories, CacheConfig())
        s.start_completion("Once upon a time", SamplingConfig(max_new_tokens=40, min_new_tokens=least,
                                                              stop_strings=("a",)))
        while not (r := s.step()).done:
            pass
        return len(s.generated_ids), r.stop_reason

    first = reply(0)
    assert first[1] == "stop_string" and first[0] < 12  # "a" comes early in this story
    n, reason = reply(12)  # the first twelve tokens' "a"s do not count (vLLM's min_tokens): the next one does
    assert reason == "stop_string" and 12 < n < 40
