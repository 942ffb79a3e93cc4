"""Tokens a cache change mid-reply has the model read again (a re-prefill, ``engine.core.reprefill``): tracked from the
cut to what was read, estimated from the model's measured prefill rate before it starts, read in short forwards
with progress after each, and its time kept out of the reply's TTFT, prefill and decode figures."""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

import pytest

from engine.config import CacheConfig, SamplingConfig
from engine.core import reprefill
from engine.core.session import ChatSession

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from slow_forward import SlowForward  # noqa: E402

STREAMING = CacheConfig(policy="streaming", policy_params={"sinks": 4, "window": 64}, overflow="rolling")
H2O = CacheConfig(policy="h2o", policy_params={"budget": 256, "recent": 64}, overflow="rolling")
LONG = [{"role": "user", "content": "the little dog ran to the park and played with a red ball in the sun. " * 15}]
SAMPLING = SamplingConfig(temperature=0.0, max_new_tokens=8, ignore_eos=True)


@pytest.fixture
def lm(stories):
    return dataclasses.replace(stories, arenas=None)  # pages of its own (the runner, and its rates, are shared)


def _until_tokens(s: ChatSession, n: int) -> None:
    while len(s.generated_ids) < n:
        assert not s.step().done


def test_a_switch_mid_reply_is_tracked_estimated_and_read_in_short_forwards(lm):
    s = ChatSession(lm, STREAMING)
    try:
        s.start(LONG, SAMPLING)
        _until_tokens(s, 3)
        fed, measured = s.index.next_pos, reprefill.rate(lm, False)
        assert measured > 0  # the prompt's prefill forwards measured the model's rate
        notes = s.apply(H2O)
        assert any("restoring evicted tokens" in n for n in notes)
        (r,) = s.turn_state.reprefills
        assert (r.start, r.tokens, r.done, r.old, r.new) == (s.index.next_pos, fed - s.index.next_pos, 0, STREAMING, H2O)
        assert r.estimate_ms == pytest.approx(r.tokens / reprefill.rate(lm, True) * 1000.0)
        seen, limit = [], reprefill.chunk(s.prefill_chunk)
        while True:
            at = s.index.next_pos
            res = s.step()
            assert s.index.next_pos - at <= limit  # short forwards: progress, and Stop, between them
            if res.reprefill is not None:
                seen.append(res.reprefill)
            if res.event is not None:
                break
        assert [x.done for x in seen] == sorted(x.done for x in seen) and seen[-1].done == r.tokens
        assert seen[-1].ms > 0 and not seen[-1].running and len(seen) >= 2
        while not (res := s.step()).done:
            assert res.reprefill is None  # it is over
        st = res.stats
        assert st.reprefilled_tokens == r.tokens and st.reprefill_ms == pytest.approx(seen[-1].ms)
        assert st.reprefills[0].new == H2O
    finally:
        s.close()


def test_its_time_is_not_the_replys_ttft(lm):
    """Chosen while the prompt is read: TTFT + the re-prefill fit in the time to the first token (by construction);
    were the re-prefill counted in TTFT too they would not (its forwards are 50 ms slower each here)."""
    s = ChatSession(lm, STREAMING)
    slow = None
    try:
        t0 = time.perf_counter()
        s.start(LONG, SAMPLING)
        for _ in range(8):
            assert s.step().event is None  # StreamingLLM reads it a few tokens a forward
        s.apply(H2O)
        slow = SlowForward(lm.model, 0.05)
        while s.step().event is None:
            pass
        wall_ms = (time.perf_counter() - t0) * 1000.0
        slow.undo()
        slow = None
        (r,) = s.turn_state.reprefills
        assert r.done == r.tokens > 16 and r.ms > 10  # its share of the slowed forwards that read it
        assert s.turn_state.ttft_ms + r.ms <= wall_ms
        assert s.turn_state.prefill_ms + r.ms <= wall_ms
    finally:
        if slow is not None:
            slow.undo()
        s.close()


def test_without_a_measurement_the_estimate_comes_from_the_models_size(lm):
    fresh = dataclasses.replace(lm, model_runner=None)  # a runner that has measured nothing
    params = sum(p.numel() for p in lm.model.parameters())
    assert reprefill.rate(fresh, False) == 0
    assert reprefill.estimate_ms(fresh, 1000, False) == pytest.approx(2 * params * 1000 / 2e11 * 1000.0)
    reprefill.record(fresh, 200, 100.0, False)  # 2,000 tokens/s
    reprefill.record(fresh, 8, 100.0, False)  # a decode step: not a prefill rate
    assert reprefill.estimate_ms(fresh, 1000, True) == pytest.approx(500.0)  # no scored rate yet: the plain one
