"""Speculative decoding on the real stories260K: greedy tokens identical to HF ``generate`` in every cache mode
and page size, identical to plain decoding with quantized K/V; a draft model (another Llama with the same
tokenizer) exact too, one with another tokenizer refused; rejection sampling keeps the target distribution."""

from __future__ import annotations

import math

import pytest
import torch

from engine.config import CacheConfig, SamplingConfig
from engine.core.session import ChatSession
from engine.speculation.draft_model import DraftMismatchError, ModelDrafter
from engine.core.verify import MAX_DRAFT, SpecConfig, Speculator, NgramDrafter, verify
from engine.core.sampling import Sampler

# a story that repeats itself: prompt lookup finds what comes next
PROMPT = ("Once upon a time, there was a little girl named Lily. She loved to play outside. One day, Lily saw a "
          "big dog. Once upon a time, there was a little girl named Lily. She loved")
N = 120


@pytest.fixture(scope="module")
def prompt_ids(stories):
    return stories.tokenizer(PROMPT)["input_ids"]


@pytest.fixture(scope="module")
def hf_tokens(stories, prompt_ids):
    with torch.inference_mode():
        out = stories.model.generate(torch.tensor([prompt_ids]), max_new_tokens=N, min_new_tokens=N, do_sample=False)
    return out[0, len(prompt_ids):].tolist()


def run(lm, ids, cfg: CacheConfig, spec: SpecConfig | None, n: int = N, drafter=None, **sampling):
    s = ChatSession(lm, cfg)
    if spec is not None:
        s.speculate(spec, drafter)
    s.start_ids(ids, SamplingConfig(max_new_tokens=n, ignore_eos=True, **sampling))
    events = []
    while not (r := s.step()).done:
        events.append(r.event)
        check_cache(s)
    events.append(r.event)
    check_cache(s)
    return s, r, [e for e in events if e is not None]


def check_cache(s: ChatSession) -> None:
    """No provisional slot is left: the store holds the index's tokens, the pages hold them exactly."""
    if s.store is None:
        return
    assert s.store.num_tokens == s.index.n <= len(s.seq)
    if s.cache_config.mode == "paged":
        P = s.store.page_size
        assert len(s.store.table.pages) == -(-s.index.n // P)


@pytest.mark.parametrize("cfg", [CacheConfig(), CacheConfig(page_size=1), CacheConfig(page_size=4),
                                 CacheConfig(page_size=7, prefix_reuse=False), CacheConfig(mode="contiguous")],
                         ids=["paged16", "paged1", "paged4", "paged7", "contiguous"])
@pytest.mark.parametrize("k", [0, 5])
def test_ngram_greedy_is_hf(stories, prompt_ids, hf_tokens, cfg, k):
    s, r, events = run(stories, prompt_ids, cfg, SpecConfig(method="ngram", draft_tokens=k, auto_off=False))
    assert s.generated_ids == hf_tokens
    st = r.stats
    assert st.speculative == "ngram" and st.draft_tokens > 0 and 0 < st.accepted_draft_tokens <= st.draft_tokens
    assert st.forwards == st.generated_tokens - st.accepted_draft_tokens  # each accepted draft saved a forward
    assert sum(e.draft for e in events) == st.accepted_draft_tokens
    assert [e.index for e in events] == list(range(N))  # one event per token, in order
    assert sum(st.accepted_by_position) == st.accepted_draft_tokens
    assert st.spec_note.startswith(f"speculative: {st.accepted_draft_tokens} of {st.draft_tokens} draft tokens")


def test_snapshots_show_the_verification_and_its_rollback(stories, prompt_ids):
    s = ChatSession(stories, CacheConfig(page_size=4))
    s.speculate(SpecConfig(method="ngram", draft_tokens=6, auto_off=False))
    s.start_ids(prompt_ids, SamplingConfig(max_new_tokens=N, ignore_eos=True))
    seen = []
    while not (r := s.step()).done:
        sn = r.snapshot
        if sn.verified:
            seen.append((sn.verified, sn.rolled_back))
            assert 0 <= sn.rolled_back < sn.verified <= 7 and sn.written_pages  # the pages the k + 1 slots took
    assert seen and any(rb for _, rb in seen) and any(rb == 0 for _, rb in seen)


@pytest.mark.parametrize("k_dtype,v_dtype,page", [("int8", "int8", 16), ("int4", "int8", 4), ("auto", "int4", 16)])
def test_quantized_kv_same_tokens_as_plain_decoding(stories, prompt_ids, k_dtype, v_dtype, page):
    cfg = CacheConfig(k_dtype=k_dtype, v_dtype=v_dtype, page_size=page)
    plain, _, _ = run(stories, prompt_ids, cfg, None)
    spec, r, _ = run(stories, prompt_ids, cfg, SpecConfig(method="ngram", auto_off=False))
    assert spec.generated_ids == plain.generated_ids and r.stats.accepted_draft_tokens > 0


def test_an_eviction_policy_pauses_speculation_and_changes_nothing(stories, prompt_ids):
    cfg = CacheConfig(policy="streaming", policy_params={"sinks": 4, "window": 24})
    plain, _, _ = run(stories, prompt_ids, cfg, None)
    spec, r, _ = run(stories, prompt_ids, cfg, SpecConfig(method="ngram", auto_off=False))
    assert spec.generated_ids == plain.generated_ids
    assert r.stats.draft_tokens == 0  # the window evicts as it goes: no slot can be cut back exactly


def test_switches_mid_reply_keep_hf_tokens(stories, prompt_ids, hf_tokens):
    s = ChatSession(stories, CacheConfig(page_size=4))
    s.speculate(SpecConfig(method="ngram", auto_off=False))
    s.start_ids(prompt_ids, SamplingConfig(max_new_tokens=N, ignore_eos=True))
    for i in range(400):
        r = s.step()
        if r.done:
            break
        if i == 20:
            s.apply(CacheConfig(mode="contiguous"))
        if i == 40:
            s.speculate(SpecConfig(method="ngram", draft_tokens=2, auto_off=False))
        if i == 60:
            s.apply(CacheConfig(page_size=16, k_dtype="auto"))
        if i == 70:
            s.speculate(None)
        if i == 80:
            s.speculate(SpecConfig(method="ngram", auto_off=False))
        check_cache(s)
    assert s.generated_ids == hf_tokens


def test_stops_inside_a_verification(stories, prompt_ids, hf_tokens):
    for n in (2, 3, 17, 33):  # max new tokens reached on a draft the verification accepted
        s, r, events = run(stories, prompt_ids, CacheConfig(page_size=4), SpecConfig(method="ngram", auto_off=False),
                           n=n)
        assert s.generated_ids == hf_tokens[:n] and r.stop_reason == "max_tokens" and len(events) == n
        assert s.index.n == len(s.seq) - 1  # every token but the last was fed, nothing more


def test_context_end_inside_a_verification(stories):
    ctx = stories.info.context_length
    ids = stories.tokenizer((PROMPT + " ") * 8)["input_ids"][: ctx - 40]
    plain, rp, _ = run(stories, ids, CacheConfig(), None, n=100)
    spec, rs, _ = run(stories, ids, CacheConfig(), SpecConfig(method="ngram", auto_off=False), n=100)
    assert rs.stop_reason == rp.stop_reason == "context_full"
    assert spec.generated_ids == plain.generated_ids and rs.stats.accepted_draft_tokens > 0


def test_cancel_hands_out_the_verified_tokens_first(stories, prompt_ids, hf_tokens):
    s = ChatSession(stories, CacheConfig())
    s.speculate(SpecConfig(method="ngram", draft_tokens=8, auto_off=False))
    s.start_ids(prompt_ids, SamplingConfig(max_new_tokens=N, ignore_eos=True))
    while not s._ready:
        assert not s.step().done
    waiting = len(s._ready)
    s.cancel()
    got = [s.step() for _ in range(waiting + 1)]
    assert all(not r.done and r.event is not None for r in got[:-1])
    assert got[-1].done and got[-1].stop_reason == "cancelled"
    assert s.generated_ids == hf_tokens[:len(s.generated_ids)]
    check_cache(s)


def _random_llama(stories, seed: int):
    """A random-weight Llama of stories260K's config and tokenizer (a different model with the same vocabulary)."""
    import dataclasses

    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(stories.model.config).eval()
    return dataclasses.replace(stories, model=model, arenas=None, model_runner=None)


def test_draft_model_is_exact(stories, prompt_ids, hf_tokens):
    draft = _random_llama(stories, 0)
    drafter = ModelDrafter(draft, stories)
    s, r, _ = run(stories, prompt_ids, CacheConfig(page_size=4), SpecConfig(method="draft", draft_path="random",
                                                                            auto_off=False), drafter=drafter)
    assert s.generated_ids == hf_tokens
    assert r.stats.draft_tokens > 0 and r.stats.speculative == "draft:random"
    s.close()
    assert drafter.cache.n == 0 and all(a.pool.num_used == 0 for a in draft.arenas)  # its pages given back

    self_draft = ModelDrafter(dataclasses_replace_arenas(stories), stories)  # the model drafting for itself
    s, r, _ = run(stories, prompt_ids, CacheConfig(), SpecConfig(method="draft", draft_path="self", auto_off=False),
                  drafter=self_draft)
    assert s.generated_ids == hf_tokens and r.stats.accepted_draft_tokens == r.stats.draft_tokens > 0
    assert r.stats.forwards < N / 4


def dataclasses_replace_arenas(lm):
    import dataclasses

    return dataclasses.replace(lm, arenas=None)


def test_draft_model_with_another_tokenizer_is_refused(stories, demo_model):
    with pytest.raises(DraftMismatchError, match="tokenizer differs"):
        ModelDrafter(demo_model, stories)


def test_rejection_sampling_keeps_the_target_distribution():
    """One draft token ``d`` with q a point mass: the first token must be drawn from p itself (accept d with
    p(d), else the residual). 40,000 draws of a 6-token vocabulary; each frequency within 5 sigma of p."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 1.5], [0.0] * 6])
    p = torch.softmax(logits[0], -1)
    sampler = Sampler(SamplingConfig(temperature=1.0, seed=7))
    for d in (0, 3):
        n = 40_000
        counts = torch.zeros(6)
        for _ in range(n):
            counts[verify(sampler, logits, [d], [1, 2])[0]] += 1
        for t in range(6):
            sigma = math.sqrt(float(p[t]) * (1 - float(p[t])) / n)
            assert abs(float(counts[t]) / n - float(p[t])) < 5 * sigma + 1e-3, (d, t, counts / n, p)


def test_a_draft_the_model_rules_out_is_never_kept():
    logits = torch.tensor([[5.0, 5.0, -math.inf], [0.0, 0.0, 0.0]])
    sampler = Sampler(SamplingConfig(temperature=1.0, seed=1))
    assert all(verify(sampler, logits, [2], [0])[0] != 2 for _ in range(500))


def test_prompt_lookup_takes_the_latest_longest_match_with_room():
    d = NgramDrafter(max_ngram=3)
    assert d.propose([1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3], 3) == [7, 8, 5]  # "2 3" last seen before 7 8 5
    assert d.propose([4, 5, 6], 3) == []
    assert d.propose([1, 2, 1, 2, 1, 2], 2) == [1, 2]
    assert d.propose([5, 7, 7, 7, 7], 3) == [7, 7, 7]  # a loop: the match with 3 tokens after it, not the tail


def test_adaptive_k_and_auto_off():
    sp = Speculator(SpecConfig(method="ngram"), NgramDrafter())
    assert sp.k == 4
    assert [sp.propose([1, 2, 1, 2], 3, None) for _ in range(2)] == [[], []]  # the probe: plain steps first
    for _ in range(2):
        sp.record_plain(1.0)  # plain decoding: 1 ms per token
    assert sp.record_verify(4, 4, 5, 1.0) == "" and sp.k == 6  # all accepted: +2
    assert sp.record_verify(6, 1, 2, 1.0) == "" and sp.k == 5  # a rejection: -1; 2 ms for 7 tokens pays
    notes = [sp.record_verify(5, 0, 1, 10.0) for _ in range(6)]  # 10 ms for one token each
    # judged on the last 4 verifications at every one: 12 ms for 8 tokens is 1.5 ms a token, off at once
    assert "1.5 ms per token against 1.0 ms" in notes[0] and not any(notes[1:])
    assert not sp.active and sp.propose([1, 2, 1], 3, None) == []
    fixed = Speculator(SpecConfig(method="ngram", draft_tokens=3), NgramDrafter())
    fixed.record_verify(3, 3, 4, 1.0)
    assert fixed.k == 3


@pytest.mark.parametrize("text,error", [("beam", "not one of"), ("draft:", "needs its path")])
def test_spec_config_refuses(text, error):
    with pytest.raises(ValueError, match=error):
        SpecConfig.parse(text)
    with pytest.raises(ValueError, match="draft tokens"):
        SpecConfig(method="ngram", draft_tokens=MAX_DRAFT + 1)


def test_penalties_on_the_reply_and_logprobs(stories, prompt_ids):
    """OpenAI's presence / frequency penalties count the reply's tokens, accepted drafts included (greedy: the
    same tokens as plain decoding); log-probabilities are taken token by token, so speculation steps aside."""
    pen = dict(presence_penalty=0.4, frequency_penalty=0.2)
    plain, _, _ = run(stories, prompt_ids, CacheConfig(), None, **pen)
    spec, r, _ = run(stories, prompt_ids, CacheConfig(), SpecConfig(method="ngram", auto_off=False), **pen)
    assert spec.generated_ids == plain.generated_ids and r.stats.draft_tokens > 0
    _, r, _ = run(stories, prompt_ids, CacheConfig(), SpecConfig(method="ngram", auto_off=False), logprobs=2)
    assert r.stats.draft_tokens == 0


def test_a_reply_after_a_verdict_of_slower_still_speculates_and_judges_at_once():
    """The plain step's time is kept per model: a later reply (another chat's too) speculates without a probe, its
    acceptance counted, and is judged at its second verification — off when it does not pay, on when it does."""
    verdicts: dict = {}
    sp = Speculator(SpecConfig(method="ngram"), NgramDrafter(), verdicts)
    for _ in range(2):
        sp.record_plain(1.0)
    notes = [sp.record_verify(4, 0, 1, 10.0) for _ in range(2)]
    assert "speculation off" in notes[1] and not sp.active and not verdicts["ngram"].pays
    assert "% " not in notes[1]  # the verifications' cost, not an acceptance the reply's footer will contradict
    sp.stats.off_reason, sp._paused = "", False  # back on (prompt lookup found a repeat), then slower again:
    assert [sp.record_verify(4, 0, 1, 10.0) for _ in range(2)] == ["", ""] and not sp.active  # said once a reply
    other = Speculator(SpecConfig(method="ngram"), NgramDrafter(), verdicts)  # another chat of the model
    assert other.new_reply() == "" and other.active and other.probe == 0  # no probe: 1 ms per plain step known
    other.record_verify(4, 4, 5, 2.0)
    assert other.record_verify(6, 6, 7, 2.0) == "" and other.active  # 4 ms for 12 tokens: it pays this time
    assert verdicts["ngram"].pays and other.stats.accepted == 10
    assert other.new_reply() == "" and other.stats.accepted == 0


def _lookup_by_scan(ids, k, max_ngram=3):
    """Prompt lookup as a full scan of the chat (the drafter's former code): the reference for its index."""
    import numpy as np

    arr = np.asarray(ids, dtype=np.int64)
    T = len(arr)
    for n in range(min(max_ngram, T - 1), 0, -1):
        windows = np.lib.stride_tricks.sliding_window_view(arr[:T - 1], n)
        hits = np.nonzero((windows == arr[T - n:]).all(axis=1))[0]
        if len(hits):
            full = hits[hits + n + k <= T]
            start = int(full[-1] if len(full) else hits[0]) + n
            out = arr[start:start + k].tolist()
            while len(out) < k:
                out.append(out[len(out) - (T - start)])
            return out
    return []


def test_the_ngram_index_proposes_what_a_full_scan_does():
    """The drafter indexes only what each step adds; over growing chats, edits (a new prompt) and every k its
    drafts are the full scan's."""
    import random

    from engine.core.verify import NgramDrafter

    rng = random.Random(7)
    d = NgramDrafter(3)
    for trial in range(40):
        ids = [rng.randrange(6) for _ in range(rng.randrange(1, 30))]
        for _ in range(30):
            k = rng.randrange(1, 9)
            assert d.propose(ids, k) == _lookup_by_scan(ids, k), (trial, ids, k)
            if rng.random() < 0.1:
                ids = ids[:rng.randrange(1, len(ids) + 1)] + [rng.randrange(6)]  # cut back and changed
            else:
                ids = ids + [rng.randrange(6) for _ in range(rng.randrange(1, 4))]


def test_paused_prompt_lookup_comes_back_where_the_reply_repeats():
    """Turned off by its judge, prompt lookup goes on guessing in the shadow: once its last 4 guesses would have
    paid (guesses of SHADOW_K = 8 all true, not of the k = 2 the misses shrank: 9 tokens a verification at 2 ms,
    under 0.75 x 1 ms a plain step per token), the reply speculates again, with k at what the guesses kept."""
    from engine.core.verify import SHADOW_K, WINDOW

    sp = Speculator(SpecConfig(method="ngram"), NgramDrafter())
    for _ in range(2):
        assert sp.propose([1, 2, 1, 2], 8, None) == []  # the probe
        sp.record_plain(1.0)
    assert "comes back" in [sp.record_verify(4, 0, 1, 2.0) for _ in range(2)][1] and not sp.active
    ids = [5, 6, 7, 8] * 3  # the reply now repeats a line: every guess comes true
    for step in range((SHADOW_K + 1) * WINDOW + 2):
        assert sp.propose(ids, 16, None) == []  # plain steps while paused
        ids.append(ids[-4])
        if sp.active:
            break
    assert sp.active and step >= SHADOW_K * WINDOW - 1  # four guesses of 8, each decided when all of it came
    assert sp.propose(ids, 16, None) == [ids[len(ids) - 4 + i % 4] for i in range(SHADOW_K)]  # k = 8 again
    other = Speculator(SpecConfig(method="ngram"), NgramDrafter())
    for _ in range(2):
        other.propose([1, 2, 1, 2], 8, None)
        other.record_plain(1.0)
    [other.record_verify(4, 0, 1, 2.0) for _ in range(2)]
    for t in range(40, 80):  # a reply that never repeats: it stays off
        other.propose(list(range(t)), 8, None)
    assert not other.active
