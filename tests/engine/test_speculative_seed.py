"""Seeded sampling with speculation: the reply is a function of the seed alone — the same tokens as decoding
without speculation, whatever the drafter proposed, however many drafts stayed, whatever k was and whenever
speculation went off or on (auto-off decides that from measured speed, i.e. from the wall clock)."""

from __future__ import annotations

import pytest
import torch

from engine.config import CacheConfig, SamplingConfig
from engine.core.session import ChatSession
from engine.speculation.draft_model import ModelDrafter
from engine.core.verify import SpecConfig, verify
from engine.core.sampling import Sampler

# a story that repeats itself: prompt lookup drafts often, and at temperature 0.8 some drafts stay, some do not
PROMPT = ("Once upon a time, there was a little girl named Lily. She loved to play outside. One day, Lily saw a "
          "big dog. Once upon a time, there was a little girl named Lily. She loved")
N = 120
SAMPLING = dict(temperature=0.8, seed=11, max_new_tokens=N, ignore_eos=True)


def reply(lm, spec: SpecConfig | None, drafter=None, switch_at: dict | None = None, **sampling) -> tuple[list, int]:
    """(token ids, draft tokens offered) of one seeded reply; ``switch_at``: step -> SpecConfig | None, set then
    (what auto-off and its retry do to a reply, here at fixed steps instead of measured times)."""
    s = ChatSession(lm, CacheConfig(page_size=4))
    if spec is not None:
        s.speculate(spec, drafter)
    s.start_ids(lm.tokenizer(PROMPT)["input_ids"], SamplingConfig(**{**SAMPLING, **sampling}))
    drafted, i = 0, 0
    while not (r := s.step()).done:
        i += 1
        if switch_at and i in switch_at:
            drafted += s.sequence.reply.spec.draft_tokens if s.sequence.reply.spec is not None else 0
            s.speculate(switch_at[i])
    drafted += s.sequence.reply.spec.draft_tokens if s.sequence.reply.spec is not None else 0
    return s.generated_ids, drafted


@pytest.fixture(scope="module")
def plain(stories):
    ids, _ = reply(stories, None)
    assert len(ids) == N
    return ids


@pytest.mark.parametrize("spec", [SpecConfig(method="ngram", auto_off=False),
                                  SpecConfig(method="ngram", draft_tokens=1, auto_off=False),
                                  SpecConfig(method="ngram", draft_tokens=7, auto_off=False)],
                         ids=["adaptive", "k1", "k7"])
def test_seeded_speculative_reply_is_the_plain_one(stories, plain, spec):
    ids, drafted = reply(stories, spec)
    assert drafted > 0  # speculation ran: drafts were offered and verified
    assert ids == plain


def test_seeded_reply_survives_speculation_switching_mid_reply(stories, plain):
    """Auto-off turns speculation off after a measurement and a later reply retries it: the draws must not
    depend on when (steps 10, 30, 50, 70 here: on, off, k = 3, off)."""
    switch = {10: SpecConfig(method="ngram", auto_off=False), 30: None,
              50: SpecConfig(method="ngram", draft_tokens=3, auto_off=False), 70: None}
    ids, drafted = reply(stories, None, switch_at=switch)
    assert drafted > 0 and ids == plain


def test_a_draft_model_keeps_the_seeded_reply(stories, plain):
    """The model drafting for itself (greedy drafts: many stay, some are replaced by the sampled token)."""
    ids, drafted = reply(stories, SpecConfig(method="draft", draft_path="self", auto_off=False),
                         drafter=ModelDrafter(stories, stories))
    assert drafted > 0 and ids == plain


def test_penalties_and_filters_keep_the_seeded_reply(stories):
    """Repetition / presence / frequency penalties and top-p / top-k: the same tokens with and without drafts."""
    extra = dict(repetition_penalty=1.1, presence_penalty=0.3, frequency_penalty=0.2, top_p=0.9, top_k=40)
    ids, _ = reply(stories, None, **extra)
    spec, drafted = reply(stories, SpecConfig(method="ngram", auto_off=False), **extra)
    assert drafted > 0 and spec == ids


def test_a_verification_draws_once_per_token_it_yields():
    """The generator moves on by exactly one draw per token a verification yields, as plain decoding does: the
    drafts (two kept here, out of three) cost no draw of their own."""
    logits = torch.tensor([[0.0, 9.0, 0.0], [0.0, 0.0, 9.0], [9.0, 0.0, 0.0], [0.0, 9.0, 0.0]])
    spec = Sampler(SamplingConfig(temperature=1.0, seed=5))
    tokens = verify(spec, logits, [1, 2, 1], [0])
    plain = Sampler(SamplingConfig(temperature=1.0, seed=5))
    assert tokens == [plain(logits[i]) for i in range(len(tokens))] and len(tokens) == 3
    assert torch.equal(spec.generator.get_state(), plain.generator.get_state())
